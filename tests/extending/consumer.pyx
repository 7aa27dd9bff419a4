# A small extension that uses fastattn's public C-level API the way another project
# would: cimport the declarations, call the serial kernels on raw pointers from its own
# nogil code and its own prange loop. The tests build it with the package's compiler.

import numpy as np

from cython.parallel cimport prange

from fastattn cimport kernels
from fastattn.kernels cimport floating


cdef inline const floating* cp(const floating[::1] a) noexcept nogil:
    return &a[0] if a.shape[0] > 0 else NULL


cdef inline floating* wp(floating[::1] a) noexcept nogil:
    return &a[0] if a.shape[0] > 0 else NULL


def dot_scores(const floating[::1] q, const floating[::1] k, floating[::1] s,
               Py_ssize_t m, Py_ssize_t n, Py_ssize_t e, double scale):
    with nogil:
        kernels.dot_scores(cp(q), cp(k), wp(s), m, n, e, <floating> scale)


def softmax_rows(const floating[::1] x, floating[::1] y, Py_ssize_t m, Py_ssize_t n):
    with nogil:
        kernels.softmax_rows(cp(x), wp(y), m, n)


def softmax_rows_inplace(floating[::1] x, Py_ssize_t m, Py_ssize_t n):
    with nogil:
        kernels.softmax_rows(wp(x), wp(x), m, n)


def weighted_sum(const floating[::1] p, const floating[::1] v, floating[::1] out,
                 Py_ssize_t m, Py_ssize_t n, Py_ssize_t ev):
    with nogil:
        kernels.weighted_sum(cp(p), cp(v), wp(out), m, n, ev)


def attention(const floating[::1] q, const floating[::1] k, const floating[::1] v,
              floating[::1] out, floating[::1] lse, Py_ssize_t N, Py_ssize_t Lq,
              Py_ssize_t Lk, Py_ssize_t E, Py_ssize_t Ev, double scale, int causal,
              int num_threads):
    """N independent slices in this extension's own prange; returns each slice's code.

    An empty lse buffer means "no lse" (NULL).
    """
    rcs = np.zeros(N, dtype=np.intc)
    cdef int[::1] rc = rcs
    cdef Py_ssize_t n
    cdef const floating* qp = cp(q)
    cdef const floating* kp = cp(k)
    cdef const floating* vp = cp(v)
    cdef floating* op = wp(out)
    cdef floating* lp = wp(lse)
    cdef bint with_lse = lse.shape[0] > 0
    with nogil:
        for n in prange(N, num_threads=num_threads, schedule="static"):
            rc[n] = kernels.attention_slice(
                qp + n * Lq * E, kp + n * Lk * E, vp + n * Lk * Ev, op + n * Lq * Ev,
                lp + n * Lq if with_lse else NULL, Lq, Lk, E, Ev, <floating> scale,
                causal)
    return rcs


def causal_values():
    return {"none": kernels.CAUSAL_NONE, "top_left": kernels.CAUSAL_TOP_LEFT,
            "bottom_right": kernels.CAUSAL_BOTTOM_RIGHT}


def call_from_team(f, int outer):
    """Call the Python function f from every thread of an OpenMP team of `outer`."""
    cdef int i
    with nogil:
        for i in prange(outer, num_threads=outer, schedule="static"):
            with gil:
                f()


def error_codes():
    return {"no_memory": kernels.ERROR_NO_MEMORY, "bad_causal": kernels.ERROR_BAD_CAUSAL,
            "bad_size": kernels.ERROR_BAD_SIZE}


def attention_sizes(Py_ssize_t Lq, Py_ssize_t Lk, Py_ssize_t E, Py_ssize_t Ev):
    """attention_slice on 64 zero floats per buffer with whatever sizes are given
    (the sizes are rejected before any buffer is touched): its return code."""
    cdef float q[64]
    cdef float k[64]
    cdef float v[64]
    cdef float out[64]
    cdef int rc
    with nogil:
        rc = kernels.attention_slice(q, k, v, out, NULL, Lq, Lk, E, Ev, 1.0,
                                     kernels.CAUSAL_NONE)
    return rc


def checked_sizes(Py_ssize_t m, Py_ssize_t n, Py_ssize_t e):
    """The three size-checked kernels on 64-float buffers: their return codes."""
    cdef double a[64]
    cdef double b[64]
    cdef double c[64]
    cdef int r1, r2, r3
    with nogil:
        r1 = kernels.dot_scores_checked(a, b, c, m, n, e, 1.0)
        r2 = kernels.softmax_rows_checked(a, c, m, n)
        r3 = kernels.weighted_sum_checked(a, b, c, m, n, e)
    return r1, r2, r3


def dot_scores_checked(const floating[::1] q, const floating[::1] k, floating[::1] s,
                       Py_ssize_t m, Py_ssize_t n, Py_ssize_t e, double scale):
    cdef int rc
    with nogil:
        rc = kernels.dot_scores_checked(cp(q), cp(k), wp(s), m, n, e, <floating> scale)
    return rc


def weighted_sum_checked(const floating[::1] p, const floating[::1] v,
                         floating[::1] out, Py_ssize_t m, Py_ssize_t n, Py_ssize_t ev):
    cdef int rc
    with nogil:
        rc = kernels.weighted_sum_checked(cp(p), cp(v), wp(out), m, n, ev)
    return rc


def attention_variants(const floating[::1] q, const floating[::1] k,
                       const floating[::1] v, floating[::1] out, floating[::1] lse,
                       const unsigned char[::1] mask, const floating[::1] bias,
                       Py_ssize_t N, Py_ssize_t Lq, Py_ssize_t Lk, Py_ssize_t E,
                       Py_ssize_t Ev, double scale, int causal, Py_ssize_t left,
                       Py_ssize_t right, double softcap, const double[::1] slopes,
                       const Py_ssize_t[::1] q_lengths, const Py_ssize_t[::1] kv_lengths,
                       double dropout_p, unsigned long long seed, int num_threads):
    """attention_slice_variants over N slices (slice n: slope slopes[n], lengths
    q_lengths[n] and kv_lengths[n], dropout slice index n) in this extension's own
    prange; returns each slice's code. Empty lse, mask or bias buffers mean NULL."""
    rcs = np.zeros(N, dtype=np.intc)
    cdef int[::1] rc = rcs
    cdef Py_ssize_t n
    cdef const floating* qp = cp(q)
    cdef const floating* kp = cp(k)
    cdef const floating* vp = cp(v)
    cdef const floating* bp = cp(bias)
    cdef const unsigned char* mp = &mask[0] if mask.shape[0] > 0 else NULL
    cdef floating* op = wp(out)
    cdef floating* lp = wp(lse)
    with nogil:
        for n in prange(N, num_threads=num_threads, schedule="static"):
            rc[n] = kernels.attention_slice_variants(
                qp + n * Lq * E, kp + n * Lk * E, vp + n * Lk * Ev, op + n * Lq * Ev,
                lp + n * Lq if lp != NULL else NULL,
                Lq, Lk, E, Ev, <floating> scale, causal,
                mp + n * Lq * Lk if mp != NULL else NULL,
                bp + n * Lq * Lk if bp != NULL else NULL,
                left, right, softcap, slopes[n], q_lengths[n], kv_lengths[n],
                dropout_p, seed, n)
    return rcs


def variant_constants():
    return {"bad_argument": kernels.ERROR_BAD_ARGUMENT,
            "window_unbounded": kernels.WINDOW_UNBOUNDED, "length_all": kernels.LENGTH_ALL}


def variant_arguments(Py_ssize_t Lq, Py_ssize_t Lk, Py_ssize_t left, Py_ssize_t right,
                      double softcap, double slope, Py_ssize_t q_length,
                      Py_ssize_t kv_length, double dropout_p, Py_ssize_t slice_index,
                      int causal=0):
    """attention_slice_variants on 64-double buffers (E = Ev = 1, so Lq, Lk <= 64):
    its return code, and whether out (filled with 7) was left untouched."""
    cdef double q[64]
    cdef double k[64]
    cdef double v[64]
    cdef double out[64]
    cdef int rc, i
    for i in range(64):
        q[i] = k[i] = v[i] = 1
        out[i] = 7
    with nogil:
        rc = kernels.attention_slice_variants(
            q, k, v, out, NULL, Lq, Lk, 1, 1, 1.0, causal, NULL, NULL, left, right,
            softcap, slope, q_length, kv_length, dropout_p, 0, slice_index)
    return rc, all(out[i] == 7 for i in range(64))


def attention_sinks(const floating[::1] q, const floating[::1] k, const floating[::1] v,
                    floating[::1] out, floating[::1] lse, Py_ssize_t N, Py_ssize_t Lq,
                    Py_ssize_t Lk, Py_ssize_t E, Py_ssize_t Ev, double scale, int causal,
                    Py_ssize_t left, Py_ssize_t right, const double[::1] sinks,
                    const Py_ssize_t[::1] q_lengths, int num_threads):
    """attention_slice_sinks over N slices (slice n: sink sinks[n], query length
    q_lengths[n]) in this extension's own prange; returns each slice's code."""
    rcs = np.zeros(N, dtype=np.intc)
    cdef int[::1] rc = rcs
    cdef Py_ssize_t n
    cdef const floating* qp = cp(q)
    cdef const floating* kp = cp(k)
    cdef const floating* vp = cp(v)
    cdef floating* op = wp(out)
    cdef floating* lp = wp(lse)
    with nogil:
        for n in prange(N, num_threads=num_threads, schedule="static"):
            rc[n] = kernels.attention_slice_sinks(
                qp + n * Lq * E, kp + n * Lk * E, vp + n * Lk * Ev, op + n * Lq * Ev,
                lp + n * Lq, Lq, Lk, E, Ev, <floating> scale, causal, NULL, NULL,
                left, right, 0, 0, sinks[n], q_lengths[n], kernels.LENGTH_ALL, 0, 0, n)
    return rcs


def sink_argument(double sink):
    """attention_slice_sinks on 64-double buffers with this sink: its return code,
    and whether out (filled with 7) was left untouched."""
    cdef double q[64]
    cdef double k[64]
    cdef double v[64]
    cdef double out[64]
    cdef int rc, i
    for i in range(64):
        q[i] = k[i] = v[i] = 1
        out[i] = 7
    with nogil:
        rc = kernels.attention_slice_sinks(
            q, k, v, out, NULL, 4, 5, 1, 1, 1.0, 0, NULL, NULL, -1, -1, 0, 0, sink, -1,
            -1, 0, 0, 0)
    return rc, all(out[i] == 7 for i in range(64))


def nothing_to_compute(Py_ssize_t Lq, Py_ssize_t Lk):
    """attention_slice_variants with E = Ev = 0 and no lse (nothing to write) over
    Lq queries and Lk keys: its return code (it must return at once)."""
    cdef double dummy[1]
    cdef int rc
    with nogil:
        rc = kernels.attention_slice_variants(
            dummy, dummy, dummy, dummy, NULL, Lq, Lk, 0, 0, 1.0, 0, NULL, NULL, -1, -1,
            0, 0, -1, -1, 0, 0, 0)
    return rc
