"""The public C-level API: fastattn/kernels.pxd, cimported by another extension.

``consumer`` (tests/extending/consumer.pyx, see extending_build.py) is built in a temporary
folder with the package's compiler and flags; it calls every kernel of kernels.pxd from
its own nogil code and its own prange loop. Results are checked against
``fastattn.reference``.
"""

import re
from pathlib import Path

import numpy as np
import pytest

import fastattn
import fastattn.kernels
from fastattn import reference

from extending_build import consumer  # noqa: F401 (a fixture)
from helpers import assert_close, randn

DTYPES = [np.float32, np.float64]
PXD = Path(fastattn.__file__).with_name("kernels.pxd")
RELEASED = Path(__file__).parent / "extending" / "kernels_released.pxd.txt"


def declarations(text):
    """The `cdef ...` declarations of a .pxd, one per entry, whitespace normalised."""
    code = "\n".join(line.split("#", 1)[0] for line in text.splitlines())
    decls, current = [], None
    for line in code.splitlines():
        if line.startswith("cdef ") or line.startswith("ctypedef "):
            if current is not None:
                decls.append(current)
            current = line
        elif current is not None and line.strip():
            current += " " + line
        elif current is not None:
            decls.append(current)
            current = None
    if current is not None:
        decls.append(current)
    return [" ".join(d.split()) for d in decls]


# ----------------------------------------------------------------- the .pxd itself

def test_pxd_ships_with_the_package():
    assert PXD.is_file(), "kernels.pxd must be installed next to the kernels module"


def test_pxd_has_no_cimports():
    code = [line.split("#", 1)[0] for line in PXD.read_text().splitlines()]
    assert not [line for line in code if re.search(r"\bcimport\b", line)]


def test_released_signatures_never_change():
    """Every released declaration is still there, unchanged and in the same order;
    new ones may only be added after them."""
    released = declarations(RELEASED.read_text())
    current = declarations(PXD.read_text())
    assert current[:len(released)] == released


def test_every_declared_function_is_exported():
    capi = fastattn.kernels.__pyx_capi__
    names = re.findall(r"\b(\w+)\(", " ".join(
        d for d in declarations(PXD.read_text()) if d.startswith("cdef ")
        and "(" in d))
    assert names == ["dot_scores", "softmax_rows", "weighted_sum", "attention_slice",
                     "dot_scores_checked", "softmax_rows_checked", "weighted_sum_checked",
                     "attention_slice_variants", "attention_slice_sinks"]
    for name in names:
        for fused in ("__pyx_fuse_0", "__pyx_fuse_1"):     # float, then double
            assert fused + name in capi


# ------------------------------------------------------------ the four kernels

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,e", [(1, 1, 1), (5, 7, 3), (70, 130, 33), (3, 0, 4)])
def test_dot_scores(consumer, rng, dtype, m, n, e):
    q, k = randn(rng, (m, e), dtype), randn(rng, (n, e), dtype)
    s = np.empty((m, n), dtype)
    consumer.dot_scores(q.ravel(), k.ravel(), s.ravel(), m, n, e, 0.3)
    assert_close(s, reference.scores(q, k, scale=0.3), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_softmax_rows(consumer, rng, dtype):
    x = randn(rng, (6, 9), dtype) * 4
    x[1] = -np.inf                      # nothing allowed: zeros
    x[2, ::2] = -np.inf
    x[3] *= 1e4                         # huge logits: max subtraction keeps it finite
    x[4, 3] = np.nan
    y = np.empty_like(x)
    consumer.softmax_rows(x.ravel(), y.ravel(), 6, 9)
    assert_close(y, reference.softmax(x), dtype)
    assert (y[1] == 0).all()
    consumer.softmax_rows_inplace(x.ravel(), 6, 9)      # x and y may be the same buffer
    assert_close(x, y, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,ev", [(1, 1, 1), (4, 9, 5), (65, 3, 17), (2, 0, 3)])
def test_weighted_sum(consumer, rng, dtype, m, n, ev):
    p, v = randn(rng, (m, n), dtype), randn(rng, (n, ev), dtype)
    out = np.empty((m, ev), dtype)
    consumer.weighted_sum(p.ravel(), v.ravel(), out.ravel(), m, n, ev)
    assert_close(out, reference.weighted_sum(p, v), dtype)


def run_attention(consumer, q, k, v, scale, causal, num_threads=2, with_lse=True):
    N, Lq, E = q.shape
    Lk, Ev = v.shape[-2:]
    out = np.full((N, Lq, Ev), 7, q.dtype)
    lse = np.full((N, Lq) if with_lse else (0,), 7, q.dtype)
    rc = consumer.attention(q.ravel(), k.ravel(), v.ravel(), out.ravel(), lse.ravel(),
                            N, Lq, Lk, E, Ev, scale, causal, num_threads)
    return rc, out, lse


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", ["none", "top_left", "bottom_right"])
@pytest.mark.parametrize("N,Lq,Lk,E,Ev", [(5, 130, 75, 16, 8), (3, 7, 200, 5, 3),
                                          (2, 1, 1, 1, 1), (2, 4, 0, 3, 2)])
def test_attention_slice_in_a_prange(consumer, rng, dtype, causal, N, Lq, Lk, E, Ev):
    q, k, v = (randn(rng, (N, Lq, E), dtype), randn(rng, (N, Lk, E), dtype),
               randn(rng, (N, Lk, Ev), dtype))
    code = consumer.causal_values()[causal]
    rc, out, lse = run_attention(consumer, q, k, v, 0.25, code)
    assert (rc == 0).all()
    want, want_lse = reference.attention(q, k, v, scale=0.25, return_lse=True,
                                         causal=False if causal == "none" else causal)
    assert_close(out, want, dtype, scale=max(1.0, float(np.abs(v).max(initial=0))))
    assert_close(lse, want_lse, dtype, scale=max(1.0, float(np.abs(want_lse[
        np.isfinite(want_lse)]).max(initial=0))))
    # the serial kernel in one thread or in two gives the same bits
    _, out1, lse1 = run_attention(consumer, q, k, v, 0.25, code, num_threads=1)
    np.testing.assert_array_equal(out1, out)
    np.testing.assert_array_equal(lse1, lse)


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_slice_without_lse_and_matches_the_python_api(consumer, rng, dtype):
    q, k, v = (randn(rng, (4, 33, 8), dtype) for _ in range(3))
    rc, out, _ = run_attention(consumer, q, k, v, 8 ** -0.5, 0, with_lse=False)
    assert (rc == 0).all()
    assert_close(out, fastattn.attention(q, k, v), dtype)


def test_attention_slice_rejects_an_unknown_causal_value(consumer, rng):
    q = randn(rng, (1, 3, 2))
    rc, out, lse = run_attention(consumer, q, q, q, 1.0, 7)
    assert list(rc) == [-2]
    assert (out == 7).all() and (lse == 7).all()        # untouched


def test_causal_constants(consumer):
    assert consumer.causal_values() == {"none": 0, "top_left": 1, "bottom_right": 2}


# ----------------------------------------------- sizes a hostile caller may pass

@pytest.mark.parametrize("Lq,Lk,E,Ev", [(4, 4, -1, 4), (4, 4, 4, -1), (-1, 4, 4, 4),
                                        (4, -5, 4, 4), (4, 4, 2**55, 4),
                                        (4, 4, 4, 2**55), (2**40, 2**40, 2**30, 4),
                                        (4, 2**62, 4, 4)])
def test_attention_slice_rejects_bad_sizes(consumer, Lq, Lk, E, Ev):
    """Negative sizes and sizes whose buffer or scratch products overflow are refused
    with ERROR_BAD_SIZE before anything is read, written or allocated (they used to
    write outside the scratch, or overflow its size, and crash)."""
    codes = consumer.error_codes()
    assert codes == {"no_memory": -1, "bad_causal": -2, "bad_size": -3}
    assert consumer.attention_sizes(Lq, Lk, E, Ev) == codes["bad_size"]


def test_attention_slice_accepts_empty_sizes(consumer):
    assert consumer.attention_sizes(0, 4, 4, 4) == 0
    assert consumer.attention_sizes(4, 0, 4, 4) == 0


@pytest.mark.parametrize("m,n,e,codes", [(-1, 2, 2, (-3, -3, -3)), (2, -1, 2, (-3, -3, -3)),
                                         (2, 2, -3, (-3, 0, -3)),
                                         (2**40, 2**40, 1, (-3, -3, -3)),
                                         (2**32, 2**32, 0, (-3, -3, -3)),
                                         (1, 4, 2**62, (-3, 0, -3))])
def test_checked_kernels_reject_bad_sizes(consumer, m, n, e, codes):
    """(dot_scores_checked(m, n, e), softmax_rows_checked(m, n),
    weighted_sum_checked(m, n, e)): negative sizes and overflowing products refused."""
    assert consumer.checked_sizes(m, n, e) == codes


@pytest.mark.parametrize("dtype", DTYPES)
def test_checked_kernels_compute_what_the_released_ones_do(consumer, rng, dtype):
    q, k = randn(rng, (7, 5), dtype), randn(rng, (9, 5), dtype)
    s = np.empty((7, 9), dtype)
    assert consumer.dot_scores_checked(q.ravel(), k.ravel(), s.ravel(), 7, 9, 5, 0.5) == 0
    assert_close(s, reference.scores(q, k, scale=0.5), dtype)
    p, v = randn(rng, (7, 9), dtype), randn(rng, (9, 40), dtype)
    out = np.empty((7, 40), dtype)
    assert consumer.weighted_sum_checked(p.ravel(), v.ravel(), out.ravel(), 7, 9, 40) == 0
    assert_close(out, reference.weighted_sum(p, v), dtype)


# ------------------------------------------------------- attention_slice_variants

def run_variants(consumer, q, k, v, scale=0.5, causal="none", mask=None, bias=None,
                 window=(None, None), softcap=None, slopes=None, q_lengths=None,
                 kv_lengths=None, dropout_p=0.0, seed=0, num_threads=2):
    """attention_slice_variants on every slice of (N, L, E) arrays, the arguments
    spelled as fastattn.attention takes them; returns (codes, out, lse)."""
    N, Lq, E = q.shape
    Lk, Ev = v.shape[-2:]
    dtype = q.dtype
    out = np.full((N, Lq, Ev), 7, dtype)
    lse = np.full((N, Lq), 7, dtype)
    consts = consumer.variant_constants()
    side = lambda w: consts["window_unbounded"] if w is None else w  # noqa: E731
    lengths = lambda x: np.full(N, consts["length_all"], np.intp) if x is None \
        else np.asarray(x, np.intp)                                  # noqa: E731
    rc = consumer.attention_variants(
        q.ravel(), k.ravel(), v.ravel(), out.ravel(), lse.ravel(),
        np.empty(0, np.uint8) if mask is None else
        np.broadcast_to(mask, (N, Lq, Lk)).astype(np.uint8).ravel(),
        np.empty(0, dtype) if bias is None else
        np.broadcast_to(bias, (N, Lq, Lk)).astype(dtype).ravel(),
        N, Lq, Lk, E, Ev, scale, consumer.causal_values()[causal], side(window[0]),
        side(window[1]), 0.0 if softcap is None else softcap,
        np.zeros(N) if slopes is None else np.asarray(slopes, np.float64),
        lengths(q_lengths), lengths(kv_lengths), dropout_p, seed, num_threads)
    return rc, out, lse


VARIANT_CASES = {
    "window": dict(window=(3, 1)),
    "window-left": dict(window=(0, None)),
    "window-huge": dict(window=(2**63 - 1, 2**62)),
    "softcap": dict(softcap=0.75),
    "alibi": dict(slopes=[0.5, 0.0, 2.0]),
    "lengths": dict(q_lengths=[70, 0, 33], kv_lengths=[5, 81, 0]),
    "mask-bias": dict(mask="random", bias="random"),
    "dropout": dict(dropout_p=0.4, seed=2**63 + 5),
    "all": dict(window=(40, 2), softcap=3.0, slopes=[0.1, 0.2, 0.3],
                q_lengths=[64, 70, 9], kv_lengths=[81, 30, 66], mask="random",
                bias="random", dropout_p=0.25, seed=99),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", ["none", "top_left", "bottom_right"])
@pytest.mark.parametrize("case", list(VARIANT_CASES))
def test_attention_slice_variants(consumer, rng, dtype, causal, case):
    """Each variant (and all of them) against fastattn.reference on the same slices:
    slice n of the batch is slice index n, so even the dropout pattern is the same."""
    N, Lq, Lk, E, Ev = 3, 70, 81, 8, 5
    q, k, v = (randn(rng, (N, Lq, E), dtype), randn(rng, (N, Lk, E), dtype),
               randn(rng, (N, Lk, Ev), dtype))
    kw = dict(VARIANT_CASES[case])
    if kw.get("mask") == "random":
        kw["mask"] = rng.random((N, Lq, Lk)) < 0.8
    if kw.get("bias") == "random":
        kw["bias"] = randn(rng, (N, Lq, Lk), dtype)
    rc, out, lse = run_variants(consumer, q, k, v, causal=causal, **kw)
    assert (rc == 0).all()
    window = kw.pop("window", (None, None))
    ref_kw = dict(mask=kw.get("mask"), bias=kw.get("bias"),
                  window=None if window == (None, None) else window,
                  softcap=kw.get("softcap"), alibi_slopes=kw.get("slopes"),
                  q_lengths=kw.get("q_lengths"), kv_lengths=kw.get("kv_lengths"),
                  dropout_p=kw.get("dropout_p", 0.0),
                  dropout_seed=kw.get("seed") if kw.get("dropout_p") else None)
    want, want_lse = reference.attention(q, k, v, scale=0.5, return_lse=True,
                                         causal=False if causal == "none" else causal,
                                         **ref_kw)
    assert_close(out, want, dtype, scale=4.0 / (1 - ref_kw["dropout_p"]))
    assert_close(lse, want_lse, dtype, scale=max(1.0, float(np.abs(want_lse[
        np.isfinite(want_lse)]).max(initial=0))))
    # the same bits in one thread as in two
    _, out1, lse1 = run_variants(consumer, q, k, v, causal=causal, num_threads=1,
                                 window=window, **kw)
    np.testing.assert_array_equal(out1, out)
    np.testing.assert_array_equal(lse1, lse)


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_slice_variants_without_variants_is_attention_slice(consumer, rng,
                                                                      dtype):
    q, k, v = (randn(rng, (2, 67, 6), dtype) for _ in range(3))
    for causal in ("none", "top_left", "bottom_right"):
        code = consumer.causal_values()[causal]
        _, out, lse = run_attention(consumer, q, k, v, 0.5, code)
        rc, out2, lse2 = run_variants(consumer, q, k, v, causal=causal)
        assert (rc == 0).all()
        np.testing.assert_array_equal(out2, out)
        np.testing.assert_array_equal(lse2, lse)


def test_attention_slice_variants_constants(consumer):
    assert consumer.variant_constants() == {"bad_argument": -4, "window_unbounded": -1,
                                            "length_all": -1}


NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("args, code", [
    # (Lq, Lk, left, right, softcap, slope, q_length, kv_length, dropout_p, slice_index)
    ((4, 5, -1, -1, 0, 0, -1, -1, 0, 0), 0),               # nothing: attention_slice
    ((4, 5, 0, 0, 2.0, -1.5, 4, 0, 0.5, 3), 0),              # every variant, in range
    ((4, 5, -2, -1, 0, 0, -1, -1, 0, 0), -4),               # window sides below -1
    ((4, 5, -1, -7, 0, 0, -1, -1, 0, 0), -4),
    ((4, 5, -1, -1, -1.0, 0, -1, -1, 0, 0), -4),            # softcap < 0, not finite
    ((4, 5, -1, -1, INF, 0, -1, -1, 0, 0), -4),
    ((4, 5, -1, -1, NAN, 0, -1, -1, 0, 0), -4),
    ((4, 5, -1, -1, 0, NAN, -1, -1, 0, 0), -4),             # slope not finite
    ((4, 5, -1, -1, 0, -INF, -1, -1, 0, 0), -4),
    ((4, 5, -1, -1, 0, 0, 5, -1, 0, 0), -4),                # lengths out of [0, L]
    ((4, 5, -1, -1, 0, 0, -2, -1, 0, 0), -4),
    ((4, 5, -1, -1, 0, 0, -1, 6, 0, 0), -4),
    ((4, 5, -1, -1, 0, 0, -1, -1, 1.0, 0), -4),             # dropout_p out of [0, 1)
    ((4, 5, -1, -1, 0, 0, -1, -1, -0.1, 0), -4),
    ((4, 5, -1, -1, 0, 0, -1, -1, NAN, 0), -4),
    ((4, 5, -1, -1, 0, 0, -1, -1, 0.5, -1), -4),            # negative slice index
])
def test_attention_slice_variants_rejects_bad_arguments(consumer, args, code):
    rc, untouched = consumer.variant_arguments(*args)
    assert rc == code
    assert untouched == (code != 0)


def test_attention_slice_variants_checks_causal_and_sizes_first(consumer):
    # an unknown causal value, then bad sizes, are reported before bad variants
    assert consumer.variant_arguments(4, 5, -3, -1, 0, 0, -1, -1, 0, 0, 9) == (-2, True)
    assert consumer.variant_arguments(-4, 5, -3, -1, 0, 0, -1, -1, 0, 0) == (-3, True)


# ------------------------------------------------------------ attention sinks (0.3)

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", ["none", "bottom_right"])
def test_attention_slice_sinks(consumer, rng, dtype, causal):
    """Each slice's sink against fastattn.reference: rows with no allowed key (a window
    that shuts them out) give zeros and lse = sink, padding rows zeros and -inf."""
    N, Lq, Lk, E, Ev = 3, 70, 90, 8, 5
    q, k, v = (randn(rng, (N, Lq, E), dtype), randn(rng, (N, Lk, E), dtype),
               randn(rng, (N, Lk, Ev), dtype))
    sinks = np.array([0.5, -1.0, 3.0])
    q_lengths = np.array([Lq, 40, 0], dtype=np.intp)
    code = consumer.causal_values()[causal]
    out = np.full((N, Lq, Ev), 7, dtype)
    lse = np.full((N, Lq), 7, dtype)
    rc = consumer.attention_sinks(q.ravel(), k.ravel(), v.ravel(), out.ravel(),
                                  lse.ravel(), N, Lq, Lk, E, Ev, 0.5, code, 5, 0,
                                  sinks, q_lengths, 2)
    assert (rc == 0).all()
    for n in range(N):
        want, want_lse = reference.attention(
            q[n:n + 1], k[n:n + 1], v[n:n + 1], scale=0.5, return_lse=True,
            causal=False if causal == "none" else causal, window=(5, 0),
            sinks=sinks[n:n + 1], q_lengths=q_lengths[n:n + 1])
        assert_close(out[n], want[0], dtype, scale=4.0)
        np.testing.assert_allclose(lse[n], want_lse[0], rtol=1e-5 if dtype == np.float32
                                   else 1e-12)
    assert (lse[2] == -np.inf).all() and (out[2] == 0).all()     # padding rows


@pytest.mark.parametrize("sink, code", [(0.0, 0), (-INF, 0), (NAN, -4), (INF, -4)])
def test_attention_slice_sinks_rejects_nan_and_inf(consumer, sink, code):
    rc, untouched = consumer.sink_argument(sink)
    assert rc == code
    assert untouched == (code != 0)


@pytest.mark.parametrize("Lq, Lk", [(2**44, 5), (5, 2**62), (2**44, 2**62)])
def test_nothing_to_compute_returns_at_once(consumer, Lq, Lk):
    """E = Ev = 0 and no lse: nothing to write, whatever Lq and Lk (it used to visit
    every row and key: hours)."""
    assert consumer.nothing_to_compute(Lq, Lk) == 0
