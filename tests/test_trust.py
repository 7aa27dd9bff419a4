"""Regression tests for answers that used to be silently wrong, one per finding: attention
sinks on every path, the rule for NaN and inf values behind weights that underflow,
out= overlapping the per-head arrays, softcaps outside the computable range, nested
calls from signal handlers, Ctrl-C inside long work items.

Oracles: fastattn.reference (plain NumPy, float64 where it matters) and hand values.
"""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import fastattn
from fastattn import reference

from helpers import assert_close, randn, rounded_weights_bound

FLOATS = [np.float32, np.float64]


def close(a, b, dtype, scale=1.0):
    """Equal NaN positions, and finite values within the dtype's tolerance."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    np.testing.assert_array_equal(np.isnan(a), np.isnan(b))
    fin = np.isfinite(b)
    np.testing.assert_array_equal(np.isfinite(a), fin)
    assert_close(np.where(fin, a, 0), np.where(fin, b, 0), dtype, scale=scale)


# ------------------------------------------------------------------ attention sinks
#
# Shapes that take each path of the forward: the tiled pass (one and several tiles),
# the tiled pass with its keys split into pieces (few tiles, many keys), the decode
# path, and the decode path split along the keys.

PATHS = {
    "tiled": (2, 3, 70, 150, 16),
    "tiled-split": (1, 1, 64, 4096, 16),
    "decode": (2, 4, 3, 300, 8),
    "decode-split": (1, 2, 1, 3000, 32),
}

VARIANTS = {
    "none": {},
    "causal-br": dict(causal="bottom_right"),
    "window": dict(causal=True, window=(20, 3)),
    "lengths": dict(q_lengths=[2, 1], kv_lengths=[100, 3]),
    "softcap-alibi": dict(softcap=4.0, alibi_slopes=[0.5]),
    "dropout": dict(dropout_p=0.3, dropout_seed=11),
}


def sink_case(rng, path, variant, dtype):
    B, H, Lq, Lk, E = PATHS[path]
    q, k, v = (randn(rng, (B, H, L, E), dtype) for L in (Lq, Lk, Lk))
    kw = dict(VARIANTS[variant])
    for name in ("q_lengths", "kv_lengths"):
        if name in kw:
            kw[name] = np.minimum(np.array(kw[name] * B)[:B],
                                  Lq if name == "q_lengths" else Lk)
    if "alibi_slopes" in kw:
        kw["alibi_slopes"] = np.resize(kw["alibi_slopes"], H)
    # about as heavy as all the keys together, so that it shows in every row
    sinks = (rng.standard_normal(H) + np.log(Lk)).astype(dtype)
    return q, k, v, sinks, kw


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("path", list(PATHS))
def test_sinks_on_every_path(rng, path, variant, dtype):
    """out and lse with sinks against the reference on every path of the forward,
    with every variant; the same bits on one thread as on two."""
    q, k, v, sinks, kw = sink_case(rng, path, variant, dtype)
    out, lse = fastattn.attention(q, k, v, sinks=sinks, return_lse=True, **kw)
    want, want_lse = reference.attention(q, k, v, sinks=sinks, return_lse=True, **kw)
    close(out, want, dtype, scale=4.0)
    close(lse, want_lse, dtype, scale=10.0)
    out1 = fastattn.attention(q, k, v, sinks=sinks, num_threads=1, **kw)
    np.testing.assert_array_equal(out1, out)
    # the sink changes the answer (a sink ignored would pass the checks above only
    # if the reference ignored it too)
    plain = reference.attention(q, k, v, **kw)
    assert np.abs(np.nan_to_num(plain - want)).max() > 1e-3


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("variant", ["none", "window", "lengths", "dropout"])
@pytest.mark.parametrize("path", ["tiled", "decode"])
def test_sink_gradients(rng, path, variant, dtype):
    """dq, dk, dv and dsinks against the reference; dsinks also against a central
    difference of the loss sum(out * grad_out) in float64."""
    q, k, v, sinks, kw = sink_case(rng, path, variant, dtype)
    out, lse = fastattn.attention(q, k, v, sinks=sinks, return_lse=True, **kw)
    go = randn(rng, out.shape, dtype)
    grads = fastattn.attention_backward(go, q, k, v, out, lse, sinks=sinks, **kw)
    want = reference.attention_backward(go, q, k, v, out, lse, sinks=sinks, **kw)
    assert len(grads) == 4 and grads[3].shape == sinks.shape
    for g, w in zip(grads, want):
        close(g, w, dtype, scale=8.0)
    if dtype == np.float64:
        eps = 1e-6
        for h in range(len(sinks)):
            up, down = sinks.copy(), sinks.copy()
            up[h] += eps
            down[h] -= eps
            diff = (np.sum(reference.attention(q, k, v, sinks=up, **kw) * go)
                    - np.sum(reference.attention(q, k, v, sinks=down, **kw) * go))
            np.testing.assert_allclose(grads[3][h], diff / (2 * eps), rtol=1e-5,
                                       atol=1e-8)


def test_sinks_broadcast_and_their_gradient_sums(rng):
    """sinks (1, H) against a batch of 2: the gradient is summed over the batch."""
    q, k, v = (randn(rng, (2, 3, 9, 8), np.float64) for _ in range(3))
    sinks = randn(rng, (1, 3), np.float64)
    out, lse = fastattn.attention(q, k, v, sinks=sinks, return_lse=True)
    go = randn(rng, out.shape, np.float64)
    g = fastattn.attention_backward(go, q, k, v, out, lse, sinks=sinks)
    w = reference.attention_backward(go, q, k, v, out, lse, sinks=sinks)
    assert g[3].shape == (1, 3)
    np.testing.assert_allclose(g[3], w[3], rtol=1e-10)


def test_sink_rows_with_no_key_and_padding_rows(rng):
    """A row whose keys are all blocked gives zeros and lse = sink; a padding row
    (q_lengths) stays zeros with lse = -inf: the sink is no key."""
    q, k, v = (randn(rng, (1, 2, 6, 4), np.float64) for _ in range(3))
    mask = np.ones((6, 6), bool)
    mask[2] = False
    sinks = np.array([0.7, -2.0])
    out, lse = fastattn.attention(q, k, v, mask=mask, sinks=sinks, q_lengths=[5],
                                  return_lse=True)
    assert (out[0, :, 2] == 0).all()
    np.testing.assert_array_equal(lse[0, :, 2], sinks)
    assert (out[0, :, 5] == 0).all() and (lse[0, :, 5] == -np.inf).all()
    w = fastattn.attention_weights(q, k, mask=mask, sinks=sinks, q_lengths=[5])
    np.testing.assert_allclose(w[0, :, :5].sum(-1),
                               1 - np.exp(sinks[:, None] - lse[0, :, :5]), atol=1e-12)
    assert (w[0, :, 5] == 0).all()


@pytest.mark.parametrize("path", list(PATHS))
def test_nan_and_inf_sinks_give_nan_rows_and_minus_inf_is_none(rng, path):
    q, k, v, _, _ = sink_case(rng, path, "none", np.float64)
    H = q.shape[1]
    plain, plain_lse = fastattn.attention(q, k, v, return_lse=True)
    for bad in (np.nan, np.inf):
        sinks = np.zeros(H)
        sinks[0] = bad
        out, lse = fastattn.attention(q, k, v, sinks=sinks, return_lse=True)
        assert np.isnan(out[:, 0]).all() and np.isnan(lse[:, 0]).all()
        assert np.isfinite(out[:, 1:]).all()
        want, want_lse = reference.attention(q, k, v, sinks=sinks, return_lse=True)
        close(out, want, np.float64)
        close(lse, want_lse, np.float64)
    out, lse = fastattn.attention(q, k, v, sinks=np.full(H, -np.inf), return_lse=True)
    np.testing.assert_array_equal(out, plain)
    np.testing.assert_array_equal(lse, plain_lse)


def test_sinks_in_attention_varlen(rng):
    """Per (sequence, head) sinks of a packed batch, forward and backward, against the
    reference."""
    cu = np.array([0, 3, 3, 70, 72])
    q = randn(rng, (72, 4, 8), np.float64)
    k = randn(rng, (72, 2, 8), np.float64)
    v = randn(rng, (72, 2, 6), np.float64)
    sinks = randn(rng, (4, 4), np.float64)
    out, lse = fastattn.attention_varlen(q, k, v, cu, cu, causal=True, sinks=sinks,
                                         return_lse=True)
    want, want_lse = reference.attention_varlen(q, k, v, cu, cu, causal=True,
                                                sinks=sinks, return_lse=True)
    close(out, want, np.float64)
    close(lse, want_lse, np.float64)
    go = randn(rng, out.shape, np.float64)
    g = fastattn.attention_varlen_backward(go, q, k, v, out, lse, cu, cu, causal=True,
                                           sinks=sinks)
    w = reference.attention_varlen_backward(go, q, k, v, out, lse, cu, cu, causal=True,
                                            sinks=sinks)
    for a, b in zip(g, w):
        close(a, b, np.float64)


@pytest.mark.parametrize("bad, error", [
    (np.zeros(5), ValueError),              # not the query heads
    (np.zeros((3, 3)), ValueError),         # an extra leading axis
    (np.array([True, False, True]), TypeError),
    (np.array(["a", "b", "c"]), TypeError),
])
def test_bad_sinks_are_refused_naming_them(rng, bad, error):
    q = randn(rng, (2, 3, 4, 8), np.float64)
    with pytest.raises(error, match="sinks"):
        fastattn.attention(q, q, q, sinks=bad)


# ------------------------------------- NaN and inf values behind weights that underflow

GAPS = {np.float32: (87.0, 87.7), np.float64: (708.0, 708.8)}


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("Lq, Lk", [(70, 200), (64, 4096), (3, 200), (1, 3000)])
@pytest.mark.parametrize("with_sink", [False, True])
def test_nan_value_reaches_exactly_when_its_weight_is_normal(dtype, Lq, Lk, with_sink):
    """Key 0 holds the row's maximum (score 0; with a sink, the sink is 0 and every key
    lies below it); a key with a NaN value sits `gap` below it. Just inside the
    dtype's normal range its weight counts and the row is NaN; just outside it counts
    as 0 and the row is finite: in the kernels on every path (tiled, split, decode)
    and in the reference alike."""
    inside, outside = GAPS[dtype]
    for gap, reaches in ((inside, True), (outside, False)):
        for j in (1, 63, 64, Lk - 1):
            q = np.zeros((1, 1, Lq, 4), dtype)
            k = np.zeros((1, 1, Lk, 4), dtype)
            v = np.ones((1, 1, Lk, 3), dtype)
            bias = np.full((Lq, Lk), -1000.0, dtype)
            bias[:, 0] = -1.0 if with_sink else 0.0
            bias[:, j] = -gap
            v[0, 0, j, 0] = np.nan
            kw = dict(bias=bias, scale=1.0)
            if with_sink:
                kw["sinks"] = np.zeros(1, dtype)
            out = fastattn.attention(q, k, v, **kw)
            want = reference.attention(q, k, v, **kw)
            assert np.isnan(out[..., 0]).all() == reaches, (gap, j)
            assert np.isnan(want[..., 0]).all() == reaches, (gap, j)
            assert np.isfinite(out[..., 1:]).all()
            close(out, want, dtype)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("Lq, Lk", [(70, 200), (64, 4096), (1, 3000)])
def test_huge_value_behind_a_weight_below_the_normal_range_adds_nothing(dtype, Lq, Lk):
    """The same rule for a finite value: a key `gap` below the row's maximum whose value
    is near the dtype's largest. Just inside the normal range its weight times the
    value adds about 5 to the row (about 2 in float64); just outside it the weight
    counts as 0, not as the subnormal it would be, and the row is the maximum key's
    value, 1: in the kernels on every path and in the reference alike."""
    inside, outside = GAPS[dtype]
    huge = 3e38 if dtype == np.float32 else 1e308
    for gap, adds in ((inside, True), (outside, False)):
        for j in (1, 63, Lk - 1):
            q = np.zeros((1, 1, Lq, 4), dtype)
            k = np.zeros((1, 1, Lk, 4), dtype)
            v = np.ones((1, 1, Lk, 3), dtype)
            bias = np.full((Lq, Lk), -1000.0, dtype)
            bias[:, 0] = 0.0
            bias[:, j] = -gap
            v[0, 0, j, 0] = huge
            out = fastattn.attention(q, k, v, bias=bias, scale=1.0)
            want = reference.attention(q, k, v, bias=bias, scale=1.0)
            assert (want[..., 0] > 1.5).all() == adds, (gap, j)
            assert (out[..., 0] > 1.5).all() == adds, (gap, j)
            close(out, want, dtype)


# --------------------------------------------------------------- out= overlapping inputs

@pytest.mark.parametrize("name", ["alibi_slopes", "sinks"])
def test_out_overlapping_a_per_head_array_is_detected(rng, name):
    """out= sharing memory with alibi_slopes or sinks: computed into a fresh buffer and
    copied, as for q, k, v, mask and bias (it used to be read while being written)."""
    q, k, v = (randn(rng, (1, 4, 8, 16), np.float64) for _ in range(3))
    out = np.zeros((1, 4, 8, 16))
    per_head = out[0, :, 0, 0]            # a view into out: (4,), stride 16 * 8
    per_head[:] = [0.5, 0.25, 2.0, 1.0]
    copy = per_head.copy()
    want = reference.attention(q, k, v, **{name: copy})
    got = fastattn.attention(q, k, v, out=out, **{name: per_head})
    assert got is out
    assert_close(out, want, np.float64)


# ------------------------------------------------------------------------- softcap

@pytest.mark.parametrize("dtype, cap", [
    (np.float32, 1e39), (np.float32, 1e300), (np.float32, 1e-300), (np.float32, 1e-39),
    (np.float64, 1e-310), (np.float64, 1e308),
    ("bfloat16", 1e39), ("float16", 1e-300)])
def test_softcap_outside_the_computable_range_is_refused(rng, dtype, cap):
    if dtype == "bfloat16":
        dtype = pytest.importorskip("ml_dtypes").bfloat16
    q = randn(rng, (1, 2, 8, 16), np.float32).astype(dtype)
    with pytest.raises(ValueError, match="softcap.*range"):
        fastattn.attention(q, q, q, softcap=cap)


@pytest.mark.parametrize("dtype, cap", [
    (np.float32, 1.2e-38), (np.float32, 8e37), (np.float64, 2.3e-308), (np.float64, 4e307),
    (np.float32, 1e-20), (np.float64, 1e200)])
def test_softcap_at_the_ends_of_the_range_is_computed(rng, dtype, cap):
    """The extremes that are accepted give what the reference (float64) gives: a tiny
    cap makes every score +-cap (all keys equal), a huge one changes nothing."""
    q, k, v = (randn(rng, (1, 2, 70, 16), np.float64) for _ in range(3))
    want = reference.attention(q, k, v, softcap=float(cap))
    got = fastattn.attention(q.astype(dtype), k.astype(dtype), v.astype(dtype),
                             softcap=cap)
    assert np.isfinite(got).all()
    assert_close(got, want, dtype, scale=4.0)


# ----------------------------------------------------- calls from a signal handler

NESTED = textwrap.dedent("""
    import signal, sys, numpy as np, fastattn
    dtype = np.dtype(sys.argv[1])
    rng = np.random.default_rng(0)
    # two query tiles against 2**18 keys: the keys are split into pieces whose partial
    # results live in the calling thread's kept scratch until they are merged
    q = rng.standard_normal((1, 2, 64, 64)).astype(dtype)
    k = rng.standard_normal((1, 2, 2**18, 64)).astype(dtype)
    calls = []

    def handler(signum, frame):
        # the same call in the middle of the outer one (the same scratch); the timer
        # is armed again once it is done (no handler inside a handler), three times
        # at most (each nested call costs a whole outer call: slow builds stay bounded)
        calls.append(fastattn.attention(q, k, k, num_threads=2).sum())
        if len(calls) < 3:
            signal.setitimer(signal.ITIMER_REAL, 0.01)

    want = fastattn.attention(q, k, k, num_threads=2)
    signal.signal(signal.SIGALRM, handler)
    signal.setitimer(signal.ITIMER_REAL, 0.01)
    for _ in range(5):
        got = fastattn.attention(q, k, k, num_threads=2)
        if not np.array_equal(got, want):
            print("corrupted", len(calls))
            break
    else:
        print("same", len(calls) > 0)
    signal.setitimer(signal.ITIMER_REAL, 0)
""")


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_a_call_from_a_signal_handler_leaves_the_outer_call_alone(dtype, tmp_path):
    """A handler that calls fastattn while a long call runs (handlers run between the
    drivers' work items) must not touch the outer call's scratch: the outer result is
    the same bits as without the handler (it used to be off by up to 5e33)."""
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(fastattn.__file__)))
    res = subprocess.run([sys.executable, "-c", NESTED, dtype], capture_output=True,
                         text=True, timeout=600, cwd=tmp_path, env=env)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.split() == ["same", "True"], res.stdout + res.stderr


# ------------------------------------------------------ Ctrl-C inside long work items

PROMPT = textwrap.dedent("""
    import os, signal, sys, threading, time, numpy as np, fastattn
    what = sys.argv[1]
    signal.signal(signal.SIGINT, signal.default_int_handler)
    rng = np.random.default_rng(0)
    if what == "few-rows":          # decode path: 2 query rows, 2**36 broadcast keys
        q = rng.standard_normal((2, 64)).astype(np.float32)
        k = np.broadcast_to(q[:1], (2**36, 64))
        call = lambda: fastattn.attention(q, k, k, num_threads=2)
    elif what == "tile-rows":       # tiled path: one tile against 2**34 broadcast keys
        q = rng.standard_normal((64, 64)).astype(np.float32)
        k = np.broadcast_to(q[:1], (2**34, 64))
        call = lambda: fastattn.attention(q, k, k, num_threads=2)
    else:                           # E = Ev = 0 with the lse over 2**40 keys
        q = np.zeros((3, 0), np.float32)
        k = np.broadcast_to(np.zeros((1, 0), np.float32), (2**40, 0))
        call = lambda: fastattn.attention(q, k, k, scale=1.0, return_lse=True,
                                          num_threads=2)
    threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT)).start()
    start = time.monotonic()
    try:
        call()
        print("finished")
    except KeyboardInterrupt:
        print("interrupted", time.monotonic() - start < 30)
""")


@pytest.mark.parametrize("what", ["few-rows", "tile-rows", "no-columns"])
def test_ctrl_c_inside_a_long_work_item(what, tmp_path):
    """Work items with a huge number of keys (hours each) look for Ctrl-C between
    their key blocks: interrupted one second in, the call ends within seconds (it
    used to go on for more than 20 s, up to hours)."""
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(fastattn.__file__)))
    res = subprocess.run([sys.executable, "-c", PROMPT, what], capture_output=True,
                         text=True, timeout=300, cwd=tmp_path, env=env)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.split() == ["interrupted", "True"], res.stdout + res.stderr


# ----------------------------------------------- packed batches: one parallel region

def packed(rng, lengths_q, lengths_k, Hq, Hkv, E, Ev, dtype):
    cu_q = np.concatenate([[0], np.cumsum(lengths_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lengths_k)]).astype(np.int64)
    q = randn(rng, (int(cu_q[-1]), Hq, E), np.float32).astype(dtype)
    k = randn(rng, (int(cu_k[-1]), Hkv, E), np.float32).astype(dtype)
    v = randn(rng, (int(cu_k[-1]), Hkv, Ev), np.float32).astype(dtype)
    return q, k, v, cu_q, cu_k


def test_attention_varlen_runs_one_plan(rng, monkeypatch):
    """All sequences of a packed batch are one plan in one parallel region (5 000
    sequences of a few tokens took one region each: 5x the padded batch's time)."""
    from fastattn import _compute
    calls = []
    real = _compute.drivers.attention
    monkeypatch.setattr(_compute.drivers, "attention",
                        lambda plan, threads: calls.append(plan) or real(plan, threads))
    lens = rng.integers(0, 6, 500)
    q, k, v, cu_q, cu_k = packed(rng, lens, lens, 2, 2, 8, 8, np.float32)
    out = fastattn.attention_varlen(q, k, v, cu_q, cu_k, causal=True)
    assert len(calls) == 1
    close(out, reference.attention_varlen(q, k, v, cu_q, cu_k, causal=True), np.float32)


VARLEN_CASES = {
    "decode": ([1, 3, 0, 4, 2], [700, 40, 5, 0, 3000]),        # every row <= 4: decode
    "tiled": ([70, 1, 0, 130, 64], [70, 300, 2, 130, 64]),
    "split": ([64, 3], [5000, 20]),                            # few tiles, long keys
    "ragged": ([1, 200, 7, 65], [1, 200, 9, 600]),
}


@pytest.mark.parametrize("dtype", [np.float32, np.float64, "bfloat16", np.float16])
@pytest.mark.parametrize("case", list(VARLEN_CASES))
@pytest.mark.parametrize("kw", [dict(causal=True), dict(causal="bottom_right"),
                                dict(window=(30, 5), alibi_slopes=[0.5, 0.1, 1.0, 2.0]),
                                dict(softcap=3.0, dropout_p=0.2, dropout_seed=3)],
                         ids=["causal", "bottom_right", "window-alibi", "softcap-dropout"])
def test_attention_varlen_against_the_reference(rng, dtype, case, kw):
    """Every path (decode, tiled, split keys) with empty sequences, GQA and every
    variant, out and lse against the reference; rows are never written past their
    sequence (out= filled with a sentinel is fully overwritten, nothing else); the same
    bits on one thread."""
    if dtype == "bfloat16":
        dtype = pytest.importorskip("ml_dtypes").bfloat16
    lq, lk = VARLEN_CASES[case]
    if kw.get("causal") is True:
        lq = [min(a, b) for a, b in zip(lq, lk)]
    q, k, v, cu_q, cu_k = packed(rng, lq, lk, 4, 2, 32, 16, dtype)
    sinks = randn(rng, (len(lq), 4), np.float64)
    out, lse = fastattn.attention_varlen(q, k, v, cu_q, cu_k, sinks=sinks,
                                         return_lse=True, **kw)
    want, want_lse = reference.attention_varlen(
        *(x.astype(np.float64) for x in (q, k, v)), cu_q, cu_k, sinks=sinks,
        return_lse=True, **kw)
    if np.dtype(dtype).itemsize == 2:         # rounded once to the 16-bit dtype
        half_ulp = 2.0 ** -8 if np.dtype(dtype) != np.float16 else 2.0 ** -11
        got = out.astype(np.float64)
        assert np.isfinite(got).all()
        # (bfloat16 on the bfloat16 units: the weights rounded once for the product)
        extra = rounded_weights_bound(
            q, k, v, lambda *a, **o: reference.attention_varlen(*a, cu_q, cu_k, **o),
            sinks=sinks, **kw)
        assert (np.abs(got - want) <= half_ulp * np.abs(want) + 1e-5 + extra).all()
        close(lse, want_lse, np.float32, scale=10.0)
    else:
        close(out, want, dtype, scale=4.0)
        close(lse, want_lse, dtype, scale=10.0)
    one = fastattn.attention_varlen(q, k, v, cu_q, cu_k, sinks=sinks, num_threads=1,
                                    **kw)
    np.testing.assert_array_equal(one.view(np.uint8), out.view(np.uint8))
    if np.dtype(dtype) in (np.float32, np.float64):
        dest = np.full(out.shape, 7.0, dtype)
        fastattn.attention_varlen(q, k, v, cu_q, cu_k, sinks=sinks, out=dest, **kw)
        np.testing.assert_array_equal(dest, out)


def general_varlen(monkeypatch, *args, **kw):
    """attention_varlen through its general path (the short path's plan refused)."""
    from fastattn import _compute
    with monkeypatch.context() as m:
        m.setattr(_compute, "plain_packed_plan", lambda *a, **k: None)
        return fastattn.attention_varlen(*args, **kw)


def short_packed_plan(q, k, v, cu_q, cu_k, causal=False, scale=None, sinks=None,
                      window=None, softcap=None):
    from fastattn import _dispatch
    from fastattn._plan import plain_packed_plan
    return plain_packed_plan(q, k, v, cu_q, cu_k, causal, scale, sinks,
                             _dispatch.bf16_dot, _dispatch.amx, window=window,
                             softcap=softcap)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, "bfloat16", np.float16])
@pytest.mark.parametrize("kw", [
    dict(causal=True), dict(causal="bottom_right", window=(30, 5), sinks=True),
    dict(causal=False, window=[None, 3], softcap=2.5, scale=0.3),
    dict(causal="top_left", window=(2 ** 70, 0)), dict(causal=False, window="edge")],
    ids=["causal", "bottom_right-sinks", "window-softcap", "no-window", "edge"])
def test_a_packed_call_takes_the_short_path_with_the_general_bits(rng, monkeypatch,
                                                                  dtype, kw):
    """Packed sequences of one float dtype (transformers' continuous batching: q, k
    and v views of (1, H, total, E) tensors, int32 offsets) are planned from the
    buffers directly: the general plan's sizes, positions and operands, the general
    path's bits, the reference's result, on every path (decode, tiled, split keys).
    "edge": sides of the longest sequence and twice it less one, which restrict
    nothing; the general path keeps both as bounds (below its span, twice the
    longest), as the plan must."""
    from fastattn import _compute, _dispatch
    from fastattn import _validation as _v
    from fastattn._plan import packed_plan
    if dtype == "bfloat16":
        dtype = pytest.importorskip("ml_dtypes").bfloat16
    comp = np.float64 if dtype == np.float64 else np.float32
    real = _compute.plain_packed_plan
    kw = dict(kw)
    edge = kw.get("window") == "edge"
    for name, (lq, lk) in VARLEN_CASES.items():
        if kw["causal"] is True:
            lq = [min(a, b) for a, b in zip(lq, lk)]
        q, k, v, cu_q, cu_k = packed(rng, lq, lk, 4, 2, 32, 16, dtype)
        q, k, v = (np.ascontiguousarray(x.swapaxes(0, 1)).swapaxes(0, 1)
                   for x in (q, k, v))                      # heads first, seen packed
        cu_q, cu_k = cu_q.astype(np.int32), cu_k.astype(np.int64)
        if kw.get("sinks") is True:
            kw["sinks"] = randn(rng, (4,), comp)
        if edge:
            kw["window"] = (max(lq + lk), 2 * max(lq + lk) - 1)
        made = short_packed_plan(q, k, v, cu_q, cu_k, **kw)
        assert made is not None, name
        plan, out = made
        a = _v.varlen_args(q, k, v, cu_q, cu_k, causal=kw["causal"],
                           scale=kw.get("scale"))
        var = fastattn._varlen._variants(a, window=kw.get("window"),
                                         softcap=kw.get("softcap"),
                                         sinks=kw.get("sinks"))
        general = packed_plan(a.q, a.k, a.v, out, None, a.cu_seqlens_q, a.cu_seqlens_k,
                              a.scale, a.computation, groups=a.groups, causal=a.causal,
                              window=var.window, softcap=var.softcap, sinks=var.sinks,
                              bf16_dot=_dispatch.bf16_dot, amx=_dispatch.amx,
                              round_weights=True)
        assert (plan.sizes, plan.groups, plan.positions, plan.bottom_right, plan.dtype,
                plan.dot_kernel, plan.batch_shape, plan.softcap) == (
            general.sizes, general.groups, general.positions, general.bottom_right,
            general.dtype, general.dot_kernel, general.batch_shape,
            general.softcap), name
        for operand in ("q", "k", "v", "out"):
            assert plan.operand(operand) == general.operand(operand), (name, operand)
        assert out.shape == (q.shape[0], 4, 16) and out.dtype == q.dtype
        calls = []
        with monkeypatch.context() as m:
            m.setattr(_compute, "plain_packed_plan",
                      lambda *x, **o: calls.append(real(*x, **o)) or calls[-1])
            got = fastattn.attention_varlen(q, k, v, cu_q, cu_k, **kw)
        assert len(calls) == 1 and calls[0] is not None, name
        want = general_varlen(monkeypatch, q, k, v, cu_q, cu_k, **kw)
        assert got.dtype == want.dtype and np.array_equal(got.view(np.uint8),
                                                          want.view(np.uint8)), name
        ref = reference.attention_varlen(*(x.astype(np.float64) for x in (q, k, v)),
                                         cu_q, cu_k, **kw)
        if np.dtype(dtype).itemsize == 2:
            half_ulp = 2.0 ** -8 if np.dtype(dtype) != np.float16 else 2.0 ** -11
            extra = rounded_weights_bound(
                q, k, v, lambda *x, **o: reference.attention_varlen(*x, cu_q, cu_k, **o),
                **kw)
            diff = np.abs(got.astype(np.float64) - ref)
            assert (diff <= half_ulp * np.abs(ref) + 1e-5 + extra).all(), name
        else:
            close(got, ref, dtype, scale=4.0)


def test_every_other_packed_call_takes_the_general_path(rng):
    """plain_packed_plan says None (the general path then computes the call, or names
    what is wrong) for anything but packed sequences' plain call."""
    q, k, v, cu_q, cu_k = packed(rng, [3, 0, 5], [4, 2, 5], 4, 2, 8, 8, np.float32)
    assert short_packed_plan(q, k, v, cu_q, cu_k) is not None
    decreasing = np.array([0, 4, 3, 8])
    others = {
        "a list of offsets": dict(cu_q=cu_q.tolist()),
        "float offsets": dict(cu_k=cu_k.astype(float)),
        "int16 offsets": dict(cu_q=cu_q.astype(np.int16)),
        "2-D offsets": dict(cu_q=cu_q[None]),
        "offsets from 1": dict(cu_q=cu_q + 1),
        "decreasing offsets": dict(cu_q=decreasing),
        "offsets short of the rows": dict(cu_k=np.array([0, 4, 6, 10])),
        "offsets of other lengths": dict(cu_k=cu_k[:3]),
        "one offset": dict(cu_q=cu_q[:1], cu_k=cu_k[:1]),
        "a 4-D q": dict(q=q[None]),
        "float64 k": dict(k=k.astype(np.float64)),
        "int8 codes": dict(k=k.astype(np.int8), v=v.astype(np.int8)),
        "a list for q": dict(q=q.tolist()),
        "columns not contiguous": dict(k=np.repeat(k, 2, -1)[..., ::2]),
        "heads not a multiple": dict(q=np.zeros((8, 3, 8), np.float32)),
        "rows of other lengths": dict(v=v[:-1]),
        "no keys": dict(k=k[:0], v=v[:0], cu_k=np.zeros(4, np.int64)),
    }
    for why, change in others.items():
        args = {**dict(q=q, k=k, v=v, cu_q=cu_q, cu_k=cu_k), **change}
        assert short_packed_plan(**args) is None, why
    for keywords in (dict(causal=np.True_), dict(causal="top-left"), dict(scale=1),
                     dict(sinks=np.zeros((3, 4), np.float32)),
                     dict(sinks=np.zeros(4, np.float64)), dict(window=(np.int64(3), 0)),
                     dict(window=(-1, 0)), dict(softcap=3), dict(softcap=-1.0)):
        assert short_packed_plan(q, k, v, cu_q, cu_k, **keywords) is None, keywords
    with pytest.raises(ValueError, match="cu_seqlens_q must be non-decreasing"):
        fastattn.attention_varlen(q, k, v, decreasing, cu_k)
    with pytest.raises(ValueError, match="window's left side must be >= 0"):
        fastattn.attention_varlen(q, k, v, cu_q, cu_k, window=(-1, 0))
    np.testing.assert_array_equal(      # NumPy integers: computed by the general path
        fastattn.attention_varlen(q, k, v, cu_q, cu_k, window=(np.int64(3), 0)),
        fastattn.attention_varlen(q, k, v, cu_q, cu_k, window=(3, 0)))
