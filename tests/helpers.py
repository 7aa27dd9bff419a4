"""Shared helpers: random inputs and the tolerance rule of the test suite."""

import json
import os
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

# Subprocesses run here, outside the source tree, so that they import the installed
# package (the source folder has no compiled extensions).
OUTSIDE_SOURCE = tempfile.gettempdir()


def run_with_isa(code, isa):
    """Run ``code`` in a fresh interpreter outside the source tree with FASTATTN_ISA set
    to ``isa`` (unset for None); the JSON it prints."""
    env = dict(os.environ)
    env.pop("FASTATTN_ISA", None)
    if isa is not None:
        env["FASTATTN_ISA"] = isa
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, cwd=OUTSIDE_SOURCE, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    return json.loads(res.stdout)

# Errors are measured relative to the scale of the output (for attention, max |v|:
# every output row is a convex combination of value rows).
RTOL = {np.float16: 2e-3, np.float32: 2e-6, np.float64: 1e-12}


def tolerance(dtype):
    return RTOL[np.dtype(dtype).type]


def assert_close(actual, expected, dtype, scale=None):
    """|actual - expected| <= tol(dtype) * scale, with NaN and inf where expected has them."""
    actual = np.asarray(actual, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    same_special = (np.isnan(actual) == np.isnan(expected)) & (
        np.isinf(expected) <= (actual == expected))
    assert same_special.all(), "NaN/inf pattern differs"
    finite = np.isfinite(expected)
    if scale is None:
        scale = max(1.0, float(np.max(np.abs(expected[finite]), initial=0.0)))
    err = np.max(np.abs(actual[finite] - expected[finite]), initial=0.0)
    assert err <= tolerance(dtype) * scale, f"max error {err:.3g} > {tolerance(dtype)} * {scale:.3g}"


def close_to(got, want, dtype, scale=None, extra=0.0):
    """got against a float64 `want`: float32 results within the float32 rule; 16-bit
    ones within half an ulp of their dtype at the value plus the float32 rule (the
    kernels compute in float32 and round once), plus ``extra`` (like want: the
    weights' rounding on the bfloat16 units, rounded_weights_bound)."""
    got = np.asarray(got, np.float64)
    want = np.asarray(want, np.float64)
    if np.dtype(dtype).itemsize == 2:
        bits = 8 if np.dtype(dtype).name == "bfloat16" else 11
        scale = max(1.0, float(np.abs(want).max(initial=0.0))) if scale is None else scale
        tol = 0.5 * np.abs(want) * 2.0 ** (1 - bits) + 4e-6 * scale + extra
        assert np.all(np.abs(got - want) <= tol), float(np.abs(got - want).max())
        return
    assert_close(got, want, np.float32, scale)


def rounded_weights_bound(q, k, v, attend=None, rounded=False, **kw):
    """How far attention with ``precision=None`` may be from ``"highest"`` where the
    bfloat16 units round the weights once to bfloat16 for the product with v: each
    weight moves by at most 2^-8 of itself, so each output by at most 2^-8 W |v|, W
    the weights (sinks, dropout and every rule as ``kw`` says), with a margin for the
    output's own rounding. Zero unless v is bfloat16 or ``rounded`` says the weights
    meet other values rounded (int8 value codes on the AMX tiles: k and v then the
    dequantized arrays). ``attend``: the float64 function that takes (q, k, v, **kw)
    (default fastattn.reference.attention), e.g. reference.attention_varlen with its
    cu_seqlens bound in. Values that are not finite count as 0: the rows that meet them
    are computed exactly, without rounded weights."""
    from fastattn import reference
    if np.dtype(np.asarray(v).dtype).name != "bfloat16" and not rounded:
        return 0.0
    attend = reference.attention if attend is None else attend
    v64 = np.asarray(v, np.float64)
    v_abs = np.where(np.isfinite(v64), np.abs(v64), 0.0)
    return 2.0 ** -8 * (1 + 2.0 ** -7) * attend(np.asarray(q, np.float64),
                                                np.asarray(k, np.float64), v_abs, **kw)


def paged_codes_close(q, kc, vc, ks, vs, table, lengths, lse=True):
    """fastattn.attention_paged over a quantized cache (codes kc, vc with scales ks, vs),
    checked against the float64 recomputation on the dequantized values within the
    bound of weights rounded once to bfloat16 for the values' product, and (lse) its
    log-sum-exp too; returns its output."""
    import fastattn
    from fastattn import reference
    got = fastattn.attention_paged(q, kc, vc, table, lengths, k_scale=ks, v_scale=vs,
                                   return_lse=lse)
    want = reference.attention_paged(q.astype(np.float64), kc, vc, table, lengths,
                                     k_scale=ks, v_scale=vs, return_lse=lse)
    if lse:
        (got, got_lse), (want, want_lse) = got, want
        assert_close(got_lse, want_lse, np.float32)
    close_to(got, want, got.dtype, extra=rounded_weights_bound(
        q, reference.dequantize_kv(kc, ks), reference.dequantize_kv(vc, vs),
        attend=lambda q, k, v: reference.attention_paged(q, k, v, table, lengths),
        rounded=True))
    return got


def assert_contiguous_bits(got, q, kc, vc, ks, vs, table, lengths, b):
    """got[b], from attention_paged over 16-bit queries, has the bits of attention on
    sequence b's blocks gathered into a contiguous cache."""
    import fastattn

    def rows(cache):
        return np.concatenate([cache[t] for t in table[b]])[:lengths[b]]
    alone = fastattn.attention(q[b:b + 1].transpose(0, 2, 1, 3),
                               rows(kc).transpose(1, 0, 2)[None],
                               rows(vc).transpose(1, 0, 2)[None],
                               k_scale=rows(ks).T[None], v_scale=rows(vs).T[None],
                               enable_gqa=True)
    np.testing.assert_array_equal(alone.transpose(0, 2, 1, 3).view(np.uint16),
                                  got[b:b + 1].view(np.uint16))


def float8_pairs(q, code):
    """Whether a decoding step of queries q over a cache of `code` runs on the float8
    pairs' kernels in this process (src/fa_pairs.h: bfloat16 queries, a float8 cache,
    bf16_dot on and the kernels in the driver module), which round the weights times
    the values' scales once to bfloat16 (rounded_weights_bound's ``rounded``)."""
    from fastattn import _dispatch
    return (np.dtype(np.asarray(q).dtype).name == "bfloat16"
            and code in ("float8_e4m3fn", "float8_e5m2") and bool(_dispatch.bf16_dot)
            and bool(getattr(_dispatch.drivers, "FLOAT8_PAIRS", False)))


def randn(rng, shape, dtype=np.float64):
    return rng.standard_normal(shape).astype(dtype)


def assert_gil_released(call):
    """Another Python thread keeps running while ``call()`` is in the kernels.

    With the GIL held, the ticking thread would stall for the whole kernel time, in
    every attempt; with it released, its longest pause stays far below the length of
    the call. Up to three attempts, so that one unlucky pause of the operating system's
    scheduler on a loaded machine does not decide the outcome.
    """
    worst = []
    for _ in range(3):
        stamps = []
        done = threading.Event()

        def ticker():
            while not done.is_set():
                stamps.append(time.perf_counter())

        t = threading.Thread(target=ticker)
        t.start()
        try:
            time.sleep(0.01)
            start = time.perf_counter()
            call()
            end = time.perf_counter()
        finally:
            done.set()
            t.join()
        during = np.array([s for s in stamps if start <= s <= end])
        gaps = np.diff(np.concatenate([[start], during, [end]]))
        worst.append(gaps.max() / (end - start))
        if len(during) > 10 and worst[-1] < 0.5:
            return
    raise AssertionError(
        f"the other thread stalled for {max(worst):.0%} of the call: GIL held?")
