"""Paged and quantized key-value caches: quantize_kv, store_kv, attention_paged and the
quantized k/v of attention and attention_varlen, against the plain NumPy twins of
fastattn.reference (gather, dequantize, attend in float64) and hand-computed values."""

import contextlib

import numpy as np
import pytest

import fastattn
from fastattn import reference

from helpers import assert_close, close_to, float8_pairs, rounded_weights_bound

ml_dtypes = pytest.importorskip("ml_dtypes")


@contextlib.contextmanager
def default_threads(n):
    """Calls without ``num_threads`` run on n threads inside the block."""
    fastattn.set_num_threads(n)
    try:
        yield
    finally:
        fastattn.set_num_threads(None)


@contextlib.contextmanager
def plans_made(monkeypatch, name):
    """The calls of ``fastattn._compute.<name>`` (a short path's plan) made inside the
    block, each True where it made a plan (else the general path took the call)."""
    from fastattn import _compute
    calls, real = [], getattr(_compute, name)

    def spy(*args, **kw):
        made = real(*args, **kw)
        calls.append(made is not None)
        return made

    with monkeypatch.context() as m:
        m.setattr(_compute, name, spy)
        yield calls
BF16 = np.dtype(ml_dtypes.bfloat16)
CODES = ["int8", "float8_e4m3fn", "float8_e5m2"]
FLOAT8_STEP = {"float8_e4m3fn": 2.0 ** -3, "float8_e5m2": 2.0 ** -2}  # relative ulp



# ---------------------------------------------------------------------- quantize_kv

def test_quantize_kv_by_hand():
    x = np.array([[1.0, -0.5, 0.25], [0.0, 0.0, 0.0], [-2.0, 1.0, 0.5]])
    codes, scale = fastattn.quantize_kv(x)
    assert codes.dtype == np.int8 and scale.dtype == np.float32
    np.testing.assert_array_equal(scale, np.float32([1 / 127, 1.0, 2 / 127]))
    # 0.25 * 127 = 31.75 -> 32; -0.5 * 127 = -63.5 -> -64 (ties to even); 0.5 / (2/127)
    # = 31.75 -> 32
    np.testing.assert_array_equal(codes, [[127, -64, 32], [0, 0, 0], [-127, 64, 32]])


@pytest.mark.parametrize("dtype", CODES)
@pytest.mark.parametrize("axis_scale", ["token", "head"])
def test_quantize_kv_round_trips_within_half_a_code_step(dtype, axis_scale):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 9, 3, 16)) * rng.uniform(0.01, 10, (2, 9, 3, 1))
    x[0, 4, 1] = 0                                   # an all-zero row
    codes, scale = fastattn.quantize_kv(x, dtype, axis_scale=axis_scale)
    assert codes.shape == x.shape and codes.dtype.name == dtype
    assert scale.shape == ((2, 9, 3) if axis_scale == "token" else (2, 1, 3))
    back = reference.dequantize_kv(codes, scale).astype(np.float64)
    s = np.broadcast_to(scale, x.shape[:-1])[..., None].astype(np.float64)
    if dtype == "int8":
        step = s                                     # one code is one scale
    else:                                            # one ulp of the code at x / s
        y = np.abs(x) / s
        step = s * np.maximum(2.0 ** np.floor(np.log2(np.maximum(y, 1e-300))),
                              2.0 ** (-6 if dtype == "float8_e4m3fn" else -14))
        step = step * FLOAT8_STEP[dtype]
    assert np.all(np.abs(back - x) <= 0.5 * step * (1 + 1e-6) + 1e-12)
    if axis_scale == "token":
        assert np.all(scale[0, 4, 1] == 1)
    # the reference's twin, row by row, gives the same codes and scales
    want_codes, want_scale = reference.quantize_kv(x, dtype, axis_scale=axis_scale)
    np.testing.assert_array_equal(scale, want_scale)
    np.testing.assert_array_equal(codes.view(np.uint8), want_codes.view(np.uint8))


@pytest.mark.parametrize("xdtype", [np.float32, np.float64, np.float16, BF16, np.int16])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_int8_codes_are_the_references_in_parallel(xdtype, threads):
    """quantize_kv's int8 codes per token (compiled, 256 rows per work item) are the
    reference's, bit for bit, at any thread count: rows of every magnitude, all-zero
    rows, rows whose ratio to 127 underflows float32 (the smallest scale), ties."""
    rng = np.random.default_rng(threads)
    x = rng.standard_normal((700, 3, 40)) * 10.0 ** rng.uniform(-3, 3, (700, 3, 1))
    x[5, 1] = 0
    x[600, 2, :3] = (127.0, 0.5, -62.5)             # ties: 0.5 -> 0, -62.5 -> -62
    x[600, 2, 3:] = 0
    if xdtype == np.float64:
        x[650, 0] = 1e-300                          # ratio below float32's range
        x[650, 1] = 0
        x[650, 1, ::2] = -3e-46
    x = x.astype(xdtype)
    with default_threads(threads):
        codes, scale = fastattn.quantize_kv(x)
        want_codes, want_scale = reference.quantize_kv(x)
        assert codes.dtype == np.int8 and scale.dtype == np.float32
        np.testing.assert_array_equal(scale.view(np.int32), want_scale.view(np.int32))
        np.testing.assert_array_equal(codes, want_codes)
        assert scale[5, 1] == 1 and list(codes[600, 2, :3]) == [127, 0, -62]
        if xdtype == np.float64:
            assert scale[650, 0] == scale[650, 1] == np.float32(2.0 ** -149)
            assert not codes[650, :2].any()
        for where in ((0, 0, 0), (699, 2, 39), (300, 1, 7)):   # a bad value, any item
            for bad in (np.inf, -np.inf, np.nan):
                y = x.astype(np.float64)
                y[where] = bad
                with pytest.raises(ValueError, match="must be finite"):
                    fastattn.quantize_kv(y)
        empty_codes, empty_scale = fastattn.quantize_kv(np.zeros((4, 0)))
        assert empty_codes.shape == (4, 0) and list(empty_scale) == [1, 1, 1, 1]
        assert fastattn.quantize_kv(np.zeros((0, 3)))[1].shape == (0,)


@pytest.mark.parametrize("code", ["float8_e4m3fn", "float8_e5m2"])
@pytest.mark.parametrize("xdtype", [np.float64, np.float32])
@pytest.mark.parametrize("threads", [1, 2])
def test_float8_codes_per_token_are_the_references(code, xdtype, threads):
    """quantize_kv's float8 codes per token (compiled: the quotient's float64 bits
    rounded to the code's mantissa, or a count of subnormal steps) are ml_dtypes'
    rounding of the same quotients, as the reference makes them, bit for bit: every
    code, every midpoint between two (ties to even) and the float64 values either side
    of it, rows of every magnitude, at 1 and 2 threads."""
    dtype = np.dtype(getattr(ml_dtypes, code))
    limit = {"float8_e4m3fn": 448.0, "float8_e5m2": 57344.0}[code]
    values = np.arange(256, dtype=np.uint8).view(dtype).astype(np.float64)
    values = np.unique(values[np.isfinite(values)])
    middles = (values[1:] + values[:-1]) / 2
    exact = np.concatenate([values, middles, np.nextafter(middles, np.inf),
                            np.nextafter(middles, -np.inf)])
    exact = exact[np.abs(exact) <= limit]
    if xdtype == np.float32:                # (the values a float32 row can hold)
        exact = exact[exact.astype(np.float32) == exact]
    rows = -(-exact.size // 78) * 2             # (an even count: pairs of heads below)
    ties = np.zeros(rows * 39)
    ties[:exact.size] = exact
    # each row's largest magnitude the limit: its scale is 1, its quotients its values
    ties = np.concatenate([np.full((rows, 1), limit), ties.reshape(rows, 39)], axis=1)
    rng = np.random.default_rng(7)
    x = rng.standard_normal((700, 40)) * 10.0 ** rng.uniform(-30, 30, (700, 1))
    x = np.concatenate([ties, x]).astype(xdtype).reshape(-1, 2, 40)
    with default_threads(threads):
        got, scale = fastattn.quantize_kv(x, code)
        want, want_scale = reference.quantize_kv(x, code)
        assert got.dtype == dtype and scale.dtype == np.float32
        np.testing.assert_array_equal(scale.view(np.int32), want_scale.view(np.int32))
        np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))
        if code == "float8_e4m3fn":             # by hand: ties go to the even mantissa
            y = np.array([[448.0, 1.0625, 1.1875, -1.0625, 2.0 ** -10, 3 * 2.0 ** -10,
                           -(2.0 ** -10), 0.0]], xdtype)
            codes, one = fastattn.quantize_kv(y, code)
            assert one[0] == 1
            np.testing.assert_array_equal(
                codes.astype(np.float64),
                [[448.0, 1.0, 1.25, -1.0, 0.0, 2.0 ** -8, -0.0, 0.0]])
            assert codes.view(np.uint8)[0, 6] == 0x80            # the sign of -0 kept
        bad = x.astype(np.float64)
        bad[-1, 1, 39] = np.nan
        with pytest.raises(ValueError, match="must be finite"):
            fastattn.quantize_kv(bad, code)


def test_a_store_of_a_token_that_is_not_finite_writes_nothing():
    rng = np.random.default_rng(8)
    k_cache = rng.integers(-127, 128, (300, 2, 2, 16)).astype(np.int8)
    v_cache = k_cache.copy()
    k_scale = rng.uniform(0.1, 1, (300, 2, 2)).astype(np.float32)
    v_scale = k_scale.copy()
    before = [a.copy() for a in (k_cache, v_cache, k_scale, v_scale)]
    k = rng.standard_normal((500, 2, 16))
    k[499, 1, 15] = np.nan
    with pytest.raises(ValueError, match="must be finite"):
        fastattn.store_kv(k_cache, v_cache, np.arange(500), k, k[::-1], k_scale=k_scale,
                          v_scale=v_scale)
    for a, b in zip((k_cache, v_cache, k_scale, v_scale), before):
        np.testing.assert_array_equal(a, b)


def test_quantize_kv_refuses_what_it_cannot_do():
    with pytest.raises(ValueError, match="dtype must be one of"):
        fastattn.quantize_kv(np.ones((2, 4)), "int4")
    with pytest.raises(ValueError, match="axis_scale"):
        fastattn.quantize_kv(np.ones((2, 4)), axis_scale="row")
    with pytest.raises(ValueError, match="finite"):
        fastattn.quantize_kv(np.array([[1.0, np.inf]]))
    with pytest.raises(ValueError, match=r"\(\.\.\., L, H, D\)"):
        fastattn.quantize_kv(np.ones((2, 4)), axis_scale="head")
    with pytest.raises(TypeError, match="x must hold real"):
        fastattn.quantize_kv(np.ones((2, 4), complex))


# ------------------------------------------------------------ quantized attention

def quantized(rng, shape, dtype, per="token"):
    x = rng.standard_normal(shape)
    if per == "token":
        return fastattn.quantize_kv(x, dtype)
    codes, scale = fastattn.quantize_kv(x, dtype)
    if per == "head":                    # one scale per head, codes kept as they are
        return codes, scale.max(axis=-1, keepdims=True)
    return codes, np.float32(scale.max())     # one for all


def dequantized_reference(q, k, v, ks, vs, **kw):
    kd = reference.dequantize_kv(k, ks).astype(np.float64)
    vd = reference.dequantize_kv(v, vs).astype(np.float64)
    return reference.attention(np.asarray(q, np.float64), kd, vd, **kw)


@pytest.mark.parametrize("code", CODES)
@pytest.mark.parametrize("Lq", [1, 4, 70])
@pytest.mark.parametrize("qdtype", [np.float32, BF16, np.float16])
def test_attention_reads_a_quantized_cache(code, Lq, qdtype):
    rng = np.random.default_rng(Lq)
    q = rng.standard_normal((2, 4, Lq, 32)).astype(qdtype)
    k, ks = quantized(rng, (2, 2, 300, 32), code)
    v, vs = quantized(rng, (2, 2, 300, 24), code, "head")
    kw = dict(enable_gqa=True, causal="bottom_right")
    got = fastattn.attention(q, k, v, k_scale=ks, v_scale=vs, **kw)
    assert got.dtype == np.dtype(qdtype) and got.shape == (2, 4, Lq, 24)
    close_to(got, dequantized_reference(q, k, v, ks, vs, **kw), qdtype,
             extra=rounded_weights_bound(q, reference.dequantize_kv(k, ks),
                                         reference.dequantize_kv(v, vs),
                                         rounded=float8_pairs(q, code), **kw))


def general_attention(monkeypatch, *args, **kw):
    """fastattn.attention through its general path (the short path's plan refused)."""
    from fastattn import _compute
    with monkeypatch.context() as m:
        m.setattr(_compute, "plain_plan", lambda *a, **k: None)
        return fastattn.attention(*args, **kw)


@pytest.mark.parametrize("storage", ["int8", "float8_e4m3fn", "float8_e5m2",
                                     "e5m2 unscaled", "e4m3 keys scaled"])
@pytest.mark.parametrize("qdtype", [np.float32, BF16, np.float16])
@pytest.mark.parametrize("B, Hq, Hkv, Lq, Lk, variants", [
    (1, 8, 2, 1, 300, {}),                                   # a decoding step, GQA
    (2, 4, 4, 3, 77, dict(causal="bottom_right", sinks=True)),
    (2, 6, 2, 70, 129, dict(causal=True, window=(40, 0), kv_lengths=[129, 60])),
])
def test_a_quantized_cache_takes_the_short_path_with_the_general_bits(
        monkeypatch, storage, qdtype, B, Hq, Hkv, Lq, Lk, variants):
    """attention over a quantized cache whose scales are one per token and head (as
    quantize_kv makes them) is planned from the buffers directly: the general plan's
    operands, the general path's bits, the dequantized reference's values."""
    from fastattn import _dispatch
    from fastattn._plan import plain_plan
    from test_core import plan_of
    rng = np.random.default_rng(Lq * 7 + Hq)
    code = {"e5m2 unscaled": "float8_e5m2", "e4m3 keys scaled": "float8_e4m3fn"}.get(
        storage, storage)
    q = rng.standard_normal((B, Hq, Lq, 32)).astype(qdtype)
    k, ks = quantized(rng, (B, Hkv, Lk, 32), code)
    v, vs = quantized(rng, (B, Hkv, Lk, 48), code)
    if storage == "e5m2 unscaled":
        ks = vs = None
    if storage == "e4m3 keys scaled":
        vs = None
    kw = dict(variants, enable_gqa=True)
    if kw.pop("sinks", False):
        kw["sinks"] = rng.standard_normal(Hq).astype(np.float32)
    if "kv_lengths" in kw:
        kw["kv_lengths"] = np.array(kw["kv_lengths"], np.int32)
    short = {name: kw[name] for name in ("sinks", "window", "kv_lengths") if name in kw}
    made = plain_plan(q, k, v, kw.get("causal", False), None, True, _dispatch.bf16_dot,
                      _dispatch.amx, round_weights=True, k_scale=ks, v_scale=vs,
                      **short)
    assert made is not None
    plan, out = made
    general, _ = plan_of(q, k, v, k_scale=ks, v_scale=vs, codes=True,
                         **{n: kw[n] for n in ("enable_gqa", "causal") if n in kw})
    assert out.dtype == np.dtype(qdtype) and out.shape == (B, Hq, Lq, 48)
    assert (plan.sizes, plan.groups, plan.dtype, plan.dot_kernel) == (
        general.sizes, general.groups, general.dtype, general.dot_kernel)
    for name in ("q", "k", "v", "k_scale", "v_scale"):
        mine, theirs = plan.operand(name), general.operand(name)
        assert (mine is None) == (theirs is None), name
        if mine is not None:        # in place: the same address and row steps
            assert mine[0] == theirs[0] and mine[2] == theirs[2], name
    with plans_made(monkeypatch, "plain_plan") as calls:
        got = fastattn.attention(q, k, v, k_scale=ks, v_scale=vs, **kw)
    assert calls == [True]
    want = general_attention(monkeypatch, q, k, v, k_scale=ks, v_scale=vs, **kw)
    assert got.dtype == want.dtype == np.dtype(qdtype)
    assert np.array_equal(got.view(np.uint8), want.view(np.uint8))
    close_to(got, dequantized_reference(q, k, v, ks, vs, **kw), qdtype,
             extra=rounded_weights_bound(q, reference.dequantize_kv(k, ks),
                                         reference.dequantize_kv(v, vs),
                                         rounded=float8_pairs(q, code), **kw))


@pytest.mark.parametrize("code", ["int8", "float8_e4m3fn"])
@pytest.mark.parametrize("layout", ["token-major", "scales strided"])
def test_a_quantized_cache_of_strided_scales_takes_the_short_path(monkeypatch, code,
                                                                  layout):
    """A token-major quantized cache ((B, L, Hkv, E) codes and (B, L, Hkv) scales,
    FlashAttention's layout) seen heads first through swapaxes, or scales alone in
    another order, keeps the short path: the general plan's operands, the general
    path's bits, the dequantized reference's values."""
    from fastattn import _dispatch
    from fastattn._plan import plain_plan
    from test_core import plan_of
    rng = np.random.default_rng(len(code) + len(layout))
    q = rng.standard_normal((2, 4, 1, 32)).astype(BF16)
    k, ks = quantized(rng, (2, 2, 90, 32), code)
    v, vs = quantized(rng, (2, 2, 90, 16), code)
    if layout == "token-major":
        k, ks, v, vs = (axes_swapped(a) for a in (k, ks, v, vs))
    else:
        vs = axes_swapped(vs)
    assert not vs.flags.c_contiguous
    made = plain_plan(q, k, v, False, None, True, _dispatch.bf16_dot, _dispatch.amx,
                      round_weights=True, k_scale=ks, v_scale=vs)
    assert made is not None
    plan, _ = made
    general, _ = plan_of(q, k, v, k_scale=ks, v_scale=vs, codes=True, enable_gqa=True)
    for name in ("q", "k", "v", "k_scale", "v_scale"):
        mine, theirs = plan.operand(name), general.operand(name)
        assert mine[0] == theirs[0] and mine[2] == theirs[2], name
    with plans_made(monkeypatch, "plain_plan") as calls:
        got = fastattn.attention(q, k, v, k_scale=ks, v_scale=vs, enable_gqa=True)
    assert calls == [True]
    want = general_attention(monkeypatch, q, k, v, k_scale=ks, v_scale=vs,
                             enable_gqa=True)
    assert np.array_equal(got.view(np.uint8), want.view(np.uint8))
    close_to(got, dequantized_reference(q, k, v, ks, vs, enable_gqa=True), BF16,
             extra=rounded_weights_bound(q, reference.dequantize_kv(k, ks),
                                         reference.dequantize_kv(v, vs),
                                         rounded=float8_pairs(q, code),
                                         enable_gqa=True))


def test_every_other_quantized_call_takes_the_general_path():
    """plain_plan says None for a quantized cache whose scales are not one float32
    per token and head (or have a negative stride), for int8 codes missing a scale,
    for a float64 q, for scales beside float k and v, and for the backward's plan;
    the general path then computes the call or names what is wrong."""
    from fastattn._plan import plain_plan
    rng = np.random.default_rng(41)
    q = rng.standard_normal((2, 4, 1, 16)).astype(np.float32)
    k, ks = quantized(rng, (2, 2, 50, 16), "int8")
    v, vs = quantized(rng, (2, 2, 50, 16), "int8")

    def short(q=q, k=k, v=v, ks=ks, vs=vs, lse=None):
        return plain_plan(q, k, v, False, None, True, lse=lse, k_scale=ks, v_scale=vs)

    assert short() is not None
    others = {
        "per-head scales": dict(ks=ks.max(axis=-1, keepdims=True)),
        "one scale for all": dict(vs=np.float32(vs.max())),
        "scales of a negative stride": dict(ks=ks[:, :, ::-1]),
        "float64 scales": dict(vs=vs.astype(np.float64)),
        "a list of scales": dict(ks=ks.tolist()),
        "one scale missing": dict(vs=None),
        "a float64 query": dict(q=q.astype(np.float64)),
        "codes of two dtypes": dict(v=v.view(np.uint8)),
        "float caches with scales": dict(k=k.astype(np.float32), v=v.astype(np.float32)),
        "the backward's plan": dict(lse=np.zeros((2, 4, 1), np.float32)),
    }
    for why, change in others.items():
        assert short(**change) is None, why
    ref = dequantized_reference(q, k, v, ks, vs, enable_gqa=True)
    for why in ("per-head scales", "one scale for all", "scales of a negative stride",
                "float64 scales", "a list of scales"):
        c = dict(dict(ks=ks, vs=vs), **others[why])
        got = fastattn.attention(q, k, v, k_scale=c["ks"], v_scale=c["vs"],
                                 enable_gqa=True)
        close_to(got, dequantized_reference(q, k, v, np.asarray(c["ks"]),
                                            np.asarray(c["vs"]), enable_gqa=True),
                 np.float32)
    with pytest.raises(ValueError, match="needs both k_scale and v_scale"):
        fastattn.attention(q, k, v, k_scale=ks, enable_gqa=True)
    with pytest.raises(ValueError, match="k_scale and v_scale are for a quantized"):
        fastattn.attention(q, k.astype(np.float32), v.astype(np.float32), k_scale=ks,
                           v_scale=vs, enable_gqa=True)
    with pytest.raises(TypeError, match="q must be float32, bfloat16 or float16"):
        fastattn.attention(q.astype(np.float64), k, v, k_scale=ks, v_scale=vs,
                           enable_gqa=True)
    close_to(fastattn.attention(q, k, v, k_scale=ks, v_scale=vs, enable_gqa=True), ref,
             np.float32)


@pytest.mark.parametrize("code", CODES)
def test_quantized_cache_with_every_variant(code):
    rng = np.random.default_rng(3)
    q = rng.standard_normal((2, 4, 5, 16)).astype(np.float32)
    k, ks = quantized(rng, (2, 4, 200, 16), code, "all")
    v, vs = quantized(rng, (2, 4, 200, 16), code)
    kw = dict(causal="bottom_right", window=(50, 0), softcap=4.0,
              alibi_slopes=rng.uniform(0, 0.1, 4), sinks=rng.standard_normal(4),
              kv_lengths=np.array([200, 37]), q_lengths=np.array([5, 3]))
    got, lse = fastattn.attention(q, k, v, k_scale=ks, v_scale=vs, return_lse=True, **kw)
    want, want_lse = dequantized_reference(q, k, v, ks, vs, return_lse=True, **kw)
    close_to(got, want, np.float32)
    assert_close(lse, want_lse, np.float32)


def test_float8_codes_need_no_scale_and_nan_codes_follow_the_nan_rule():
    rng = np.random.default_rng(4)
    q = rng.standard_normal((1, 2, 3, 16)).astype(np.float32)
    k = rng.standard_normal((1, 2, 40, 16)).astype(ml_dtypes.float8_e4m3fn)
    v = rng.standard_normal((1, 2, 40, 16)).astype(ml_dtypes.float8_e4m3fn)
    close_to(fastattn.attention(q, k, v), dequantized_reference(q, k, v, None, None),
             np.float32)
    v[0, 1, 7, 3] = np.nan                            # the code S.1111.111
    got = fastattn.attention(q, k, v)
    want = dequantized_reference(q, k, v, None, None)
    assert np.isnan(got[0, 1, :, 3]).all() and np.isnan(want[0, 1, :, 3]).all()
    assert_close(got, want, np.float32)               # NaN exactly where it is


@pytest.mark.parametrize("E", [8, 63, 64, 72, 128, 136])
@pytest.mark.parametrize("where", ["k", "v"])
def test_an_e4m3_nan_code_is_found_in_every_column(E, where):
    """A decoding step over e4m3 codes finds a NaN code (S.1111.111, either sign)
    wherever it lies in a row (the kernels read the codes in units that leave NaN
    finite, so the step looks for them first: 64 codes at a time and the rest): the
    rows that see it are NaN (a key's NaN: the whole row; a value's: its column), as
    the reference's, and the others as the reference's."""
    rng = np.random.default_rng(E)
    q = rng.standard_normal((1, 2, 1, E)).astype(np.float32)
    k = rng.standard_normal((1, 2, 90, E)).astype(ml_dtypes.float8_e4m3fn)
    v = rng.standard_normal((1, 2, 90, E)).astype(ml_dtypes.float8_e4m3fn)
    for col in sorted({0, 1, E // 2, E - 2, E - 1} & set(range(E))):
        kk, vv = k.copy(), v.copy()
        bad = kk if where == "k" else vv
        bad.view(np.uint8)[0, 1, 33, col] = 0x7F if col % 2 else 0xFF
        got = fastattn.attention(q, kk, vv)
        want = dequantized_reference(q, kk, vv, None, None)
        nan = np.isnan(want)
        assert nan[0, 1].any() and not nan[0, 0].any()
        np.testing.assert_array_equal(np.isnan(got), nan)
        close_to(np.where(nan, 0, got), np.where(nan, 0, want), np.float32)


@pytest.mark.parametrize("code", CODES)
def test_attention_varlen_reads_a_quantized_cache(code):
    rng = np.random.default_rng(5)
    cu_q, cu_k = np.array([0, 3, 3, 10]), np.array([0, 50, 80, 200])
    q = rng.standard_normal((10, 4, 16)).astype(np.float32)
    k, ks = quantized(rng, (200, 2, 16), code)
    v, vs = quantized(rng, (200, 2, 16), code)
    got = fastattn.attention_varlen(q, k, v, cu_q, cu_k, causal="bottom_right",
                                    k_scale=ks, v_scale=vs)
    want = reference.attention_varlen(q.astype(np.float64),
                                      reference.dequantize_kv(k, ks).astype(np.float64),
                                      reference.dequantize_kv(v, vs).astype(np.float64),
                                      cu_q, cu_k, causal="bottom_right")
    close_to(got, want, np.float32)


@pytest.mark.parametrize("n_seq", [6, 40])         # keys split into pieces; not split
def test_a_ragged_decoding_batch_with_its_longest_sequences_last(n_seq):
    """The decode path hands out its sequences' items longest first: each item's
    partial result still lands in its own sequence (against the float64 reference),
    and the bits are the same on one thread and on two."""
    rng = np.random.default_rng(n_seq)
    lengths = np.sort(rng.integers(1, 700, n_seq))
    lengths[n_seq // 2] = 0                              # an empty cache in the middle
    lengths[-1] = 1500                                   # the longest last
    cu_k = np.concatenate([[0], np.cumsum(lengths)])
    cu_q = np.arange(n_seq + 1)
    q = rng.standard_normal((n_seq, 8, 32)).astype(np.float32)
    k = rng.standard_normal((cu_k[-1], 2, 32)).astype(np.float32)
    v = rng.standard_normal((cu_k[-1], 2, 24)).astype(np.float32)
    got = fastattn.attention_varlen(q, k, v, cu_q, cu_k, causal="bottom_right",
                                    num_threads=2)
    one = fastattn.attention_varlen(q, k, v, cu_q, cu_k, causal="bottom_right",
                                    num_threads=1)
    np.testing.assert_array_equal(got, one)
    want = reference.attention_varlen(q.astype(np.float64), k.astype(np.float64),
                                      v.astype(np.float64), cu_q, cu_k,
                                      causal="bottom_right")
    empty = lengths == 0
    np.testing.assert_array_equal(got[empty], want[empty])     # as the reference says
    close_to(got[~empty], want[~empty], np.float32)


def test_quantized_cache_errors_name_the_argument():
    rng = np.random.default_rng(6)
    q = rng.standard_normal((2, 3, 8)).astype(np.float32)
    k8, ks = fastattn.quantize_kv(rng.standard_normal((2, 5, 8)))
    kf = rng.standard_normal((2, 5, 8)).astype(np.float32)
    with pytest.raises(ValueError, match="v_scale is missing"):
        fastattn.attention(q, k8, k8, k_scale=ks)
    with pytest.raises(ValueError, match="has dtype float32"):
        fastattn.attention(q, kf, kf, k_scale=ks, v_scale=ks)
    with pytest.raises(TypeError, match="q must be float32, bfloat16 or float16"):
        fastattn.attention(q.astype(np.float64), k8, k8, k_scale=ks, v_scale=ks)
    with pytest.raises(ValueError, match=r"k_scale of shape \(3,\) does not broadcast"):
        fastattn.attention(q, k8, k8, k_scale=np.ones(3, np.float32), v_scale=ks)
    with pytest.raises(TypeError, match="k_scale must hold real"):
        fastattn.attention(q, k8, k8, k_scale=np.ones((2, 5), complex), v_scale=ks)
    f8 = kf.astype(ml_dtypes.float8_e5m2)
    with pytest.raises(TypeError, match="quantized caches are for inference"):
        fastattn.attention_backward(q, q, f8, f8, q, np.zeros((2, 3), np.float32))
    with pytest.raises(TypeError, match="quantized caches are for inference"):
        fastattn.scores(q, f8)
    # int8 without scales keeps its old meaning: integer values, computed in float64
    ints = np.arange(80, dtype=np.int8).reshape(2, 5, 8) % 5
    got = fastattn.attention(q, ints, ints)
    assert got.dtype == np.float64
    assert_close(got, reference.attention(q.astype(np.float64), ints.astype(np.float64),
                                          ints.astype(np.float64)), np.float64)


# ----------------------------------------------------------------- paged caches

def paged_case(rng, *, B=3, Lq=1, Hq=4, Hkv=2, E=16, Ev=16, block_size=16,
               num_blocks=30, dtype=np.float32, code=None, packed=False, share=False):
    """A random paged cache, its block table (blocks in random order, optionally a
    prefix shared by every sequence) and lengths (one full, one 0, one exactly a
    block, the rest random), and queries."""
    max_blocks = 5
    tables = [rng.permutation(num_blocks)[:max_blocks] for _ in range(B)]
    if share:
        for t in tables[1:]:
            t[:2] = tables[0][:2]
    table = np.array(tables, np.int32)
    lengths = rng.integers(0, max_blocks * block_size + 1, B)
    lengths[0] = max_blocks * block_size
    if B > 1:
        lengths[1] = 0
    if B > 2:
        lengths[2] = block_size
    kc = rng.standard_normal((num_blocks, block_size, Hkv, E))
    vc = rng.standard_normal((num_blocks, block_size, Hkv, Ev))
    ks = vs = None
    if code:
        (kc, ks), (vc, vs) = fastattn.quantize_kv(kc, code), fastattn.quantize_kv(vc, code)
    else:
        kc, vc = kc.astype(dtype), vc.astype(dtype)
    qdtype = np.float32 if code else dtype
    if packed:
        counts = np.minimum(rng.integers(0, 6, B), np.maximum(lengths, 1))
        cu = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
        q = rng.standard_normal((int(cu[-1]), Hq, E)).astype(qdtype)
    else:
        cu = None
        q = rng.standard_normal((B, Lq, Hq, E)).astype(qdtype)
    return dict(q=q, k_cache=kc, v_cache=vc, block_table=table, kv_lengths=lengths,
                cu_seqlens_q=cu, k_scale=ks, v_scale=vs)


def axes_swapped(a):
    """a's values in a buffer whose axes 1 and 2 are swapped, seen in a's own shape: a
    (num_blocks, Hkv, block_size, ...) buffer seen as (num_blocks, block_size, Hkv,
    ...) (blocks stored heads first), or a (B, L, Hkv, ...) buffer as (B, Hkv, L, ...)
    (a token-major cache)."""
    return np.ascontiguousarray(a.swapaxes(1, 2)).swapaxes(1, 2)


def exact(case):
    """The case with its bfloat16 arrays widened to float64 (exactly): the reference
    then returns its float64 result rather than that result rounded to bfloat16."""
    return {name: a.astype(np.float64) if name in ("q", "k_cache", "v_cache")
            and a.dtype == BF16 else a for name, a in case.items()}


def check_paged(case, **kw):
    """attention_paged against the float64 reference, allowing for the weights'
    rounding where bfloat16 values run on the bfloat16 units (with precision=None)."""
    got, lse = fastattn.attention_paged(**case, return_lse=True, **kw)
    want, want_lse = reference.attention_paged(**exact(case), return_lse=True, **kw)
    assert got.dtype == case["q"].dtype and got.shape == want.shape
    tables = {name: case[name] for name in ("block_table", "kv_lengths", "cu_seqlens_q")}
    rounding = rounded_weights_bound(
        case["q"], case["k_cache"], case["v_cache"],
        attend=lambda q, k, v: reference.attention_paged(q, k, v, **tables, **kw))
    close_to(got, want, got.dtype, extra=rounding)
    assert lse.shape == want_lse.shape
    assert_close(lse, want_lse, np.float32)
    return got


@pytest.mark.parametrize("block_size", [1, 16, 64])
@pytest.mark.parametrize("Lq", [1, 3, 70])
@pytest.mark.parametrize("storage", ["float32", "bfloat16", "float16", "int8",
                                     "float8_e4m3fn", "float8_e5m2"])
def test_attention_paged_against_the_reference(block_size, Lq, storage):
    rng = np.random.default_rng(block_size * 100 + Lq)
    code = storage if storage in CODES else None
    dtype = {"bfloat16": BF16}.get(storage, np.dtype(storage) if not code else None)
    case = paged_case(rng, Lq=Lq, block_size=block_size, code=code, dtype=dtype,
                      num_blocks=max(30, 5 * 3), share=block_size == 16)
    check_paged(case)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("packed", [False, True])
def test_attention_paged_with_every_variant(causal, packed):
    rng = np.random.default_rng(7)
    case = paged_case(rng, Lq=4, packed=packed, Hq=6, Hkv=3)
    check_paged(case, causal=causal, window=(20, 2), softcap=6.0,
                alibi_slopes=rng.uniform(0, 0.2, (3, 6)), sinks=rng.standard_normal(6),
                scale=0.3)


@pytest.mark.parametrize("packed", [False, True])
def test_attention_paged_float64(packed):
    rng = np.random.default_rng(8)
    case = paged_case(rng, Lq=3, dtype=np.float64, packed=packed)
    got, lse = fastattn.attention_paged(**case, return_lse=True)
    want, want_lse = reference.attention_paged(**case, return_lse=True)
    assert got.dtype == np.float64 and lse.dtype == np.float64
    assert_close(got, want, np.float64)
    assert_close(lse, want_lse, np.float64)


def test_chunked_prefill_edge_cases():
    # packed queries: empty sequences, a sequence of one query, more queries than keys
    rng = np.random.default_rng(9)
    case = paged_case(rng, B=4, packed=True)
    case["kv_lengths"] = np.array([80, 0, 1, 3])
    case["cu_seqlens_q"] = np.array([0, 0, 0, 1, 6], np.int32)
    case["q"] = rng.standard_normal((6, 4, 16)).astype(np.float32)
    got = check_paged(case)
    # the last sequence's 5 queries sit at positions -2..2 of its 3 keys: the first
    # two see no key (zeros), the others do
    assert not got[1:3].any() and got[3:].all()


def test_paged_reads_the_same_bits_as_the_contiguous_call():
    # one sequence: its blocks in random order give exactly the contiguous call's bits
    rng = np.random.default_rng(10)
    for Lq, block_size in ((1, 16), (3, 1), (100, 64), (100, 16)):
        Lk = 320
        k = rng.standard_normal((1, 2, Lk, 32)).astype(np.float32)
        v = rng.standard_normal((1, 2, Lk, 32)).astype(np.float32)
        q = rng.standard_normal((1, 4, Lq, 32)).astype(np.float32)
        nb = Lk // block_size
        perm = rng.permutation(nb)
        kc = np.empty((nb, block_size, 2, 32), np.float32)
        vc = np.empty_like(kc)
        kc[perm] = k[0].swapaxes(0, 1).reshape(nb, block_size, 2, 32)
        vc[perm] = v[0].swapaxes(0, 1).reshape(nb, block_size, 2, 32)
        got = fastattn.attention_paged(q.swapaxes(1, 2), kc, vc, perm[None],
                                       np.array([Lk]))
        want = fastattn.attention(q, k, v, causal="bottom_right", enable_gqa=True)
        np.testing.assert_array_equal(got.swapaxes(1, 2), want)


@pytest.mark.parametrize("storage", ["bfloat16", "int8", "float32"])
@pytest.mark.parametrize("threads", [1, 2])
def test_a_slice_widened_once_is_never_read_for_another(storage, threads):
    # Each thread keeps the widened K/V rows of the slice it last read for the
    # slice's next query tiles. Two sequences share their first block and the same
    # head (Hkv = 1), so their rows start at the same address: only the block table
    # tells them apart. 130 queries each: three tiles per slice.
    rng = np.random.default_rng(12)
    code = storage if storage in CODES else None
    dtype = {"bfloat16": BF16}.get(storage, np.float32)
    case = paged_case(rng, B=2, Lq=130, Hq=2, Hkv=1, E=32, Ev=16, block_size=16,
                      num_blocks=12, code=code, dtype=dtype)
    case["block_table"] = np.array([[0, 1, 2, 3, 4], [0, 5, 6, 7, 8]], np.int32)
    case["kv_lengths"] = np.array([80, 75])
    got = fastattn.attention_paged(**case, causal=False, num_threads=threads)
    # bfloat16 with E = 32 runs on the bfloat16 units where the CPU has them
    rounding = rounded_weights_bound(
        case["q"], case["k_cache"], case["v_cache"],
        attend=lambda q, k, v: reference.attention_paged(
            q, k, v, case["block_table"], case["kv_lengths"], causal=False))
    close_to(got, reference.attention_paged(**exact(case), causal=False), got.dtype,
             extra=rounding)
    assert np.abs(got[0].astype(np.float64) - got[1]).max() > 0.1


def test_paged_bits_do_not_depend_on_the_threads():
    rng = np.random.default_rng(11)
    B, bs = 8, 16
    lengths = rng.integers(1, 40 * bs, B)
    table = np.stack([rng.permutation(B * 40)[:40] for _ in range(B)]).astype(np.int32)
    kc = rng.standard_normal((B * 40, bs, 2, 64)).astype(BF16)
    vc = rng.standard_normal((B * 40, bs, 2, 64)).astype(BF16)
    q = rng.standard_normal((B, 1, 8, 64)).astype(BF16)
    results = [fastattn.attention_paged(q, kc, vc, table, lengths, num_threads=n)
               for n in (1, 2, 3, 7)]
    for r in results[1:]:
        np.testing.assert_array_equal(r.view(np.uint16), results[0].view(np.uint16))


def test_attention_paged_reads_strided_caches_and_fills_out():
    # a (num_blocks, Hkv, block_size, E) buffer seen through swapaxes(1, 2)
    rng = np.random.default_rng(12)
    case = paged_case(rng, Lq=2)
    case["k_cache"] = axes_swapped(case["k_cache"])
    case["v_cache"] = axes_swapped(case["v_cache"])
    out = np.empty((3, 2, 4, 16), np.float32)
    res = fastattn.attention_paged(**case, out=out)
    assert res is out
    close_to(out, reference.attention_paged(**case), np.float32)


def test_attention_paged_errors_name_the_argument():
    rng = np.random.default_rng(13)
    case = paged_case(rng)

    def call(**change):
        fastattn.attention_paged(**dict(case, **change))

    table = case["block_table"].copy()
    table[0, 4] = 30                                   # needed: sequence 0 is full
    with pytest.raises(ValueError, match=r"block_table\[0, 4\] = 30"):
        call(block_table=table)
    table = case["block_table"].copy()
    table[1, 0] = -1                                   # sequence 1 has no keys: not read
    call(block_table=table)
    with pytest.raises(ValueError, match="kv_lengths must lie in"):
        call(kv_lengths=np.array([81, 0, 16]))
    with pytest.raises(ValueError, match="kv_lengths must lie in"):
        call(kv_lengths=np.array([-1, 0, 16]))
    with pytest.raises(TypeError, match="block_table must hold integers"):
        call(block_table=case["block_table"].astype(float))
    with pytest.raises(ValueError, match=r"kv_lengths must have shape \(B,\)"):
        call(kv_lengths=np.array([1, 2]))
    with pytest.raises(ValueError, match="causal must be True or False"):
        call(causal="bottom_right")
    with pytest.raises(ValueError, match="q's batch"):
        call(q=case["q"][:2])
    with pytest.raises(ValueError, match="multiple of the key/value heads"):
        call(q=np.zeros((3, 1, 3, 16), np.float32))
    with pytest.raises(ValueError, match="cu_seqlens_q must have shape"):
        call(q=np.zeros((2, 4, 16), np.float32), cu_seqlens_q=np.array([0, 2]))
    with pytest.raises(ValueError, match="k_cache must have shape"):
        call(k_cache=case["k_cache"][0])
    with pytest.raises(ValueError, match="same blocks"):
        call(v_cache=case["v_cache"][:-1])
    with pytest.raises(ValueError, match="k_scale and v_scale are for a quantized"):
        call(k_scale=np.ones(1, np.float32), v_scale=np.ones(1, np.float32))
    with pytest.raises(ValueError, match="out must have shape"):
        call(out=np.empty((3, 1, 4, 15), np.float32))


# ---------------------------------------------------------------------- store_kv

def canary_caches(dtype, num_blocks=6, block_size=4, Hkv=2, E=8):
    """Caches filled with a pattern no store writes (to see every changed entry)."""
    kc = np.full((num_blocks, block_size, Hkv, E), 77, dtype)
    vc = np.full((num_blocks, block_size, Hkv, E), 77, dtype)
    return kc, vc


@pytest.mark.parametrize("dtype", [np.float32, BF16, np.int8, "float8_e4m3fn"])
def test_store_kv_writes_its_slots_and_nothing_else(dtype):
    rng = np.random.default_rng(14)
    dtype = np.dtype(getattr(ml_dtypes, dtype) if isinstance(dtype, str) else dtype)
    kc, vc = canary_caches(dtype)
    quant = fastattn._validation.is_code(dtype)
    ks = np.full(kc.shape[:3], 5.0, np.float32) if quant else None
    vs = np.full(kc.shape[:3], 5.0, np.float32) if quant else None
    slots = np.array([5, -1, 23, 0])
    k = rng.standard_normal((4, 2, 8))
    v = rng.standard_normal((4, 2, 8))
    before = [x.copy() for x in (kc, vc)]
    fastattn.store_kv(kc, vc, slots, k, v, k_scale=ks, v_scale=vs)
    # the reference's twin, token by token, on copies of the caches before the store
    want_k, want_v = before
    want_ks = np.full(kc.shape[:3], 5.0, np.float32) if quant else None
    want_vs = np.full(kc.shape[:3], 5.0, np.float32) if quant else None
    reference.store_kv(want_k, want_v, slots, k, v, k_scale=want_ks, v_scale=want_vs)
    for got, want in ((kc, want_k), (vc, want_v), (ks, want_ks), (vs, want_vs)):
        if got is not None:
            np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))
    changed = np.zeros(kc.shape[:2], bool)
    changed[1, 1] = changed[5, 3] = changed[0, 0] = True
    assert (kc[~changed].view(np.uint8) == before[0][~changed].view(np.uint8)).all()
    assert (vc[~changed].view(np.uint8) == before[1][~changed].view(np.uint8)).all()
    if quant:
        assert (ks[~changed] == 5).all() and not (ks[changed] == 5).any()
        back = reference.dequantize_kv(kc[1, 1], ks[1, 1])
        if dtype == np.int8:                    # half a code: half a scale
            tol = 0.5 * ks[1, 1][:, None]
        else:                                   # half an ulp of 3 mantissa bits
            tol = 2.0 ** -4 * np.abs(k[0]) + ks[1, 1][:, None] * 2.0 ** -10
        assert np.all(np.abs(back - k[0]) <= tol * (1 + 1e-6))


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16, BF16])
@pytest.mark.parametrize("slot_dtype", [np.int32, np.int64])
def test_a_decoding_step_stores_on_the_short_path(monkeypatch, dtype, slot_dtype):
    """New tokens of the cache's own dtype at distinct slots in range take the short
    path and write what the reference's twin writes, and nothing else; any other call
    (a skipped slot, rows to round, a repeated slot, a slot past the cache) is the
    general path's, which writes or refuses it as before."""
    from fastattn import _serving
    taken = []
    real = _serving._store_plain
    monkeypatch.setattr(_serving, "_store_plain",
                        lambda *a: taken.append(real(*a)) or taken[-1])
    rng = np.random.default_rng(16)
    kc, vc = canary_caches(dtype)
    slots = np.array([5, 23, 0], slot_dtype)
    k = rng.standard_normal((3, 2, 8)).astype(dtype)
    v = rng.standard_normal((3, 2, 8)).astype(dtype)
    want_k, want_v = kc.copy(), vc.copy()
    reference.store_kv(want_k, want_v, slots, k, v)
    fastattn.store_kv(kc, vc, slots, k, v)
    assert taken == [True]
    for got, want in ((kc, want_k), (vc, want_v)):
        np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))
    for slot in (23, 0, 9):         # one token (a decoding step's own branch)
        reference.store_kv(want_k, want_v, np.array([slot], slot_dtype), k[1:2], v[2:])
        fastattn.store_kv(kc, vc, np.array([slot], slot_dtype), k[1:2], v[2:])
        assert taken[-1] is True
        for got, want in ((kc, want_k), (vc, want_v)):
            np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))
    big_k, big_v = canary_caches(dtype, num_blocks=40)   # more slots than the few's
    many = rng.permutation(160)[:100].astype(slot_dtype)
    k100 = rng.standard_normal((100, 2, 8)).astype(dtype)
    want = big_k.copy(), big_v.copy()
    reference.store_kv(*want, many, k100, -k100)
    fastattn.store_kv(big_k, big_v, many, k100, -k100)
    assert taken[-1] is True
    for got, want_ in zip((big_k, big_v), want):
        np.testing.assert_array_equal(got.view(np.uint8), want_.view(np.uint8))
    with pytest.raises(ValueError, match="below num_blocks"):
        fastattn.store_kv(big_k, big_v, np.r_[many[:99], 160].astype(slot_dtype), k100,
                          k100)
    assert taken[-1] is False
    other = np.float64 if dtype != np.float64 else np.float32     # rows to round
    for slots_, k_ in ((np.array([5, -1, 0], slot_dtype), k), (slots, k.astype(other))):
        want_k, want_v = kc.copy(), vc.copy()
        reference.store_kv(want_k, want_v, slots_, k_, v)
        fastattn.store_kv(kc, vc, slots_, k_, v)
        assert taken[-1] is False
        np.testing.assert_array_equal(kc.view(np.uint8), want_k.view(np.uint8))
    before = kc.copy(), vc.copy()
    with pytest.raises(ValueError, match="distinct"):
        fastattn.store_kv(kc, vc, np.array([3, 3, 1], slot_dtype), k, v)
    with pytest.raises(ValueError, match="below num_blocks"):
        fastattn.store_kv(kc, vc, np.array([3, 24, 1], slot_dtype), k, v)
    with pytest.raises(ValueError, match="below num_blocks"):
        fastattn.store_kv(kc, vc, np.array([24], slot_dtype), k[:1], v[:1])
    assert taken[-3:] == [False, False, False]
    assert all(np.array_equal(a.view(np.uint8), b.view(np.uint8))
               for a, b in zip((kc, vc), before))


def test_store_kv_checks_everything_before_writing():
    kc, vc = canary_caches(np.int8)
    ks = np.ones(kc.shape[:3], np.float32)
    vs = np.ones(kc.shape[:3], np.float32)
    k = np.ones((2, 2, 8))
    before = (kc.copy(), vc.copy(), ks.copy(), vs.copy())

    def refused(error, match, **change):
        args = dict(k_cache=kc, v_cache=vc, slots=np.array([1, 2]), k=k, v=k,
                    k_scale=ks, v_scale=vs)
        args.update(change)
        with pytest.raises(error, match=match):
            fastattn.store_kv(**args)
        for got, want in zip((kc, vc, ks, vs), before):
            np.testing.assert_array_equal(got, want)

    refused(ValueError, "below num_blocks", slots=np.array([1, 24]))
    refused(ValueError, "distinct", slots=np.array([3, 3]))
    refused(TypeError, "slots must hold integers", slots=np.array([1.0, 2.0]))
    refused(ValueError, r"v must have shape \(n, Hkv, Ev\)", v=np.ones((2, 2, 7)))
    refused(ValueError, "needs v_scale", v_scale=None)
    # a fixed scale that cannot hold the values: refused, not clipped
    refused(ValueError, "fixed scale cannot represent", k_scale=np.float32(0.001))
    refused(ValueError, "must be writeable",
            k_cache=np.broadcast_to(kc, kc.shape))
    refused(TypeError, "k_cache must be a numpy.ndarray", k_cache=kc.tolist())
    fc = np.zeros((6, 4, 2, 8), np.float32)
    with pytest.raises(ValueError, match="k_scale is for a quantized cache"):
        fastattn.store_kv(fc, fc.copy(), [1], np.ones((1, 2, 8)), np.ones((1, 2, 8)),
                          k_scale=ks)
    assert not fc.any()


def test_store_then_attend_is_the_reference():
    # a decoding loop: store each new token, then attend over the paged cache
    rng = np.random.default_rng(15)
    kc = np.zeros((12, 4, 2, 16), np.int8)
    vc = np.zeros_like(kc)
    ks = np.ones(kc.shape[:3], np.float32)
    vs = np.ones(kc.shape[:3], np.float32)
    table = np.array([[3, 7, 1, 0], [11, 2, 5, 9]], np.int32)
    keys = rng.standard_normal((2, 14, 2, 16))
    values = rng.standard_normal((2, 14, 2, 16))
    for t in range(14):
        slots = table[:, t // 4] * 4 + t % 4
        fastattn.store_kv(kc, vc, slots, keys[:, t], values[:, t], k_scale=ks,
                          v_scale=vs)
        q = rng.standard_normal((2, 1, 4, 16)).astype(np.float32)
        lengths = np.array([t + 1, t + 1])
        got = fastattn.attention_paged(q, kc, vc, table, lengths, k_scale=ks, v_scale=vs)
        want = reference.attention_paged(q, kc, vc, table, lengths, k_scale=ks,
                                         v_scale=vs)
        close_to(got, want, np.float32)
        # and the quantized cache stays within half a code of the stored tokens
        plain = reference.attention(q.swapaxes(1, 2), keys[:, :t + 1].swapaxes(1, 2),
                                    values[:, :t + 1].swapaxes(1, 2), enable_gqa=True)
        assert np.abs(got - plain.swapaxes(1, 2)).max() < 0.05


@pytest.mark.parametrize("kernel", ["fma", "avx512_bf16", "amx_bf16"])
@pytest.mark.parametrize("block_size", [16, 64])
def test_paged_bfloat16_gives_the_contiguous_bits_on_every_kernel(monkeypatch, kernel,
                                                                  block_size):
    # the tiled path's bfloat16 units read a block of the cache in place, or gathered
    # where the block of keys crosses a block of the cache: the same bits either way
    from test_reduced import kernels_here, use_kernels
    if kernel not in kernels_here():
        pytest.skip(f"no {kernel} kernel on this CPU or build")
    use_kernels(monkeypatch, bf16_dot=kernel == "avx512_bf16", amx=kernel == "amx_bf16")
    rng = np.random.default_rng(16)
    Lk, Hkv, E = 320, 2, 64
    k = rng.standard_normal((1, Hkv, Lk, E)).astype(BF16)
    v = rng.standard_normal((1, Hkv, Lk, E)).astype(BF16)
    q = rng.standard_normal((1, 4, 70, E)).astype(BF16)
    nb = Lk // block_size
    perm = rng.permutation(nb)
    kc = np.empty((nb, block_size, Hkv, E), BF16)
    vc = np.empty_like(kc)
    kc[perm] = k[0].swapaxes(0, 1).reshape(nb, block_size, Hkv, E)
    vc[perm] = v[0].swapaxes(0, 1).reshape(nb, block_size, Hkv, E)
    got = fastattn.attention_paged(q.swapaxes(1, 2), kc, vc, perm[None], np.array([Lk]))
    want = fastattn.attention(q, k, v, causal="bottom_right", enable_gqa=True)
    np.testing.assert_array_equal(got.swapaxes(1, 2).view(np.uint16), want.view(np.uint16))



# ------------------------------------------- decoding over heads that lie side by side


def side_by_side(a):
    """(B, L, H, ...) as the (B, H, L, ...) view a cache of that layout is read through,
    and a head-major copy of it (the same values, each head's rows one run)."""
    view = np.swapaxes(a, 1, 2)
    return view, np.ascontiguousarray(view)


@pytest.mark.parametrize("storage", ["float32", "bfloat16", "float16", "float64",
                                     "int8", "float8_e4m3fn", "float8_e5m2"])
@pytest.mark.parametrize("Lq, groups, E", [(1, 2, 64), (4, 2, 64), (1, 1, 72),
                                           (3, 1, 72)])
@pytest.mark.parametrize("Ev", [48, 136])
def test_decode_reads_heads_side_by_side(storage, Lq, groups, E, Ev):
    # K and V (B, L, Hkv, E) seen as (B, Hkv, L, E): the decode items take several
    # K/V heads at once and read each token's heads in one pass. The answer is the
    # float64 recomputation's, and bit for bit the head-major copy's, on any thread
    # count (the heads per item follow the threads; each head's sums do not). Query
    # rows per head: 2, 8 (two blocks of 4), 1 and 3 (2 + 1); E = 72 leaves a tail.
    # Ev = 136: a head's part of a 16-bit value row is 256 bytes or more (the values'
    # passes across the heads then take fewer keys each: 700 keys leave a short one).
    from fastattn._dispatch import drivers
    from test_core import plan_of
    rng = np.random.default_rng(Lq * 10 + len(storage) + E)
    code = storage if storage in CODES else None
    dtype = BF16 if storage == "bfloat16" else (np.float32 if code else np.dtype(storage))
    B, L, Hkv = 2, 700, 4
    x = rng.standard_normal((B, L, Hkv, E))
    y = rng.standard_normal((B, L, Hkv, Ev))
    kw = {}
    if code:
        (x, ks), (y, vs) = fastattn.quantize_kv(x, code), fastattn.quantize_kv(y, code)
        (ks, ks_copy), (vs, vs_copy) = side_by_side(ks), side_by_side(vs)
        kw, kw_copy = dict(k_scale=ks, v_scale=vs), dict(k_scale=ks_copy, v_scale=vs_copy)
    else:
        x, y = x.astype(dtype), y.astype(dtype)
        kw_copy = {}
    (k, k_copy), (v, v_copy) = side_by_side(x), side_by_side(y)
    q = rng.standard_normal((B, Hkv * groups, Lq, E)).astype(dtype)
    exact = [q.astype(np.float64), reference.dequantize_kv(k, kw.get("k_scale")),
             reference.dequantize_kv(v, kw.get("v_scale"))]
    plan = plan_of(q, k, v, enable_gqa=True, causal="bottom_right", codes=True, **kw)[0]
    assert drivers.decode_heads_per_item(plan, 1) == Hkv      # the path under test
    assert drivers.decode_heads_per_item(plan_of(q, k_copy, v_copy, enable_gqa=True,
                                                 codes=True, **kw_copy)[0], 1) == 1
    for variant in ({}, {"window": (100, 0)}, {"sinks": rng.standard_normal(Hkv * groups)}):
        want = reference.attention(*exact, enable_gqa=True, causal="bottom_right",
                                   **variant)
        copy = fastattn.attention(q, k_copy, v_copy, enable_gqa=True,
                                  causal="bottom_right", num_threads=1, **kw_copy,
                                  **variant)
        for n in (1, 2, 3):
            got = fastattn.attention(q, k, v, enable_gqa=True, causal="bottom_right",
                                     num_threads=n, **kw, **variant)
            np.testing.assert_array_equal(got.view(np.uint8), copy.view(np.uint8))
        close_to(got, want, got.dtype)


def test_decode_side_by_side_keeps_the_rule_for_values_that_are_not_finite():
    # an inf in one head's values where that head gives it no weight (masked) and a
    # NaN e4m3 code in another's keys: each head keeps the rule it has alone
    rng = np.random.default_rng(40)
    B, L, Hkv, E = 1, 600, 4, 32
    x, ks = fastattn.quantize_kv(rng.standard_normal((B, L, Hkv, E)), "float8_e4m3fn")
    y, vs = fastattn.quantize_kv(rng.standard_normal((B, L, Hkv, E)), "float8_e5m2")
    x.view(np.uint8)[0, 300, 2, 5] = 0x7F                   # a NaN code: head 2's key 300
    y.view(np.uint8)[0, 10, 1, 3] = 0x7C                    # inf: head 1's value 10 ...
    mask = np.ones((B, 1, 1, L), bool)
    mask[..., 10] = False                                   # ... which nobody weighs
    (k, k_copy), (v, v_copy) = side_by_side(x), side_by_side(y)
    (ks, ks_copy), (vs, vs_copy) = side_by_side(ks), side_by_side(vs)
    q = rng.standard_normal((B, Hkv, 1, E)).astype(np.float32)
    got = fastattn.attention(q, k, v, mask=mask, k_scale=ks, v_scale=vs, num_threads=1)
    copy = fastattn.attention(q, k_copy, v_copy, mask=mask, k_scale=ks_copy,
                              v_scale=vs_copy, num_threads=1)
    want = reference.attention(q.astype(np.float64), reference.dequantize_kv(k, ks),
                               reference.dequantize_kv(v, vs), mask=mask)
    np.testing.assert_array_equal(got.view(np.uint32), copy.view(np.uint32))
    assert np.isnan(got[0, 2]).all() and np.isfinite(np.delete(got, 2, axis=1)).all()
    close_to(np.delete(got, 2, axis=1), np.delete(want, 2, axis=1), np.float32)


@pytest.mark.parametrize("layout", ["head-major", "side by side", "paged"])
def test_an_e4m3_nan_code_found_after_the_kernels_read_the_step(layout):
    # the decode kernels read e4m3 codes in units that leave a NaN code finite, and the
    # step looks for NaN codes once they have read it: a key's NaN code makes its
    # rows NaN, a value's its column, in that head only, however the rows lie
    rng = np.random.default_rng(42)
    L, Hkv, E, bs = 300, 4, 32, 16
    x = rng.standard_normal((1, L, Hkv, E)).astype(ml_dtypes.float8_e4m3fn)
    y = rng.standard_normal((1, L, Hkv, E)).astype(ml_dtypes.float8_e4m3fn)
    x.view(np.uint8)[0, 260, 2, 5] = 0xFF               # head 2's key 260
    y.view(np.uint8)[0, 17, 1, 30] = 0x7F               # head 1's value 17, column 30
    q = rng.standard_normal((1, 2 * Hkv, 1, E)).astype(np.float32)
    k, v = np.swapaxes(x, 1, 2), np.swapaxes(y, 1, 2)
    want = reference.attention(q.astype(np.float64), k.astype(np.float64),
                               v.astype(np.float64), enable_gqa=True)
    if layout == "paged":
        order = rng.permutation(L // bs + 1)            # blocks in random order
        kc = np.zeros((len(order), bs, Hkv, E), x.dtype)
        vc = np.zeros_like(kc)
        kc[order[:L // bs]], vc[order[:L // bs]] = (a[0, :L - L % bs].reshape(-1, bs, Hkv, E)
                                                    for a in (x, y))
        kc[order[-1], :L % bs], vc[order[-1], :L % bs] = x[0, -(L % bs):], y[0, -(L % bs):]
        got = fastattn.attention_paged(np.swapaxes(q, 1, 2), kc, vc,
                                       order[None].astype(np.int32),
                                       np.array([L], np.int32))
        got = np.swapaxes(got, 1, 2)
    else:
        if layout == "head-major":
            k, v = np.ascontiguousarray(k), np.ascontiguousarray(v)
        got = fastattn.attention(q, k, v, enable_gqa=True, num_threads=1)
    nan = np.isnan(want)
    assert nan[0, 4:6].all() and nan[0, 2:4, :, 30].all()
    assert nan.sum() == 2 * E + 2
    np.testing.assert_array_equal(np.isnan(got), nan)
    close_to(np.where(nan, 0, got), np.where(nan, 0, want), np.float32)


def test_nan_codes_between_side_by_side_heads_are_not_read_as_values():
    # K and V a slice of wider rows: between the heads' parts of each token row lie
    # NaN codes that belong to no head. The step looks for NaN codes across the heads'
    # rows at once; finding these, it looks head by head and finds none: the result is
    # the clean head-major copy's, bit for bit, and finite.
    rng = np.random.default_rng(43)
    L, Hkv, E, pad = 300, 4, 32, 8
    wide = [rng.standard_normal((1, L, Hkv, E + pad)).astype(ml_dtypes.float8_e4m3fn)
            for _ in range(2)]
    for a in wide:
        a.view(np.uint8)[..., E:] = 0x7F
    k, v = (np.swapaxes(a[..., :E], 1, 2) for a in wide)
    q = rng.standard_normal((1, 2 * Hkv, 1, E)).astype(np.float32)
    from fastattn._dispatch import drivers
    from test_core import plan_of
    plan = plan_of(q, k, v, enable_gqa=True, codes=True)[0]
    assert drivers.decode_heads_per_item(plan, 1) > 1        # the heads side by side
    want = fastattn.attention(q, np.ascontiguousarray(k), np.ascontiguousarray(v),
                              enable_gqa=True, num_threads=1)
    for n in (1, 2):
        got = fastattn.attention(q, k, v, enable_gqa=True, num_threads=n)
        assert np.isfinite(got).all()
        np.testing.assert_array_equal(got, want)


def test_paged_decode_over_token_major_blocks_gives_the_head_major_bits():
    # blocks (num_blocks, block_size, Hkv, E): a decode item takes the heads of several
    # K/V heads at once; the bits are those of the same cache with each head's rows
    # of a block one run ((num_blocks, Hkv, block_size, E) seen through swapaxes)
    rng = np.random.default_rng(41)
    for code in (None, "int8"):
        case = paged_case(rng, B=6, Hq=8, Hkv=4, E=32, Ev=32, block_size=16,
                          num_blocks=40, dtype=BF16, code=code)
        copy = dict(case)
        for name in ("k_cache", "v_cache", "k_scale", "v_scale"):
            if case.get(name) is not None:
                copy[name] = axes_swapped(case[name])
        want = fastattn.attention_paged(**copy, num_threads=1)
        for n in (1, 2, 5):
            got = fastattn.attention_paged(**case, num_threads=n)
            np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))
        exact = {name: a.astype(np.float64) if name in ("q", "k_cache", "v_cache")
                 and a.dtype == BF16 else a for name, a in case.items()}
        close_to(got, reference.attention_paged(**exact), got.dtype)


# ------------------------------------------------- the decoding step's short path

def general_paged(monkeypatch, case, **kw):
    """attention_paged through its general path (the short path's plan refused)."""
    from fastattn import _compute
    with monkeypatch.context() as m:
        m.setattr(_compute, "plain_paged_plan", lambda *a, **k: None)
        return fastattn.attention_paged(**case, **kw)


def short_plan(case, causal=True, scale=None, sinks=None, window=None, softcap=None):
    from fastattn import _dispatch
    from fastattn._plan import plain_paged_plan
    return plain_paged_plan(case["q"], case["k_cache"], case["v_cache"],
                            case["block_table"], case["kv_lengths"], case["k_scale"],
                            case["v_scale"], causal, scale, sinks, _dispatch.bf16_dot,
                            _dispatch.amx, window=window, softcap=softcap,
                            cu_seqlens_q=case.get("cu_seqlens_q"))


@pytest.mark.parametrize("storage", ["float32", "float64", "bfloat16", "float16", "int8",
                                     "float8_e4m3fn", "float8_e5m2", "e5m2 unscaled"])
@pytest.mark.parametrize("Lq, Hq, causal", [(1, 4, True), (3, 2, False), (2, 6, True)])
def test_a_decoding_step_takes_the_short_path_with_the_general_bits(monkeypatch, storage,
                                                                   Lq, Hq, causal):
    """A decoding step's call (plain ndarrays, scales per token and head) is planned
    from the buffers directly: the same plan as the general path's, the same bits,
    the reference's result."""
    from fastattn import _dispatch
    from fastattn import _validation as _v
    from fastattn._plan import paged_plan
    rng = np.random.default_rng(Lq * 10 + Hq)
    code = {"e5m2 unscaled": "float8_e5m2"}.get(storage, storage)
    code = code if code in CODES else None
    dtype = {"bfloat16": BF16}.get(storage, None if code else np.dtype(storage))
    case = paged_case(rng, Lq=Lq, Hq=Hq, Hkv=2, code=code, dtype=dtype, share=True)
    del case["cu_seqlens_q"]
    if storage == "e5m2 unscaled":
        case["k_scale"] = case["v_scale"] = None
    if code and Hq == 6:
        case["q"] = case["q"].astype(BF16)
    case["block_table"][1, :] = -7             # sequence 1 has no keys: never read
    case["kv_lengths"] = case["kv_lengths"].astype(np.int32 if Hq == 2 else np.int64)
    scale = 0.3 if Hq == 2 else None
    sinks = rng.standard_normal(Hq).astype(np.float64 if storage == "float64"
                                           else np.float32) if Hq == 6 else None
    made = short_plan(case, causal, scale, sinks)
    assert made is not None
    plan, out = made
    a = _v.paged_args(**case, scale=scale, causal=causal)
    general = paged_plan(a.q, a.k_cache, a.v_cache, a.block_table, a.kv_lengths, out,
                         None, None, a.scale, a.computation, k_scale=a.k_scale,
                         v_scale=a.v_scale, groups=a.groups, causal=a.causal,
                         sinks=sinks, bf16_dot=_dispatch.bf16_dot, amx=_dispatch.amx,
                         round_weights=True)
    assert (plan.sizes, plan.groups, plan.positions, plan.bottom_right, plan.dtype,
            plan.dot_kernel, plan.batch_shape) == (
        general.sizes, general.groups, general.positions, general.bottom_right,
        general.dtype, general.dot_kernel, general.batch_shape)
    for name in ("q", "k", "v", "out", "k_scale", "v_scale"):
        assert plan.operand(name) == general.operand(name), name
    if sinks is not None:       # one element per slice: its address and batch strides
        assert plan.operand("sinks")[:2] == general.operand("sinks")[:2]
    assert out.shape == case["q"].shape[:-1] + (16,) and out.dtype == case["q"].dtype
    with plans_made(monkeypatch, "plain_paged_plan") as calls:
        got = fastattn.attention_paged(**case, causal=causal, scale=scale, sinks=sinks)
    assert calls == [True]
    want = general_paged(monkeypatch, case, causal=causal, scale=scale, sinks=sinks)
    assert got.dtype == want.dtype and np.array_equal(got.view(np.uint8),
                                                      want.view(np.uint8))
    rounding = rounded_weights_bound(
        case["q"], reference.dequantize_kv(case["k_cache"], case["k_scale"]),
        reference.dequantize_kv(case["v_cache"], case["v_scale"]),
        attend=lambda q, k, v: reference.attention_paged(
            q, k, v, case["block_table"], case["kv_lengths"], causal=causal, scale=scale,
            sinks=sinks), rounded=float8_pairs(case["q"], code))
    close_to(got, reference.attention_paged(**exact(case), causal=causal, scale=scale,
                                            sinks=sinks),
             got.dtype if got.dtype != np.float64 else np.float32, extra=rounding)


@pytest.mark.parametrize("storage", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("Lq, causal, window, softcap", [
    (1, True, (5, 0), None), (1, True, [20, None], None), (2, True, (None, None), None),
    (1, True, (2**70, 0), None), (3, False, (4, 2), None), (2, False, (0, 0), None),
    (1, True, (79, 0), None), (1, True, None, 2.5), (2, False, (4, 2), 0.5)])
def test_a_windowed_decoding_step_takes_the_short_path(monkeypatch, storage, Lq, causal,
                                                        window, softcap):
    """A window of Python ints (a sliding-window layer's decoding step) and a float
    softcap keep the short path: the general plan's positions and cap, the general
    path's bits, the reference's values."""
    from fastattn import _dispatch
    from fastattn import _validation as _v
    from fastattn._plan import paged_plan
    rng = np.random.default_rng(Lq + len(str(window)))
    code = storage if storage in CODES else None
    dtype = {"bfloat16": BF16}.get(storage, None if code else np.dtype(storage))
    case = paged_case(rng, Lq=Lq, Hq=4, Hkv=2, code=code, dtype=dtype, share=True)
    del case["cu_seqlens_q"]
    made = short_plan(case, causal, window=window, softcap=softcap)
    assert made is not None
    plan, out = made
    a = _v.paged_args(**case, causal=causal)
    Lk = int(a.kv_lengths.max())
    var = _v.variant_args((a.block_table.shape[0], a.Hq), a.Lq, Lk,
                          (1, a.Hq, a.Lq, 16), a.computation, window=window,
                          softcap=softcap)
    general = paged_plan(a.q, a.k_cache, a.v_cache, a.block_table, a.kv_lengths, out,
                         None, None, a.scale, a.computation, k_scale=a.k_scale,
                         v_scale=a.v_scale, groups=a.groups, causal=a.causal,
                         window=var.window, softcap=var.softcap,
                         bf16_dot=_dispatch.bf16_dot, amx=_dispatch.amx,
                         round_weights=True)
    assert plan.positions == general.positions
    assert plan.softcap == general.softcap == softcap
    with plans_made(monkeypatch, "plain_paged_plan") as calls:
        got = fastattn.attention_paged(**case, causal=causal, window=window,
                                       softcap=softcap)
    assert calls == [True]
    want = general_paged(monkeypatch, case, causal=causal, window=window,
                         softcap=softcap)
    assert np.array_equal(got.view(np.uint8), want.view(np.uint8))
    close_to(got, reference.attention_paged(**exact(case), causal=causal, window=window,
                                            softcap=softcap),
             got.dtype)


@pytest.mark.parametrize("code", ["int8", "float8_e4m3fn"])
@pytest.mark.parametrize("layout", ["heads first", "scales strided",
                                    "scales broadcast"])
def test_a_decoding_step_over_strided_scales_takes_the_short_path(monkeypatch, code,
                                                                 layout):
    """Scales in another layout than C order (blocks stored heads first, as vLLM's CPU
    cache keeps them, their scales likewise; scales alone strided; one scale per head
    broadcast to the full shape) keep the short path: the general plan's operands,
    the general path's bits, the reference's result."""
    from fastattn import _dispatch
    from fastattn import _validation as _v
    from fastattn._plan import paged_plan
    rng = np.random.default_rng(len(layout) + len(code))
    case = paged_case(rng, Lq=1, Hq=4, Hkv=2, code=code, share=True)
    del case["cu_seqlens_q"]
    if layout == "heads first":
        for name in ("k_cache", "v_cache", "k_scale", "v_scale"):
            case[name] = axes_swapped(case[name])
    elif layout == "scales strided":
        case["v_scale"] = axes_swapped(case["v_scale"])
    else:
        case["k_scale"] = np.broadcast_to(case["k_scale"].max(axis=(0, 1)),
                                          case["k_scale"].shape)
    assert not case["v_scale"].flags.c_contiguous or layout == "scales broadcast"
    made = short_plan(case)
    assert made is not None
    plan, out = made
    a = _v.paged_args(**case)
    general = paged_plan(a.q, a.k_cache, a.v_cache, a.block_table, a.kv_lengths, out,
                         None, None, a.scale, a.computation, k_scale=a.k_scale,
                         v_scale=a.v_scale, groups=a.groups, causal=a.causal,
                         bf16_dot=_dispatch.bf16_dot, amx=_dispatch.amx,
                         round_weights=True)
    for name in ("q", "k", "v", "out", "k_scale", "v_scale"):
        assert plan.operand(name) == general.operand(name), name
    with plans_made(monkeypatch, "plain_paged_plan") as calls:
        got = fastattn.attention_paged(**case)
    assert calls == [True]
    want = general_paged(monkeypatch, case)
    assert np.array_equal(got.view(np.uint8), want.view(np.uint8))
    rounding = rounded_weights_bound(
        case["q"], reference.dequantize_kv(case["k_cache"], case["k_scale"]),
        reference.dequantize_kv(case["v_cache"], case["v_scale"]),
        attend=lambda q, k, v: reference.attention_paged(
            q, k, v, case["block_table"], case["kv_lengths"]),
        rounded=float8_pairs(case["q"], code))
    close_to(got, reference.attention_paged(**exact(case)), got.dtype, extra=rounding)


@pytest.mark.parametrize("storage", ["float32", "float64", "bfloat16", "int8",
                                     "float8_e4m3fn"])
@pytest.mark.parametrize("causal, window, softcap, sinks", [
    (True, None, None, False), (True, (6, 0), 2.5, True), (False, [3, 2], None, True),
    (False, "edge", None, False)])
def test_packed_queries_take_the_short_path_with_the_general_bits(
        monkeypatch, storage, causal, window, softcap, sinks):
    """Packed queries (chunked prefill, a batch of decoding steps: ``cu_seqlens_q``
    with int32 or int64 offsets, sequences of no queries) are planned from the buffers
    directly: the general plan's sizes, positions and operands, the general path's
    bits, the reference's result. "edge": a left side of Lq + Lk less one, which the
    general path keeps as a bound though it restricts nothing, and a right side of
    twice that, which it drops."""
    from fastattn import _dispatch
    from fastattn import _validation as _v
    from fastattn._plan import paged_plan
    rng = np.random.default_rng(len(storage) + 7 * causal)
    code = storage if storage in CODES else None
    dtype = {"bfloat16": BF16}.get(storage, None if code else np.dtype(storage))
    case = paged_case(rng, B=4, Hq=4, Hkv=2, code=code, dtype=dtype, packed=True)
    case["cu_seqlens_q"] = case["cu_seqlens_q"].astype(
        np.int64 if storage == "bfloat16" else np.int32)
    comp = np.float64 if storage == "float64" else np.float32
    sinks = rng.standard_normal(4).astype(comp) if sinks else None
    a = _v.paged_args(**case, causal=causal)
    if window == "edge":
        span = a.Lq + int(a.kv_lengths.max())
        window = (span - 1, 2 * span - 1)
    made = short_plan(case, causal, None, sinks, window, softcap)
    assert made is not None
    plan, out = made
    var = _v.variant_args((4, 4), a.Lq, int(a.kv_lengths.max()), (4, 4, a.Lq, 16),
                          a.computation, window=window, softcap=softcap, sinks=sinks)
    general = paged_plan(a.q, a.k_cache, a.v_cache, a.block_table, a.kv_lengths, out,
                         None, a.cu_seqlens_q, a.scale, a.computation,
                         k_scale=a.k_scale, v_scale=a.v_scale, groups=a.groups,
                         causal=a.causal, window=var.window, softcap=var.softcap,
                         sinks=var.sinks, bf16_dot=_dispatch.bf16_dot,
                         amx=_dispatch.amx, round_weights=True)
    assert (plan.sizes, plan.groups, plan.positions, plan.bottom_right, plan.dtype,
            plan.dot_kernel, plan.batch_shape, plan.softcap) == (
        general.sizes, general.groups, general.positions, general.bottom_right,
        general.dtype, general.dot_kernel, general.batch_shape, general.softcap)
    for name in ("q", "k", "v", "out", "k_scale", "v_scale"):
        assert plan.operand(name) == general.operand(name), name
    assert out.shape == case["q"].shape[:-1] + (16,) and out.dtype == case["q"].dtype
    kw = dict(causal=causal, window=window, softcap=softcap, sinks=sinks)
    with plans_made(monkeypatch, "plain_paged_plan") as calls:
        got = fastattn.attention_paged(**case, **kw)
    assert calls == [True]
    want = general_paged(monkeypatch, case, **kw)
    assert got.dtype == want.dtype and np.array_equal(got.view(np.uint8),
                                                      want.view(np.uint8))
    ref = reference.attention_paged(**exact(case), **kw)
    rounding = rounded_weights_bound(
        case["q"], reference.dequantize_kv(case["k_cache"], case["k_scale"]),
        reference.dequantize_kv(case["v_cache"], case["v_scale"]),
        attend=lambda q, k, v, **o: reference.attention_paged(
            q, k, v, case["block_table"], case["kv_lengths"],
            cu_seqlens_q=case["cu_seqlens_q"], **kw, **o),
        rounded=float8_pairs(case["q"], code) or storage == "bfloat16")
    close_to(got, ref, got.dtype if got.dtype != np.float64 else np.float32,
             extra=rounding)


def test_every_other_paged_call_takes_the_general_path():
    """plain_paged_plan says None (the general path then computes the call, or
    names what is wrong) for anything but a decoding step's plain call."""
    rng = np.random.default_rng(40)
    case = paged_case(rng, Lq=2, code="int8")
    del case["cu_seqlens_q"]
    assert short_plan(case) is not None
    table, lengths = case["block_table"], case["kv_lengths"]
    bad_entry = table.copy()
    bad_entry[0, 4] = 30                        # needed: sequence 0 is full
    negative = table.copy()
    negative[2, 0] = -1                         # sequence 2 holds one block
    others = {
        "a list for the table": dict(block_table=table.tolist()),
        "a list for the lengths": dict(kv_lengths=lengths.tolist()),
        "float lengths": dict(kv_lengths=lengths.astype(float)),
        "int16 table": dict(block_table=table.astype(np.int16)),
        "a 1-D table": dict(block_table=table[0]),
        "a table of other rows": dict(block_table=table[:2]),
        "lengths of other rows": dict(kv_lengths=lengths[:2]),
        "a needed block past the cache": dict(block_table=bad_entry),
        "a needed block below 0": dict(block_table=negative),
        "a length past the table": dict(kv_lengths=np.array([81, 0, 16])),
        "a negative length": dict(kv_lengths=np.array([-1, 0, 16])),
        "per-head scales": dict(k_scale=case["k_scale"].max(axis=(0, 1))),
        "scales of a negative stride": dict(v_scale=case["v_scale"][:, ::-1]),
        "float64 scales": dict(k_scale=case["k_scale"].astype(np.float64)),
        "one scale missing": dict(v_scale=None),
        "a float64 query": dict(q=case["q"].astype(np.float64)),
        "a 3-D query": dict(q=case["q"][:, 0]),
        "float caches with scales": dict(k_cache=case["k_cache"].astype(np.float32),
                                         v_cache=case["v_cache"].astype(np.float32)),
        "codes of two dtypes": dict(v_cache=case["v_cache"].view(np.uint8)),
        "columns not contiguous": dict(k_cache=np.repeat(case["k_cache"], 2, -1)[..., ::2]),
        "heads not a multiple": dict(q=np.zeros((3, 2, 3, 16), np.float32)),
        "a 4-D query with offsets": dict(cu_seqlens_q=np.arange(4)),
    }
    packed = dict(case, q=case["q"][:, 0], cu_seqlens_q=np.arange(4, dtype=np.int32))
    assert short_plan(packed) is not None
    packed_others = {
        "a list of offsets": dict(cu_seqlens_q=[0, 1, 2, 3]),
        "float offsets": dict(cu_seqlens_q=np.arange(4.0)),
        "int16 offsets": dict(cu_seqlens_q=np.arange(4, dtype=np.int16)),
        "offsets of another length": dict(cu_seqlens_q=np.arange(3)),
        "offsets from 1": dict(cu_seqlens_q=np.arange(1, 5)),
        "decreasing offsets": dict(cu_seqlens_q=np.array([0, 2, 1, 3])),
        "offsets short of the rows": dict(cu_seqlens_q=np.array([0, 1, 2, 2])),
        "an empty table": dict(block_table=table[:0], kv_lengths=lengths[:0],
                               cu_seqlens_q=np.zeros(1, np.int64)),
    }
    for why, change in packed_others.items():
        assert short_plan(dict(packed, **change)) is None, why
    with pytest.raises(ValueError, match="cu_seqlens_q must be non-decreasing"):
        fastattn.attention_paged(**dict(packed, cu_seqlens_q=np.array([0, 2, 1, 3])))
    for why, change in others.items():
        assert short_plan(dict(case, **change)) is None, why
    assert short_plan(case, causal="bottom_right") is None
    assert short_plan(case, causal=np.True_) is None
    assert short_plan(case, scale=1) is None
    assert short_plan(case, sinks=np.zeros((3, 4), np.float32)) is None
    for window in ((np.int64(3), 0), (True, 0), (-1, 0), (1, 2, 3), "left", 3):
        assert short_plan(case, window=window) is None, window
    for cap in (3, np.float32(3.0), -1.0, float("inf"), 1e-40):
        assert short_plan(case, softcap=cap) is None, cap
    with pytest.raises(ValueError, match="softcap must be finite and > 0"):
        fastattn.attention_paged(**case, softcap=-1.0)
    with pytest.raises(ValueError, match="window's left side must be >= 0"):
        fastattn.attention_paged(**case, window=(-1, 0))
    np.testing.assert_array_equal(      # NumPy integers: computed by the general path
        fastattn.attention_paged(**case, window=(np.int64(3), 0)),
        fastattn.attention_paged(**case, window=(3, 0)))
    # what the general path computes, it computes as before
    got = fastattn.attention_paged(**dict(case, kv_lengths=lengths.tolist()))
    np.testing.assert_array_equal(got, fastattn.attention_paged(**case))
    with pytest.raises(ValueError, match=r"block_table\[0, 4\] = 30"):
        fastattn.attention_paged(**dict(case, block_table=bad_entry))
    with pytest.raises(ValueError, match=r"block_table\[2, 0\] = -1"):
        fastattn.attention_paged(**dict(case, block_table=negative))
