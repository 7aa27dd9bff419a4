"""bfloat16 and float16 (the README's "bfloat16 and float16").

Oracles: float64 recomputations of the same (16-bit) inputs (fastattn.reference on
float64 copies) and, where PyTorch is installed, PyTorch's own scaled_dot_product_attention
in the same dtype, whose error the result must not exceed. bfloat16 arrays need the
optional ml_dtypes; the float16 half of each test runs without it.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import fastattn
from fastattn import reference

from helpers import OUTSIDE_SOURCE, randn, rounded_weights_bound, run_with_isa

try:
    import ml_dtypes
except ImportError:
    ml_dtypes = None

BF16 = None if ml_dtypes is None else np.dtype(ml_dtypes.bfloat16)
needs_bf16 = pytest.mark.skipif(ml_dtypes is None, reason="ml_dtypes is not installed")
DTYPES = [pytest.param("bfloat16", marks=needs_bf16), "float16"]

# one unit in the last place at 1.0: rounding once to the dtype is within half of it
# of the exact result, relative to the result's magnitude
ULP = {"bfloat16": 2.0 ** -7, "float16": 2.0 ** -10}


def as_dtype(name):
    return BF16 if name == "bfloat16" else np.dtype(np.float16)


def f64(*arrays):
    return [None if a is None else np.asarray(a).astype(np.float64) for a in arrays]


def assert_rounded_once(out, exact, name, extra=0.0):
    """out is exact rounded to the dtype: within half an ulp of it, plus the float32
    arithmetic underneath (a relative 1e-5 of the output's scale), plus ``extra``
    (an array like exact: the weights' rounding, helpers.rounded_weights_bound)."""
    got = out.astype(np.float64)
    exact = np.asarray(exact, np.float64)
    assert got.shape == exact.shape
    finite = np.isfinite(exact)
    assert (np.isnan(got) == np.isnan(exact)).all()
    scale = max(1.0, float(np.abs(exact[finite]).max(initial=0)))
    bound = ULP[name] / 2 * np.abs(exact[finite]) + 1e-5 * scale
    bound = bound + np.broadcast_to(extra, exact.shape)[finite]
    err = np.abs(got[finite] - exact[finite])
    assert (err <= bound).all(), f"max excess {np.max(err - bound):.3g}"


def data(rng, name, *shapes):
    dt = as_dtype(name)
    return [randn(rng, s, np.float32).astype(dt) for s in shapes]


# ------------------------------------------------------------------------ attention

CASES = {
    "plain": dict(),
    "causal": dict(causal=True),
    "bottom_right": dict(causal="bottom_right"),
    "mask": dict(mask="mask"),
    "bias": dict(bias="bias"),
    "window": dict(causal=True, window=(17, 0)),
    "softcap": dict(softcap=2.0),
    "alibi": dict(alibi_slopes=np.array([0.5, 0.25, 0.125])),
    "lengths": dict(q_lengths=np.array([50, 3]), kv_lengths=np.array([90, 0])),
    "dropout": dict(dropout_p=0.25, dropout_seed=7),
}


def case_keywords(rng, case, H, Lq, Lk):
    """The keywords of CASES[case] for (B, H, Lq, Lk) data: a random mask and bias
    made, the lengths cut to Lq and Lk."""
    kw = dict(CASES[case])
    if kw.get("mask") == "mask":
        kw["mask"] = rng.random((Lq, Lk)) < 0.8
    if kw.get("bias") == "bias":
        kw["bias"] = randn(rng, (H, Lq, Lk), np.float32)
    if "q_lengths" in kw:
        kw["q_lengths"] = np.minimum(kw["q_lengths"], Lq)
        kw["kv_lengths"] = np.minimum(kw["kv_lengths"], Lk)
    return kw


@pytest.mark.parametrize("name", DTYPES)
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("Lq", [70, 2])          # the tiled and the decode path
def test_attention_is_computed_in_float32_and_rounded_once(rng, name, case, Lq):
    B, H, Lk, E = 2, 3, 130, 40
    q, k, v = data(rng, name, (B, H, Lq, E), (B, H, Lk, E), (B, H, Lk, 24))
    kw = case_keywords(rng, case, H, Lq, Lk)
    out, lse = fastattn.attention(q, k, v, return_lse=True, **kw)
    assert out.dtype == q.dtype and lse.dtype == np.float32
    want, want_lse = reference.attention(*f64(q, k, v), return_lse=True, **kw)
    assert_rounded_once(out, want, name)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", DTYPES)
def test_grouped_query_decode_and_transposed_views(rng, name):
    """GQA with a key-value cache in 16 bits, seen as transformers sees it:
    (B, L, H, E) buffers through swapaxes, read in place."""
    B, Hq, Hkv, Lk, E = 2, 8, 2, 600, 64
    q, kb, vb = data(rng, name, (B, 1, Hq, E), (B, Lk, Hkv, E), (B, Lk, Hkv, E))
    q, k, v = (x.swapaxes(1, 2) for x in (q, kb, vb))
    out = fastattn.attention(q, k, v, enable_gqa=True, causal="bottom_right")
    want = reference.attention(*f64(q, k, v), enable_gqa=True, causal="bottom_right")
    assert_rounded_once(out, want, name)


@pytest.mark.parametrize("name", DTYPES)
@pytest.mark.parametrize("Lq,groups,Ev", [(1, 1, 8), (1, 1, 130), (2, 1, 17),
                                          (4, 1, 64), (1, 8, 64), (3, 5, 200)])
@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_decode_reads_sixteen_bit_rows_in_place(rng, name, Lq, groups, Ev, layout):
    """The decode path reads 16-bit K and V rows in place (widened in registers, with
    prefetch): the result is float64's rounded once, and equal bit for bit to the
    float32 computation on the widened inputs (widening is exact and the sums are the
    same); a NaN value row in the last, partial step reaches only the row that sees
    it (the others: the same values within one rounding of the dtype, the step's sum
    being taken again without the fused path)."""
    Lk = 600
    Hk = 2
    q, k, v = data(rng, name, (2, Hk * groups, Lq, 32), (2, Lk, Hk, 32),
                   (2, Lk, Hk, Ev))
    k, v = k.swapaxes(1, 2), v.swapaxes(1, 2)
    if layout == "contiguous":
        k, v = k.copy(), v.copy()
    kw = dict(enable_gqa=True, causal="bottom_right")
    out = fastattn.attention(q, k, v, **kw)
    assert_rounded_once(out, reference.attention(*f64(q, k, v), **kw), name)
    wide = fastattn.attention(*(x.astype(np.float32) for x in (q, k, v)), **kw)
    np.testing.assert_array_equal(out.view(np.uint16),
                                  wide.astype(out.dtype).view(np.uint16))
    v = v.copy()
    v[1, 0, Lk - 1, Ev // 2] = np.nan
    out2 = fastattn.attention(q, k, v, **kw)
    sees = np.zeros(out.shape[:-1], bool)
    sees[1, :groups, Lq - 1] = True
    assert np.isnan(out2[sees][:, Ev // 2].astype(np.float32)).all()
    got, want = out2[~sees].astype(np.float64), out[~sees].astype(np.float64)
    assert np.isfinite(got).all()
    assert (np.abs(got - want) <= ULP[name] * np.abs(want) + 1e-6).all()


@needs_bf16
def test_sixteen_bit_operands_are_read_in_place(rng):
    from fastattn import _compute, _validation as _v
    from test_core import address
    q, k, v = data(rng, "bfloat16", (2, 5, 8), (2, 9, 8), (2, 9, 8))
    args = _v.attention_args(q, k, v)
    assert args.q.dtype == BF16 and args.computation == np.float32
    plan = _compute._plan(args, np.empty((2, 5, 8), np.float32))
    assert plan.operand("q")[0] == address(q) and plan.operand("v")[0] == address(v)


@pytest.mark.parametrize("name", DTYPES)
def test_results_do_not_depend_on_the_number_of_threads(rng, name):
    q, k, v = data(rng, name, (3, 4, 130, 32), (3, 4, 200, 32), (3, 4, 200, 32))
    one = fastattn.attention(q, k, v, causal=True, num_threads=1)
    for threads in (2, 3, 8):
        two = fastattn.attention(q, k, v, causal=True, num_threads=threads)
        np.testing.assert_array_equal(one.view(np.uint16), two.view(np.uint16))
    d1 = fastattn.attention(q[:, :, :1], k, v, num_threads=1)
    d2 = fastattn.attention(q[:, :, :1], k, v, num_threads=4)
    np.testing.assert_array_equal(d1.view(np.uint16), d2.view(np.uint16))


@pytest.mark.parametrize("name", DTYPES)
def test_keys_changed_between_calls_are_widened_anew(rng, name):
    # a call keeps each slice's widened K/V rows for the slice's next query tiles, in
    # scratch that the next call reuses: rows changed in place between two calls
    # must be read again, not taken from the first call's copy
    # (one slice: the thread's last slice is the next call's first)
    q, k, v = data(rng, name, (1, 1, 130, 32), (1, 1, 100, 32), (1, 1, 100, 32))
    first = fastattn.attention(q, k, v, num_threads=1)
    k[...] = data(rng, name, (1, 1, 100, 32))[0]
    v[:, :, 50:] = data(rng, name, (1, 1, 50, 32))[0]
    second = fastattn.attention(q, k, v, num_threads=1)
    assert_rounded_once(second, reference.attention(*f64(q, k, v)), name,
                        rounded_weights_bound(q, k, v))
    assert np.abs(second.astype(np.float64) - first).max() > 0.1


@pytest.mark.parametrize("name", DTYPES)
def test_nan_and_inf_reach_their_rows(rng, name):
    q, k, v = data(rng, name, (1, 70, 16), (1, 90, 16), (1, 90, 16))
    v[0, 5, 3] = np.inf
    k[0, 7, 0] = np.nan
    out = fastattn.attention(q, k, v, causal=True)
    want = reference.attention(*f64(q, k, v), causal=True)
    assert (np.isnan(out.astype(np.float64)) == np.isnan(want)).all()
    assert_rounded_once(out, want, name)


def test_promotion():
    h = np.ones((2, 3, 4), np.float16)
    f = np.ones((2, 3, 4), np.float32)
    assert fastattn.attention(h, h, f).dtype == np.float32
    assert fastattn.attention(h, h, h).dtype == np.float16
    assert fastattn.attention(h, h, np.ones((2, 3, 4), np.int64)).dtype == np.float64
    if BF16 is not None:
        b = np.ones((2, 3, 4), BF16)
        assert fastattn.attention(b, b, b).dtype == BF16
        assert fastattn.attention(b, h, b).dtype == np.float32     # bf16 + f16
        assert fastattn.attention(b, f, b).dtype == np.float32
        assert fastattn.attention(b, b, np.ones((2, 3, 4))).dtype == np.float64


@needs_bf16
@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "int4"])
def test_other_ml_dtypes_formats_are_refused(fmt):
    x = np.ones((2, 3, 4), getattr(ml_dtypes, fmt))
    with pytest.raises(TypeError, match="q"):
        fastattn.attention(x, x, x)


@pytest.mark.parametrize("name", DTYPES)
def test_out_in_sixteen_bits(rng, name):
    q, k, v = data(rng, name, (2, 30, 8), (2, 40, 8), (2, 40, 8))
    out = np.empty((2, 30, 8), q.dtype)
    res = fastattn.attention(q, k, v, out=out)
    assert res is out
    assert_rounded_once(out, reference.attention(*f64(q, k, v)), name)
    with pytest.raises(ValueError, match="dtype"):
        fastattn.attention(q, k, v, out=np.empty((2, 30, 8), np.float32))


# (q shape, k and v shape, keywords): each reaches a writer of the fused pass
ROUNDED_AS_WRITTEN = {
    "tiles": ((2, 3, 130, 64), (2, 3, 200, 64), dict(causal=True)),
    "split keys": ((1, 1, 40, 32), (1, 1, 9000, 32), dict(bias="bias")),
    "decode": ((1, 8, 1, 64), (1, 2, 700, 64), dict(enable_gqa=True)),
    "rows without keys": ((2, 3, 70, 16), (2, 3, 90, 16),
                          dict(kv_lengths=np.array([90, 0]), return_lse=True)),
    "window and sinks": ((1, 3, 100, 48), (1, 3, 100, 48),
                         dict(window=(20, 3), sinks=np.array([0.5, -1.0, 2.0]))),
}


@pytest.mark.parametrize("name", DTYPES)
@pytest.mark.parametrize("case", list(ROUNDED_AS_WRITTEN))
@pytest.mark.parametrize("special", [None, np.inf, np.nan])
def test_sixteen_bit_results_are_rounded_as_the_kernels_write_them(rng, monkeypatch,
                                                                   name, case, special):
    """The fused pass writes a 16-bit result itself, each float32 row rounded once as
    it is written (by a tile, by the merge of split keys or of a decode's pieces, after
    a row is redone exactly, for rows without keys): on the float32 micro-GEMM the bits
    are those of the float32 call on the widened operands, rounded by NumPy; in a new
    array, into out= (its own, or q itself: computed apart, then copied), and packed
    (varlen: rows Hq * Ev apart)."""
    use_kernels(monkeypatch)                # (bfloat16 on the micro-GEMM too)
    q_shape, kv_shape, kw = ROUNDED_AS_WRITTEN[case]
    q, k, v = data(rng, name, q_shape, kv_shape, kv_shape)
    kw = dict(kw)
    if kw.get("bias") == "bias":
        kw["bias"] = randn(rng, q_shape[-2:-1] + kv_shape[-2:-1], np.float32)
    if special is not None:
        v[..., 5, 3] = special              # a row redone by attend_row_exactly
    lse = kw.pop("return_lse", False)

    def bits(x):
        return (x[0] if lse else x).view(np.uint16)

    wide = [x.astype(np.float32) for x in (q, k, v)]
    want = fastattn.attention(*wide, return_lse=lse, **kw)
    want = (want[0] if lse else want).astype(q.dtype)
    assert (bits(fastattn.attention(q, k, v, return_lse=lse, **kw))
            == want.view(np.uint16)).all()
    if set(kw) <= {"causal", "window", "sinks"}:        # packed: (B * L, H, E)
        def packed(x):
            return np.concatenate([x_b.swapaxes(0, 1) for x_b in x])
        cu = [np.arange(x.shape[0] + 1) * x.shape[2] for x in (q, k)]
        got = fastattn.attention_varlen(*map(packed, (q, k, v)), *cu, **kw)
        wide_got = fastattn.attention_varlen(*map(packed, wide), *cu, **kw)
        assert got.dtype == q.dtype
        assert (got.view(np.uint16) == wide_got.astype(q.dtype).view(np.uint16)).all()
    for out in (np.empty(want.shape, q.dtype),
                q if q.shape == want.shape else np.ones(want.shape, q.dtype)):
        res = fastattn.attention(q, k, v, out=out, return_lse=lse, **kw)
        assert (res[0] if lse else res) is out
        assert (out.view(np.uint16) == want.view(np.uint16)).all()


NARROW_PROBE = """
import json, sys, numpy as np
from fastattn._dispatch import drivers, level
rng = np.random.default_rng(3)
# every exponent and sign with random mantissas, and the edges: zeros, subnormals of
# both formats, ties, the largest finite float16 and what rounds past it, inf, NaN
bits = np.concatenate([rng.integers(0, 2 ** 32, 300_000, dtype=np.uint64),
                       np.arange(0, 2 ** 32, 2 ** 32 // 9973, dtype=np.uint64)])
edges = np.array([0.0, -0.0, 2.0 ** -24, 2.0 ** -25, 3 * 2.0 ** -26, 2.0 ** -14,
                  2.0 ** -14 - 2.0 ** -25, 65504, 65519.99, 65520, -65520, 1e38,
                  1 + 2.0 ** -11, 1 + 3 * 2.0 ** -11, 1 + 2.0 ** -8, 1 + 3 * 2.0 ** -8,
                  np.inf, -np.inf, np.nan, -np.nan, 1.2e-38, 1e-45], np.float32)
x = np.concatenate([bits.astype(np.uint32).view(np.float32), edges])
got = {}
for name in sys.argv[1:]:
    units = name == "bfloat16 on the units"
    dt = np.dtype(np.float16 if name == "float16" else __import__("ml_dtypes").bfloat16)
    y = np.empty(x.size, dt)
    drivers.narrow(x[5:], y[5:], 2, units)      # (an unaligned start)
    drivers.narrow(x[:5], y[:5], 2, units)
    got[name] = y.view(np.uint16).tolist()
print(json.dumps({"level": level, "bits": x.view(np.uint32).tolist(), "got": got}))
"""


@pytest.mark.parametrize("isa", ["baseline", "avx2", "avx512"])
def test_rounding_to_sixteen_bits_is_numpys_at_every_level(isa):
    """The drivers round a float32 result to bfloat16 or float16 (src/fa_half.h:
    fa_narrow_row, vcvtps2ph where the level has it; the output rows of the tiles on
    the bfloat16 units by vcvtne2ps2bf16, src/fa_bf16.h: fa_bf16_narrow_row, which
    takes NaN and subnormal lanes the other way); the bits are those of NumPy's and
    ml_dtypes' ``astype``, except that a signalling NaN comes back quiet (as x86's
    conversions give it)."""
    names = ["float16"] + ([] if ml_dtypes is None else ["bfloat16"])
    if isa == "avx512" and ml_dtypes is not None and can_dot_bf16():
        names.append("bfloat16 on the units")
    res = subprocess.run([sys.executable, "-c", NARROW_PROBE, *names], capture_output=True,
                         text=True, cwd=OUTSIDE_SOURCE, timeout=120,
                         env={**os.environ, "FASTATTN_ISA": isa})
    assert res.returncode == 0, res.stderr[-2000:]
    got = json.loads(res.stdout)
    x = np.array(got["bits"], np.uint32).view(np.float32)
    signalling = np.isnan(x) & ((x.view(np.uint32) & 0x400000) == 0)
    for name in names:
        dt = as_dtype(name.split()[0])
        with np.errstate(all="ignore"):
            want = x.astype(dt).view(np.uint16)
        bits = np.array(got["got"][name], np.uint16)
        np.testing.assert_array_equal(bits[~signalling], want[~signalling])
        assert np.isnan(bits[signalling].view(dt).astype(np.float32)).all()
        quiet = 0x0200 if name == "float16" else 0x0040
        assert (bits[signalling] & quiet).all()


# ------------------------------------------------------- the rest of the public API

@pytest.mark.parametrize("name", DTYPES)
def test_the_other_functions_take_sixteen_bit_arrays(rng, name):
    dt = as_dtype(name)
    q, k, v = data(rng, name, (2, 3, 20, 8), (2, 3, 30, 8), (2, 3, 30, 8))
    q64, k64, v64 = f64(q, k, v)
    s = fastattn.scores(q, k, causal=True)
    assert s.dtype == dt
    assert_rounded_once(s, reference.scores(q64, k64, causal=True), name)
    w = fastattn.attention_weights(q, k, softcap=3.0)
    assert w.dtype == dt
    assert_rounded_once(w, reference.attention_weights(q64, k64, softcap=3.0), name)
    x = randn(rng, (4, 33), np.float32).astype(dt)
    assert_rounded_once(fastattn.softmax(x), reference.softmax(x.astype(np.float64)),
                        name)
    p = reference.attention_weights(q64, k64).astype(dt)
    ws = fastattn.weighted_sum(p, v)
    assert ws.dtype == dt
    assert_rounded_once(ws, p.astype(np.float64) @ v64, name)


@pytest.mark.parametrize("name", DTYPES)
@pytest.mark.parametrize("case", sorted(CASES))
def test_backward_in_sixteen_bits(rng, name, case):
    dt = as_dtype(name)
    B, H, Lq, Lk, E = 2, 3, 20, 30, 8
    q, k, v = data(rng, name, (B, H, Lq, E), (B, H, Lk, E), (B, H, Lk, E))
    kw = case_keywords(rng, case, H, Lq, Lk)
    out, lse = fastattn.attention(q, k, v, return_lse=True, **kw)
    g = randn(rng, out.shape, np.float32).astype(dt)
    grads = fastattn.attention_backward(g, q, k, v, out, lse, **kw)
    q64, k64, v64, g64 = f64(q, k, v, g)
    o64, lse64 = reference.attention(q64, k64, v64, return_lse=True, **kw)
    want = reference.attention_backward(g64, q64, k64, v64, o64, lse64, **kw)
    for a, ref in zip(grads, want):
        assert a.dtype == dt
        # the saved out is rounded to 16 bits: the gradients carry that rounding
        np.testing.assert_allclose(a.astype(np.float64), ref,
                                   atol=4 * ULP[name] * max(1, np.abs(ref).max()))


@pytest.mark.parametrize("name", DTYPES)
def test_sixteen_bit_calls_allocate_their_results_alone(rng, name):
    """No float32 copy of q, k, v, grad_out or out, no float32 output (the forward
    rounds its rows as it writes them), and the backward's float32 gradients and
    partial dQ in the thread's kept scratch: once that exists, a call allocates its
    16-bit results and little else (the forward: out and a float32 lse, 1 x the bytes
    of one input plus 1/32; the backward: dq, dk and dv, 3 x), not 6 x more for
    float32 gradients, 2 x for the partial dQ and 10 x for five widened copies."""
    import tracemalloc
    q, k, v, g = data(rng, name, *[(1, 16, 256, 64)] * 4)
    out, lse = fastattn.attention(q, k, v, return_lse=True)
    fastattn.attention_backward(g, q, k, v, out, lse)     # the scratch, once
    peaks = []
    for call in (lambda: fastattn.attention(q, k, v, return_lse=True),
                 lambda: fastattn.attention_backward(g, q, k, v, out, lse)):
        tracemalloc.start()
        try:
            call()
            peaks.append(tracemalloc.get_traced_memory()[1] / q.nbytes)
        finally:
            tracemalloc.stop()
    assert peaks[0] < 1.5 and peaks[1] < 3.5, peaks


def test_the_kept_scratch_is_bounded(rng):
    """What the README promises a calling thread keeps: at most five buffers, each at
    most KEEP_BYTES (or KEEP_BYTES_PER_THREAD per thread of the call), after calls of
    every kind (a new thread: its own buffers only): the tile areas and the partial dQ
    as bytes, the float32 result of 16-bit weights and weighted sums, the backward's
    tiles of dQ."""
    import threading
    from fastattn import _scratch
    kept = {}

    def calls():
        for dt in (np.float16, np.float32, np.float64):
            # the second: dk and dv in float32 would be more than KEEP_BYTES
            for lq, lk in ((40, 40), (4, 17000)):
                q = randn(rng, (1, 2, lq, 64), np.float32).astype(dt)
                k = randn(rng, (1, 2, lk, 64), np.float32).astype(dt)
                out, lse = fastattn.attention(q, k, k, return_lse=True)
                fastattn.attention_backward(out, q, k, k, out, lse)
                fastattn.attention(q[:, :, :1], k, k)                   # decode
                fastattn.weighted_sum(fastattn.attention_weights(q, k), k)
        kept.update(_scratch._local.buffers)

    t = threading.Thread(target=calls)
    t.start()
    t.join()
    slots = {slot: dtype for dtype, slot in kept}
    assert len(kept) <= 5           # (dq_tile: one float32 and one float64 buffer)
    assert slots["work"] == slots["dq_part"] == np.dtype(np.uint8)
    assert slots["result"] == np.dtype(np.float32)
    from fastattn._config import resolve_num_threads
    most = max(_scratch.KEEP_BYTES,
               _scratch.KEEP_BYTES_PER_THREAD * resolve_num_threads())
    assert all(buf.nbytes <= max(most, 1024 * buf.itemsize) for buf in kept.values())
    assert {slot for _, slot in kept} == {"work", "result", "dq_part", "dq_tile"}


def test_widened_slices_keep_the_scratch_within_what_is_kept(rng, monkeypatch):
    """A thread's widened K/V slice (16-bit K and V, several query tiles) makes the
    tiled forward's scratch larger; where the larger scratch would not be kept between
    calls the forward widens block by block instead: the same bits, from the kept
    buffer."""
    from fastattn import _scratch
    q, k, v = data(rng, "float16", (1, 2, 130, 32), (1, 2, 600, 32), (1, 2, 600, 32))
    monkeypatch.setattr(_scratch._local, "buffers", {})
    wide = fastattn.attention(q, k, v, num_threads=1)
    with_slices = _scratch._local.buffers[np.dtype(np.uint8), "work"].nbytes
    monkeypatch.setattr(_scratch, "KEEP_BYTES", with_slices - 1)
    monkeypatch.setattr(_scratch, "KEEP_BYTES_PER_THREAD", 0)
    _scratch._local.buffers = {}
    narrow = fastattn.attention(q, k, v, num_threads=1)
    np.testing.assert_array_equal(narrow.view(np.uint16), wide.view(np.uint16))
    without = _scratch._local.buffers[np.dtype(np.uint8), "work"].nbytes
    # the slices are 600 keys x (32 + 32) floats: 150 KiB of the first call's scratch
    assert without <= with_slices - 600 * 64 * 4


def test_what_is_kept_grows_with_the_threads_of_the_call():
    from fastattn import _scratch
    keep, per = _scratch.KEEP_BYTES, _scratch.KEEP_BYTES_PER_THREAD
    assert _scratch.kept(keep) and not _scratch.kept(keep + 1)
    assert _scratch.kept(keep + 1, threads=keep // per + 1)
    assert _scratch.kept(per * 32, threads=32) and not _scratch.kept(per * 32 + 1, 32)


def test_a_team_of_threads_keeps_its_larger_work_area(rng, monkeypatch):
    """The drivers' work area holds a region per thread: a call on more threads keeps
    its larger area between calls up to KEEP_BYTES_PER_THREAD per thread (the same
    buffer again on the next call), and past that gets one of its own."""
    from fastattn import _config, _scratch
    if _config.resolve_num_threads(2) < 2:
        pytest.skip("needs two threads (OpenMP and two usable cores)")
    q, k, v = data(rng, "float32", (1, 2, 200, 32), (1, 2, 300, 32), (1, 2, 300, 32))
    monkeypatch.setattr(_scratch._local, "buffers", {})
    expected = fastattn.attention(q, k, v, num_threads=2)
    size = _scratch._local.buffers[np.dtype(np.uint8), "work"].nbytes
    monkeypatch.setattr(_scratch, "KEEP_BYTES", 1024)
    for per_thread, is_kept in ((size // 2 + 64, True), (size // 2 - 64, False)):
        monkeypatch.setattr(_scratch, "KEEP_BYTES_PER_THREAD", per_thread)
        _scratch._local.buffers = {}
        first = fastattn.attention(q, k, v, num_threads=2)
        buffer = _scratch._local.buffers.get((np.dtype(np.uint8), "work"))
        assert (buffer is not None and buffer.nbytes >= size - 64) == is_kept
        second = fastattn.attention(q, k, v, num_threads=2)
        if is_kept:
            assert _scratch._local.buffers[np.dtype(np.uint8), "work"] is buffer
        np.testing.assert_array_equal(first, expected)
        np.testing.assert_array_equal(second, expected)


@pytest.mark.parametrize("name", DTYPES)
def test_results_do_not_share_the_kept_scratch(rng, name):
    """What a 16-bit call returns is its own: the next calls (which reuse the float32
    scratch the first computed in) leave it as it was."""
    q, k, v, g = data(rng, name, *[(2, 3, 40, 16)] * 4)
    q2, k2, v2, g2 = data(rng, name, *[(2, 3, 40, 16)] * 4)
    out, lse = fastattn.attention(q, k, v, return_lse=True)
    grads = fastattn.attention_backward(g, q, k, v, out, lse)
    weights = fastattn.attention_weights(q, k)
    mixed = fastattn.weighted_sum(weights, v)
    kept = [x.copy() for x in (out, lse, *grads, weights, mixed)]
    out2, lse2 = fastattn.attention(q2, k2, v2, return_lse=True)
    fastattn.attention_backward(g2, q2, k2, v2, out2, lse2)
    fastattn.weighted_sum(fastattn.attention_weights(q2, k2), v2)
    for now, then in zip((out, lse, *grads, weights, mixed), kept):
        assert now.tobytes() == then.tobytes()
    assert out.tobytes() != out2.tobytes()


@pytest.mark.parametrize("q_shape, kv_shape, kw", [
    ((2, 3, 70, 40), (2, 3, 90, 40), {}),                       # dQ written by its item
    ((1, 4, 50, 64), (1, 2, 3000, 64), dict(enable_gqa=True)),  # chunks, shared K/V
    ((1, 1, 5, 32), (1, 1, 5000, 32), {}),                      # one slice, 8 chunks
    ((2, 6, 1, 64), (2, 2, 700, 64), dict(enable_gqa=True, causal="bottom_right")),
    ((3, 2, 33, 16), (1, 2, 40, 16), dict(causal=True)),        # K/V broadcast
])
def test_sixteen_bit_gradients_are_the_float32_ones_rounded_once(rng, q_shape, kv_shape,
                                                                 kw):
    """float16 operands are widened exactly and summed by the float32 kernels, and the
    drivers round dq, dk and dv once: the float32 backward of the widened operands,
    rounded by NumPy, gives the same bits, whether dQ is rounded by the item that sums
    it or after the sum of its per-chunk partials."""
    q, go = (randn(rng, q_shape, np.float32).astype(np.float16) for _ in range(2))
    k, v = (randn(rng, kv_shape, np.float32).astype(np.float16) for _ in range(2))
    out, lse = fastattn.attention(q, k, v, return_lse=True, **kw)
    got = fastattn.attention_backward(go, q, k, v, out, lse, **kw)
    wide = [a.astype(np.float32) for a in (go, q, k, v, out)]
    want = fastattn.attention_backward(*wide, lse, **kw)
    for g, w in zip(got, want):
        assert g.dtype == np.float16
        np.testing.assert_array_equal(g.view(np.uint16),
                                      w.astype(np.float16).view(np.uint16))


@pytest.mark.parametrize("name", DTYPES)
def test_backward_takes_sixteen_bit_gradients_with_float32_inputs(rng, name):
    """grad_out and out of another dtype than q, k and v are read as they are."""
    q, k, v = data(rng, "float16", (2, 70, 16), (2, 90, 16), (2, 90, 12))
    q, k, v = (x.astype(np.float32) for x in (q, k, v))
    out, lse = fastattn.attention(q, k, v, return_lse=True, causal=True)
    g = randn(rng, out.shape, np.float32).astype(as_dtype(name))
    got = fastattn.attention_backward(g, q, k, v, out.astype(as_dtype(name)), lse,
                                      causal=True)
    want = fastattn.attention_backward(g.astype(np.float32), q, k, v,
                                       out.astype(as_dtype(name)).astype(np.float32),
                                       lse, causal=True)
    for a, b in zip(got, want):
        assert a.dtype == np.float32
        assert (a == b).all()


@pytest.mark.parametrize("name", DTYPES)
@pytest.mark.parametrize("shape", [(2, 4, 128, 128, 64), (1, 2, 200, 300, 80)])
@pytest.mark.parametrize("causal", [False, True])
def test_backward_error_near_pytorch_in_the_same_dtype(rng, name, shape, causal):
    """Each gradient's max error against float64 is at most 1.5 x that of PyTorch's
    backward in the same dtype (both are dominated by the final rounding: the
    ratio measured 0.3-1.3 over shapes and seeds)."""
    torch = pytest.importorskip("torch")
    B, H, Lq, Lk, E = shape
    q, k, v = data(rng, name, (B, H, Lq, E), (B, H, Lk, E), (B, H, Lk, E))
    g = data(rng, name, (B, H, Lq, E))[0]
    q64, k64, v64, g64 = f64(q, k, v, g)
    o64, lse64 = reference.attention(q64, k64, v64, causal=causal, return_lse=True)
    exact = reference.attention_backward(g64, q64, k64, v64, o64, lse64, causal=causal)
    out, lse = fastattn.attention(q, k, v, causal=causal, return_lse=True)
    ours = fastattn.attention_backward(g, q, k, v, out, lse, causal=causal)
    tdt = torch.bfloat16 if name == "bfloat16" else torch.float16
    tq, tk, tv = (torch.from_numpy(x.astype(np.float32)).to(tdt).requires_grad_()
                  for x in (q, k, v))
    tout = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)
    theirs = torch.autograd.grad(tout, (tq, tk, tv),
                                 torch.from_numpy(g.astype(np.float32)).to(tdt))
    for a, t, w in zip(ours, theirs, exact):
        their_err = np.abs(t.double().numpy() - w).max()
        assert np.abs(a.astype(np.float64) - w).max() <= 1.5 * their_err


@pytest.mark.parametrize("name", DTYPES)
def test_varlen_in_sixteen_bits(rng, name):
    dt = as_dtype(name)
    cu = np.array([0, 5, 5, 37])
    q, k, v = data(rng, name, (37, 4, 16), (37, 2, 16), (37, 2, 8))
    kw = dict(window=(6, 0), softcap=3.0, alibi_slopes=np.array([0.5, 0.25, 0.125, 0.1]))
    out = fastattn.attention_varlen(q, k, v, cu, cu, **kw)
    assert out.dtype == dt
    q64, k64, v64 = f64(q, k, v)
    for b in range(len(cu) - 1):
        s = slice(cu[b], cu[b + 1])
        want = reference.attention(q64[s].swapaxes(0, 1), k64[s].swapaxes(0, 1),
                                   v64[s].swapaxes(0, 1), enable_gqa=True, **kw)
        assert_rounded_once(out[s].swapaxes(0, 1), want, name)


@pytest.mark.parametrize("name", DTYPES)
def test_merge_partials_and_multi_head_attention(rng, name):
    dt = as_dtype(name)
    q, k, v = data(rng, name, (2, 6, 8), (2, 40, 8), (2, 40, 8))
    parts = [fastattn.attention(q, k[:, a:b], v[:, a:b], return_lse=True)
             for a, b in ((0, 25), (25, 40))]
    out, lse = fastattn.merge_partials([o for o, _ in parts], [s for _, s in parts])
    assert out.dtype == dt and lse.dtype == np.float32
    want = reference.attention(*f64(q, k, v))
    np.testing.assert_allclose(out.astype(np.float64), want, atol=3 * ULP[name])
    mha = fastattn.MultiHeadAttention(16, 2, dtype=dt, seed=0)
    x = randn(rng, (2, 5, 16), np.float32).astype(dt)
    y = mha(x)
    assert y.dtype == dt
    # the same weights in float64 (integers: inputs and weights are 16-bit values)
    mha64 = fastattn.MultiHeadAttention.from_state_dict(
        {name: w.astype(np.float64) for name, w in mha.state_dict().items()}, 2)
    want = mha64(x.astype(np.float64))
    np.testing.assert_allclose(y.astype(np.float64), want, rtol=0,
                               atol=8 * ULP[name] * max(1, np.abs(want).max()))


# ------------------------------------------------------------ against PyTorch's own

def _pytorch_error(torch, q, k, v, exact, causal, name):
    tdt = torch.bfloat16 if name == "bfloat16" else torch.float16
    tq, tk, tv = (torch.from_numpy(x.astype(np.float32)).to(tdt) for x in (q, k, v))
    theirs = torch.nn.functional.scaled_dot_product_attention(
        tq, tk, tv, is_causal=causal).double().numpy()
    return np.abs(theirs - exact)


@pytest.mark.parametrize("name", DTYPES)
@pytest.mark.parametrize("shape", [(2, 4, 128, 128, 64), (1, 8, 1, 700, 128),
                                   (1, 2, 200, 300, 80)])
@pytest.mark.parametrize("causal", [False, True])
def test_error_no_larger_than_pytorch_in_the_same_dtype(rng, name, shape, causal):
    """precision="highest": the max error against float64 no larger than PyTorch's
    SDPA's in the same dtype, on whichever kernel this CPU uses."""
    torch = pytest.importorskip("torch")
    B, H, Lq, Lk, E = shape
    q, k, v = data(rng, name, (B, H, Lq, E), (B, H, Lk, E), (B, H, Lk, E))
    exact = reference.attention(*f64(q, k, v), causal=causal)
    ours = fastattn.attention(q, k, v, causal=causal,
                              precision="highest").astype(np.float64)
    assert np.abs(ours - exact).max() <= _pytorch_error(torch, q, k, v, exact, causal,
                                                        name).max()


# --------------------------------------------------------------------- the import

def test_import_fastattn_imports_no_optional_dependency(tmp_path):
    code = ("import json, sys, fastattn\n"
            "print(json.dumps(sorted(m for m in ('ml_dtypes', 'torch', 'transformers', "
            "'dask', 'matplotlib', 'tqdm') if m in sys.modules)))")
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(fastattn.__file__)))
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=OUTSIDE_SOURCE, env=env, timeout=120)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout) == []


@pytest.mark.parametrize("name", DTYPES)
def test_dask_attention_in_sixteen_bits(rng, name):
    da = pytest.importorskip("dask.array")
    import fastattn.dask as fdask
    q, k, v = data(rng, name, (2, 3, 50, 8), (2, 3, 70, 8), (2, 3, 70, 8))
    chunked = [da.from_array(x, chunks=(1, 3, 20, 8)) for x in (q, k, v)]
    lazy = fdask.attention(*chunked, causal="bottom_right")
    assert lazy.dtype == q.dtype
    out = lazy.compute()
    assert out.dtype == q.dtype
    assert_rounded_once(out, reference.attention(*f64(q, k, v), causal="bottom_right"),
                        name)
    if name == "bfloat16":          # mixed bfloat16/float16 promote to float32
        mixed = fdask.attention(chunked[0], chunked[1].astype(np.float16), chunked[2])
        assert mixed.dtype == np.float32 and mixed.compute().dtype == np.float32


@pytest.mark.parametrize("name", DTYPES)
def test_every_sixteen_bit_value_is_widened_exactly(name):
    """q, k and v are widened by the kernels (not by NumPy): every one of the 65536
    bit patterns, subnormals, infinities and NaN included, as a key (scores with
    q = 1), a query (k = 1) and a value (one key, weight 1) comes back unchanged."""
    dt = as_dtype(name)
    every = np.arange(65536, dtype=np.uint16).view(dt)
    one = np.ones((1, 1), dt)
    with np.errstate(invalid="ignore"):     # (ml_dtypes warns on NaN)
        want = every.astype(np.float64)
    nan = np.isnan(want)
    for got in (fastattn.scores(one, every.reshape(-1, 1), scale=1.0)[0],
                fastattn.scores(every.reshape(-1, 1), one, scale=1.0)[:, 0],
                fastattn.attention(one, one, every.reshape(1, -1))[0]):
        got = got.astype(np.float64)
        assert (np.isnan(got) == nan).all()
        np.testing.assert_array_equal(got[~nan], want[~nan])
        nonzero = ~nan & (want != 0)       # (a sum starting at +0 turns -0 into +0)
        assert (np.signbit(got[nonzero]) == np.signbit(want[nonzero])).all()


# ------------------------------------------------------------ precision=, show_config

def test_precision_values(rng, monkeypatch):
    use_kernels(monkeypatch)            # no bfloat16 matrix kernel
    q, k, v = (randn(rng, (2, 9, 8), np.float32) for _ in range(3))
    exact = reference.attention(*f64(q, k, v))
    for precision in (None, "highest", "bf16"):
        out, lse = fastattn.attention(q, k, v, precision=precision, return_lse=True)
        # without a bfloat16 matrix kernel float32 computes in float32 for each
        np.testing.assert_allclose(out, exact, rtol=0, atol=2e-6)
        g = fastattn.attention_backward(np.ones_like(out), q, k, v, out, lse,
                                        precision=precision)
        assert all(x.dtype == np.float32 for x in g)
    for bad in ("fast", 3, "HIGHEST", b"highest"):
        with pytest.raises(ValueError, match="precision must be None, 'highest' or 'bf16'"):
            fastattn.attention(q, k, v, precision=bad)
    with pytest.raises(ValueError, match="'bf16x3' was removed"):
        fastattn.attention(q, k, v, precision="bf16x3")
    with pytest.raises(ValueError, match="precision"):
        fastattn.attention_backward(q, q, k, v, q, q[..., 0], precision="tf32")
    with pytest.raises(ValueError, match="'bf16x3' was removed"):
        fastattn.attention_backward(q, q, k, v, q, q[..., 0], precision="bf16x3")


def test_show_config_says_how_sixteen_bit_dtypes_are_computed(capsys):
    info = fastattn._config.config()
    for key in ("bfloat16", "float16", "cpu_16bit", "amx", "precision"):
        assert key in info
    assert info["isa"] in info["bfloat16"]
    assert ("AVX512-BF16" in info["bfloat16"]) == fastattn._dispatch.bf16_dot
    fastattn.show_config()
    printed = capsys.readouterr().out
    assert "bfloat16" in printed and "amx" in printed


# ---------------------------------------------- bfloat16 scores by AVX512-BF16 dot products

BF16_PROBE = """
import json, sys, warnings
import numpy as np, ml_dtypes
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import fastattn
from fastattn import _compute, _dispatch, _validation, reference
rng = np.random.default_rng(5)
bf = ml_dtypes.bfloat16
q = rng.standard_normal((2, 3, 70, 64)).astype(bf)
k = rng.standard_normal((2, 3, 130, 64)).astype(bf)
v = rng.standard_normal((2, 3, 130, 24)).astype(bf)
args = _validation.attention_args(q, k, v)
kernel = _compute._plan(args, np.empty((2, 3, 70, 24), np.float32)).dot_kernel
out = fastattn.attention(q, k, v, causal=True, softcap=5.0).astype(np.float64)
want = reference.attention(*(x.astype(np.float64) for x in (q, k, v)), causal=True,
                           softcap=5.0)
print(json.dumps({"bf16_dot": _dispatch.bf16_dot, "amx": _dispatch.amx, "kernel": kernel,
                  "err": float(np.abs(out - want).max()),
                  "scale": float(np.abs(want).max()),
                  "warnings": [str(w.message) for w in caught]}))
"""


def check_against_float64(q, k, v, **kw):
    """bfloat16 attention (and lse) against the float64 recomputation: with
    precision="highest" rounded once; by default (the weights may be rounded once to
    bfloat16 for the product with v) within that rounding more
    (helpers.rounded_weights_bound); the same bits on one thread as on all."""
    want, want_lse = reference.attention(*f64(q, k, v), return_lse=True, **kw)
    for precision in ("highest", None):
        out, lse = fastattn.attention(q, k, v, return_lse=True, precision=precision,
                                      **kw)
        one = fastattn.attention(q, k, v, num_threads=1, precision=precision, **kw)
        extra = 0.0 if precision else rounded_weights_bound(q, k, v, **kw)
        assert_rounded_once(out, want, "bfloat16", extra)
        np.testing.assert_allclose(lse, want_lse, rtol=1e-5, atol=1e-5)
        assert (one.view(np.uint16) == out.view(np.uint16)).all()


def use_kernels(monkeypatch, bf16_dot=False, amx=False):
    """Turn the bfloat16 kernels of fastattn._dispatch on or off for one test."""
    from fastattn import _dispatch
    monkeypatch.setattr(_dispatch, "bf16_dot", bf16_dot)
    monkeypatch.setattr(_dispatch, "amx", amx)


def bf16_probe(isa):
    return run_with_isa(BF16_PROBE, isa)


def can_dot_bf16():
    from fastattn import _cpu, _dispatch
    return (_cpu.matrix_features()["avx512_bf16"] and "avx512" in _dispatch.supported_levels
            and "avx512" in _dispatch.built_levels)


def can_amx():
    """The CPU, the OS and the build allow the AMX kernels (not an emulating build), in
    the avx512 level's module (whichever module this process uses)."""
    import importlib
    from fastattn import _cpu
    f = _cpu.matrix_features()
    if not (can_dot_bf16() and f["amx_bf16"] and f["amx_int8"] and f["amx_os"]):
        return False
    avx512 = importlib.import_module("fastattn._drivers_avx512")
    return (getattr(avx512, "HAS_AMX_BF16", False)
            and not getattr(avx512, "AMX_EMULATED", False) and _cpu.request_amx())


@needs_bf16
@pytest.mark.parametrize("isa", [None, "avx512_bf16", "avx512", "avx2"])
def test_bf16_scores_kernel_is_chosen_and_capped_by_fastattn_isa(isa):
    from fastattn import _cpu
    got = bf16_probe(isa)
    can = can_dot_bf16()
    if isa == "avx512_bf16":
        expect = can
    elif isa is None:
        expect = can and _cpu.matrix_features()["amd"]
    else:
        expect = False                  # a level named: the FMA micro-GEMM
    amx = isa is None and can_amx()         # on by default where the CPU has it
    assert got["bf16_dot"] == expect
    assert got["amx"] == amx
    assert got["kernel"] == ("amx_bf16" if amx else "avx512_bf16" if expect else "fma")
    assert any("avx512_bf16" in w for w in got["warnings"]) == (
        isa == "avx512_bf16" and not can)
    # either way: the exact result rounded once to bfloat16 (plus float32 arithmetic)
    assert got["err"] <= ULP["bfloat16"] / 2 * got["scale"] + 1e-5 * max(1, got["scale"])


@needs_bf16
@pytest.mark.skipif(not can_dot_bf16(), reason="the CPU or build has no AVX512-BF16")
@pytest.mark.parametrize("E", [2, 6, 64, 80, 128])
@pytest.mark.parametrize("Lk", [1, 5, 64, 131])
def test_bf16_scores_kernel_against_float64(rng, monkeypatch, E, Lk):
    """Every tail of the kernel's register tile (key rows 6/4/2/1), odd and even numbers
    of pairs, through the fused pass with the kernel on."""
    from fastattn import _compute, _validation
    q, k, v = data(rng, "bfloat16", (2, 70, E), (2, Lk, E), (2, Lk, 16))
    kw = dict(bias=randn(rng, (70, Lk), np.float32), causal="bottom_right")
    use_kernels(monkeypatch, bf16_dot=True)
    plan = _compute._plan(_validation.attention_args(q, k, v),
                          np.empty((2, 70, 16), np.float32))
    assert plan.dot_kernel == "avx512_bf16"
    check_against_float64(q, k, v, **kw)


@needs_bf16
@pytest.mark.skipif(not can_dot_bf16(), reason="the CPU or build has no AVX512-BF16")
@pytest.mark.parametrize("bf16_dot", [True, False])
@pytest.mark.parametrize("E, Ev", [(2, 2), (6, 5), (64, 64), (80, 48)])
@pytest.mark.parametrize("Lk", [5, 64, 131])
def test_bf16_backward_kernel_against_float64(rng, monkeypatch, bf16_dot, E, Ev, Lk):
    """The backward with its score-like products on vdpbf16ps (q k^T, and dO v^T where
    Ev is even) or on the float32 micro-GEMM: partial query tiles and key blocks,
    grouped-query heads, a bias, bottom-right causal; the same bits on one thread.
    With E and Ev multiples of 64 the three gradient products run on vdpbf16ps too, P
    and dS rounded to bfloat16 for them (as PyTorch's backward rounds them): each term
    then errs by at most 2^-9 of its size, and the sums by at most 2^-8 of the sums of
    the terms' magnitudes (float64, from the float64 P and dS) beyond the one rounding."""
    q, k, v = data(rng, "bfloat16", (2, 4, 70, E), (2, 2, Lk, E), (2, 2, Lk, Ev))
    g = data(rng, "bfloat16", (2, 4, 70, Ev))[0]
    kw = dict(bias=randn(rng, (70, Lk), np.float32), causal="bottom_right",
              enable_gqa=True)
    use_kernels(monkeypatch, bf16_dot=bf16_dot)
    out, lse = fastattn.attention(q, k, v, return_lse=True, **kw)
    grads = fastattn.attention_backward(g, q, k, v, out, lse, **kw)
    one = fastattn.attention_backward(g, q, k, v, out, lse, num_threads=1, **kw)
    q64, k64, v64, g64, o64 = f64(q, k, v, g, out)
    want = reference.attention_backward(g64, q64, k64, v64, o64, lse, **kw)
    rounded_products = bf16_dot and E % 64 == 0 and Ev % 64 == 0
    if rounded_products:
        size = product_magnitudes(q64, k64, v64, g64, o64, **kw)
    for x, (a, b, ref) in enumerate(zip(grads, one, want)):
        assert a.dtype == BF16
        assert (a.view(np.uint16) == b.view(np.uint16)).all()
        if rounded_products:
            err = np.abs(a.astype(np.float64) - ref)
            bound = ULP["bfloat16"] / 2 * np.abs(ref) + 2.0 ** -8 * size[x] + 1e-5
            assert (err <= bound).all(), f"max excess {np.max(err - bound):.3g}"
        else:
            assert_rounded_once(a, ref, "bfloat16")


@needs_bf16
@pytest.mark.skipif(not can_dot_bf16(), reason="the CPU or build has no AVX512-BF16")
@pytest.mark.parametrize("case", sorted(CASES))
def test_bf16_gradient_products_take_every_variant(rng, monkeypatch, case):
    """The gradient products on vdpbf16ps (E = Ev = 64) after every variant's rules on
    the tiles (mask, bias, window, softcap, ALiBi, lengths, dropout): against float64,
    within the bound of the 16-bit backward test; the same bits on one thread."""
    B, H, Lq, Lk, E = 2, 3, 70, 90, 64
    q, k, v = data(rng, "bfloat16", (B, H, Lq, E), (B, H, Lk, E), (B, H, Lk, E))
    kw = case_keywords(rng, case, H, Lq, Lk)
    use_kernels(monkeypatch, bf16_dot=True)
    from fastattn import _compute, _dispatch, _validation
    plan = _compute._plan(_validation.attention_args(q, k, v),
                          np.empty((B, H, Lq, E), np.float32))
    if _dispatch.drivers.HAS_AVX512_BF16:      # (not at FASTATTN_ISA=baseline, avx2)
        assert _dispatch.drivers.backward_kernel(plan, BF16) == "avx512_bf16"
    out, lse = fastattn.attention(q, k, v, return_lse=True, **kw)
    g = data(rng, "bfloat16", (B, H, Lq, E))[0]
    grads = fastattn.attention_backward(g, q, k, v, out, lse, **kw)
    one = fastattn.attention_backward(g, q, k, v, out, lse, num_threads=1, **kw)
    q64, k64, v64, g64 = f64(q, k, v, g)
    o64, lse64 = reference.attention(q64, k64, v64, return_lse=True, **kw)
    want = reference.attention_backward(g64, q64, k64, v64, o64, lse64, **kw)
    for a, b, ref in zip(grads, one, want):
        assert (a.view(np.uint16) == b.view(np.uint16)).all()
        np.testing.assert_allclose(a.astype(np.float64), ref,
                                   atol=4 * ULP["bfloat16"] * max(1, np.abs(ref).max()))


def product_magnitudes(q, k, v, g, out, **kw):
    """|dS| |K| scale, |dS|^T |Q| scale and |P|^T |dO| (float64; grouped-query heads
    summed onto their key/value head): the sums of the magnitudes of the terms of dQ,
    dK and dV."""
    groups = q.shape[1] // k.shape[1]
    ke, ve = (np.repeat(x, groups, axis=1) for x in (k, v))
    p = reference.attention_weights(q, k, **kw)
    ds = p * (g @ ve.swapaxes(-1, -2) - (g * out).sum(-1, keepdims=True))
    scale = 1 / np.sqrt(q.shape[-1])

    def per_kv_head(x):
        return x.reshape(x.shape[0], -1, groups, *x.shape[2:]).sum(2)

    return (scale * np.abs(ds) @ np.abs(ke),
            per_kv_head(scale * np.abs(ds).swapaxes(-1, -2) @ np.abs(q)),
            per_kv_head(np.abs(p).swapaxes(-1, -2) @ np.abs(g)))


def plan_kernel(q, k, v):
    """The dot_kernel of the plan of attention(q, k, v)."""
    from fastattn import _compute, _validation
    args = _validation.attention_args(q, k, v)
    s = args.shapes
    return _compute._plan(args, np.empty(s.batch + (s.Lq, s.Ev), np.float32)).dot_kernel


@needs_bf16
def test_bf16_scores_kernel_is_not_used_where_it_cannot_read_pairs(rng, monkeypatch):
    """Odd E (a pair would run past a row), float16 or mixed dtypes: the FMA
    micro-GEMM. (Rows whose elements are not adjacent are made so by the plan, which
    copies such operands, so the kernel reads them too.)"""
    q, k, v = data(rng, "bfloat16", (2, 9, 8), (2, 11, 8), (2, 11, 8))
    use_kernels(monkeypatch, bf16_dot=True)
    kernel = plan_kernel
    assert kernel(q, k, v) == "avx512_bf16"
    assert kernel(q[..., :7], k[..., :7], v) == "fma"               # E odd
    assert kernel(q, k[..., ::-1], v) == "avx512_bf16"              # (copied)
    assert kernel(*(x.astype(np.float16) for x in (q, k, v))) == "fma"
    assert kernel(q.astype(np.float32), k, v) == "fma"
    # transposed views whose rows are contiguous: read in place by the kernel
    qt = np.ascontiguousarray(q.swapaxes(0, 1)).swapaxes(0, 1)
    assert kernel(qt, k, v) == "avx512_bf16"
    got = fastattn.attention(q, k[..., ::-1], v)
    assert_rounded_once(got, reference.attention(*f64(q, k[..., ::-1], v)), "bfloat16")


@needs_bf16
@pytest.mark.skipif(not can_dot_bf16(), reason="the CPU or build has no AVX512-BF16")
@pytest.mark.parametrize("offset, width", [(0, 33), (1, 34), (1, 33)])
def test_bf16_kernel_packs_query_rows_whose_pairs_are_not_aligned(rng, monkeypatch,
                                                                  offset, width):
    """Query rows packed as 32-bit words where a row's pairs are aligned words, element
    by element where they are not (odd row stride, odd first element): same result."""
    E = 32
    big = data(rng, "bfloat16", (2, 70, width + 1))[0]
    q = big[..., offset:offset + E]
    assert not q.flags.c_contiguous
    k, v = data(rng, "bfloat16", (2, 90, E), (2, 90, 16))
    use_kernels(monkeypatch, bf16_dot=True)
    got = fastattn.attention(q, k, v, causal=True)
    dense = fastattn.attention(np.ascontiguousarray(q), k, v, causal=True)
    assert (got.view(np.uint16) == dense.view(np.uint16)).all()
    assert_rounded_once(got, reference.attention(*f64(q, k, v), causal=True), "bfloat16",
                        rounded_weights_bound(q, k, v, causal=True))


@needs_bf16
@pytest.mark.skipif(not can_dot_bf16(), reason="the CPU or build has no AVX512-BF16")
@pytest.mark.parametrize("Ev", [16, 48, 128])
@pytest.mark.parametrize("jump", [0.05, 200.0])
def test_bf16_values_product_rescales_the_running_sums(rng, monkeypatch, Ev, jump):
    """On the bfloat16 units the values' product rescales each row's running sums by
    e^(m_old - m_new) as it adds the block's: a bias rising along the keys raises every
    row's maximum in every block (factor ~e^-3), or by 200 per key (the factor
    underflows to 0 and drops the earlier sums). The float64 recomputation's result,
    within the bound of the weights rounded once."""
    q, k, v = data(rng, "bfloat16", (2, 70, 64), (2, 300, 64), (2, 300, Ev))
    bias = (jump * np.arange(300)).astype(np.float32)
    use_kernels(monkeypatch, bf16_dot=True)
    assert plan_kernel(q, k, v) == "avx512_bf16"
    got = fastattn.attention(q, k, v, bias=bias)
    want = reference.attention(*f64(q, k, v), bias=bias)
    assert_rounded_once(got, want, "bfloat16",
                        rounded_weights_bound(q, k, v, bias=bias))


# ------------------------------------------------------------------------ AMX tiles

def amx_testable():
    """The AMX kernels can run here: on the CPU, or emulated (a test build)."""
    from fastattn import _dispatch
    return (ml_dtypes is not None and getattr(_dispatch.drivers, "HAS_AMX_BF16", False)
            and (can_amx() or (getattr(_dispatch.drivers, "AMX_EMULATED", False)
                               and _dispatch.level == "avx512" and can_dot_bf16())))


needs_amx = pytest.mark.skipif(not amx_testable(),
                               reason="no AMX-BF16 here (nor an emulating build)")


BF16_KERNELS = [
    pytest.param("fma", marks=needs_bf16),
    pytest.param("avx512_bf16", marks=pytest.mark.skipif(
        ml_dtypes is None or not can_dot_bf16(), reason="no AVX512-BF16 here")),
    pytest.param("amx_bf16", marks=needs_amx)]


@pytest.mark.parametrize("kernel", BF16_KERNELS)
def test_default_precision_within_the_bound_of_pytorch(rng, monkeypatch, kernel):
    """precision=None (the weights may be rounded once to bfloat16 for the product
    with v) on each bfloat16 kernel, over a grid of shapes, causal or not, and seeds:
    each max error against float64 at most 1.25 x PyTorch's bfloat16 SDPA's on the
    same inputs plus a twentieth of bfloat16's half-ulp at the output's magnitude, and
    the grid's mean error no larger than PyTorch's. On the bfloat16 units the rounding
    is real (the result differs from precision="highest")."""
    torch = pytest.importorskip("torch")
    use_kernels(monkeypatch, bf16_dot=kernel != "fma", amx=kernel == "amx_bf16")
    ours_mean, theirs_mean, rounded = [], [], False
    for shape in [(2, 4, 128, 128, 64), (1, 2, 256, 1024, 128), (1, 4, 70, 300, 64),
                  (8, 2, 197, 197, 64), (1, 2, 200, 300, 80)]:
        for causal in (False, True):
            B, H, Lq, Lk, E = shape
            q, k, v = data(rng, "bfloat16", (B, H, Lq, E), (B, H, Lk, E), (B, H, Lk, E))
            exact = reference.attention(*f64(q, k, v), causal=causal)
            got = fastattn.attention(q, k, v, causal=causal)
            high = fastattn.attention(q, k, v, causal=causal, precision="highest")
            rounded |= bool((got != high).any())
            err = np.abs(got.astype(np.float64) - exact)
            theirs = _pytorch_error(torch, q, k, v, exact, causal, "bfloat16")
            slack = ULP["bfloat16"] / 2 / 20 * np.abs(exact).max()
            assert err.max() <= 1.25 * theirs.max() + slack, (shape, causal)
            ours_mean.append(err.mean())
            theirs_mean.append(theirs.mean())
    assert np.mean(ours_mean) <= np.mean(theirs_mean)
    # (the bfloat16 units run in the avx512 level's module only: FASTATTN_ISA below it
    # computes every kernel's plan on the float32 micro-GEMM)
    from fastattn import _dispatch
    assert rounded == (kernel != "fma" and _dispatch.level == "avx512")


@pytest.mark.parametrize("kernel", BF16_KERNELS)
def test_split_keys_with_each_bfloat16_kernel(rng, monkeypatch, kernel):
    """One query tile over 5000 keys: the tiled path splits the keys into pieces
    (src: attend_keys), each piece's sums from the kernel in use (AMX tiles for the
    scores and the values, vdpbf16ps, or the float32 micro-GEMM), merged; a NaN value
    in the third piece reaches the rows that see it. Against float64, with the same
    bits on one thread as on all."""
    from fastattn._dispatch import drivers
    q, k, v = data(rng, "bfloat16", (1, 50, 64), (1, 5000, 64), (1, 5000, 64))
    use_kernels(monkeypatch, bf16_dot=kernel != "fma", amx=kernel == "amx_bf16")
    assert plan_kernel(q, k, v) == kernel
    from fastattn import _compute, _validation
    args = _validation.attention_args(q, k, v)
    plan = _compute._plan(args, np.empty((1, 50, 64), np.float32))
    assert drivers.forward_path(plan)[1] < 5000          # split
    kw = dict(bias=randn(rng, (50, 5000), np.float32), causal="bottom_right")
    check_against_float64(q, k, v, **kw)
    v = v.copy()
    v[0, 4960, 7] = np.nan                  # seen by the rows 10..49 (bottom-right)
    check_against_float64(q, k, v, **kw)


@needs_amx
@pytest.mark.parametrize("E, Ev", [(32, 16), (64, 64), (96, 48), (128, 128), (64, 24)])
@pytest.mark.parametrize("Lk", [1, 15, 16, 17, 33, 64, 65, 131])
def test_amx_kernel_against_float64(rng, monkeypatch, E, Ev, Lk):
    """Every edge of the tiles: keys past the last whole 16 (vdpbf16ps), 16 or 32 keys
    per tile, blocks padded to 32 keys for the values' product, Ev in one or two tile
    rows (and Ev = 24: the float32 product), 70 query rows (lanes padded to 64);
    read through strided rows. Same bits on one thread as on all."""
    q, k, v = data(rng, "bfloat16", (2, 70, E), (2, Lk, E + 32), (2, Lk, Ev + 16))
    k, v = k[..., 16:16 + E], v[..., :Ev]           # rows with a stride
    kw = dict(bias=randn(rng, (70, Lk), np.float32), causal="bottom_right")
    use_kernels(monkeypatch, amx=True)
    assert plan_kernel(q, k, v) == "amx_bf16"
    check_against_float64(q, k, v, **kw)


@needs_amx
@pytest.mark.parametrize("case", ["plain", "causal", "window", "softcap", "alibi",
                                  "lengths", "dropout", "mask"])
def test_amx_kernel_with_every_option(rng, monkeypatch, case):
    """The options act on the score tile, which AMX writes as the other kernels do:
    same result as the float32 micro-GEMM's path (precision="highest"), both within
    rounding of float64; by default within the weights' rounding more."""
    q, k, v = data(rng, "bfloat16", (2, 3, 90, 64), (2, 3, 100, 64), (2, 3, 100, 32))
    kw = case_keywords(rng, case, 3, 90, 100)
    use_kernels(monkeypatch, amx=True)
    assert plan_kernel(q, k, v) == "amx_bf16"
    got = fastattn.attention(q, k, v, precision="highest", **kw)
    default = fastattn.attention(q, k, v, **kw)
    use_kernels(monkeypatch, amx=False)
    fma = fastattn.attention(q, k, v, **kw)
    scale = max(1.0, float(np.abs(fma.astype(np.float64)).max()))
    np.testing.assert_allclose(got.astype(np.float64), fma.astype(np.float64),
                               rtol=ULP["bfloat16"], atol=1e-5 * scale)
    want = reference.attention(*f64(q, k, v), **kw)
    assert_rounded_once(got, want, "bfloat16")
    assert_rounded_once(default, want, "bfloat16", rounded_weights_bound(q, k, v, **kw))


@pytest.mark.parametrize("kernel", ["avx512_bf16", "amx_bf16"])
@pytest.mark.parametrize("scale", [0.125, 40.0, 1e-3, 0.0, -0.25, -40.0])
@pytest.mark.parametrize("Lk", [64, 96, 100])
@pytest.mark.parametrize("causal", [False, True])
def test_weights_go_straight_to_pairs_for_a_positive_scale(rng, monkeypatch, kernel,
                                                           scale, Lk, causal):
    """On the bfloat16 units the softmax hands a block's weights to the values' product
    as bfloat16 pairs, never stored in float32, where the scale still to apply is
    positive and the block is whole groups of 32 keys (64 and 96 keys: every block;
    100: not its last); a zero or negative scale takes the stored path, and so do the
    blocks a causal rule crosses (scaled before the rule). Against float64 on each
    kernel here, the same bits on one thread."""
    if kernel not in kernels_here():
        pytest.skip(f"no {kernel} kernel on this CPU or build")
    q, k, v = data(rng, "bfloat16", (2, 3, 90, 64), (2, 3, Lk, 64), (2, 3, Lk, 32))
    use_kernels(monkeypatch, bf16_dot=True, amx=kernel == "amx_bf16")
    assert plan_kernel(q, k, v) == kernel
    check_against_float64(q, k, v, scale=scale, causal=causal)


@needs_amx
@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_amx_kernel_with_values_that_are_not_finite(rng, monkeypatch, bad):
    """A value row holding inf or NaN reaches exactly the query rows that attend to its
    key (the block takes the float32 path), as in the float64 recomputation."""
    q, k, v = data(rng, "bfloat16", (1, 80, 32), (1, 150, 32), (1, 150, 16))
    v[0, 70, 3] = bad
    use_kernels(monkeypatch, amx=True)
    got = fastattn.attention(q, k, v, causal="bottom_right")
    want = reference.attention(*f64(q, k, v), causal="bottom_right")
    assert_rounded_once(got, want, "bfloat16")
    assert not np.isfinite(got[0, :, 3].astype(np.float64)).all()


@needs_amx
@pytest.mark.parametrize("scale", [None, 0.01, 40.0])
def test_amx_softmax_saturated_masked_and_nan_rows(rng, monkeypatch, scale):
    """The AMX path's own softmax (vscalefps exp, float32 block sums): weights that
    underflow (scale 40: one key takes all), a row whose keys are all masked (zeros),
    a query row of NaN (NaN) and a score of NaN among finite ones (the NaN query row's
    tile and the NaN key's slice take the float32 path, the last query rows of the
    first slice stay on the tiles: within the weights' rounding)."""
    q, k, v = data(rng, "bfloat16", (2, 70, 64), (2, 200, 64), (2, 200, 32))
    q[0, 5] = np.nan
    k[1, 150, 7] = np.nan
    mask = rng.random((2, 70, 200)) < 0.7
    mask[1, 9] = False
    use_kernels(monkeypatch, amx=True)
    out, lse = fastattn.attention(q, k, v, mask=mask, scale=scale, return_lse=True)
    want, want_lse = reference.attention(*f64(q, k, v), mask=mask, scale=scale,
                                         return_lse=True)
    assert_rounded_once(out, want, "bfloat16",
                        rounded_weights_bound(q, k, v, mask=mask, scale=scale))
    assert (out[1, 9].astype(np.float64) == 0).all() and lse[1, 9] == -np.inf
    assert np.isnan(out[0, 5].astype(np.float64)).all()
    finite = np.isfinite(want_lse)
    assert (np.isnan(lse) == np.isnan(want_lse)).all()
    np.testing.assert_allclose(lse[finite], want_lse[finite], rtol=1e-5, atol=1e-5)


@needs_bf16
def test_amx_kernel_is_not_used_where_it_cannot_read_tiles(rng, monkeypatch):
    """AMX reads rows of 32 elements in place: E a multiple of 32, bfloat16 q and k;
    otherwise vdpbf16ps where that is on, else the float32 micro-GEMM."""
    q, k, v = data(rng, "bfloat16", (2, 9, 64), (2, 11, 64), (2, 11, 8))
    use_kernels(monkeypatch, amx=True)
    assert plan_kernel(q, k, v) == "amx_bf16"
    assert plan_kernel(q[..., :48], k[..., :48], v) == "fma"        # E = 48
    assert plan_kernel(*(x.astype(np.float16) for x in (q, k, v))) == "fma"
    assert plan_kernel(q.astype(np.float32), k, v) == "fma"
    use_kernels(monkeypatch, amx=True, bf16_dot=True)
    assert plan_kernel(q[..., :48], k[..., :48], v) == "avx512_bf16"


@needs_amx
def test_precision_bf16_rounds_float32_inputs_onto_the_tiles(rng, monkeypatch):
    """precision="bf16" on the AMX path: float32 q, k, v rounded to bfloat16 (nearest
    even), computed on the tiles, the result float32: the float64 recomputation of the
    rounded inputs, within float32 arithmetic; "highest" leaves the inputs alone."""
    q, k, v = (randn(rng, s, np.float32) for s in ((2, 70, 64), (2, 90, 64), (2, 90, 32)))
    use_kernels(monkeypatch, amx=True)
    got = fastattn.attention(q, k, v, causal=True, precision="bf16")
    assert got.dtype == np.float32
    rounded = [x.astype(BF16) for x in (q, k, v)]
    want = reference.attention(*f64(*rounded), causal=True)
    # float32 arithmetic on the rounded inputs, the weights rounded once to bfloat16
    bound = 1e-5 + 1e-4 * np.abs(want) + rounded_weights_bound(*rounded, causal=True)
    assert (np.abs(got - want) <= bound).all()
    exact = reference.attention(*f64(q, k, v), causal=True)
    assert np.abs(got - exact).max() > 1e-4        # the rounding did happen
    highest = fastattn.attention(q, k, v, causal=True)
    np.testing.assert_allclose(highest, exact, rtol=1e-5, atol=1e-6)


def test_precision_bf16_without_amx_computes_as_highest(rng, monkeypatch):
    q, k, v = (randn(rng, s, np.float32) for s in ((2, 70, 64), (2, 90, 64), (2, 90, 32)))
    use_kernels(monkeypatch, amx=False)
    got = fastattn.attention(q, k, v, precision="bf16")
    assert (got == fastattn.attention(q, k, v, precision="highest")).all()


def test_amx_choice_follows_cpu_os_build_and_fastattn_isa():
    """The decision of fastattn._dispatch, on every input it reads: the AMX state asked
    for only when everything else allows it, a refusal falls back (and says so)."""
    from fastattn._dispatch import amx_choice
    asked = []

    def request(granted):
        return lambda: asked.append(1) or granted
    cpu = {"amx_bf16": True, "amx_int8": True, "amx_os": True, "avx512_bf16": True}
    assert amx_choice("", cpu, True, False, request(True)) == (True, amx_choice(
        "", cpu, True, False, request(True))[1])
    assert amx_choice("", cpu, True, False, request(True))[1].startswith("used")
    usable, why = amx_choice("", cpu, True, False, request(False))
    assert not usable and "refused" in why
    asked.clear()
    for forced in ("avx512", "avx512_bf16", "avx2"):
        usable, why = amx_choice(forced, cpu, True, False, request(True))
        assert not usable and forced in why
    assert amx_choice("", dict(cpu, amx_os=False), True, False, request(True)) == (
        False, "not used: the OS does not enable the AMX tile state")
    assert not amx_choice("", dict(cpu, amx_bf16=False), True, False, request(True))[0]
    assert not amx_choice("", dict(cpu, amx_int8=False), True, False, request(True))[0]
    assert not amx_choice("", cpu, False, False, request(True))[0]
    assert asked == []                  # never asked the OS where AMX could not be used
    with pytest.warns(RuntimeWarning, match="amx"):
        assert not amx_choice("amx", cpu, False, False, request(True))[0]
    with pytest.warns(RuntimeWarning, match="refused"):
        assert not amx_choice("amx", cpu, True, False, request(False))[0]
    # an emulating build (no CPU support needed) only where FASTATTN_ISA=amx asks
    none = {"amx_bf16": False, "amx_int8": False, "amx_os": False, "avx512_bf16": True}
    assert amx_choice("amx", none, True, True, request(False))[0]
    assert not amx_choice("", none, True, True, request(False))[0]


# ------------------------------------------- special values on every kernel and level
#
# The bfloat16 units (vdpbf16ps, AMX tiles) flush subnormal inputs and products to zero
# and sum q.k before the scale, so a raw q.k beyond the float32 range overflows there
# even when the scaled score fits; the running sums of the values overflow near the
# largest float even when the mean does not. fastattn checks its operands first and
# computes such calls on the float32 path, and redoes rows whose running sums
# overflowed by the exact (normalised) rule: on every kernel, at every level, the
# result is the float64 recomputation rounded once.

def special_values(rng, case, name, Lq):
    """q, k, v (2, 2, Lq, 64), (2, 2, 96, 64), (2, 2, 96, 16) and their scale:
    'overflow' (bfloat16: |q|, |k| ~ 2^64, so that q.k overflows float32 before a
    scale of 2^-134 brings the scores back to O(1)), 'subnormal' (k and v subnormal in
    the dtype, so are the results), 'max' (values at +-the dtype's largest number)."""
    dt = as_dtype(name)
    info = ml_dtypes.finfo(dt) if name == "bfloat16" else np.finfo(dt)
    g = lambda *s: rng.standard_normal(s)                   # noqa: E731
    if case == "overflow":
        q, k = (np.sign(g(2, 2, L, 64)) * 2.0 ** 64 * (1 + rng.random((2, 2, L, 64)))
                for L in (Lq, 96))
        return q.astype(dt), k.astype(dt), g(2, 2, 96, 16).astype(dt), 2.0 ** -134
    if case == "subnormal":
        low = float(info.smallest_normal) / 16
        return (g(2, 2, Lq, 64).astype(dt), (g(2, 2, 96, 64) * low).astype(dt),
                (g(2, 2, 96, 16) * low).astype(dt), None)
    v = np.where(rng.random((2, 2, 96, 16)) < 0.5, -1.0, 1.0) * float(info.max)
    v[..., ::3, 0] = 1.0
    return g(2, 2, Lq, 64).astype(dt), g(2, 2, 96, 64).astype(dt), v.astype(dt), None


def kernels_here():
    """The kernels this build and CPU can run for bfloat16 (an emulating AMX build
    runs the AMX kernel anywhere)."""
    from fastattn import _dispatch
    found = ["fma"]
    if can_dot_bf16() and getattr(_dispatch.drivers, "HAS_AVX512_BF16", False):
        found.append("avx512_bf16")
    if getattr(_dispatch.drivers, "HAS_AMX_BF16", False) and (
            can_amx() or getattr(_dispatch.drivers, "AMX_EMULATED", False)):
        found.append("amx_bf16")
    return found


@pytest.mark.parametrize("name", DTYPES)
@pytest.mark.parametrize("kernel", ["fma", "avx512_bf16", "amx_bf16"])
@pytest.mark.parametrize("case", ["overflow", "subnormal", "max"])
@pytest.mark.parametrize("Lq", [70, 2])
def test_special_values_on_every_kernel(rng, monkeypatch, name, kernel, case, Lq):
    """Finite results wherever the float64 recomputation is finite, within half an ulp
    of the dtype (plus a subnormal ulp for subnormal results and the float32
    arithmetic), forward and backward, on each kernel this machine has (the tiled and
    the decode path); the same bits on one thread."""
    if kernel not in kernels_here():
        pytest.skip(f"no {kernel} kernel on this CPU or build")
    if name == "float16" and (kernel != "fma" or case == "overflow"):
        pytest.skip("float16 runs the float32 micro-GEMM, and its q.k cannot overflow")
    use_kernels(monkeypatch, bf16_dot=kernel == "avx512_bf16", amx=kernel == "amx_bf16")
    q, k, v, scale = special_values(rng, case, name, Lq)
    out, lse = fastattn.attention(q, k, v, scale=scale, return_lse=True)
    one = fastattn.attention(q, k, v, scale=scale, num_threads=1)
    q64, k64, v64 = f64(q, k, v)
    want, want_lse = reference.attention(q64, k64, v64, scale=scale, return_lse=True)
    assert np.isfinite(want).all() and np.isfinite(out.astype(np.float64)).all()
    info = ml_dtypes.finfo(BF16) if name == "bfloat16" else np.finfo(np.float16)
    subnormal_ulp = float(info.smallest_subnormal)      # the spacing of subnormals
    err = np.abs(out.astype(np.float64) - want)
    bound = (ULP[name] / 2 * np.abs(want) + subnormal_ulp
             + 1e-5 * np.abs(want).max(axis=-1, keepdims=True))
    assert (err <= bound).all(), f"{case}: max excess {np.max(err - bound):.3g}"
    np.testing.assert_allclose(lse, want_lse, rtol=1e-5)
    assert (one.view(np.uint16) == out.view(np.uint16)).all()
    if case == "max":
        return          # (dP = dO v^T overflows float32 itself: no float32 gradient)
    g = data(rng, name, out.shape)[0]
    grads = fastattn.attention_backward(g, q, k, v, out, lse, scale=scale)
    o64, l64 = reference.attention(q64, k64, v64, scale=scale, return_lse=True)
    wants = reference.attention_backward(f64(g)[0], q64, k64, v64, o64, l64, scale=scale)
    for a, w in zip(grads, wants):
        a = a.astype(np.float64)
        assert np.isfinite(a).all()
        bound = (ULP[name] * np.abs(w) + subnormal_ulp
                 + 1e-3 * np.abs(w).max(axis=(-2, -1), keepdims=True))
        assert (np.abs(a - w) <= bound).all()


@needs_bf16
@pytest.mark.parametrize("where", ["q", "k", "v", "keys of a sequence without queries"])
@pytest.mark.parametrize("Lq", [40, 100, 300])
def test_one_operand_outside_the_units_range_moves_only_its_slice_or_tile(
        rng, monkeypatch, where, Lq):
    """One bfloat16 value outside [2**-40, 2**40] (a raw q.k that may overflow, or a
    subnormal the units would flush) in one slice's k or v: that slice runs on the
    float32 path, with the bits of the same call with the bfloat16 units turned off;
    in a query row, the tile of 64 rows that holds it (with one or two tiles per slice;
    with five, checked before the tiles, the slice). Every other slice and tile keeps
    the units and the bits it has without that value; so does the whole call where the
    value is in the keys of a packed sequence without query rows (no tile reads
    them)."""
    kernels = kernels_here()[1:]
    if not kernels:
        pytest.skip("no bfloat16 units here")
    q, k, v = data(rng, "bfloat16", (3, 4, Lq, 64), (3, 4, 90, 64), (3, 4, 90, 64))
    packed = where == "keys of a sequence without queries"

    def call():
        if not packed:
            return fastattn.attention(q, k, v).view(np.uint16).copy()
        cu_q, cu_k = np.array([0, 0, Lq, 2 * Lq]), np.array([0, 90, 180, 270])
        return fastattn.attention_varlen(*(x.swapaxes(1, 2).reshape(-1, 4, 64)
                                           for x in (q[1:], k, v)), cu_q,
                                         cu_k).view(np.uint16).copy()
    moved = np.zeros(call().shape, bool)      # where the float32 path takes over
    if not packed:
        moved[2, 1, :64 if where == "q" and Lq <= 100 else Lq] = True
    x = {"q": q, "k": k, "v": v}.get(where, k)
    at = (0 if packed else 2, 1, 7, 5)
    for kernel in kernels:
        use_kernels(monkeypatch)
        fma = call()
        use_kernels(monkeypatch, bf16_dot=kernel == "avx512_bf16",
                    amx=kernel == "amx_bf16")
        units = call()
        assert (units != fma).any() and (units[moved] != fma[moved]).any() == moved.any()
        kept = x[at]
        for bad in (2.0 ** 50, 1e-39):
            x[at] = bad
            use_kernels(monkeypatch)
            want = call()
            use_kernels(monkeypatch, bf16_dot=kernel == "avx512_bf16",
                        amx=kernel == "amx_bf16")
            got = call()
            assert (got[moved] == want[moved]).all(), (kernel, bad)
            assert (got[~moved] == units[~moved]).all(), (kernel, bad)
        x[at] = kept


@needs_bf16
@pytest.mark.parametrize("case", ["overflow", "subnormal"])
def test_special_values_leave_the_bfloat16_units(rng, monkeypatch, case):
    """Operands the bfloat16 units would flush or overflow on take the float32 path
    (the plan's forward kernel says so); ordinary ones keep the units."""
    from fastattn import _compute, _dispatch, _validation
    for kernel in kernels_here()[1:]:
        use_kernels(monkeypatch, bf16_dot=kernel == "avx512_bf16",
                    amx=kernel == "amx_bf16")
        q, k, v, scale = special_values(rng, case, "bfloat16", 70)
        plan = _compute._plan(_validation.attention_args(q, k, v, scale=scale),
                              np.empty((2, 2, 70, 16), np.float32))
        assert plan.dot_kernel == kernel
        assert _dispatch.drivers.forward_kernel(plan) == "fma"
        q, k, v = data(rng, "bfloat16", (2, 2, 70, 64), (2, 2, 96, 64), (2, 2, 96, 16))
        plan = _compute._plan(_validation.attention_args(q, k, v),
                              np.empty((2, 2, 70, 16), np.float32))
        assert _dispatch.drivers.forward_kernel(plan) == kernel


@needs_bf16
@pytest.mark.parametrize("case", ["gqa", "broadcast keys, other lengths", "causal",
                                  "window"])
def test_values_packed_once_serve_every_tile(rng, monkeypatch, case):
    """On the bfloat16 units a call's V^T is packed once for all the tiles that read it
    (250 queries: four tiles per slice, over 300 keys): the query heads of a group
    share their values' slot; one K/V head broadcast to three sequences holding 10, 71
    and 300 of its rows is packed for each with its own keys; blocks that a causal
    rule or a window cuts short are packed by their tiles. Against the float64
    recomputation, on each kernel here."""
    kernels = kernels_here()[1:]
    if not kernels:
        pytest.skip("no bfloat16 units here")
    kw = {"causal": dict(causal=True), "window": dict(causal=True, window=(40, 0)),
          "broadcast keys, other lengths": dict(kv_lengths=np.array([10, 71, 300])),
          "gqa": dict(enable_gqa=True)}
    kw = kw.get(case, {})
    heads = {"gqa": 2, "broadcast keys, other lengths": 1}.get(case, 4)
    q, k, v = data(rng, "bfloat16", (3, 4, 250, 64), (1, heads, 300, 64),
                   (1, heads, 300, 32))
    if case != "broadcast keys, other lengths":
        k, v = data(rng, "bfloat16", (3, heads, 300, 64), (3, heads, 300, 32))
    k, v = (np.broadcast_to(x, (3,) + x.shape[1:]) for x in (k, v))
    for kernel in kernels:
        use_kernels(monkeypatch, bf16_dot=kernel == "avx512_bf16",
                    amx=kernel == "amx_bf16")
        check_against_float64(q, k, v, **kw)


@needs_bf16
@pytest.mark.parametrize("word", [0, 31, 45, 77, 100, 127, 128, 511, 540, 591])
def test_the_range_scan_sees_every_word(rng, monkeypatch, word):
    """The scan for the bfloat16 units' range reads every word of an operand: one
    out-of-range word of a slice's values (592 words: passes of 128, then a tail of
    two whole vectors and one part), wherever it lies, moves the call off the units."""
    from fastattn import _compute, _dispatch, _validation
    q, k, v = data(rng, "bfloat16", (2, 1, 70, 64), (2, 1, 37, 64), (2, 1, 37, 16))
    for kernel in kernels_here()[1:]:
        use_kernels(monkeypatch, bf16_dot=kernel == "avx512_bf16",
                    amx=kernel == "amx_bf16")
        out = np.empty((2, 1, 70, 16), np.float32)
        plan = _compute._plan(_validation.attention_args(q, k, v), out)
        assert _dispatch.drivers.forward_kernel(plan) == kernel
        bad = v.copy()
        bad[1].reshape(-1)[word] = 2.0 ** 50
        plan = _compute._plan(_validation.attention_args(q, k, bad), out)
        assert _dispatch.drivers.forward_kernel(plan) == "fma", kernel
