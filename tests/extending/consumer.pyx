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
