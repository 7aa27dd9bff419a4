"""The kernel core: the Plan (operands read in place through their strides), the path
choice, Ctrl-C during a long call, and the rule for NaN/inf values whose weights
underflow (independent of tiling)."""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import fastattn
from fastattn import _compute, _dispatch, reference
from fastattn import _validation as _v
from fastattn._dispatch import drivers
from fastattn._plan import SIZES, make_plan, plain_plan

from helpers import assert_close

KEY_BLOCK = SIZES["KEY_BLOCK"]


def plan_of(q, k, v, **kw):
    args = _v.attention_args(q, k, v, **kw)
    s = args.shapes
    out = np.empty(s.batch + (s.Lq, s.Ev), args.computation)
    return _compute._plan(args, out), args


def address(a):
    return a.__array_interface__["data"][0]


# ------------------------------------------------------------------------ the plan

def test_transposed_views_are_read_in_place(rng):
    """q, k, v as transformers builds them: (B, L, H, E) buffers seen as (B, H, L, E)
    through swapaxes. The plan points into those buffers, with their strides."""
    B, L, H, E = 2, 37, 3, 16
    qb, kb, vb = (rng.standard_normal((B, L, H, E)).astype(np.float32) for _ in range(3))
    q, k, v = (x.swapaxes(1, 2) for x in (qb, kb, vb))
    assert not q.flags.c_contiguous
    plan, _ = plan_of(q, k, v)
    for name, view, base in (("q", q, qb), ("k", k, kb), ("v", v, vb)):
        addr, batch_strides, row_stride, col_stride = plan.operand(name)
        assert addr == address(base)
        assert row_stride == H * E and col_stride == 1
        assert batch_strides == (L * H * E, E)      # (B, H): not mergeable
    out = fastattn.attention(q, k, v)
    assert_close(out, reference.attention(q, k, v), np.float32)


def test_a_last_axis_without_unit_stride_is_copied(rng):
    q = rng.standard_normal((2, 8, 5)).swapaxes(1, 2)        # (2, 5, 8), strided rows
    plan, _ = plan_of(q, q, q)
    addr, _, row_stride, col_stride = plan.operand("q")
    assert col_stride == 1 and addr != address(q)
    assert_close(fastattn.attention(q, q, q), reference.attention(q, q, q), np.float64)


def test_broadcast_operands_get_zero_strides_and_no_copy(rng):
    q = rng.standard_normal((3, 4, 6, 8))
    k = rng.standard_normal((1, 4, 9, 8))               # broadcast over axis 0
    mask = rng.random((6, 9)) < 0.7                     # one matrix for every slice
    plan, _ = plan_of(q, k, k, mask=mask)
    assert plan.operand("k")[0] == address(k)
    assert plan.operand("k")[1] == (0, 9 * 8)
    m_addr, m_batch, m_rs, m_cs = plan.operand("mask")
    assert m_addr == address(mask) and m_batch == (0, 0) and (m_rs, m_cs) == (9, 1)
    assert plan.batch_shape == (3, 4)       # k steps through them unlike q: not merged
    assert plan.operand("q")[1] == (4 * 6 * 8, 6 * 8)
    # where every operand steps alike, the axes are merged into one
    plan, _ = plan_of(q, q, q, mask=np.ones((3, 4, 6, 6), bool))
    assert plan.batch_shape == (12,) and plan.operand("mask")[1] == (36,)
    assert_close(fastattn.attention(q, k, k, mask=mask),
                 reference.attention(q, k, k, mask=mask), np.float64)


def test_grouped_query_heads_are_index_arithmetic(rng):
    q = rng.standard_normal((2, 6, 5, 8))
    k = rng.standard_normal((2, 2, 7, 8))
    plan, _ = plan_of(q, k, k, enable_gqa=True)
    assert plan.groups == 3 and plan.batch_shape == (2, 6)
    assert plan.operand("k")[1] == (2 * 7 * 8, 7 * 8)   # per kv head; h // 3 picks it
    assert_close(fastattn.attention(q, k, k, enable_gqa=True),
                 reference.attention(q, k, k, enable_gqa=True), np.float64)


def test_more_batch_axes_than_a_plan_holds(rng):
    """Twelve batch axes that broadcast differently in q and k cannot all be merged:
    the plan falls back to contiguous copies and stays correct."""
    shape_q = (2, 1) * 6
    shape_k = (1, 2) * 6
    q = rng.standard_normal(shape_q + (3, 4))
    k = rng.standard_normal(shape_k + (5, 4))
    plan, _ = plan_of(q, k, k)
    assert len(plan.batch_shape) <= SIZES["MAX_BATCH_AXES"]
    assert_close(fastattn.attention(q, k, k), reference.attention(q, k, k), np.float64)


def test_the_positions_of_both_causal_kinds():
    q = np.zeros((3, 2))
    k = np.zeros((7, 2))
    assert plan_of(q, k, k, causal=True)[0].positions == (0, None, 0)
    assert plan_of(q, k, k, causal="bottom_right")[0].positions == (4, None, 0)
    assert plan_of(q, k, k)[0].positions == (0, None, None)


def test_make_plan_checks_operand_shapes():
    q = np.zeros((2, 3, 4))
    with pytest.raises(ValueError):
        make_plan((2,), 3, 5, 4, 4, 1.0, np.float64, q=q, k=np.zeros((2, 6, 4)))


# ------------------------------------------------------------------ the common call

try:
    import ml_dtypes
except ImportError:
    ml_dtypes = None
needs_bf16 = pytest.mark.skipif(ml_dtypes is None, reason="ml_dtypes is not installed")

PLAIN_CASES = [  # (B, Hq, Hkv, Lq, Lk, E, Ev, dtype, causal, scale, layout)
    (1, 8, 2, 1, 700, 64, 64, np.float32, False, None, "transformers"),   # decode, GQA
    (2, 4, 4, 3, 65, 16, 24, np.float64, True, 0.3, "contiguous"),
    (1, 6, 3, 70, 70, 32, 32, np.float32, True, None, "transformers"),    # tiled
    (3, 2, 1, 5, 129, 8, 8, np.float64, False, 1.5, "transformers"),
    # the key-value-cache convention: a decoding step, a chunk of a prefill, and more
    # queries than keys (the first rows see none)
    (1, 8, 2, 1, 700, 64, 64, np.float32, "bottom_right", None, "transformers"),
    (2, 4, 2, 40, 300, 16, 16, np.float32, "bottom_right", 0.3, "contiguous"),
    (1, 2, 2, 9, 5, 8, 8, np.float64, "bottom_right", None, "contiguous"),
    # 16-bit: read in place, computed in float32, each row rounded once as written
    (1, 8, 2, 1, 700, 64, 64, np.float16, False, None, "transformers"),
    (2, 3, 3, 70, 90, 32, 16, np.float16, True, 0.2, "contiguous"),
    pytest.param((1, 8, 2, 1, 700, 64, 64, "bfloat16", False, None, "transformers"),
                 marks=needs_bf16),
    pytest.param((1, 6, 3, 70, 70, 32, 32, "bfloat16", True, None, "transformers"),
                 marks=needs_bf16),
    pytest.param((2, 2, 1, 65, 130, 6, 10, "bfloat16", False, 0.7, "contiguous"),
                 marks=needs_bf16),
]


def as_dtype(dtype):
    return np.dtype(ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype)


def assert_reference(got, arrays, dtype, **kw):
    """got against the float64 reference of q, k, v (``arrays``): 16-bit results
    within one rounding (half an ulp, and a little), others within assert_close's
    bound."""
    expected = reference.attention(*(x.astype(np.float64) for x in arrays), **kw)
    if dtype.itemsize == 2:
        ulp = 2.0 ** -7 if dtype.kind == "V" else 2.0 ** -10
        np.testing.assert_allclose(got.astype(np.float64), expected,
                                   atol=0.6 * ulp * np.abs(expected).max())
    else:
        assert_close(got, expected, dtype)


def plain_arrays(rng, B, Hq, Hkv, Lq, Lk, E, Ev, dtype, layout):
    dtype = as_dtype(dtype)

    def make(H, L, D):
        if layout == "contiguous":
            return rng.standard_normal((B, H, L, D)).astype(dtype)
        return rng.standard_normal((B, L, H, D)).astype(dtype).swapaxes(1, 2)
    return make(Hq, Lq, E), make(Hkv, Lk, E), make(Hkv, Lk, Ev)


@pytest.mark.parametrize("case", PLAIN_CASES)
def test_the_common_call_has_the_general_plan_and_bits(rng, case):
    """4-D arrays without mask, bias or variant take plain_plan: the same sizes,
    positions and operand addresses as the general plan, and the same bits."""
    B, Hq, Hkv, Lq, Lk, E, Ev, dtype, causal, scale, layout = case
    q, k, v = plain_arrays(rng, B, Hq, Hkv, Lq, Lk, E, Ev, dtype, layout)
    dtype = as_dtype(dtype)
    gqa = Hq != Hkv
    made = plain_plan(q, k, v, causal, scale, gqa, _dispatch.bf16_dot, _dispatch.amx)
    assert made is not None
    plan, out = made
    general, args = plan_of(q, k, v, causal=causal, scale=scale, enable_gqa=gqa)
    assert out.shape == (B, Hq, Lq, Ev) and out.dtype == args.result     # (16-bit too)
    assert (plan.sizes, plan.groups, plan.positions, plan.bottom_right, plan.dtype,
            plan.dot_kernel) == (general.sizes, general.groups, general.positions,
                                 general.bottom_right, general.dtype, general.dot_kernel)
    assert plan.bottom_right == (causal == "bottom_right")
    for name in ("q", "k", "v"):
        assert plan.operand(name)[0] == general.operand(name)[0]     # in place
    assert drivers.forward_path(plan)[0] == drivers.forward_path(general)[0]
    got = fastattn.attention(q, k, v, causal=causal, scale=scale, enable_gqa=gqa)
    want = _compute.attend(args, False, None, 2)                # the general path
    assert got.dtype == want.dtype == dtype and np.array_equal(
        got.view(np.uint8), want.view(np.uint8))
    assert_reference(got, (q, k, v), dtype, causal=causal, scale=scale, enable_gqa=gqa)


def test_every_other_call_takes_the_general_path(rng):
    """plain_plan says None (and the general path computes it, checks included) for
    anything but the common call."""
    q, k, v = plain_arrays(rng, 2, 4, 2, 3, 40, 8, 8, np.float32, "contiguous")
    assert plain_plan(q, k, v, False, None, True) is not None
    # causal="top_left" (the PyTorch operator's spelling) is causal=True
    top_left = plain_plan(q, k, v, "top_left", None, True)
    assert top_left is not None and top_left[0].positions == plain_plan(
        q, k, v, True, None, True)[0].positions

    class Sub(np.ndarray):
        pass

    unaligned = np.empty(q.nbytes + 1, np.uint8)[1:].view(np.float32).reshape(q.shape)
    unaligned[...] = q
    others = {
        "3-D arrays": (q[0], k[0], v[0], False, None, True),
        "5-D arrays": (q[None], k[None], v[None], False, None, True),
        "k broadcast over the batch": (q, k[:1], v[:1], False, None, True),
        "GQA without enable_gqa": (q, k, v, False, None, False),
        "float16 and float32": (q.astype(np.float16), k, v, False, None, True),
        "mixed dtypes": (q.astype(np.float64), k, v, False, None, True),
        "other byte order": (q.astype(">f4"), k.astype(">f4"), v.astype(">f4"), False,
                             None, True),
        "a strided last axis": (q[..., ::2], k[..., ::2], v, False, None, True),
        "unaligned": (unaligned, k, v, False, None, True),
        "a subclass": (q.view(Sub), k, v, False, None, True),
        "no keys": (q, k[:, :, :0], v[:, :, :0], False, None, True),
        "another causal kind": (q, k, v, "bottom-right", None, True),
        "a NumPy bool": (q, k, v, np.True_, None, True),
        "an integer scale": (q, k, v, False, 1, True),
    }
    for what, call in others.items():
        assert plain_plan(*call) is None, what
        qq, kk, vv, causal, scale, gqa = call
        if what == "GQA without enable_gqa":
            with pytest.raises(ValueError, match="do not broadcast"):
                fastattn.attention(qq, kk, vv)
            continue
        if what == "another causal kind":
            with pytest.raises(ValueError, match="causal"):
                fastattn.attention(qq, kk, vv, causal=causal, enable_gqa=gqa)
            continue
        got = fastattn.attention(qq, kk, vv, causal=causal, scale=scale, enable_gqa=gqa)
        expected = reference.attention(qq, kk, vv, causal=causal, scale=scale,
                                       enable_gqa=gqa)
        assert_close(got, expected, got.dtype)
    with pytest.raises(ValueError, match="the same last axis E"):
        fastattn.attention(q, k[..., :4], v, enable_gqa=True)


VARIANT_CASES = [  # (B, Hq, Hkv, Lq, Lk, dtype, causal, variants, layout)
    (1, 8, 2, 1, 700, np.float32, "bottom_right", dict(window=(255, 0)), "transformers"),
    (1, 8, 2, 1, 700, np.float32, "bottom_right", dict(window=[100, None]),
     "transformers"),
    (1, 8, 2, 4, 700, np.float32, "bottom_right", dict(window=(63, 0)), "contiguous"),
    (2, 4, 2, 70, 70, np.float32, True, dict(window=(16, 0)), "transformers"),  # tiled
    (2, 4, 2, 70, 90, np.float64, True, dict(window=(None, 3)), "contiguous"),
    (1, 2, 2, 33, 80, np.float64, False, dict(window=(5, 7)), "contiguous"),
    (1, 2, 1, 9, 40, np.float32, False, dict(window=(0, 0)), "transformers"),
    (1, 2, 1, 9, 40, np.float32, False, dict(window=(None, None)), "contiguous"),
    (1, 2, 1, 9, 40, np.float32, False, dict(window=(49, 2**80)), "contiguous"),
    (1, 2, 1, 9, 40, np.float32, "bottom_right", dict(window=(48, 48)), "contiguous"),
    (1, 8, 2, 1, 700, np.float16, "bottom_right", dict(window=(255, 0)), "transformers"),
    pytest.param((2, 4, 2, 70, 70, "bfloat16", True, dict(window=(16, 0)),
                  "transformers"), marks=needs_bf16),
    # Gemma 2's softcap, with and without its window
    (1, 8, 2, 1, 700, np.float32, "bottom_right", dict(window=(255, 0), softcap=2.5),
     "transformers"),
    (2, 4, 2, 70, 90, np.float64, True, dict(softcap=0.75), "contiguous"),
    (1, 2, 1, 9, 40, np.float32, False, dict(softcap=1e30), "contiguous"),
    pytest.param((2, 4, 2, 70, 70, "bfloat16", True, dict(softcap=3.0), "transformers"),
                 marks=needs_bf16),
    # a padded cache's lengths (int64 and int32; 0 keys, all of them, one)
    (3, 8, 2, 1, 300, np.float32, "bottom_right", dict(kv_lengths=[300, 0, 1]),
     "transformers"),
    (3, 4, 4, 70, 90, np.float64, False, dict(kv_lengths=np.array([5, 90, 64], np.int32)),
     "contiguous"),
    (2, 4, 2, 3, 129, np.float32, True,
     dict(kv_lengths=np.array([129, 64], np.int32), window=(20, 0)), "transformers"),
    pytest.param((2, 8, 2, 1, 300, "bfloat16", "bottom_right",
                  dict(kv_lengths=[17, 300], softcap=5.0), "transformers"),
                 marks=needs_bf16),
]


@pytest.mark.parametrize("case", VARIANT_CASES)
def test_a_window_softcap_or_lengths_take_the_short_path_with_the_general_bits(
        rng, case, monkeypatch):
    """A sliding window (None or a pair of Python ints, as a transformers layer passes
    it), a float softcap and the keys' lengths (an int array) keep the common call's
    short path: the general plan's positions, window and cap, the general path's
    bits, the reference's values."""
    B, Hq, Hkv, Lq, Lk, dtype, causal, variants, layout = case
    kw = dict(variants)
    if isinstance(kw.get("kv_lengths"), list):
        kw["kv_lengths"] = np.array(kw["kv_lengths"])
    q, k, v = plain_arrays(rng, B, Hq, Hkv, Lq, Lk, 16, 16, dtype, layout)
    dtype = as_dtype(dtype)
    made = plain_plan(q, k, v, causal, None, True, _dispatch.bf16_dot, _dispatch.amx,
                      **kw)
    assert made is not None
    general, args = plan_of(q, k, v, causal=causal, enable_gqa=True)
    var = _v.variants_of(args, **kw)
    general = _compute._plan(args, np.empty(args.shapes.batch + (Lq, 16),
                                            args.computation), var=var)
    assert made[0].positions == general.positions
    assert made[0].softcap == general.softcap == kw.get("softcap")
    assert drivers.forward_path(made[0]) == drivers.forward_path(general)
    taken = []

    def spy(*a, _real=_compute.plain_plan, **kw):
        made = _real(*a, **kw)
        taken.append(made is not None)
        return made if len(taken) == 1 else None

    monkeypatch.setattr(_compute, "plain_plan", spy)
    kw.update(causal=causal, enable_gqa=True)
    got = fastattn.attention(q, k, v, **kw)
    want = fastattn.attention(q, k, v, **kw)
    assert taken == [True, True]     # the first call took the short path, not the second
    assert got.dtype == want.dtype == dtype and np.array_equal(
        got.view(np.uint8), want.view(np.uint8))
    assert_reference(got, (q, k, v), dtype, **kw)


def test_other_windows_softcaps_and_lengths_take_the_general_path(rng):
    """A window, softcap or kv_lengths plain_plan does not take goes to the general
    path: NumPy numbers and lists (computed there), and every wrong one, refused
    there with its message."""
    q, k, v = plain_arrays(rng, 1, 2, 1, 5, 30, 8, 8, np.float32, "contiguous")
    side = np.int64(4)
    assert plain_plan(q, k, v, False, None, True, window=(side, 0)) is None
    got = fastattn.attention(q, k, v, window=(side, 0), enable_gqa=True)
    assert_close(got, reference.attention(q, k, v, window=(4, 0), enable_gqa=True),
                 np.float32)
    wrong = {(True, 0): (TypeError, "window's left side"),
             (-1, 0): (ValueError, "window's left side must be >= 0"),
             (1, 2, 3): (ValueError, "3 values"),
             "left": (TypeError, "window must be a pair"),
             (1.5, 0): (TypeError, "window's left side")}
    for window, (error, message) in wrong.items():
        assert plain_plan(q, k, v, False, None, True, window=window) is None
        with pytest.raises(error, match=message):
            fastattn.attention(q, k, v, window=window, enable_gqa=True)
    # softcaps: an int or a NumPy float computed there, every wrong one refused there
    for cap in (3, np.float64(3.0)):
        assert plain_plan(q, k, v, False, None, True, softcap=cap) is None
        np.testing.assert_array_equal(fastattn.attention(q, k, v, softcap=cap,
                                                         enable_gqa=True),
                                      fastattn.attention(q, k, v, softcap=3.0,
                                                         enable_gqa=True))
    for cap, (error, message) in {-1.0: (ValueError, "finite and > 0"),
                                  float("nan"): (ValueError, "finite and > 0"),
                                  1e-45: (ValueError, "outside the range"),
                                  True: (TypeError, "softcap must be")}.items():
        assert plain_plan(q, k, v, False, None, True, softcap=cap) is None
        with pytest.raises(error, match=message):
            fastattn.attention(q, k, v, softcap=cap, enable_gqa=True)
    # lengths: a list or int16 computed there, every wrong one refused there
    want = fastattn.attention(q, k, v, kv_lengths=np.array([7]), enable_gqa=True)
    for lengths in ([7], np.array([7], np.int16), np.array([7], np.uint32)):
        assert plain_plan(q, k, v, False, None, True, kv_lengths=lengths) is None
        np.testing.assert_array_equal(
            fastattn.attention(q, k, v, kv_lengths=lengths, enable_gqa=True), want)
    for lengths, (error, message) in {
            (31,): (ValueError, r"must lie in \[0, 30\]"),
            (-1,): (ValueError, r"must lie in \[0, 30\]"),
            (3, 4): (ValueError, r"must have shape \(B,\)"),
            (1.5,): (TypeError, "must hold integers")}.items():
        lengths = np.array(lengths)
        assert plain_plan(q, k, v, False, None, True, kv_lengths=lengths) is None
        with pytest.raises(error, match=message):
            fastattn.attention(q, k, v, kv_lengths=lengths, enable_gqa=True)


@pytest.mark.parametrize("case", PLAIN_CASES)
def test_the_common_backward_has_the_general_plan_and_bits(rng, case):
    """attention_backward's commonest call (plain_plan's arrays, grad_out and out
    C-contiguous in the computation dtype or q's, lse in the computation dtype) takes
    the short path: the general plan with lse and no output, the same gradient bits."""
    B, Hq, Hkv, Lq, Lk, E, Ev, dtype, causal, scale, layout = case
    q, k, v = plain_arrays(rng, B, Hq, Hkv, Lq, Lk, E, Ev, dtype, layout)
    gqa = Hq != Hkv
    out, lse = fastattn.attention(q, k, v, causal=causal, scale=scale, enable_gqa=gqa,
                                  return_lse=True)
    g = rng.standard_normal(out.shape).astype(out.dtype)
    made = plain_plan(q, k, v, causal, scale, gqa, _dispatch.bf16_dot, _dispatch.amx,
                      lse)
    assert made is not None and made[1] is None
    plan = made[0]
    general = _compute._plan(_v.attention_args(q, k, v, causal=causal, scale=scale,
                                               enable_gqa=gqa), None, lse)
    assert (plan.sizes, plan.groups, plan.positions, plan.bottom_right, plan.dtype,
            plan.dot_kernel) == (general.sizes, general.groups, general.positions,
                                 general.bottom_right, general.dtype, general.dot_kernel)
    assert plan.operand("lse")[0] == general.operand("lse")[0]     # in place
    assert plan.operand("out") is None
    kw = dict(causal=causal, scale=scale, enable_gqa=gqa)
    got = fastattn.attention_backward(g, q, k, v, out, lse, **kw)
    args = _v.attention_args(q, k, v, **kw)
    want = _compute.gradients(args, g, out, lse, 2, result=args.result)
    for a, b, x in zip(got, want, (q, k, v)):
        assert a.dtype == b.dtype == x.dtype and a.shape == x.shape
        assert np.array_equal(a.view(np.uint8), b.view(np.uint8))
    wide = [x.astype(np.float64) for x in (g, q, k, v, out, lse)]
    expected = reference.attention_backward(*wide, **kw)
    for a, ref in zip(got, expected):       # (16 bits: the rounded out and the result)
        tol = 1e-10 if a.dtype == np.float64 else 1e-4 if a.dtype == np.float32 else 2e-2
        np.testing.assert_allclose(a.astype(np.float64), ref,
                                   atol=tol * max(1, np.abs(ref).max()))


def test_every_other_backward_takes_the_general_path(rng):
    """The backward's short path says None for anything but its common call; the
    general path then computes it (or raises)."""
    q, k, v = plain_arrays(rng, 2, 4, 2, 3, 40, 8, 8, np.float32, "contiguous")
    out, lse = fastattn.attention(q, k, v, return_lse=True, enable_gqa=True)
    g = np.ones_like(out)
    common = (g, q, k, v, out, lse, False, None, True, None)
    assert _compute.gradients_plain(*common) is not None
    others = {
        "lse in float64": dict(lse=lse.astype(np.float64)),
        "lse not contiguous": dict(lse=np.asfortranarray(lse)),
        "grad_out in float64": dict(grad_out=g.astype(np.float64)),
        "grad_out not contiguous": dict(grad_out=np.asfortranarray(g)),
        "out as a list": dict(out=out.tolist()),
        "out in float16": dict(out=out.astype(np.float16)),
        "k and v shared by the batch": dict(k=k[0], v=v[0]),
    }
    names = ("grad_out", "q", "k", "v", "out", "lse")
    for what, change in others.items():
        call = dict(zip(names, common[:6]), **change)
        assert _compute.gradients_plain(*call.values(), False, None, True, None) is None, what
        got = fastattn.attention_backward(*call.values(), enable_gqa=True)
        wide = [np.asarray(x, dtype=np.float64) for x in call.values()]
        for a, ref in zip(got, reference.attention_backward(*wide, enable_gqa=True)):
            np.testing.assert_allclose(a, ref, rtol=1e-3, atol=1e-3)
    with pytest.raises(ValueError, match="lse has shape"):
        fastattn.attention_backward(g, q, k, v, out, lse[..., None], enable_gqa=True)

# -------------------------------------------------------------------- the path choice

def test_path_choice_and_its_constants():
    c = drivers.PATH_CONSTANTS
    assert c["QUERY_TILE"] == SIZES["QUERY_TILE"]
    q = np.zeros((8, c["DECODE_ROWS"], 16))
    k = np.zeros((8, 4096, 16))
    path = drivers.forward_path(plan_of(q, k, k)[0])
    assert path[0] == "decode"
    assert path[3] >= c["SPLIT_ITEMS"]      # few slices: the keys are split
    q = np.zeros((8, c["DECODE_ROWS"] + 1, 16))
    # 8 query tiles: 4096 keys in 4 pieces of 1024 (TILE_SPLIT_MIN_KEYS) for 32 items
    assert drivers.forward_path(plan_of(q, k, k)[0]) == ("tiled", 1024, 32)
    k = np.zeros((64, 4096, 16))                # SPLIT_ITEMS tiles or more: no split
    q = np.zeros((64, c["DECODE_ROWS"] + 1, 16))
    assert drivers.forward_path(plan_of(q, k, k)[0]) == ("tiled", 4096, 64)


@pytest.mark.parametrize("slices,Lq,Lk", [(1, 64, 16384), (1, 200, 9000), (2, 64, 4096),
                                          (3, 130, 100000), (8, 64, 2047), (5, 64, 2048),
                                          (31, 5, 70000), (1, 64, 1024 * 40 + 1)])
def test_few_query_tiles_split_their_keys_for_sixteen_threads(slices, Lq, Lk):
    """Fewer than SPLIT_ITEMS (slice, query tile) items: the keys are split into pieces
    of at least TILE_SPLIT_MIN_KEYS keys, multiples of KEY_BLOCK, until there are
    SPLIT_ITEMS items (16 threads get two each) or the pieces reach that minimum; a
    rule of the shapes alone (so the bits do not depend on the threads)."""
    c = drivers.PATH_CONSTANTS
    tiles = slices * -(-Lq // c["QUERY_TILE"])
    q = np.zeros((slices, Lq, 8), np.float32)
    k = np.zeros((slices, Lk, 8), np.float32)
    kind, chunk, items = drivers.forward_path(plan_of(q, k, k)[0])
    pieces = -(-Lk // chunk)
    assert kind == "tiled" and items == tiles * pieces
    if Lk < 2 * c["TILE_SPLIT_MIN_KEYS"]:
        assert pieces == 1
        return
    assert chunk % c["KEY_BLOCK"] == 0 and chunk >= c["TILE_SPLIT_MIN_KEYS"]
    assert (pieces - 1) * chunk < Lk <= pieces * chunk
    # as many pieces as SPLIT_ITEMS asks for, unless they would get too short; the
    # pieces are rounded up to whole key blocks, which may leave one piece fewer
    want = min(-(-c["SPLIT_ITEMS"] // tiles), Lk // c["TILE_SPLIT_MIN_KEYS"])
    assert want - 1 <= pieces <= want
    assert chunk - c["KEY_BLOCK"] < -(-Lk // want) <= chunk
    if Lk >= 32 * c["TILE_SPLIT_MIN_KEYS"]:
        assert items >= 16          # every one of 16 threads has work


def test_backward_chunks_depend_only_on_the_shapes():
    keys, chunks = drivers.backward_chunks(1000, 1)
    assert keys % KEY_BLOCK == 0 and (chunks - 1) * keys < 1000 <= chunks * keys
    assert drivers.backward_chunks(0, 4)[1] == 0
    assert drivers.backward_chunks(64 * 100, 64) == (64 * 100, 1)


# ------------------------------------------------------- NaN behind an underflowed key

@pytest.mark.parametrize("dtype,scores", [(np.float32, (0.0, 55.0, 110.0)),
                                          (np.float64, (0.0, 400.0, 800.0))])
@pytest.mark.parametrize("Lq", [1, 3, 70])          # the decode path and the tiles
@pytest.mark.parametrize("layout", ["one_block", "nan_with_middle", "all_apart",
                                    "middle_first"])
def test_a_nan_value_behind_an_underflowed_weight_never_reaches_the_row(dtype, scores,
                                                                        Lq, layout):
    """Key a holds NaN in v and scores 0; b scores 55 (float32) and c 110. Against the
    row's maximum (110) the weight of a, exp(-110), underflows to 0, so NaN must not
    reach the row, wherever the three keys sit among the key blocks (64 keys in a
    tile, DECODE_KEYS on the decode path; it used to reach it when a and b shared a
    block and c came later)."""
    decode = Lq <= drivers.PATH_CONSTANTS["DECODE_ROWS"]
    block = SIZES["DECODE_KEYS"] if decode else KEY_BLOCK
    Lk = 3 * block
    a, b, c = {"one_block": (1, 2, 3), "nan_with_middle": (1, 2, block + 5),
               "all_apart": (0, block + 1, 2 * block + 1),
               "middle_first": (block + 3, 0, 2 * block + 7)}[layout]
    q = np.zeros((Lq, 4), dtype)
    k = np.zeros((Lk, 4), dtype)
    v = np.ones((Lk, 2), dtype)
    v[b] = 2.0
    v[c] = 3.0
    v[a] = np.nan
    bias = np.full((Lq, Lk), -np.inf, dtype)
    bias[:, a], bias[:, b], bias[:, c] = scores
    out, lse = fastattn.attention(q, k, v, bias=bias, return_lse=True)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, 3.0, rtol=1e-6)
    np.testing.assert_allclose(lse, scores[2], rtol=1e-6)
    # a weight that does not underflow (without c) lets it through, in every layout
    bias[:, c] = -np.inf
    assert np.isnan(fastattn.attention(q, k, v, bias=bias)).all()


@pytest.mark.parametrize("a,b,c", [(1, 1030, 2100), (2100, 1, 1030), (1030, 2100, 5),
                                   (3000, 2990, 2050)])
def test_a_nan_value_behind_an_underflowed_weight_in_split_keys(a, b, c):
    """The same rule when the tiled path splits the keys (70 query rows: 2 tiles, so
    3100 keys go in 3 pieces): the NaN, the middle and the largest score in pieces of
    their own or together, in every order; each piece's partial result is merged, and
    a row whose merge is not finite is redone by the exact rule."""
    Lq, Lk = 70, 3100
    q = np.zeros((Lq, 4), np.float32)
    k = np.zeros((Lk, 4), np.float32)
    assert drivers.forward_path(plan_of(q, k, k)[0]) == ("tiled", 1088, 6)
    v = np.ones((Lk, 2), np.float32)
    v[b], v[c], v[a] = 2.0, 3.0, np.nan
    bias = np.full((Lq, Lk), -np.inf, np.float32)
    bias[:, a], bias[:, b], bias[:, c] = 0.0, 55.0, 110.0
    bias[7] = -np.inf                   # a row with no allowed key: zeros, lse -inf
    out, lse = fastattn.attention(q, k, v, bias=bias, return_lse=True)
    rows = np.arange(Lq) != 7
    np.testing.assert_allclose(out[rows], 3.0, rtol=1e-6)
    np.testing.assert_allclose(lse[rows], 110.0, rtol=1e-6)
    assert (out[7] == 0).all() and lse[7] == -np.inf
    bias[:, c] = -np.inf
    out = fastattn.attention(q, k, v, bias=bias)
    assert np.isnan(out[rows]).all() and (out[7] == 0).all()


SPLIT_VARIANTS = {
    "plain": {},
    "causal top-left": dict(causal=True),
    "causal bottom-right": dict(causal="bottom_right"),
    "window": dict(causal="bottom_right", window=(700, 30)),
    "mask": "mask",
    "bias": "bias",
    "softcap": dict(softcap=3.0),
    "alibi": dict(alibi_slopes=np.array([0.01, 0.002])),
    "lengths": dict(q_lengths=np.array([70, 9]), kv_lengths=np.array([4100, 1500]),
                    causal="bottom_right"),
    "dropout": dict(dropout_p=0.2, dropout_seed=11),
    "nan and inf values": "nan",
}


@pytest.mark.parametrize("variant", list(SPLIT_VARIANTS))
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
def test_split_keys_match_float64_with_every_variant(rng, variant, dtype):
    """Few query tiles (2 batches, 2 query heads on 1 key-value head, 70 rows: 8
    tiles) over 4100 keys: the tiled path splits the keys in 4 pieces (the last one
    short) and merges them. out and lse against the float64 reference with every
    variant, rows with no allowed key included (mask, lengths), NaN and inf values
    reaching exactly the rows that see them, and the same bits at 1, 2 and 3
    threads."""
    B, H, Hkv, Lq, Lk, E = 2, 2, 1, 70, 4100, 16
    q = rng.standard_normal((B, H, Lq, E)).astype(dtype)
    k = rng.standard_normal((B, Hkv, Lk, E)).astype(dtype)
    v = rng.standard_normal((B, Hkv, Lk, E)).astype(dtype)
    kw = SPLIT_VARIANTS[variant]
    if kw == "mask":
        mask = rng.random((B, 1, Lq, Lk)) < 0.3
        mask[0, 0, 5] = False                           # a row with no allowed key
        mask[1, 0, :, 1000:3000] = False                # pieces with nothing allowed
        kw = dict(mask=mask)
    elif kw == "bias":
        kw = dict(bias=rng.standard_normal((1, H, Lq, Lk)).astype(dtype))
    elif kw == "nan":       # rows 0-50 see key 3380, row 69 alone key 4099 (window)
        v[0, 0, 3380, 3] = np.nan
        v[1, 0, 4099, 5] = np.inf
        kw = dict(causal="bottom_right", window=(700, 0))
    kw = dict(kw, enable_gqa=True)
    plan, _ = plan_of(q, k, v, **{x: y for x, y in kw.items()
                                  if x in ("mask", "bias", "causal", "enable_gqa")})
    assert drivers.forward_path(plan) == ("tiled", 1088, 32)
    out, lse = fastattn.attention(q, k, v, return_lse=True, num_threads=2, **kw)
    want, want_lse = reference.attention(*(x.astype(np.float64) for x in (q, k, v)),
                                         return_lse=True, **kw)
    assert_close(out, want, dtype)
    assert_close(lse, want_lse, dtype, scale=max(1.0, np.abs(want_lse[np.isfinite(
        want_lse)]).max()))
    for threads in (1, 3):
        again, again_lse = fastattn.attention(q, k, v, return_lse=True,
                                              num_threads=threads, **kw)
        np.testing.assert_array_equal(again, out)
        np.testing.assert_array_equal(again_lse, lse)


@pytest.mark.parametrize("Lq", [2, 130])
def test_rows_that_cannot_see_a_nan_value_are_untouched(rng, Lq):
    q = rng.standard_normal((Lq, 8))
    k = rng.standard_normal((200, 8))
    v = rng.standard_normal((200, 8))
    clean = fastattn.attention(q, k, v, causal=True)
    v[150] = np.inf
    out = fastattn.attention(q, k, v, causal=True)
    sees = np.arange(Lq) >= 150
    np.testing.assert_array_equal(out[~sees], clean[~sees])
    assert (~np.isfinite(out[sees])).all()


# --------------------------------------------------------------------------- Ctrl-C

INTERRUPT = textwrap.dedent("""
    import os, signal, sys, threading, numpy as np, fastattn
    what = sys.argv[1]
    # a process started in the background by a shell inherits SIGINT ignored, and
    # Python then installs no handler: install the usual one
    signal.signal(signal.SIGINT, signal.default_int_handler)
    rng = np.random.default_rng(0)
    # a call of minutes on two cores; Ctrl-C arrives one second into it
    q = rng.standard_normal((4, 32768, 64)).astype(np.float32)
    threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT)).start()
    try:
        if what == "forward":
            fastattn.attention(q, q, q, num_threads=2)
        else:
            out = np.zeros_like(q)
            lse = np.zeros(q.shape[:-1], np.float32)
            fastattn.attention_backward(out, q, q, q, out, lse, num_threads=2)
    except KeyboardInterrupt:
        small = rng.standard_normal((2, 70, 8))
        ok = np.allclose(fastattn.attention(small, small, small),
                         fastattn.reference.attention(small, small, small))
        print("interrupted", ok)
        sys.exit(0)
    print("finished")
""")


@pytest.mark.parametrize("what", ["forward", "backward"])
def test_ctrl_c_interrupts_a_long_call(what, tmp_path):
    """SIGINT one second into a call of minutes raises KeyboardInterrupt promptly (the
    drivers look for pending signals between work items); the next call works."""
    # outside the source tree, whose fastattn/ (not built) would shadow the installed one
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(fastattn.__file__)))
    res = subprocess.run([sys.executable, "-c", INTERRUPT, what], capture_output=True,
                         text=True, timeout=600, cwd=tmp_path, env=env)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.split() == ["interrupted", "True"], res.stdout + res.stderr


# ------------------------------------------------------------------ the micro-GEMM

@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_micro_gemm_on_every_edge(rng, dtype):
    """weighted_sum is one gemm() call per tile: rows 1..17 (whole micro-tiles, one or
    two rows left, more left), columns around every multiple of the vector width, and
    a transposed (strided) p, against float64 NumPy."""
    for m in (1, 2, 3, 5, 8, 9, 10, 17, 64, 65):
        for ev in (1, 7, 16, 31, 32, 33, 64, 70):
            p = rng.standard_normal((m, 13)).astype(dtype)
            v = rng.standard_normal((13, ev)).astype(dtype)
            want = p.astype(np.float64) @ v.astype(np.float64)
            assert_close(fastattn.weighted_sum(p, v), want, dtype)
            pt = np.ascontiguousarray(p.T).T             # columns of p unit-stride
            assert_close(fastattn.weighted_sum(pt, v), want, dtype)
