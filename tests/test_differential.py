"""Differential fuzzing: attention, attention_backward and attention_varlen against
fastattn.reference, with every variant combined at random, in every dtype, with special
values (NaN, inf, values near the largest float, subnormals, -inf biases) placed at
random.

The oracle is the reference computed in float64 on the same (stored) inputs: results
agree within the dtype's tolerance (16-bit results: rounded once, within half an ulp),
NaN and inf land in the same places. The examples are drawn by hypothesis with a fixed
seed (tests/conftest.py: 300 per test, FASTATTN_FUZZ_LONG=1 for 3000); CI runs them at
every instruction-set level it runs the kernels' tests at.
"""

import numpy as np
import pytest

import fastattn
from fastattn import reference
from helpers import rounded_weights_bound

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import assume, given, note, strategies as st   # noqa: E402

try:
    import ml_dtypes
except ImportError:
    ml_dtypes = None

DTYPES = ["float32", "float64", "float16"] + (["bfloat16"] if ml_dtypes else [])
HALF_ULP = {"bfloat16": 2.0 ** -8, "float16": 2.0 ** -11}
SPECIALS = ["none", "none", "none", "nan_v", "inf_v", "nan_k", "nan_q", "big_v",
            "subnormal_v", "blocked_row", "huge_scores"]


def f64(arrays):
    return [a.astype(np.float64) for a in arrays]


def as_dtype(name):
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def finfo(name):
    return ml_dtypes.finfo(as_dtype(name)) if name == "bfloat16" else np.finfo(name)


@st.composite
def problems(draw, backward=False):
    """One call: arrays (stored dtype), keywords, and the special value placed."""
    name = draw(st.sampled_from(DTYPES))
    dt = as_dtype(name)
    B, Hkv, groups = draw(st.integers(1, 2)), draw(st.integers(1, 2)), draw(
        st.sampled_from([1, 2]))
    Hq = Hkv * groups
    Lq = draw(st.sampled_from([1, 2, 3, 5, 17, 64, 65, 130]))
    Lk = draw(st.sampled_from([1, 3, 63, 64, 65, 200, 1100]))
    E = draw(st.sampled_from([1, 2, 8, 32, 64]))
    Ev = draw(st.sampled_from([1, 3, 16, 64]))
    rng = np.random.default_rng(draw(st.integers(0, 2 ** 32 - 1)))
    q = rng.standard_normal((B, Hq, Lq, E))
    k = rng.standard_normal((B, Hkv, Lk, E))
    v = rng.standard_normal((B, Hkv, Lk, Ev))
    kw = dict(enable_gqa=groups > 1)
    kw["causal"] = draw(st.sampled_from([False, True, "bottom_right"]))
    if draw(st.booleans()):
        kw["window"] = (draw(st.sampled_from([None, 0, 3, 40])),
                        draw(st.sampled_from([None, 0, 5])))
    if draw(st.booleans()):
        kw["softcap"] = draw(st.sampled_from([1.0, 5.0, 30.0]))
    if draw(st.booleans()):
        kw["alibi_slopes"] = rng.random(Hq) * draw(st.sampled_from([0.1, 1.0]))
    if draw(st.booleans()):
        kw["sinks"] = rng.standard_normal(Hq) + np.log(Lk)
    if draw(st.booleans()):
        kw["q_lengths"] = rng.integers(0, Lq + 1, B)
        kw["kv_lengths"] = rng.integers(0, Lk + 1, B)
    if draw(st.booleans()):
        kw["mask"] = rng.random((Lq, Lk)) < 0.85
    if draw(st.booleans()):
        kw["bias"] = rng.standard_normal((Hq, Lq, Lk)) * 2
    if draw(st.integers(0, 3)) == 0:
        kw["dropout_p"], kw["dropout_seed"] = 0.25, draw(st.integers(0, 2 ** 63))
    special = "none" if backward else draw(st.sampled_from(SPECIALS))
    info = finfo(name)
    b, h, i, j = (rng.integers(0, n) for n in (B, Hkv, Lq, Lk))
    if special == "nan_v":
        v[b, h, j, rng.integers(0, Ev)] = np.nan
    elif special == "inf_v":
        v[b, h, j, 0] = np.inf
    elif special == "nan_k":
        k[b, h, j, rng.integers(0, E)] = np.nan
    elif special == "nan_q":
        q[b, h * groups, i, 0] = np.nan
    elif special == "big_v":
        # (times at most 1 / (1 - 0.25) by dropout: the results stay in range)
        v[b, h] = np.where(rng.random((Lk, Ev)) < 0.5, -1, 1) * float(info.max) * 0.5
    elif special == "subnormal_v":
        v[b, h] *= float(info.smallest_normal) / 8
    elif special == "blocked_row":
        kw["bias"] = np.broadcast_to(kw.get("bias", np.zeros((Hq, Lq, Lk))),
                                     (Hq, Lq, Lk)).copy()
        kw["bias"][:, i] = -np.inf
    elif special == "huge_scores":
        q *= 1e3
    note(f"{name} B={B} Hq={Hq} Hkv={Hkv} Lq={Lq} Lk={Lk} E={E} Ev={Ev} "
         f"special={special} keywords={sorted(kw)}")
    arrays = [x.astype(dt) for x in (q, k, v)]
    if "bias" in kw and name in ("bfloat16", "float16"):
        kw["bias"] = kw["bias"].astype(np.float32)
    if special in ("nan_v", "inf_v"):
        assume(not near_the_underflow(name, arrays, kw, j))
    return name, arrays, kw


def near_the_underflow(name, arrays, kw, j):
    """Whether key j's weight, against some row's maximum, lies so near the smallest
    normal number of the computation dtype that the rounding of its score decides
    whether a NaN or inf value there reaches the row (such rows are not asserted)."""
    rule = {k: x for k, x in kw.items() if k not in ("dropout_p", "dropout_seed", "sinks")}
    s = reference.scores(*f64(arrays[:2]), **rule)
    top = np.max(s, axis=-1, initial=-np.inf)
    if "sinks" in kw:
        top = np.maximum(top, np.broadcast_to(np.asarray(kw["sinks"])[:, None],
                                              top.shape))
    limit = -np.log(np.finfo(np.float64 if name == "float64" else np.float32).tiny)
    with np.errstate(invalid="ignore"):
        gap = top - s[..., j]
    return bool(np.any(np.abs(gap - limit) < 0.05))


def check(got, want, name, scale, pattern=None, extra=0.0):
    """got against the float64 want: the same NaN and inf as ``pattern`` (the
    reference in the computation dtype, whose underflows decide which NaN and inf
    values reach a row; default want), and within tolerance where it is finite, plus
    ``extra`` (like want: the weights' rounding, helpers.rounded_weights_bound)."""
    got = np.asarray(got, np.float64)
    if pattern is not None:
        pattern = np.asarray(pattern, np.float64)
        np.testing.assert_array_equal(np.isnan(got), np.isnan(pattern))
        np.testing.assert_array_equal(np.isinf(got), np.isinf(pattern))
        # (where a NaN or inf value reached a row in float64 only, the value to expect
        # is the computation dtype's)
        want = np.where(np.isfinite(pattern), np.where(np.isfinite(want), want, pattern),
                        pattern)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    fin = np.isfinite(want)
    np.testing.assert_array_equal(got[~fin & ~np.isnan(want)],
                                  want[~fin & ~np.isnan(want)])
    assert np.isfinite(got[fin]).all(), "a finite result became inf"
    err = np.abs(got[fin] - want[fin])
    if name in HALF_ULP:
        bound = HALF_ULP[name] * np.abs(want[fin]) + 2e-5 * scale
        bound += float(finfo(name).smallest_subnormal)
        bound += np.broadcast_to(extra, want.shape)[fin]
    else:
        bound = (3e-5 if name == "float32" else 1e-10) * scale
    assert (err <= bound).all(), f"max excess {np.max(err - bound):.3g} (scale {scale:.3g})"


@given(problems())
def test_attention_against_the_reference(case):
    name, (q, k, v), kw = case
    out, lse = fastattn.attention(q, k, v, return_lse=True, **kw)
    want, want_lse = reference.attention(*f64((q, k, v)), return_lse=True, **kw)
    same = reference.attention(q, k, v, **kw)       # in the computation dtype
    vmax = float(np.nanmax(np.abs(np.where(np.isinf(v.astype(np.float64)), 0,
                                           v.astype(np.float64))), initial=1.0))
    scale = max(1.0, vmax) / (1 - kw.get("dropout_p", 0))
    # scores are computed in the computation dtype: their rounding (relative to their
    # size) moves every weight by as much
    rule = {k: x for k, x in kw.items() if k not in ("dropout_p", "dropout_seed", "sinks")}
    s = reference.scores(*f64((q, k)), **rule)
    smax = float(np.max(np.abs(s[np.isfinite(s)]), initial=1.0))
    check(out, want, name, scale * (1 + smax / 64), pattern=same,
          extra=rounded_weights_bound(q, k, v, **kw))
    check(lse, want_lse, "float32" if name != "float64" else "float64",
          max(1.0, float(np.abs(want_lse[np.isfinite(want_lse)]).max(initial=1.0))))


@given(problems(backward=True))
def test_attention_backward_against_the_reference(case):
    name, (q, k, v), kw = case
    out, lse = fastattn.attention(q, k, v, return_lse=True, **kw)
    rng = np.random.default_rng(0)
    go = rng.standard_normal(out.shape).astype(out.dtype)
    grads = fastattn.attention_backward(go, q, k, v, out, lse, **kw)
    want = reference.attention_backward(*f64((go, q, k, v, out)), lse, **kw)
    assert len(grads) == len(want) == (4 if "sinks" in kw else 3)
    for g, w in zip(grads, want):
        g = np.asarray(g, np.float64)
        assert g.shape == w.shape and np.isfinite(g).all()
        scale = max(1.0, float(np.abs(w).max())) / (1 - kw.get("dropout_p", 0))
        if name in HALF_ULP:    # the gradient products may round P and dS once more
            bound = 2 * HALF_ULP[name] * (np.abs(w) + scale)
            assert (np.abs(g - w) <= bound).all()
        else:
            check(g, w, name, 10 * scale)


@st.composite
def packed_problems(draw):
    name = draw(st.sampled_from(DTYPES))
    dt = as_dtype(name)
    n = draw(st.integers(1, 5))
    lq = draw(st.lists(st.sampled_from([0, 1, 2, 4, 5, 64, 70]), min_size=n, max_size=n))
    lk = draw(st.lists(st.sampled_from([0, 1, 3, 64, 65, 300]), min_size=n, max_size=n))
    Hkv, groups = draw(st.integers(1, 2)), draw(st.sampled_from([1, 2]))
    E, Ev = draw(st.sampled_from([2, 16, 64])), draw(st.sampled_from([1, 16]))
    rng = np.random.default_rng(draw(st.integers(0, 2 ** 32 - 1)))
    cu_q = np.concatenate([[0], np.cumsum(lq)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lk)]).astype(np.int64)
    q = rng.standard_normal((cu_q[-1], Hkv * groups, E)).astype(dt)
    k = rng.standard_normal((cu_k[-1], Hkv, E)).astype(dt)
    v = rng.standard_normal((cu_k[-1], Hkv, Ev)).astype(dt)
    kw = dict(causal=draw(st.sampled_from([False, True, "bottom_right"])))
    if draw(st.booleans()):
        kw["window"] = (draw(st.sampled_from([None, 2, 30])),
                        draw(st.sampled_from([None, 0, 4])))
    if draw(st.booleans()):
        kw["softcap"] = 4.0
    if draw(st.booleans()):
        kw["alibi_slopes"] = rng.random(Hkv * groups)
    if draw(st.booleans()):
        kw["sinks"] = rng.standard_normal((n, Hkv * groups))
    if draw(st.integers(0, 3)) == 0:
        kw["dropout_p"], kw["dropout_seed"] = 0.3, draw(st.integers(0, 2 ** 32))
    note(f"{name} lq={lq} lk={lk} Hkv={Hkv} groups={groups} E={E} Ev={Ev} "
         f"keywords={sorted(kw)}")
    return name, (q, k, v, cu_q, cu_k), kw


@given(packed_problems())
def test_attention_varlen_against_the_reference(case):
    name, (q, k, v, cu_q, cu_k), kw = case
    out, lse = fastattn.attention_varlen(q, k, v, cu_q, cu_k, return_lse=True, **kw)
    want, want_lse = reference.attention_varlen(*f64((q, k, v)), cu_q, cu_k,
                                                return_lse=True, **kw)
    scale = 4.0 / (1 - kw.get("dropout_p", 0))
    check(out, want, name, scale, extra=rounded_weights_bound(
        q, k, v, lambda *a, **o: reference.attention_varlen(*a, cu_q, cu_k, **o), **kw))
    check(lse, want_lse, "float32" if name != "float64" else "float64", 10.0)
    if name in HALF_ULP:
        return
    go = np.random.default_rng(1).standard_normal(out.shape).astype(out.dtype)
    grads = fastattn.attention_varlen_backward(go, q, k, v, out, lse, cu_q, cu_k, **kw)
    wants = reference.attention_varlen_backward(go, q, k, v, out, lse, cu_q, cu_k, **kw)
    for g, w in zip(grads, wants):
        check(g, w, name, 10 * max(1.0, float(np.abs(w).max(initial=1.0))) * scale)
