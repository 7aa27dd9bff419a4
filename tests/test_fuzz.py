"""Fuzzing the whole public API with hypothesis.

Every call either raises ValueError/TypeError with a message naming the argument, or
returns the result of the NumPy reference computed in float64 (within the tolerance
rule of helpers.py, scaled by the conditioning of the problem: the magnitude of the
scores that the softmax sees). Shapes include 0 and 1 sizes and the 64-row/64-key
block edges; dtypes, memory layouts, masks, bias, causal kinds, GQA, the attention
variants (window, softcap, ALiBi slopes, sequence lengths, dropout with its seed),
``out`` and ``num_threads`` are drawn at random, and about a quarter of the cases carry
one deliberate mistake.

Seeded and deterministic: 300 examples per test (profile "fastattn" in conftest.py);
``FASTATTN_FUZZ_LONG=1`` runs 3000. A function that does not exist yet is skipped.
"""

import math

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, strategies as st  # noqa: E402

import fastattn  # noqa: E402
from fastattn import reference  # noqa: E402

from helpers import assert_close  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

FLOATS = [np.float16, np.float32, np.float64]
DATA_DTYPES = FLOATS + [np.int32]
LAYOUTS = ["c", "f", "neg", "step", "readonly", "swapped"]
CAUSALS = [False, True, "top_left", "bottom_right", np.bool_(True), np.bool_(False)]
THREADS = [None, 1, 2, 3, np.int64(2), 10**6]

needs = {name: pytest.mark.skipif(not hasattr(fastattn, name),
                                  reason=f"fastattn.{name} does not exist yet")
         for name in ("attention_backward", "MultiHeadAttention", "positional_encoding")}


# ------------------------------------------------------------------- strategies

def _layout(a, kind):
    """The same values in another memory layout (non-contiguous, reversed, ...)."""
    if a.ndim == 0 or a.size == 0:
        return a
    if kind == "f":
        return np.asfortranarray(a)
    if kind == "neg":
        return a[::-1].copy()[::-1]
    if kind == "step":
        big = np.zeros(a.shape[:-1] + (2 * a.shape[-1],), a.dtype)
        big[..., ::2] = a
        return big[..., ::2]
    if kind == "swapped":               # non-native byte order, same values
        return a.astype(a.dtype.newbyteorder())
    if kind == "readonly":
        a = a.copy()
        a.flags.writeable = False
        return a
    return a


def _values(rng, shape, dtype):
    if np.dtype(dtype).kind == "i":
        return rng.integers(-3, 4, size=shape).astype(dtype)
    return rng.standard_normal(shape).astype(dtype)


@st.composite
def sizes(draw, big=True):
    """Mostly 0..5; sometimes across the 64 block edge."""
    if big and draw(st.integers(0, 9)) == 0:
        return draw(st.sampled_from([63, 64, 65, 70]))
    return draw(st.integers(0, 5))


@st.composite
def broadcast_shape(draw, full):
    """A shape that broadcasts to ``full`` without enlarging it."""
    nd = draw(st.integers(0, len(full)))
    tail = full[len(full) - nd:] if nd else ()
    return tuple(1 if draw(st.booleans()) and draw(st.booleans()) else n for n in tail)


VARIANT_NAMES = ("window", "softcap", "alibi_slopes", "q_lengths", "kv_lengths",
                 "dropout_p", "dropout_seed")


@st.composite
def variant_keywords(draw, rng, batch, q_ndim, Lq, Lk, dropout):
    """Some of the attention variants, each in about one case in five; ``dropout``
    only where the function takes it (those that return outputs or gradients)."""
    kw = {}
    batch = tuple(batch)
    often = lambda: draw(st.integers(0, 4)) == 0  # noqa: E731
    if often():
        side = st.none() | st.integers(0, Lq + Lk + 1) | st.just(10**9)
        kw["window"] = draw(st.tuples(side, side) | st.lists(side, min_size=2,
                                                              max_size=2))
    if often():
        kw["softcap"] = draw(st.sampled_from([0.5, 2.0, 30.0, 3, np.float32(5)]))
    if batch and q_ndim >= 3 and often():
        shape = draw(st.sampled_from([batch[-1:], batch, (1,) * (len(batch) - 1)
                                      + batch[-1:]]))
        slopes = rng.random(shape) * draw(st.sampled_from([0.1, 1.0, 4.0]))
        # (a list of an empty array would lose its shape)
        kw["alibi_slopes"] = slopes.tolist() if slopes.size and draw(st.booleans()) \
            else slopes
    for name, L in (("q_lengths", Lq), ("kv_lengths", Lk)):
        if batch and often():
            dtype = draw(st.sampled_from([np.int64, np.int32, np.uint8]))
            kw[name] = rng.integers(0, L + 1, batch[:1]).astype(dtype)
    if dropout and often():
        kw["dropout_p"] = draw(st.sampled_from([0.0, 0.1, 0.5, 0.9]))
        kw["dropout_seed"] = draw(st.integers(0, 2**64 - 1))
    return kw


@st.composite
def attention_cases(draw, with_v=True, with_call_options=True):
    """Arguments of attention/scores/attention_weights, and one optional mistake."""
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    gqa = draw(st.booleans()) and draw(st.booleans())
    if gqa:
        hkv = draw(st.integers(1, 2))
        groups = draw(st.integers(1, 3))
        outer = tuple(draw(st.lists(st.integers(1, 2), max_size=1)))
        qb = outer + (hkv * groups,)
        kb = tuple(draw(st.sampled_from([n, 1])) for n in outer) + (hkv,)
    else:
        qb = tuple(draw(st.lists(st.integers(0, 3), max_size=2)))
        kb = tuple(draw(st.sampled_from([n, 1])) for n in qb)
        if draw(st.booleans()):      # k/v with fewer (or more) batch axes
            kb = kb[draw(st.integers(0, len(kb))):]
        if not qb and draw(st.integers(0, 3)) == 0:   # k/v with more batch axes
            kb = (draw(st.integers(1, 2)),)
    Lq, Lk = draw(sizes()), draw(sizes())
    E, Ev = draw(sizes(big=False)), draw(sizes(big=False))
    dt = draw(st.sampled_from(DATA_DTYPES))
    mixed = draw(st.integers(0, 4)) == 0
    dts = [draw(st.sampled_from(DATA_DTYPES)) if mixed else dt for _ in range(3)]
    q = _values(rng, qb + (Lq, E), dts[0])
    k = _values(rng, kb + (Lk, E), dts[1])
    v = _values(rng, kb + (Lk, Ev), dts[2])
    batch = np.broadcast_shapes(qb, kb) if not gqa else (
        np.broadcast_shapes(qb[:-1], kb[:-1]) + qb[-1:])
    full = tuple(batch) + (Lq, Lk)
    kw = {}
    if draw(st.booleans()):
        kw["mask"] = rng.random(draw(broadcast_shape(full))) < 0.7
    if draw(st.booleans()):
        bshape = draw(broadcast_shape(full))
        if draw(st.integers(0, 3)) == 0:
            bias = rng.integers(-2, 3, size=bshape)
        else:
            bias = rng.standard_normal(bshape)
            bias[rng.random(bshape) < 0.2] = -np.inf
        kw["bias"] = bias
    causal = draw(st.sampled_from(CAUSALS))
    if causal is not False:
        kw["causal"] = causal
    if E == 0 or draw(st.integers(0, 3)) == 0:
        kw["scale"] = draw(st.sampled_from([0.0, -0.5, 0.5, 1.0, 2, np.float32(0.25)]))
    if gqa:
        kw["enable_gqa"] = True
    kw.update(draw(variant_keywords(rng, batch, q.ndim, Lq, Lk, dropout=with_v)))
    arrays = {"q": q, "k": k, "v": v}
    for name in arrays:
        arrays[name] = _layout(arrays[name], draw(st.sampled_from(LAYOUTS)))
    for name in ("mask", "bias"):
        if name in kw:
            kw[name] = _layout(kw[name], draw(st.sampled_from(LAYOUTS)))
    if not with_v:
        del arrays["v"]
    opts = {}
    if with_call_options:
        if draw(st.booleans()):
            opts["return_lse"] = True
        nt = draw(st.sampled_from(THREADS))
        if nt is not None:
            opts["num_threads"] = nt
        if draw(st.integers(0, 3)) == 0:
            res = np.result_type(*(np.float64 if np.dtype(a.dtype).kind == "i" else a.dtype
                                   for a in arrays.values()))
            opts["out"] = np.full(tuple(batch) + (Lq, Ev), np.nan, res)
    mistake = draw(st.sampled_from(MISTAKES)) if draw(st.integers(0, 3)) == 0 else None
    expect = None
    if mistake is not None:
        expect = mistake(arrays, kw, opts, full, rng)
    return arrays, kw, opts, expect


# One deliberate mistake: each changes the arguments and returns (exception, regex
# that the message must match, naming the argument), or None when it does not apply.

def _bad_e(arrays, kw, opts, full, rng):
    k = arrays["k"]
    arrays["k"] = np.zeros(k.shape[:-1] + (k.shape[-1] + 1,))
    return ValueError, r"\bq\b.*\bk\b"


def _bad_keys(arrays, kw, opts, full, rng):
    if "v" not in arrays:
        return None
    v = arrays["v"]
    arrays["v"] = np.zeros(v.shape[:-2] + (v.shape[-2] + 1, v.shape[-1]))
    return ValueError, r"\bk\b.*\bv\b"


def _bad_dtype(arrays, kw, opts, full, rng):
    name = rng.choice(sorted(arrays))
    kind = rng.choice(["bool", "complex", "str", "object"])
    a = arrays[name]
    arrays[name] = (a.astype(bool) if kind == "bool" else a.astype(complex)
                    if kind == "complex" else np.full(a.shape, "x") if kind == "str"
                    else a.astype(object))
    return TypeError, rf"\b{name}\b"


def _low_rank(arrays, kw, opts, full, rng):
    arrays["q"] = np.zeros(3)
    return ValueError, r"\bq\b"


def _mask_dtype(arrays, kw, opts, full, rng):
    kw["mask"] = np.ones(full[-2:], dtype=rng.choice([np.float64, np.int8]))
    return TypeError, r"\bmask\b"


def _enlarging(name):
    def mistake(arrays, kw, opts, full, rng):
        kw[name] = np.ones((2,) + full, dtype=bool if name == "mask" else float)
        return ValueError, rf"\b{name}\b"
    return mistake


def _mismatched(name):
    def mistake(arrays, kw, opts, full, rng):
        shape = full[:-1] + (full[-1] + 2,)
        kw[name] = np.ones(shape, dtype=bool if name == "mask" else float)
        return ValueError, rf"\b{name}\b"
    return mistake


def _bias_dtype(arrays, kw, opts, full, rng):
    kw["bias"] = np.ones(full[-2:], dtype=rng.choice([bool, complex]))
    return TypeError, r"\bbias\b"


def _bad_causal(arrays, kw, opts, full, rng):
    kw["causal"] = ["diagonal", None, 2, "True", 1.0][rng.integers(5)]
    return ValueError, r"\bcausal\b"


def _bad_scale(arrays, kw, opts, full, rng):
    kw["scale"] = ["x", True, [1.0], 1j][rng.integers(4)]
    return TypeError, r"\bscale\b"


def _no_scale_e0(arrays, kw, opts, full, rng):
    q, k = arrays["q"], arrays["k"]
    arrays["q"] = np.zeros(q.shape[:-1] + (0,))
    arrays["k"] = np.zeros(k.shape[:-1] + (0,))
    kw.pop("scale", None)
    return ValueError, r"\bscale\b"


def _bad_gqa(arrays, kw, opts, full, rng):
    q, k, v = arrays["q"], arrays["k"], arrays.get("v")
    kw["enable_gqa"] = True
    if q.ndim < 3 or k.ndim < 3 or (v is not None and v.ndim < 3):
        return ValueError, r"enable_gqa"
    hkv = k.shape[-3]
    arrays["q"] = np.zeros(q.shape[:-3] + (hkv + 1 if hkv > 1 else 0,) + q.shape[-2:])
    if hkv <= 1:
        arrays["k"] = np.zeros(k.shape[:-3] + (2,) + k.shape[-2:])
        if v is not None:
            arrays["v"] = np.zeros(v.shape[:-3] + (2,) + v.shape[-2:])
        arrays["q"] = np.zeros(q.shape[:-3] + (3,) + q.shape[-2:])
    return ValueError, r"enable_gqa.*\bq\b"


def _bad_threads(arrays, kw, opts, full, rng):
    if "v" not in arrays:
        return None
    value, exc = [(0, ValueError), (-3, ValueError), (1.5, TypeError), (True, TypeError),
                  ("2", TypeError), (np.float64(2), TypeError)][rng.integers(6)]
    opts["num_threads"] = value
    return exc, r"num_threads"


def _bad_out(arrays, kw, opts, full, rng):
    if "v" not in arrays:
        return None
    shape = full[:-1] + (arrays["v"].shape[-1],)
    res = np.result_type(*(np.float64 if a.dtype.kind == "i" else a.dtype
                           for a in arrays.values()))
    other = np.float32 if res == np.float64 else np.float64
    opts["out"] = [np.empty(shape + (1,), res), np.empty(shape, other),
                   np.empty(shape, res).tolist(),
                   np.empty(shape[::-1], res).T if len(shape) > 1 and np.prod(shape) > 1
                   and shape[-1] > 1 else np.empty((), res)][rng.integers(4)]
    return ValueError, r"\bout\b"


def _bad_window(arrays, kw, opts, full, rng):
    value, exc = [((-1, 0), ValueError), ((0, -2), ValueError), ((1.5, None), TypeError),
                  (3, TypeError), ((1, 2, 3), ValueError), ("ab", TypeError),
                  ((True, 0), TypeError)][rng.integers(7)]
    kw["window"] = value
    return exc, r"\bwindow\b"


def _bad_softcap(arrays, kw, opts, full, rng):
    value, exc = [(0, ValueError), (-1.0, ValueError), (float("nan"), ValueError),
                  (float("inf"), ValueError), ("x", TypeError),
                  (True, TypeError)][rng.integers(6)]
    kw["softcap"] = value
    return exc, r"\bsoftcap\b"


def _bad_slopes(arrays, kw, opts, full, rng):
    batch = full[:-2]
    # no head axis, or a last axis that is not the query heads
    kw["alibi_slopes"] = np.ones(batch[-1] + 2 if batch else 1)
    return ValueError, r"\balibi_slopes\b"


def _bad_lengths(name):
    def mistake(arrays, kw, opts, full, rng):
        batch, L = full[:-2], full[-2] if name == "q_lengths" else full[-1]
        B = batch[0] if batch else 1
        value, exc = [(np.full(B, L + 1), ValueError), (np.full(B, -1), ValueError),
                      (np.zeros(B + 1, int), ValueError),
                      (np.zeros(B), TypeError)][rng.integers(4)]
        if not batch or (B == 0 and exc is ValueError):
            value, exc = np.zeros(B + 1, int), ValueError
        kw[name] = value
        return exc, rf"\b{name}\b"
    return mistake


def _bad_dropout(arrays, kw, opts, full, rng):
    if "v" not in arrays:
        return None
    (p, seed), exc, name = [((1.0, 1), ValueError, "dropout_p"),
                            ((-0.1, 1), ValueError, "dropout_p"),
                            ((float("nan"), 1), ValueError, "dropout_p"),
                            (("0.5", 1), TypeError, "dropout_p"),
                            ((0.5, None), ValueError, "dropout_seed"),
                            ((0.5, -1), ValueError, "dropout_seed"),
                            ((0.5, 2**64), ValueError, "dropout_seed"),
                            ((0.5, 1.5), TypeError, "dropout_seed")][rng.integers(8)]
    kw["dropout_p"] = p
    kw["dropout_seed"] = seed
    return exc, rf"\b{name}\b"


MISTAKES = [_bad_e, _bad_keys, _bad_dtype, _low_rank, _mask_dtype, _enlarging("mask"),
            _enlarging("bias"), _mismatched("mask"), _mismatched("bias"), _bias_dtype,
            _bad_causal, _bad_scale, _no_scale_e0, _bad_gqa, _bad_threads, _bad_out,
            _bad_window, _bad_softcap, _bad_slopes, _bad_lengths("q_lengths"),
            _bad_lengths("kv_lengths"), _bad_dropout]


# ---------------------------------------------------------------------- oracles

def _f64(a):
    return None if a is None else np.asarray(a, dtype=np.float64)


def _oracle_kw(kw):
    kw = dict(kw)
    if "bias" in kw:
        kw["bias"] = _f64(kw["bias"])
    return kw


def _result_dtype(*arrays):
    return np.result_type(*(np.float64 if a.dtype.kind == "i" else a.dtype for a in arrays))


def _score_size(arrays, kw):
    """The largest |score| the inputs can produce: the conditioning of the softmax."""
    q, k = _f64(arrays["q"]), _f64(arrays["k"])
    scale = kw.get("scale")
    if scale is None:
        scale = 1 / math.sqrt(q.shape[-1]) if q.shape[-1] else 0.0
    qk = np.max(np.abs(q), initial=0.0) * np.max(np.abs(k), initial=0.0) * q.shape[-1]
    bias = kw.get("bias")
    b = np.max(np.abs(np.where(np.isfinite(_f64(bias)), bias, 0)), initial=0.0) \
        if bias is not None else 0.0
    s = abs(float(scale)) * qk
    if kw.get("softcap") is not None:
        s = min(s, float(kw["softcap"]))
    slopes = kw.get("alibi_slopes")
    if slopes is not None:          # ALiBi adds up to slope * |i + d - j| <= (Lq + Lk)
        b += np.max(np.abs(_f64(slopes)), initial=0.0) * (q.shape[-2] + k.shape[-2])
    return max(1.0, s + b)


def _dropout_gain(kw):
    """Kept weights are scaled by 1 / (1 - dropout_p): so are the errors."""
    return 1.0 / (1.0 - float(kw.get("dropout_p", 0.0)))


def _raises(fn, expect):
    exc, pattern = expect
    with pytest.raises(exc, match=pattern) as info:
        fn()
    assert type(info.value) in (ValueError, TypeError, np.exceptions.AxisError), info.value


# ------------------------------------------------------------------------ tests

@given(attention_cases())
def test_fuzz_attention(case):
    arrays, kw, opts, expect = case
    call = lambda: fastattn.attention(*arrays.values(), **kw, **opts)  # noqa: E731
    if expect is not None:
        return _raises(call, expect)
    got = call()
    ref_out, ref_lse = reference.attention(*map(_f64, arrays.values()), return_lse=True,
                                           **_oracle_kw(kw))
    res = _result_dtype(*arrays.values())
    out, lse = got if opts.get("return_lse") else (got, None)
    if "out" in opts:
        assert out is opts["out"]
    assert out.dtype == res and out.shape == ref_out.shape
    cond = _score_size(arrays, kw)
    vmax = max(1.0, float(np.max(np.abs(_f64(arrays["v"])), initial=0.0)))
    assert_close(out, ref_out, res, vmax * cond * _dropout_gain(kw))
    if lse is not None:
        comp = np.float64 if res == np.float64 else np.float32
        assert lse.dtype == comp and lse.shape == ref_lse.shape
        assert_close(lse, ref_lse, res, max(cond, float(np.max(
            np.abs(ref_lse[np.isfinite(ref_lse)]), initial=1.0))))


@pytest.mark.parametrize("fn", ["scores", "attention_weights"])
@given(case=attention_cases(with_v=False, with_call_options=False))
def test_fuzz_scores_and_weights(fn, case):
    arrays, kw, opts, expect = case
    call = lambda: getattr(fastattn, fn)(*arrays.values(), **kw)  # noqa: E731
    if expect is not None:
        return _raises(call, expect)
    got = call()
    ref = getattr(reference, fn)(*map(_f64, arrays.values()), **_oracle_kw(kw))
    res = _result_dtype(*arrays.values())
    assert got.dtype == res and got.shape == ref.shape
    assert_close(got, ref, res, _score_size(arrays, kw))


@st.composite
def softmax_cases(draw):
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    shape = tuple(draw(st.lists(sizes(), min_size=1, max_size=3)))
    dtype = draw(st.sampled_from(DATA_DTYPES))
    x = _values(rng, shape, dtype)
    if dtype != np.int32:
        x = (x * draw(st.sampled_from([1, 10, 100]))).astype(dtype)
        x[rng.random(shape) < draw(st.sampled_from([0, 0.3, 1.0]))] = -np.inf
    x = _layout(x, draw(st.sampled_from(LAYOUTS)))
    kw = {}
    expect = None
    if draw(st.booleans()):
        kw["axis"] = draw(st.integers(-len(shape), len(shape) - 1))
    if draw(st.integers(0, 3)) == 0:
        res = np.float64 if dtype == np.int32 else dtype
        kw["out"] = np.full(shape, np.nan, res)
    if draw(st.integers(0, 4)) == 0:
        x, kw, expect = draw(st.sampled_from([
            (x, dict(kw, axis=len(shape)), (ValueError, r"axis")),
            (x, dict(kw, axis=-len(shape) - 1), (ValueError, r"axis")),
            (x, dict(kw, axis=1.0), (TypeError, r"axis")),
            (x.astype(bool), kw, (TypeError, r"\bx\b")),
            (x.astype(complex), kw, (TypeError, r"\bx\b")),
            (x, dict(kw, out=np.empty(shape + (1,))), (ValueError, r"\bout\b")),
            (x, dict(kw, out=np.empty(shape, np.float16 if dtype != np.float16
                                      else np.float32)), (ValueError, r"\bout\b")),
        ]))
    return x, kw, expect


@given(softmax_cases())
def test_fuzz_softmax(case):
    x, kw, expect = case
    call = lambda: fastattn.softmax(x, **kw)  # noqa: E731
    if expect is not None:
        return _raises(call, expect)
    got = call()
    ref = reference.softmax(_f64(x), axis=kw.get("axis", -1))
    res = _result_dtype(x)
    if "out" in kw:
        assert got is kw["out"]
    assert got.dtype == res and got.shape == x.shape
    fin = np.abs(_f64(x)[np.isfinite(_f64(x))])
    assert_close(got, ref, res, max(1.0, float(np.max(fin, initial=0.0))))


@st.composite
def weighted_sum_cases(draw):
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    pb = tuple(draw(st.lists(st.integers(0, 3), max_size=2)))
    vb = tuple(draw(st.sampled_from([n, 1])) for n in pb)[draw(st.integers(0, len(pb))):]
    if draw(st.booleans()):
        pb, vb = vb, pb
    Lq, Lk, Ev = draw(sizes()), draw(sizes()), draw(sizes(big=False))
    dts = [draw(st.sampled_from(DATA_DTYPES)) for _ in range(2)]
    p = _layout(np.abs(_values(rng, pb + (Lq, Lk), dts[0])), draw(st.sampled_from(LAYOUTS)))
    v = _layout(_values(rng, vb + (Lk, Ev), dts[1]), draw(st.sampled_from(LAYOUTS)))
    kw = {}
    batch = np.broadcast_shapes(pb, vb)
    res = _result_dtype(p, v)
    if draw(st.integers(0, 3)) == 0:
        kw["out"] = np.full(tuple(batch) + (Lq, Ev), np.nan, res)
    expect = None
    if draw(st.integers(0, 4)) == 0:
        p, v, kw, expect = draw(st.sampled_from([
            (p, np.zeros(v.shape[:-2] + (Lk + 1, Ev)), kw, (ValueError, r"\bp\b.*\bv\b")),
            (np.zeros(Lk), v, kw, (ValueError, r"\bp\b")),
            (p, np.zeros(3), kw, (ValueError, r"\bv\b")),
            (p.astype(bool), v, kw, (TypeError, r"\bp\b")),
            (p, v.astype(complex), kw, (TypeError, r"\bv\b")),
            (p, v, dict(out=np.empty(tuple(batch) + (Lq, Ev + 1), res)),
             (ValueError, r"\bout\b")),
        ]))
    return p, v, kw, expect


@given(weighted_sum_cases())
def test_fuzz_weighted_sum(case):
    p, v, kw, expect = case
    call = lambda: fastattn.weighted_sum(p, v, **kw)  # noqa: E731
    if expect is not None:
        return _raises(call, expect)
    got = call()
    ref = reference.weighted_sum(_f64(p), _f64(v))
    res = _result_dtype(p, v)
    if "out" in kw:
        assert got is kw["out"]
    assert got.dtype == res and got.shape == ref.shape
    bound = np.matmul(np.abs(_f64(p)), np.abs(_f64(v)))
    assert_close(got, ref, res, max(1.0, float(np.max(bound, initial=0.0))))


@needs["attention_backward"]
@given(attention_cases(with_call_options=False))
def test_fuzz_attention_backward(case):
    arrays, kw, opts, expect = case
    q, k, v = arrays.values()
    res = _result_dtype(q, k, v)
    try:
        out, lse = fastattn.attention(q, k, v, return_lse=True, **kw)
    except (ValueError, TypeError):
        assert expect is not None
        grad_out = out = lse = np.zeros(1)
        try:        # a mistake in a variant: well-shaped grad_out, out and lse, so that
                    # the backward's own checks of them pass and it reaches the variants
            out, lse = fastattn.attention(q, k, v, return_lse=True, **{
                n: x for n, x in kw.items() if n not in VARIANT_NAMES})
            grad_out = out
        except (ValueError, TypeError):
            pass
        return _raises(lambda: fastattn.attention_backward(
            grad_out, q, k, v, out, lse, **kw), expect)
    rng = np.random.default_rng(out.size)
    grad_out = rng.standard_normal(out.shape).astype(res)
    nt = [None, 1, 2, 10**6][out.size % 4]
    if expect is not None:      # this mistake did not stop the forward pass (e.g. out)
        return
    dq, dk, dv = fastattn.attention_backward(grad_out, q, k, v, out, lse,
                                             num_threads=nt, **kw)
    ref_out, ref_lse = reference.attention(*map(_f64, (q, k, v)), return_lse=True,
                                           **_oracle_kw(kw))
    refs = reference.attention_backward(_f64(grad_out), *map(_f64, (q, k, v)), ref_out,
                                        ref_lse, **_oracle_kw(kw))
    cond = _score_size(arrays, kw) * _dropout_gain(kw)
    for got, ref, a, bound in zip((dq, dk, dv), refs, (q, k, v),
                                  _gradient_bounds(q, k, v, grad_out, kw, out.shape)):
        assert got.shape == a.shape and got.dtype == res
        assert_close(got, ref, res, cond * bound)


def _gradient_bounds(q, k, v, grad_out, kw, out_shape):
    """Bounds on |dq|, |dk|, |dv| from the magnitudes of the inputs: with P's rows
    summing to 1, |dP| <= a = Ev max|dO| max|v| and sum_j |dS_ij| <= 2a; a gradient
    summed over broadcast or GQA uses grows with their number."""
    mx = lambda x: float(np.max(np.abs(_f64(x)), initial=0.0))  # noqa: E731
    E, Ev, Lq = q.shape[-1], v.shape[-1], q.shape[-2]
    scale = kw.get("scale")
    scale = abs(float(scale)) if scale is not None else 1 / math.sqrt(E)
    n_out = math.prod(out_shape[:-2])
    q_uses = n_out / max(1, math.prod(q.shape[:-2]))
    kv_uses = n_out * Lq / max(1, math.prod(k.shape[:-2]))
    a = max(1, Ev) * mx(grad_out) * mx(v)
    return (max(1.0, scale * 2 * a * mx(k) * q_uses),
            max(1.0, scale * 2 * a * mx(q) * kv_uses),
            max(1.0, mx(grad_out) * kv_uses))


def test_fuzz_backward_shape_errors():
    if not hasattr(fastattn, "attention_backward"):
        pytest.skip("fastattn.attention_backward does not exist yet")
    q, k, v = np.ones((2, 3, 4)), np.ones((2, 5, 4)), np.ones((2, 5, 3))
    out, lse = fastattn.attention(q, k, v, return_lse=True)
    bad = {"grad_out": np.ones((2, 3, 4)), "out": np.ones((2, 3, 2)), "lse": np.ones((2, 4))}
    for name, value in bad.items():
        args = dict(grad_out=np.ones_like(out), q=q, k=k, v=v, out=out, lse=lse)
        args[name] = value
        with pytest.raises(ValueError, match=rf"\b{name}\b"):
            fastattn.attention_backward(*args.values())
    with pytest.raises(ValueError, match="num_threads"):
        fastattn.attention_backward(np.ones_like(out), q, k, v, out, lse, num_threads=0)
    with pytest.raises(TypeError, match=r"\bq\b"):
        fastattn.attention_backward(np.ones_like(out), q.astype(bool), k, v, out, lse)


# ----------------------------------------------------------- transformer pieces

def _pe_reference(length, d_model, base):
    pos = np.arange(length, dtype=np.float64)[:, None]
    i = np.arange(d_model)[None, :]
    angle = pos / base ** ((i - i % 2) / d_model)
    return np.where(i % 2 == 0, np.sin(angle), np.cos(angle))


@needs["positional_encoding"]
@given(length=st.integers(0, 70), d_model=st.integers(1, 17),
       base=st.sampled_from([10000.0, 100.0, 2.0, 10000]),
       dtype=st.sampled_from([None, np.float16, np.float32, np.float64]),
       mistake=st.sampled_from([None] * 6 + ["length", "neg_length", "d_model", "dtype"]))
def test_fuzz_positional_encoding(length, d_model, base, dtype, mistake):
    kw = {} if dtype is None else {"dtype": dtype}
    if mistake == "length":
        with pytest.raises(TypeError, match="length"):
            fastattn.positional_encoding(2.5, d_model, **kw)
        return
    if mistake == "neg_length":
        with pytest.raises(ValueError, match="length"):
            fastattn.positional_encoding(-1, d_model, **kw)
        return
    if mistake == "d_model":
        with pytest.raises((TypeError, ValueError), match="d_model"):
            fastattn.positional_encoding(length, [d_model], **kw)
        return
    if mistake == "dtype":
        with pytest.raises((TypeError, ValueError), match="dtype"):
            fastattn.positional_encoding(length, d_model, dtype=np.complex128)
        return
    pe = fastattn.positional_encoding(length, d_model, base=base, **kw)
    want = np.dtype(dtype or np.float32)
    assert pe.shape == (length, d_model) and pe.dtype == want
    assert_close(pe, _pe_reference(length, d_model, float(base)), want.type)


def _mha_reference(mha, query, key, value, mask, causal, variants=None):
    """The module's maths written out with its own weights and fastattn.reference."""
    f = _f64
    has_bias = getattr(mha, "b_q", None) is not None     # None when built with bias=False
    b = (lambda name: f(getattr(mha, name))) if has_bias else (lambda name: 0.0)
    heads = mha.num_heads if hasattr(mha, "num_heads") else None
    q = f(query) @ f(mha.w_q).T + b("b_q")
    k = f(key) @ f(mha.w_k).T + b("b_k")
    v = f(value) @ f(mha.w_v).T + b("b_v")
    B, Lq, D = q.shape
    split = lambda a: a.reshape(a.shape[0], a.shape[1], heads,  # noqa: E731
                                a.shape[2] // heads).transpose(0, 2, 1, 3)
    variants = dict(variants or {})
    out, = (reference.attention(split(q), split(k), split(v), mask=mask, causal=causal,
                                **variants),)
    variants.pop("dropout_p", None)
    variants.pop("dropout_seed", None)
    w = reference.attention_weights(split(q), split(k), mask=mask, causal=causal,
                                    **variants)
    out = out.transpose(0, 2, 1, 3).reshape(B, Lq, D)
    return out @ f(mha.w_o).T + b("b_o"), w


@needs["MultiHeadAttention"]
@given(seed=st.integers(0, 2**32 - 1), heads=st.integers(1, 3), head_dim=st.integers(1, 4),
       batch=st.integers(1, 2), Lq=st.integers(0, 5), Lk=st.integers(1, 5),
       cross=st.booleans(), kvdim=st.sampled_from([None, 3]), bias=st.booleans(),
       dtype=st.sampled_from([np.float32, np.float64]), masked=st.booleans(),
       causal=st.sampled_from([False, True, "bottom_right"]), weights=st.booleans(),
       mistake=st.sampled_from([None] * 5 + ["divisible", "query_dim", "mask_dtype"]),
       data=st.data())
def test_fuzz_multi_head_attention(seed, heads, head_dim, batch, Lq, Lk, cross, kvdim,
                                   bias, dtype, masked, causal, weights, mistake, data):
    embed = heads * head_dim
    if mistake == "divisible":
        if heads == 1:
            return
        with pytest.raises(ValueError, match="embed_dim|num_heads"):
            fastattn.MultiHeadAttention(embed + 1, heads)
        return
    kd = kvdim if cross else None
    mha = fastattn.MultiHeadAttention(embed, heads, kdim=kd, vdim=kd, bias=bias,
                                      dtype=dtype, seed=seed)
    if not hasattr(mha, "num_heads"):
        mha.num_heads = heads
    rng = np.random.default_rng(seed)
    query = rng.standard_normal((batch, Lq, embed)).astype(dtype)
    if not cross:
        Lk = Lq
    key = rng.standard_normal((batch, Lk, kd or embed)).astype(dtype) if cross else None
    value = rng.standard_normal((batch, Lk, kd or embed)).astype(dtype) if cross else None
    mask = rng.random((batch, 1, Lq, Lk)) < 0.7 if masked else None
    if mistake == "query_dim":
        with pytest.raises(ValueError, match="query|embed"):
            mha(rng.standard_normal((batch, Lq, embed + 1)).astype(dtype), key, value)
        return
    if mistake == "mask_dtype":
        with pytest.raises(TypeError, match="mask"):
            mha(query, key, value, mask=np.ones((Lq, Lk)))
        return
    variants = data.draw(variant_keywords(rng, (batch, heads), 4, Lq, Lk, dropout=True))
    got = mha(query, key, value, mask=mask, causal=causal, need_weights=weights,
              **variants)
    ref, ref_w = _mha_reference(mha, query, query if key is None else key,
                                query if value is None else value, mask, causal, variants)
    out = got[0] if weights else got
    assert out.shape == (batch, Lq, embed) and out.dtype == dtype
    wmag = max(1.0, *(float(np.max(np.abs(_f64(getattr(mha, n))), initial=0.0))
                      for n in ("w_q", "w_k", "w_v", "w_o")))
    xmag = max(1.0, float(np.max(np.abs(_f64(query)), initial=0.0)))
    slopes = variants.get("alibi_slopes")   # ALiBi adds up to slope * (Lq + Lk)
    reach = 1 + (Lq + Lk) * float(np.max(np.abs(_f64(slopes)), initial=0.0)) \
        if slopes is not None else 1.0
    assert_close(out, ref, dtype,
                 (wmag * xmag) ** 3 * 10 * embed * reach * _dropout_gain(variants))
    if weights:
        assert got[1].shape == (batch, heads, Lq, Lk)
        assert_close(got[1], ref_w, dtype, (wmag * xmag) ** 2 * 10 * embed * reach)


# ------------------------------------------------ regressions found by fuzzing

@pytest.mark.parametrize("dtype", [">f4", ">f8", "<f2"])
def test_non_native_byte_order(dtype):
    x = np.array([[1.0, 2.0, 3.0], [0.5, -1.0, 4.0]]).astype(dtype)
    assert_close(fastattn.softmax(x), reference.softmax(x.astype(np.float64)), np.float16)
    assert_close(fastattn.attention(x, x, x), reference.attention(*[x.astype(float)] * 3),
                 np.float16)


def test_out_overlapping_the_inputs():
    rng = np.random.default_rng(1)
    p, v = rng.random((5, 5)), rng.random((5, 5))
    want = p @ v
    assert fastattn.weighted_sum(p, v, out=v) is v
    np.testing.assert_allclose(v, want, rtol=1e-12)
    q = rng.random((2, 6, 4))
    want = reference.attention(q, q, q)
    assert fastattn.attention(q, q, q, out=q) is q
    np.testing.assert_allclose(q, want, rtol=1e-12)
    x = rng.random(8)
    want = reference.softmax(x[:6])
    fastattn.softmax(x[:6], out=x[2:])      # overlapping, shifted by two
    np.testing.assert_allclose(x[2:], want, rtol=1e-12)
    y = rng.random((3, 4))
    want = reference.softmax(y)
    assert fastattn.softmax(y, out=y) is y  # exactly in place
    np.testing.assert_allclose(y, want, rtol=1e-12)


@pytest.mark.filterwarnings("ignore::PendingDeprecationWarning")
def test_out_may_be_an_ndarray_subclass():
    """np.matrix stays 2-D when reshaped: the kernels get a plain view of it."""
    out = np.asmatrix(np.zeros((2, 2)))
    res = fastattn.softmax(np.ones((2, 2)), out=out)
    assert res is out
    np.testing.assert_array_equal(np.asarray(out), 0.5)


def test_scale_out_of_float_range_and_huge_integer_num_threads():
    x = np.ones((2, 2))
    with pytest.raises(ValueError, match="scale"):
        fastattn.attention(x, x, x, scale=10**400)
    for n in (2**40, np.uint64(2**64 - 1)):
        np.testing.assert_array_equal(fastattn.attention(x, x, x, num_threads=n), x)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_misaligned_buffers(dtype):
    """Arrays at an odd byte offset (numpy.frombuffer): copied, never loaded misaligned."""
    def misaligned(a):
        raw = np.zeros(a.nbytes + 1, np.uint8)
        b = raw[1:].view(dtype).reshape(a.shape)
        b[...] = a
        assert not b.flags.aligned
        return b
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((2, 9, 4)).astype(dtype) for _ in range(3))
    want = reference.attention(q, k, v)
    mq, mk, mv = misaligned(q), misaligned(k), misaligned(v)
    out = misaligned(np.zeros_like(want))
    assert fastattn.attention(mq, mk, mv, out=out) is out
    assert_close(out, want, dtype)
    assert_close(fastattn.softmax(mq), reference.softmax(q), dtype)
    w = rng.random((2, 9, 9)).astype(dtype)
    assert_close(fastattn.weighted_sum(misaligned(w), mv), reference.weighted_sum(w, v),
                 dtype)
