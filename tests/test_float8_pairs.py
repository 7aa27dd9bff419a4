"""A decoding step's float8 codes (e4m3fn, e5m2) against bfloat16 queries on the
bfloat16 units (src/fa_pairs.h: vdpbf16ps, the codes widened exactly to bfloat16 by
byte lookups; Plan.pair_codes, Plan.pair_values). The scores are exact products summed
in float32, the values' product takes the weights (times the scales) rounded once to
bfloat16, as for bfloat16 values with precision=None.

Checked against the float64 recomputation on the dequantized cache: every finite code
read exactly (keys and values), NaN and inf codes as float64 says, E and Ev that fill
no, one or several chunks of 64 and a partial last one, one to eight query rows per
key head, odd key counts and the decoding steps' edges, paged blocks in random order
with the heads side by side (the same bits as the contiguous call), and the steps and
rows the kernels leave to the float32 ones: weights under 2^-100 or scales that make
them so, scales that are not finite, query rows whose elements span 2^100 or more, or
hold inf.

Where the kernels cannot run (no AVX512-BF16 or AVX512-VBMI, another level, or not
AMD, where bf16_dot is off by default) the results are checked against the same
oracles on the float32 kernels; the plan's choice is checked everywhere."""

import numpy as np
import pytest

import fastattn
from fastattn import reference

from helpers import (assert_close, assert_contiguous_bits, close_to, paged_codes_close,
                     rounded_weights_bound)

try:
    import ml_dtypes
    BF16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:                                 # pragma: no cover
    ml_dtypes = None
    BF16 = None

pytestmark = pytest.mark.skipif(ml_dtypes is None, reason="needs ml_dtypes")

FLOAT8 = ["float8_e4m3fn", "float8_e5m2"]


def pairs_active():
    """The kernels run in this process (the plan asks for them by default here, and
    the driver module has them for this CPU)."""
    from fastattn import _dispatch
    return bool(_dispatch.bf16_dot
                and getattr(_dispatch.drivers, "FLOAT8_PAIRS", False))


def plan_of(q, k, v, k_scale=None, v_scale=None, precision=None, **kw):
    """The plan of attention(q, k, v, k_scale=..., v_scale=..., precision=..., **kw)."""
    from fastattn import _compute, _validation
    args = _validation.attention_args(q, k, v, k_scale=k_scale, v_scale=v_scale,
                                      codes=True, **kw)
    s = args.shapes
    return _compute._plan(args, np.empty(s.batch + (s.Lq, s.Ev), np.float32),
                          round_weights=precision != "highest")


def cache(rng, shape, code, scale=1.0):
    return fastattn.quantize_kv(rng.standard_normal(shape) * scale, code)


def check(q, k, v, ks=None, vs=None, **kw):
    """attention against float64 on the dequantized cache: NaN and inf where float64
    has them, the rest within the bound of weights rounded once to bfloat16; the
    result."""
    got, lse = fastattn.attention(q, k, v, k_scale=ks, v_scale=vs, enable_gqa=True,
                                  return_lse=True, **kw)
    kw = dict(kw)
    kd = reference.dequantize_kv(k, ks).astype(np.float64)
    vd = reference.dequantize_kv(v, vs).astype(np.float64)
    rounded = kw.pop("precision", None) != "highest"
    with np.errstate(invalid="ignore", over="ignore"):
        want, want_lse = reference.attention(q.astype(np.float64), kd, vd,
                                             enable_gqa=True, return_lse=True, **kw)
        bound = rounded_weights_bound(q, kd, vd, rounded=rounded, enable_gqa=True, **kw)
    wide = got.astype(np.float64)
    np.testing.assert_array_equal(np.isnan(wide), np.isnan(want))
    np.testing.assert_array_equal(wide[np.isinf(want)], want[np.isinf(want)])
    finite = np.isfinite(want)
    close_to(wide[finite], want[finite], q.dtype,
             extra=np.broadcast_to(bound, want.shape)[finite])
    assert_close(lse, want_lse, np.float32)
    return got


def highest(q, k, v, ks=None, vs=None, **kw):
    return fastattn.attention(q, k, v, k_scale=ks, v_scale=vs, enable_gqa=True,
                              precision="highest", **kw)


# --------------------------------------------------------------- the plan's choice

@pytest.mark.parametrize("code", FLOAT8)
def test_the_plan_takes_the_pairs_for_bfloat16_queries_and_float8_codes(
        code, monkeypatch):
    from fastattn import _dispatch
    rng = np.random.default_rng(0)

    def plan(qdtype=BF16, key_code=code, value_code=code, bf16_dot=True, **kw):
        monkeypatch.setattr(_dispatch, "bf16_dot", bf16_dot)
        monkeypatch.setattr(_dispatch, "amx", False)
        q = rng.standard_normal((1, 4, 1, 64)).astype(qdtype)
        k, ks = cache(rng, (1, 1, 40, 64), key_code)
        v, vs = cache(rng, (1, 1, 40, 48), value_code)
        p = plan_of(q, k, v, ks, vs, enable_gqa=True, **kw)
        return p.pair_codes, p.pair_values
    assert plan() == (True, True)
    assert plan(precision="highest") == (True, False)   # the weights keep 24 bits
    assert plan(bf16_dot=False) == (False, False)
    assert plan(qdtype=np.float32) == (False, False)    # 24-bit rows
    assert plan(qdtype=np.float16) == (False, False)    # 11 bits: not bfloat16 words
    assert plan(key_code="int8") == (False, True)
    assert plan(value_code="int8") == (True, False)


# ------------------------------------------------------ every code, read exactly

@pytest.mark.parametrize("code", FLOAT8)
def test_every_finite_key_code_is_read_exactly(code):
    """Head h's one key holds code h at element 0 and zeros elsewhere, its query is
    one there: lse is the score itself, the code's value exactly (scale 1)."""
    codes = np.arange(256, dtype=np.uint8).view(np.dtype(getattr(ml_dtypes, code)))
    values = codes.astype(np.float64)
    finite = np.isfinite(values)
    H = int(finite.sum())
    k = np.zeros((1, H, 1, 64), np.uint8).view(codes.dtype)
    k[0, :, 0, 0] = codes[finite]
    v = np.zeros((1, H, 1, 16), np.uint8).view(codes.dtype)
    q = np.zeros((1, H, 1, 64), BF16)
    q[..., 0] = 1.0
    _, lse = fastattn.attention(q, k, v, scale=1.0, return_lse=True)
    np.testing.assert_array_equal(lse[0, :, 0].astype(np.float64), values[finite])


@pytest.mark.parametrize("code", FLOAT8)
def test_every_finite_value_code_is_read_exactly(code):
    """One key of weight one whose value row holds every finite code: the output row
    is the codes' values, exactly (each is a bfloat16 value)."""
    codes = np.arange(256, dtype=np.uint8).view(np.dtype(getattr(ml_dtypes, code)))
    finite = codes[np.isfinite(codes.astype(np.float64))]
    Ev = finite.size
    q = np.ones((1, 4, 1, 32), BF16)
    k = np.zeros((1, 1, 1, 32), np.uint8).view(codes.dtype)
    v = finite.reshape(1, 1, 1, Ev)
    got = fastattn.attention(q, k, v, enable_gqa=True)
    np.testing.assert_array_equal(got.astype(np.float64),
                                  np.broadcast_to(finite.astype(np.float64),
                                                  (1, 4, 1, Ev)))


@pytest.mark.parametrize("code", FLOAT8)
def test_nan_and_inf_codes_give_what_float64_gives(code):
    """A key whose codes hold NaN (e4m3, e5m2) or inf (e5m2) makes its rows' scores
    not finite, a value row holding them reaches the rows that weigh it; a masked key
    (causal) adds nothing whatever it holds."""
    rng = np.random.default_rng(5)
    dt = np.dtype(getattr(ml_dtypes, code))
    special = [b for b in range(256) if not np.isfinite(
        np.array([b], np.uint8).view(dt).astype(np.float64))[0]]
    k, ks = cache(rng, (2, 2, 70, 64), code)
    v, vs = cache(rng, (2, 2, 70, 80), code)
    k.view(np.uint8)[0, 0, 13, 5] = special[0]
    v.view(np.uint8)[1, 1, 30, 7] = special[-1]
    v.view(np.uint8)[1, 0, 69, 0] = special[len(special) // 2]    # masked below
    q = rng.standard_normal((2, 8, 2, 64)).astype(BF16)
    check(q, k, v, ks, vs)
    check(q, k, v, ks, vs, causal=True)     # key 69 is masked for every query
    check(q, k, v, ks, vs, causal="bottom_right")


# ------------------------------------------------- every shape, against float64

@pytest.mark.parametrize("code", FLOAT8)
@pytest.mark.parametrize("E,Ev", [(64, 64), (128, 128), (16, 100), (100, 16),
                                  (200, 192), (72, 136)])
@pytest.mark.parametrize("groups,Lq", [(1, 1), (2, 1), (3, 1), (4, 1), (8, 1), (4, 2),
                                       (5, 1)])
def test_contiguous_cache_against_float64(code, E, Ev, groups, Lq):
    """R = groups * Lq query rows per key head from 1 to 8 (blocks of 4, 2 and 1 rows
    for the scores, of 4, 3, 2 and 1 for the values), E and Ev with and without a
    partial chunk of 64, an odd number of keys."""
    rng = np.random.default_rng(E * 1000 + Ev + groups * 10 + Lq)
    q = rng.standard_normal((2, 2 * groups, Lq, E)).astype(BF16)
    k, ks = cache(rng, (2, 2, 301, E), code, 3.0)
    v, vs = cache(rng, (2, 2, 301, Ev), code)
    got = check(q, k, v, ks, vs, causal="bottom_right")
    if pairs_active():      # the weights were rounded
        assert (got != highest(q, k, v, ks, vs, causal="bottom_right")).any()


@pytest.mark.parametrize("code", FLOAT8)
@pytest.mark.parametrize("Lk", [1, 2, 3, 255, 256, 257, 512, 513, 1100])
def test_key_counts_at_the_steps_edges(code, Lk):
    """Steps of 256 keys: one key, a pair, an odd count, a step and one more, several
    steps; long enough a cache is split over pieces whose partial results merge."""
    rng = np.random.default_rng(Lk)
    q = rng.standard_normal((1, 8, 1, 128)).astype(BF16)
    k, ks = cache(rng, (1, 2, Lk, 128), code)
    v, vs = cache(rng, (1, 2, Lk, 128), code)
    check(q, k, v, ks, vs)
    check(q, k, v, precision="highest")     # no scales (float8's default of 1)


@pytest.mark.parametrize("code", FLOAT8)
def test_variants_on_the_pairs(code):
    """A window, a softcap, ALiBi, sinks and padded lengths act on the pairs' scores as
    on any others."""
    rng = np.random.default_rng(9)
    q = rng.standard_normal((2, 8, 1, 64)).astype(BF16)
    k, ks = cache(rng, (2, 2, 600, 64), code, 2.0)
    v, vs = cache(rng, (2, 2, 600, 64), code)
    check(q, k, v, ks, vs, causal="bottom_right", window=(100, 0), softcap=5.0,
          alibi_slopes=np.linspace(0.01, 0.1, 8), sinks=rng.standard_normal(8),
          kv_lengths=np.array([600, 357]))


@pytest.mark.parametrize("code", FLOAT8)
@pytest.mark.parametrize("block_size", [1, 16, 64])
def test_paged_cache_against_float64_and_the_contiguous_bits(code, block_size):
    """Blocks in random order, the heads of a token side by side (their rows read at
    once), shared between sequences: within the bound, and the same bits as the
    contiguous call on each sequence's blocks gathered (the same sums, in the same
    order, whatever the layout)."""
    rng = np.random.default_rng(block_size)
    B, Hq, Hkv, E = 3, 16, 2, 128
    max_blocks = (300 + block_size - 1) // block_size
    nb = B * max_blocks + 5
    table = np.array([rng.permutation(nb)[:max_blocks] for _ in range(B)], np.int32)
    table[1, :2] = table[0, :2]                     # shared blocks
    lengths = np.array([max_blocks * block_size, 2 * block_size, 131])
    kc, ks = cache(rng, (nb, block_size, Hkv, E), code, 2.0)
    vc, vs = cache(rng, (nb, block_size, Hkv, E), code)
    q = rng.standard_normal((B, 1, Hq, E)).astype(BF16)
    got = paged_codes_close(q, kc, vc, ks, vs, table, lengths)
    for b in range(B):
        assert_contiguous_bits(got, q, kc, vc, ks, vs, table, lengths, b)


@pytest.mark.parametrize("code", FLOAT8)
def test_the_same_bits_at_any_thread_count(code):
    rng = np.random.default_rng(3)
    q = rng.standard_normal((3, 16, 1, 128)).astype(BF16)
    k, ks = cache(rng, (3, 4, 900, 128), code)
    v, vs = cache(rng, (3, 4, 900, 128), code)
    runs = [fastattn.attention(q, k, v, k_scale=ks, v_scale=vs, enable_gqa=True,
                               num_threads=n).view(np.uint16) for n in (1, 2, 3)]
    for other in runs[1:]:
        np.testing.assert_array_equal(runs[0], other)


# -------------------------------------- what the kernels leave to the float32 ones

@pytest.mark.parametrize("code", FLOAT8)
def test_tiny_weights_and_scales_that_are_not_finite_take_the_float32_kernels(code):
    """A weight under 2^-100 in every step (every other key 80 below the rest), value
    scales that make every weight times its scale subnormal, and an infinite one:
    each such step gives precision="highest"'s bits, nothing flushed to zero, inf and
    NaN where the float64 recomputation has them."""
    rng = np.random.default_rng(11)
    q = np.zeros((1, 4, 1, 64), BF16)
    q[..., 0] = 1.0
    k = np.zeros((1, 1, 600, 64), np.uint8).view(np.dtype(getattr(ml_dtypes, code)))
    k[0, 0, ::2, 0] = -80.0                         # such keys in every step
    v, vs = cache(rng, (1, 1, 600, 64), code)
    ones = np.ones((1, 1, 600), np.float32)
    got = check(q, k, v, ones, vs, scale=1.0)
    np.testing.assert_array_equal(got.view(np.uint16),
                                  highest(q, k, v, ones, vs, scale=1.0).view(np.uint16))
    tiny = np.full((1, 1, 600), 2.0 ** -126, np.float32)
    got = check(q, k, v, ones, tiny * vs, scale=1.0)
    assert np.abs(got.astype(np.float64)).max() > 0       # not flushed
    np.testing.assert_array_equal(got.view(np.uint16), highest(
        q, k, v, ones, tiny * vs, scale=1.0).view(np.uint16))
    endless = vs.copy()
    endless[0, 0, 50] = np.inf
    check(q, k, v, ones, endless, scale=1.0)


@pytest.mark.parametrize("code", FLOAT8)
def test_query_rows_the_pairs_cannot_hold_exactly_take_the_float32_kernels(code):
    """A row whose elements span 2^100 or more (1e30 beside 1e-30, which alone decides
    the score against a key that is zero under the 1e30), a row of zeros, rows past a
    sequence's length, and a row holding inf: each as the float64 recomputation says."""
    rng = np.random.default_rng(7)
    dt = np.dtype(getattr(ml_dtypes, code))
    q = rng.standard_normal((2, 4, 2, 64)).astype(BF16)
    q[0, 1, 0, :] = 0
    q[0, 2, 1, 0] = 1e30
    q[0, 2, 1, 1] = 1e-30
    k, ks = cache(rng, (2, 1, 50, 64), code)
    k[0, 0, 7, 0] = np.zeros(1, dt)[0]
    k[0, 0, 7, 1] = np.full(1, 4.0, dt)[0]
    v, vs = cache(rng, (2, 1, 50, 64), code)
    check(q, k, v, ks, vs, scale=1e-3)
    check(q, k, v, ks, vs, q_lengths=np.array([1, 2]), kv_lengths=np.array([50, 20]))
    q[1, 3, 0, 9] = np.inf
    check(q, k, v, ks, vs)


@pytest.mark.parametrize("code", FLOAT8)
def test_against_pytorch_with_the_cache_dequantized(code):
    """The same bound as bfloat16 attention against PyTorch's SDPA in bfloat16 on the
    dequantized cache: the max error at most 1.25 times PyTorch's (plus a twentieth of
    a half-ulp at the output's magnitude), the mean no larger."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(13)
    dt = np.dtype(getattr(ml_dtypes, code))
    q = rng.standard_normal((2, 32, 1, 128)).astype(BF16)
    k = (rng.standard_normal((2, 8, 2000, 128)) * 2).astype(dt)  # codes without
    v = rng.standard_normal((2, 8, 2000, 128)).astype(dt)        # scales: bfloat16
    want = reference.attention(q.astype(np.float64), k.astype(np.float64),  # values
                               v.astype(np.float64), enable_gqa=True)
    got = fastattn.attention(q, k, v, enable_gqa=True)

    def t(a):
        return torch.from_numpy(np.asarray(a, np.float32)).to(torch.bfloat16)
    ref = torch.nn.functional.scaled_dot_product_attention(
        t(q), t(k), t(v), enable_gqa=True).float().numpy()
    err = np.abs(got.astype(np.float64) - want)
    theirs = np.abs(ref.astype(np.float64) - want)
    half_ulp = 2.0 ** -9 * np.abs(want).max()
    assert err.max() <= 1.25 * theirs.max() + half_ulp / 20
    assert err.mean() <= theirs.mean()
