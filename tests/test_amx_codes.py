"""A decoding step's scores of 16-bit queries against int8 key codes on AMX-INT8 tiles
(src/fa_amx.h, fa_amx_code_scores): exact dot products, scaled and rounded once, for
every layout the decode path reads (contiguous, paged in blocks of 1, 16 and 64 rows
in random order, heads side by side), E of 64 and 128, one to many query rows per key
head, and query rows the tiles cannot hold exactly (they take the float32 kernels).
Then the step's product of bfloat16 queries' weights with int8 value codes on AMX-BF16
tiles (fa_amx_code_values, 5 or more query rows per key head): within the bound of
weights rounded once to bfloat16 and of PyTorch's error, the same layouts, and the
steps the tiles leave to the float32 kernels (tiny weights, scales that are not
finite, too few rows), which then give precision="highest"'s bits.

Where the CPU has no AMX (and the build does not emulate it: FASTATTN_ISA=amx with
-DFA_AMX_EMULATE, .ci/run's emulated stage) the tests that run the kernels check the
float32 path against the same oracles; the plan's choice is checked everywhere."""

from fractions import Fraction

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

needs_bf16 = pytest.mark.skipif(ml_dtypes is None, reason="needs ml_dtypes")


def amx_codes_active():
    """The AMX kernels run in this process (real tiles, or an emulating build asked
    for with FASTATTN_ISA=amx)."""
    from fastattn import _dispatch
    return bool(_dispatch.amx)


def codes_plan(q, k, v, k_scale, v_scale, **kw):
    """The plan of attention(q, k, v, k_scale=k_scale, v_scale=v_scale, **kw)."""
    from fastattn import _compute, _validation
    args = _validation.attention_args(q, k, v, k_scale=k_scale, v_scale=v_scale,
                                      codes=True, **kw)
    s = args.shapes
    return _compute._plan(args, np.empty(s.batch + (s.Lq, s.Ev), np.float32))


def int8_cache(rng, shape, scale=1.0):
    return fastattn.quantize_kv(rng.standard_normal(shape) * scale, "int8")


# --------------------------------------------------------------- the plan's choice

@needs_bf16
def test_the_plan_takes_the_tiles_for_16_bit_queries_and_int8_keys_of_64_or_128(
        monkeypatch):
    from fastattn import _dispatch
    rng = np.random.default_rng(0)

    def plan(E=128, qdtype=BF16, code="int8", amx=True):
        monkeypatch.setattr(_dispatch, "amx", amx)
        q = rng.standard_normal((1, 4, 1, E)).astype(qdtype)
        (k, ks), (v, vs) = (fastattn.quantize_kv(rng.standard_normal((1, 1, 40, E)),
                                                 code) for _ in range(2))
        return codes_plan(q, k, v, ks, vs, enable_gqa=True).amx_codes
    assert plan() and plan(E=64) and plan(qdtype=np.float16)
    assert not plan(amx=False)
    assert not plan(E=96) and not plan(E=256) and not plan(E=32)
    assert not plan(qdtype=np.float32)                  # 24-bit rows: the float32 path
    assert not plan(code="float8_e4m3fn")


# ----------------------------------------------------------------- exact scores

def exact_score(q_row, codes_row, scale):
    return sum(Fraction(float(a)) * int(c) for a, c in zip(q_row, codes_row)) * \
        Fraction(scale)


@needs_bf16
@pytest.mark.parametrize("E", [64, 128])
@pytest.mark.parametrize("qdtype", ["bfloat16", "float16"])
def test_each_score_is_the_exact_dot_product_rounded_once(E, qdtype):
    """One key far above the others: lse is then its score itself, which on the tiles
    is the exact q . k (times the scale, 1 here) rounded once to float32. The rows
    mix one large element with small ones, so float32 partial sums would round."""
    dt = BF16 if qdtype == "bfloat16" else np.dtype(np.float16)
    rng = np.random.default_rng(E)
    q = (rng.uniform(0.5, 1.0, (1, 8, 1, E)) * 2.0 ** -9).astype(dt)
    q[..., 0] = 512.0
    q[0, 1, 0, 5] = -q[0, 1, 0, 5]
    k = np.zeros((1, 2, 37, E), np.int8)
    k[:, :, 0] = rng.integers(100, 128, (1, 2, E))       # key 0: far above the rest
    k[:, :, 1:] = rng.integers(-3, 4, (1, 2, 36, E))
    v = rng.integers(-127, 128, (1, 2, 37, E)).astype(np.int8)
    ones = np.ones((1, 2, 37), np.float32)
    assert codes_plan(q, k, v, ones, ones, scale=1.0, enable_gqa=True).amx_codes or (
        not amx_codes_active())
    _, lse = fastattn.attention(q, k, v, k_scale=ones, v_scale=ones, scale=1.0,
                                enable_gqa=True, return_lse=True)
    want = np.array([[float(np.float32(exact_score(q[0, h, 0], k[0, h // 4, 0], 1.0)))
                      for h in range(8)]])
    got = lse[..., 0].astype(np.float64)
    if amx_codes_active():
        np.testing.assert_array_equal(got, want)
    else:                                   # the float32 sums: within their rule
        assert_close(got, want, np.float32)


# ------------------------------------------------- every layout, against float64

def check(q, k, v, ks, vs, **kw):
    got, lse = fastattn.attention(q, k, v, k_scale=ks, v_scale=vs, enable_gqa=True,
                                  return_lse=True, **kw)
    kd = reference.dequantize_kv(k, ks).astype(np.float64)
    vd = reference.dequantize_kv(v, vs).astype(np.float64)
    want, want_lse = reference.attention(q.astype(np.float64), kd, vd, enable_gqa=True,
                                         return_lse=True, **kw)
    close_to(got, want, q.dtype,       # bfloat16 rows' weights may meet v rounded
             extra=rounded_weights_bound(q, kd, vd, rounded=q.dtype == BF16,
                                         enable_gqa=True, **kw))
    assert_close(lse, want_lse, np.float32)
    return got


@needs_bf16
@pytest.mark.parametrize("E", [64, 128])
@pytest.mark.parametrize("groups,Lq", [(1, 1), (4, 1), (8, 1), (4, 3), (6, 2)])
@pytest.mark.parametrize("Lk", [1, 15, 16, 17, 300])
def test_contiguous_cache_against_float64(E, groups, Lq, Lk):
    """Query rows per key head R = groups * Lq from 1 to 12 (sets of four rows on the
    tiles), keys that fill no, one or several tiles of 16 and a partial last one."""
    rng = np.random.default_rng(E * 1000 + groups * 100 + Lk)
    q = rng.standard_normal((2, 2 * groups, Lq, E)).astype(BF16)
    k, ks = int8_cache(rng, (2, 2, Lk, E), 3.0)
    v, vs = int8_cache(rng, (2, 2, Lk, E))
    check(q, k, v, ks, vs, causal="bottom_right")


@needs_bf16
@pytest.mark.parametrize("block_size", [1, 16, 64])
@pytest.mark.parametrize("E", [64, 128])
def test_paged_cache_against_float64_and_the_contiguous_bits(block_size, E):
    """Blocks in random order: rows at one stride inside a block of 16 or 64 are read
    in place, blocks of one row (and the last keys) are copied to a tile first; the
    heads of a token lie side by side. The same bits as the contiguous call (the
    scores are exact whatever the layout)."""
    rng = np.random.default_rng(block_size + E)
    B, Hq, Hkv, nb = 3, 8, 2, 40
    max_blocks = (200 + block_size - 1) // block_size
    nb = max(nb, B * max_blocks)
    table = np.array([rng.permutation(nb)[:max_blocks] for _ in range(B)], np.int32)
    lengths = np.array([max_blocks * block_size, 0, 131])
    kc, ks = int8_cache(rng, (nb, block_size, Hkv, E), 2.0)
    vc, vs = int8_cache(rng, (nb, block_size, Hkv, E))
    q = rng.standard_normal((B, 1, Hq, E)).astype(BF16)
    got = paged_codes_close(q, kc, vc, ks, vs, table, lengths)
    for b in (0, 2):                # the same sequence as a contiguous cache
        assert_contiguous_bits(got, q, kc, vc, ks, vs, table, lengths, b)


@needs_bf16
def test_rows_the_tiles_cannot_hold_exactly_take_the_float32_path():
    """A row whose elements span more than 31 binary orders (1e30 beside 1e-30 here,
    which alone decides the score against a key of zeros elsewhere), a row of zeros,
    and rows past a sequence's length: each as the float64 recomputation says."""
    rng = np.random.default_rng(7)
    E = 128
    q = rng.standard_normal((2, 4, 2, E)).astype(BF16)
    q[0, 1, 0, :] = 0
    q[0, 2, 1, 0] = 1e30
    q[0, 2, 1, 1] = 1e-30
    k, ks = int8_cache(rng, (2, 1, 50, E))
    k[0, 0, 7, 0] = 0
    k[0, 0, 7, 1] = 127
    v, vs = int8_cache(rng, (2, 1, 50, E))
    check(q, k, v, ks, vs)
    q_only = q.copy()
    q_only[0, 2, 1, 0] = 0
    check(q_only, k, v, ks, vs)


@needs_bf16
@pytest.mark.parametrize("groups", [4, 8])
def test_the_same_bits_at_any_thread_count(groups):
    """Four query rows per key head (the scores' tiles) and eight (the values' too)."""
    rng = np.random.default_rng(3 + groups)
    q = rng.standard_normal((3, 4 * groups, 1, 128)).astype(BF16)
    k, ks = int8_cache(rng, (3, 4, 700, 128))
    v, vs = int8_cache(rng, (3, 4, 700, 128))
    runs = [fastattn.attention(q, k, v, k_scale=ks, v_scale=vs, enable_gqa=True,
                               num_threads=n).view(np.uint16) for n in (1, 2, 3)]
    for other in runs[1:]:
        np.testing.assert_array_equal(runs[0], other)


# ------------------------------------------------ int8 values' product on AMX-BF16

def amx_values_plan(q, k, v, ks, vs, precision=None, **kw):
    """Plan.amx_values of attention(q, k, v, ...) with `precision`."""
    from fastattn import _compute, _validation
    args = _validation.attention_args(q, k, v, k_scale=ks, v_scale=vs, codes=True, **kw)
    s = args.shapes
    return _compute._plan(args, np.empty(s.batch + (s.Lq, s.Ev), np.float32),
                          round_weights=precision != "highest").amx_values


@needs_bf16
def test_the_plan_takes_the_value_tiles_for_bfloat16_queries_and_int8_values(
        monkeypatch):
    from fastattn import _dispatch
    rng = np.random.default_rng(1)

    def plan(Ev=128, qdtype=BF16, code="int8", amx=True, precision=None):
        monkeypatch.setattr(_dispatch, "amx", amx)
        q = rng.standard_normal((1, 8, 1, 64)).astype(qdtype)
        k, ks = fastattn.quantize_kv(rng.standard_normal((1, 1, 40, 64)), code)
        v, vs = fastattn.quantize_kv(rng.standard_normal((1, 1, 40, Ev)), code)
        return amx_values_plan(q, k, v, ks, vs, precision, enable_gqa=True)
    assert plan() and plan(Ev=64) and plan(Ev=192)
    assert not plan(amx=False) and not plan(precision="highest")
    assert not plan(Ev=96) and not plan(Ev=32)
    assert not plan(qdtype=np.float16)          # float16's bound: weights of 11 bits
    assert not plan(qdtype=np.float32)
    assert not plan(code="float8_e4m3fn")


def check_values(q, k, v, ks, vs, **kw):
    """attention against float64 within the bound of rounded weights; the result."""
    got = fastattn.attention(q, k, v, k_scale=ks, v_scale=vs, enable_gqa=True, **kw)
    kd = reference.dequantize_kv(k, ks).astype(np.float64)
    vd = reference.dequantize_kv(v, vs).astype(np.float64)
    want = reference.attention(q.astype(np.float64), kd, vd, enable_gqa=True, **kw)
    close_to(got, want, q.dtype, extra=rounded_weights_bound(
        q, kd, vd, rounded=True, enable_gqa=True, **kw))
    return got


def highest(q, k, v, ks, vs, **kw):
    return fastattn.attention(q, k, v, k_scale=ks, v_scale=vs, enable_gqa=True,
                              precision="highest", **kw)


@needs_bf16
@pytest.mark.parametrize("Ev", [64, 128, 192])
@pytest.mark.parametrize("groups,Lq", [(5, 1), (3, 2), (8, 1), (16, 1), (4, 4),
                                       (11, 3)])
@pytest.mark.parametrize("Lk", [1, 33, 300])
def test_value_tiles_against_float64(Ev, groups, Lq, Lk):
    """R = groups * Lq query rows per key head from 5 to 33 (passes of up to 16 rows),
    keys that fill no, one or several tiles of 32 and a partial last one, one to three
    passes of 64 columns. On the tiles the weights are rounded (the result differs
    from precision="highest")."""
    rng = np.random.default_rng(Ev * 1000 + groups * 100 + Lq * 10 + Lk)
    q = rng.standard_normal((2, 2 * groups, Lq, 64)).astype(BF16)
    k, ks = int8_cache(rng, (2, 2, Lk, 64), 3.0)
    v, vs = int8_cache(rng, (2, 2, Lk, Ev))
    got = check_values(q, k, v, ks, vs, causal="bottom_right")
    if amx_codes_active() and Lk == 300:
        assert (got != highest(q, k, v, ks, vs, causal="bottom_right")).any()


@needs_bf16
@pytest.mark.parametrize("block_size", [1, 16, 64])
def test_value_tiles_on_a_paged_cache_against_float64_and_the_contiguous_bits(
        block_size):
    """Heads side by side in blocks in random order, 8 query rows per key head: within
    the bound, and the same bits as the contiguous call (each value row is read at its
    own address, the sums in the same order)."""
    rng = np.random.default_rng(block_size)
    B, Hq, Hkv, E = 3, 16, 2, 128
    max_blocks = (300 + block_size - 1) // block_size
    nb = B * max_blocks + 5
    table = np.array([rng.permutation(nb)[:max_blocks] for _ in range(B)], np.int32)
    lengths = np.array([max_blocks * block_size, 0, 131])
    kc, ks = int8_cache(rng, (nb, block_size, Hkv, E), 2.0)
    vc, vs = int8_cache(rng, (nb, block_size, Hkv, E))
    q = rng.standard_normal((B, 1, Hq, E)).astype(BF16)
    got = paged_codes_close(q, kc, vc, ks, vs, table, lengths, lse=False)
    for b in (0, 2):
        assert_contiguous_bits(got, q, kc, vc, ks, vs, table, lengths, b)


@needs_bf16
def test_tiny_weights_subnormal_and_infinite_scales_take_the_float32_kernels():
    """A weight under 2^-100 (one key 75 below the others, about 2^-110, times a
    scale near 2^-6), scales that make every weight subnormal, and an infinite scale:
    each step so made gives
    precision="highest"'s bits, nothing flushed to zero, inf and NaN where the float64
    recomputation has them."""
    rng = np.random.default_rng(11)
    E = 64
    q = np.zeros((1, 8, 1, E), BF16)
    q[..., 0] = 1.0
    k = rng.integers(-3, 4, (1, 1, 200, E)).astype(np.int8)
    k[0, 0, 17, 0] = -75                      # score -75: its weight e^-75 or less
    ks = np.ones((1, 1, 200), np.float32)
    v, vs = int8_cache(rng, (1, 1, 200, E))
    got = check_values(q, k, v, ks, vs, scale=1.0)
    np.testing.assert_array_equal(got.view(np.uint16),
                                  highest(q, k, v, ks, vs, scale=1.0).view(np.uint16))
    k[0, 0, 17, 0] = 0
    tiny = np.full_like(vs, 1e-39)            # subnormal scales: weights x scale too
    got = fastattn.attention(q, k, v, k_scale=ks, v_scale=tiny, enable_gqa=True,
                             scale=1.0)
    want = reference.attention(q.astype(np.float64), k.astype(np.float64),
                               reference.dequantize_kv(v, tiny).astype(np.float64),
                               enable_gqa=True, scale=1.0)
    close_to(got, want, BF16, scale=np.abs(want).max(),    # at the outputs' magnitude,
             extra=2.0 ** -134)               # and half a bfloat16 subnormal's step
    seen = np.abs(want) > 1e-39               # bfloat16 holds down to 9.2e-41
    assert seen.sum() > 100 and np.all(got.astype(np.float64)[seen] != 0)
    np.testing.assert_array_equal(got.view(np.uint16),
                                  highest(q, k, v, ks, tiny, scale=1.0).view(np.uint16))
    inf = vs.copy()
    inf[0, 0, 50] = np.inf
    got = fastattn.attention(q, k, v, k_scale=ks, v_scale=inf, enable_gqa=True,
                             scale=1.0)
    want = reference.attention(q.astype(np.float64), k.astype(np.float64),
                               reference.dequantize_kv(v, inf).astype(np.float64),
                               enable_gqa=True, scale=1.0)
    np.testing.assert_array_equal(np.isnan(got.astype(np.float64)), np.isnan(want))
    np.testing.assert_array_equal(np.isinf(got.astype(np.float64)), np.isinf(want))
    np.testing.assert_array_equal(got, highest(q, k, v, ks, inf, scale=1.0))


@needs_bf16
def test_fewer_than_five_rows_per_key_head_keep_the_float32_kernels():
    rng = np.random.default_rng(12)
    q = rng.standard_normal((1, 8, 1, 128)).astype(BF16)
    k, ks = int8_cache(rng, (1, 2, 300, 128))
    v, vs = int8_cache(rng, (1, 2, 300, 128))
    np.testing.assert_array_equal(
        fastattn.attention(q, k, v, k_scale=ks, v_scale=vs, enable_gqa=True),
        highest(q, k, v, ks, vs))


@needs_bf16
def test_value_tiles_within_the_bound_of_pytorch():
    """The error against float64 at most 1.25 x that of PyTorch's bfloat16 SDPA on the
    values dequantized to bfloat16 (what a user does without fastattn) plus a twentieth
    of bfloat16's half-ulp at the output's magnitude; the mean no larger."""
    torch = pytest.importorskip("torch")
    ours_mean, theirs_mean = [], []
    for seed, (groups, Lq, Lk, Ev) in enumerate([(8, 1, 1000, 128), (16, 1, 700, 64),
                                                (4, 3, 2000, 128), (8, 2, 300, 192)]):
        rng = np.random.default_rng(seed)
        q = rng.standard_normal((1, 2 * groups, Lq, 128)).astype(BF16)
        k, ks = int8_cache(rng, (1, 2, Lk, 128))
        v, vs = int8_cache(rng, (1, 2, Lk, Ev))
        kd = reference.dequantize_kv(k, ks).astype(np.float64)
        vd = reference.dequantize_kv(v, vs).astype(np.float64)
        exact = reference.attention(q.astype(np.float64), kd, vd, enable_gqa=True)
        ours = np.abs(fastattn.attention(q, k, v, k_scale=ks, v_scale=vs,
                                         enable_gqa=True).astype(np.float64) - exact)
        tq, tk, tv = (torch.from_numpy(np.asarray(x, np.float32)).to(torch.bfloat16)
                      for x in (q.astype(np.float32), kd, vd))
        theirs = np.abs(torch.nn.functional.scaled_dot_product_attention(
            tq, tk, tv, enable_gqa=True).double().numpy() - exact)
        slack = 2.0 ** -8 / 2 / 20 * np.abs(exact).max()
        assert ours.max() <= 1.25 * theirs.max() + slack, (groups, Lq, Lk, Ev)
        ours_mean.append(ours.mean())
        theirs_mean.append(theirs.mean())
    assert np.mean(ours_mean) <= np.mean(theirs_mean)

