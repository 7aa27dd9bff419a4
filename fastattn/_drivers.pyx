"""The parallel loops: OpenMP over independent (batch·head, query block) work items.

Each driver takes flat C-contiguous buffers in the computation dtype plus, for every
(batch·head) slice n of the output, the element offset of that slice in each input
(this is how broadcasting and grouped-query heads reach the kernels without copies),
checks that every slice lies inside its buffer, releases the GIL and runs the tile
kernels of ``_tiles.pxd``. A work item is always computed whole by one thread, in a
fixed order, so results are bit-identical for any number of threads.
"""

import numpy as np

from cython.parallel cimport parallel, prange

from fastattn cimport _tiles
from fastattn._openmp cimport omp_get_thread_num
from fastattn._tiles cimport real

cdef enum:
    QUERY_BLOCK = 64        # query rows per work item: each packed key block serves them all


cdef inline const real* cptr(const real[::1] a) noexcept nogil:
    return &a[0] if a.shape[0] > 0 else NULL


cdef inline const unsigned char* bptr(const unsigned char[::1] a) noexcept nogil:
    return &a[0] if a.shape[0] > 0 else NULL


cdef inline real* wptr(real[::1] a) noexcept nogil:
    return &a[0] if a.shape[0] > 0 else NULL


def _check_slices(offsets, Py_ssize_t extent, Py_ssize_t last, Py_ssize_t size, name):
    """Every slice [off, off + last] must lie inside a buffer of `size` elements."""
    offsets = np.asarray(offsets)
    if offsets.size == 0 or extent == 0:
        return
    if offsets.min() < 0 or offsets.max() + last >= size:
        raise ValueError(f"internal error: slices of {name} fall outside its buffer")


def _scratch(Py_ssize_t threads, Py_ssize_t per_thread, dtype):
    return np.empty(max(threads * per_thread, 1), dtype=dtype)


def attention(const real[::1] q, const real[::1] k, const real[::1] v, real[::1] out,
              real[::1] lse, const Py_ssize_t[::1] q_off, const Py_ssize_t[::1] k_off,
              const Py_ssize_t[::1] v_off, Py_ssize_t Lq, Py_ssize_t Lk, Py_ssize_t E,
              Py_ssize_t Ev, double scale, Py_ssize_t shift,
              const unsigned char[::1] mask, const Py_ssize_t[::1] mask_off,
              Py_ssize_t mask_rs, Py_ssize_t mask_cs,
              const real[::1] bias, const Py_ssize_t[::1] bias_off,
              Py_ssize_t bias_rs, Py_ssize_t bias_cs, int num_threads):
    """Fused attention of N slices: out (N, Lq, Ev), lse (N, Lq) (or empty: not wanted).

    q_off/k_off/v_off (N,) are element offsets of each slice in q, k, v. A mask or bias
    is given as its own elements plus offsets (N,) and row/column strides (0 where it
    broadcasts); an empty mask/bias buffer means none. shift: query i may attend to
    key j iff j <= i + shift (shift >= Lk: no causal limit).
    """
    cdef Py_ssize_t N = q_off.shape[0]
    if not (k_off.shape[0] == v_off.shape[0] == N and out.shape[0] == N * Lq * Ev):
        raise ValueError("internal error: attention buffers do not agree")
    if lse.shape[0] not in (0, N * Lq):
        raise ValueError("internal error: lse buffer has the wrong size")
    _check_slices(q_off, Lq * E, Lq * E - 1, q.shape[0], "q")
    _check_slices(k_off, Lk * E, Lk * E - 1, k.shape[0], "k")
    _check_slices(v_off, Lk * Ev, Lk * Ev - 1, v.shape[0], "v")
    cdef bint with_mask = mask.shape[0] > 0
    cdef bint with_bias = bias.shape[0] > 0
    if with_mask:
        _check_slices(mask_off, Lq * Lk, (Lq - 1) * mask_rs + (Lk - 1) * mask_cs,
                      mask.shape[0], "mask")
    if with_bias:
        _check_slices(bias_off, Lq * Lk, (Lq - 1) * bias_rs + (Lk - 1) * bias_cs,
                      bias.shape[0], "bias")

    cdef Py_ssize_t nblk = (Lq + QUERY_BLOCK - 1) // QUERY_BLOCK
    cdef Py_ssize_t nwork = N * nblk
    if nwork == 0:
        return
    cdef int nt = <int> min(num_threads, nwork)
    cdef Py_ssize_t per = _tiles.rows_work_size(QUERY_BLOCK, E, Ev)
    cdef real[::1] work = _scratch(nt, per, np.asarray(out).dtype)

    cdef const real* qp = cptr(q)
    cdef const real* kp = cptr(k)
    cdef const real* vp = cptr(v)
    cdef real* op = wptr(out)
    cdef real* lp = wptr(lse)
    cdef const unsigned char* mp = bptr(mask)
    cdef const real* bp = cptr(bias)
    cdef real* wp = wptr(work)
    cdef real scale_r = <real> scale
    cdef Py_ssize_t w, n, i0, nrows
    cdef real* my_work = NULL

    with nogil, parallel(num_threads=nt):
        my_work = wp + omp_get_thread_num() * per
        for w in prange(nwork, schedule="dynamic"):
            n = w // nblk
            i0 = (w % nblk) * QUERY_BLOCK
            nrows = Lq - i0 if Lq - i0 < QUERY_BLOCK else QUERY_BLOCK
            _tiles.attend_rows(
                qp + q_off[n] + i0 * E, kp + k_off[n], vp + v_off[n],
                op + (n * Lq + i0) * Ev,
                lp + n * Lq + i0 if lp != NULL else NULL,
                nrows, i0, Lk, E, Ev, scale_r, shift,
                mp + mask_off[n] + i0 * mask_rs if with_mask else NULL,
                mask_rs, mask_cs,
                bp + bias_off[n] + i0 * bias_rs if with_bias else NULL,
                bias_rs, bias_cs, my_work)


def scores(const real[::1] q, const real[::1] k, real[::1] out,
           const Py_ssize_t[::1] q_off, const Py_ssize_t[::1] k_off, Py_ssize_t Lq,
           Py_ssize_t Lk, Py_ssize_t E, double scale, Py_ssize_t shift,
           const unsigned char[::1] mask, const Py_ssize_t[::1] mask_off,
           Py_ssize_t mask_rs, Py_ssize_t mask_cs,
           const real[::1] bias, const Py_ssize_t[::1] bias_off,
           Py_ssize_t bias_rs, Py_ssize_t bias_cs, bint softmax, int num_threads):
    """out (N, Lq, Lk) = scale * q @ k^T + bias with blocked entries at -inf, then
    (when `softmax`) the softmax of each row. Arguments as in :func:`attention`."""
    cdef Py_ssize_t N = q_off.shape[0]
    if not (k_off.shape[0] == N and out.shape[0] == N * Lq * Lk):
        raise ValueError("internal error: scores buffers do not agree")
    _check_slices(q_off, Lq * E, Lq * E - 1, q.shape[0], "q")
    _check_slices(k_off, Lk * E, Lk * E - 1, k.shape[0], "k")
    cdef bint with_mask = mask.shape[0] > 0
    cdef bint with_bias = bias.shape[0] > 0
    if with_mask:
        _check_slices(mask_off, Lq * Lk, (Lq - 1) * mask_rs + (Lk - 1) * mask_cs,
                      mask.shape[0], "mask")
    if with_bias:
        _check_slices(bias_off, Lq * Lk, (Lq - 1) * bias_rs + (Lk - 1) * bias_cs,
                      bias.shape[0], "bias")

    cdef Py_ssize_t nblk = (Lq + QUERY_BLOCK - 1) // QUERY_BLOCK
    cdef Py_ssize_t nwork = N * nblk
    if nwork == 0:
        return
    cdef int nt = <int> min(num_threads, nwork)
    cdef Py_ssize_t per = _tiles.rows_work_size(QUERY_BLOCK, E, 0)
    cdef real[::1] work = _scratch(nt, per, np.asarray(out).dtype)

    cdef const real* qp = cptr(q)
    cdef const real* kp = cptr(k)
    cdef real* op = wptr(out)
    cdef const unsigned char* mp = bptr(mask)
    cdef const real* bp = cptr(bias)
    cdef real* wp = wptr(work)
    cdef real scale_r = <real> scale
    cdef Py_ssize_t w, n, i0, nrows
    cdef real* my_work = NULL

    with nogil, parallel(num_threads=nt):
        my_work = wp + omp_get_thread_num() * per
        for w in prange(nwork, schedule="dynamic"):
            n = w // nblk
            i0 = (w % nblk) * QUERY_BLOCK
            nrows = Lq - i0 if Lq - i0 < QUERY_BLOCK else QUERY_BLOCK
            _tiles.score_rows(
                qp + q_off[n] + i0 * E, kp + k_off[n], op + (n * Lq + i0) * Lk,
                nrows, i0, Lk, E, scale_r, shift,
                mp + mask_off[n] + i0 * mask_rs if with_mask else NULL,
                mask_rs, mask_cs,
                bp + bias_off[n] + i0 * bias_rs if with_bias else NULL,
                bias_rs, bias_cs, softmax, my_work)


def weighted_sum(const real[::1] p, const real[::1] v, real[::1] out,
                 const Py_ssize_t[::1] p_off, const Py_ssize_t[::1] v_off,
                 Py_ssize_t Lq, Py_ssize_t Lk, Py_ssize_t Ev, int num_threads):
    """out (N, Lq, Ev) = p @ v per slice; p_off/v_off (N,) locate each slice."""
    cdef Py_ssize_t N = p_off.shape[0]
    if not (v_off.shape[0] == N and out.shape[0] == N * Lq * Ev):
        raise ValueError("internal error: weighted_sum buffers do not agree")
    _check_slices(p_off, Lq * Lk, Lq * Lk - 1, p.shape[0], "p")
    _check_slices(v_off, Lk * Ev, Lk * Ev - 1, v.shape[0], "v")
    cdef Py_ssize_t nblk = (Lq + QUERY_BLOCK - 1) // QUERY_BLOCK
    cdef Py_ssize_t nwork = N * nblk
    if nwork == 0:
        return
    cdef int nt = <int> min(num_threads, nwork)
    cdef const real* pp = cptr(p)
    cdef const real* vp = cptr(v)
    cdef real* op = wptr(out)
    cdef Py_ssize_t w, n, i0, nrows
    with nogil, parallel(num_threads=nt):
        for w in prange(nwork, schedule="static"):
            n = w // nblk
            i0 = (w % nblk) * QUERY_BLOCK
            nrows = Lq - i0 if Lq - i0 < QUERY_BLOCK else QUERY_BLOCK
            _tiles.weighted_rows(pp + p_off[n] + i0 * Lk, vp + v_off[n],
                                 op + (n * Lq + i0) * Ev, nrows, Lk, Ev)


def softmax(const real[::1] x, real[::1] out, Py_ssize_t rows, Py_ssize_t n,
            int num_threads):
    """out (rows, n) = softmax of each row of x (rows, n); x may alias out."""
    if not (x.shape[0] == out.shape[0] == rows * n):
        raise ValueError("internal error: softmax buffers do not agree")
    if rows * n == 0:
        return
    cdef int nt = <int> min(num_threads, rows)
    cdef const real* xp = cptr(x)
    cdef real* op = wptr(out)
    cdef Py_ssize_t r
    with nogil, parallel(num_threads=nt):
        for r in prange(rows, schedule="static"):
            _tiles.softmax_row(xp + r * n, op + r * n, n)
