# The parallel loops: OpenMP over independent work items. Included by the
# _drivers_<level>.pyx modules, which compile this same source for several
# instruction-set levels (see setup.py and _dispatch.py).
#
# Each driver takes flat C-contiguous buffers in the computation dtype plus, for every
# (batch·head) slice n of the output, the element offset of that slice in each input
# (this is how broadcasting and grouped-query heads reach the kernels without copies),
# checks that every slice lies inside its buffer, releases the GIL and runs the tile
# kernels of ``_tiles.pxd``. A work item is always computed whole by one thread, in a
# fixed order, and how the work is cut depends only on the shapes, so results are
# bit-identical for any number of threads.

import numpy as np

from cython.parallel cimport parallel, prange
from libc.stdint cimport uintptr_t

from fastattn cimport _tiles
from fastattn._openmp cimport omp_get_thread_num
from fastattn._tiles cimport real

cdef enum:
    QUERY_BLOCK = 64        # query rows per work item (= _tiles.QUERY_TILE)
    FEW_ROWS = 4            # at most this many query rows per slice: the decoding path
    FEW_MAX_ROWS = 64       # query rows (over a grouped-query group) in one decoding item
    SPLIT_ITEMS = 32        # decoding: split the keys until there are this many items
    SPLIT_MIN_KEYS = 256    # ... but never into pieces of fewer keys than this


cdef inline real* aligned(real* p) noexcept nogil:
    """p moved up to the next multiple of 64 bytes (the scratch has room for it)."""
    cdef uintptr_t a = <uintptr_t> p
    return <real*> ((a + 63) // 64 * 64)


cdef inline const Py_ssize_t* iptr(const Py_ssize_t[::1] a) noexcept nogil:
    return &a[0] if a.shape[0] > 0 else NULL


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
    """Room for `threads` scratch areas of `per_thread` elements, plus 64 bytes."""
    return np.empty(max(threads * per_thread, 1) + 64, dtype=dtype)


def _group_size(Py_ssize_t groups, Py_ssize_t Lq, k_off, v_off):
    """Consecutive slices that share one K/V slice and fit one decoding item."""
    cdef Py_ssize_t g = groups
    while g > 1 and (groups % g or g * Lq > FEW_MAX_ROWS):
        g -= 1
    if g > 1:
        k_off = np.asarray(k_off).reshape(-1, g)
        v_off = np.asarray(v_off).reshape(-1, g)
        if not ((k_off == k_off[:, :1]).all() and (v_off == v_off[:, :1]).all()):
            g = 1
    return g


def attention(const real[::1] q, const real[::1] k, const real[::1] v, real[::1] out,
              real[::1] lse, const Py_ssize_t[::1] q_off, const Py_ssize_t[::1] k_off,
              const Py_ssize_t[::1] v_off, Py_ssize_t Lq, Py_ssize_t Lk, Py_ssize_t E,
              Py_ssize_t Ev, double scale, Py_ssize_t shift,
              const unsigned char[::1] mask, const Py_ssize_t[::1] mask_off,
              Py_ssize_t mask_rs, Py_ssize_t mask_cs,
              const real[::1] bias, const Py_ssize_t[::1] bias_off,
              Py_ssize_t bias_rs, Py_ssize_t bias_cs, int num_threads,
              Py_ssize_t groups=1):
    """Fused attention of N slices: out (N, Lq, Ev), lse (N, Lq) (or empty: not wanted).

    q_off/k_off/v_off (N,) are element offsets of each slice in q, k, v. A mask or bias
    is given as its own elements plus offsets (N,) and row/column strides (0 where it
    broadcasts); an empty mask/bias buffer means none. shift: query i may attend to
    key j iff j <= i + shift (shift >= Lk: no causal limit). groups: runs of this many
    consecutive slices share their K/V slice (grouped-query attention), which lets the
    decoding path read each K/V slice once per group.

    Lq > FEW_ROWS: work items are (slice, block of 64 query rows), scheduled
    dynamically, longest first (causal items differ in cost). Lq <= FEW_ROWS (decoding): items are
    (group of slices, range of keys); the key ranges depend only on the shapes, and
    their partial results are merged in key order.
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
    if N * Lq == 0:
        return
    if Lq <= FEW_ROWS:
        _attention_few(q, k, v, out, lse, q_off, k_off, v_off, Lq, Lk, E, Ev, scale,
                       shift, mask, mask_off, mask_rs, mask_cs, bias, bias_off,
                       bias_rs, bias_cs, num_threads, groups)
        return

    cdef Py_ssize_t nblk = (Lq + QUERY_BLOCK - 1) // QUERY_BLOCK
    cdef Py_ssize_t nwork = N * nblk
    cdef int nt = <int> min(num_threads, nwork)
    cdef Py_ssize_t per = _tiles.attend_work_size(E, Ev)
    cdef real[::1] work = _scratch(nt, per, np.asarray(out).dtype)

    cdef const real* qp = cptr(q)
    cdef const real* kp = cptr(k)
    cdef const real* vp = cptr(v)
    cdef real* op = wptr(out)
    cdef real* lp = wptr(lse)
    cdef const unsigned char* mp = bptr(mask)
    cdef const real* bp = cptr(bias)
    cdef real* wp = aligned(wptr(work))
    cdef real scale_r = <real> scale
    cdef Py_ssize_t w, n, i0, nrows
    cdef real* my_work = NULL

    with nogil, parallel(num_threads=nt):
        my_work = wp + omp_get_thread_num() * per
        for w in prange(nwork, schedule="dynamic"):
            # the last query blocks first: under a causal mask they are the longest,
            # and handing out the long items first evens out the threads' finish
            n = w // nblk
            i0 = (nblk - 1 - w % nblk) * QUERY_BLOCK
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


def _attention_few(const real[::1] q, const real[::1] k, const real[::1] v,
                   real[::1] out, real[::1] lse, const Py_ssize_t[::1] q_off,
                   const Py_ssize_t[::1] k_off, const Py_ssize_t[::1] v_off,
                   Py_ssize_t Lq, Py_ssize_t Lk, Py_ssize_t E, Py_ssize_t Ev,
                   double scale, Py_ssize_t shift, const unsigned char[::1] mask,
                   const Py_ssize_t[::1] mask_off, Py_ssize_t mask_rs, Py_ssize_t mask_cs,
                   const real[::1] bias, const Py_ssize_t[::1] bias_off,
                   Py_ssize_t bias_rs, Py_ssize_t bias_cs, int num_threads,
                   Py_ssize_t groups):
    """The decoding path of :func:`attention` (checked arguments, Lq <= FEW_ROWS)."""
    cdef Py_ssize_t N = q_off.shape[0]
    cdef Py_ssize_t G = _group_size(groups, Lq, k_off, v_off)
    cdef Py_ssize_t R = G * Lq
    cdef Py_ssize_t ngroups = N // G
    cdef Py_ssize_t nsplit = 1, chunk = Lk if Lk > 0 else 1
    if ngroups < SPLIT_ITEMS and Lk >= 2 * SPLIT_MIN_KEYS:
        nsplit = min((SPLIT_ITEMS + ngroups - 1) // ngroups, Lk // SPLIT_MIN_KEYS)
        chunk = ((Lk + nsplit - 1) // nsplit + _tiles.KEY_BLOCK - 1) \
            // _tiles.KEY_BLOCK * _tiles.KEY_BLOCK
        nsplit = (Lk + chunk - 1) // chunk
    cdef Py_ssize_t nwork = ngroups * nsplit
    cdef int nt = <int> min(num_threads, nwork)
    dtype = np.asarray(out).dtype
    cdef Py_ssize_t per = R * (E + _tiles.KEY_BLOCK + Ev) + 16
    cdef real[::1] work = _scratch(nt, per, dtype)
    cdef real[::1] part_acc = np.empty(nwork * R * Ev + 1, dtype=dtype)
    cdef real[::1] part_m = np.empty(nwork * R + 1, dtype=dtype)
    cdef double[::1] part_l = np.empty(nwork * R + 1, dtype=np.float64)

    cdef const real* qp = cptr(q)
    cdef const real* kp = cptr(k)
    cdef const real* vp = cptr(v)
    cdef real* op = wptr(out)
    cdef real* lp = wptr(lse)
    cdef const unsigned char* mp = bptr(mask)
    cdef const real* bp = cptr(bias)
    cdef const Py_ssize_t* mop = iptr(mask_off)
    cdef const Py_ssize_t* bop = iptr(bias_off)
    cdef real* wp = aligned(wptr(work))
    cdef real* pa = wptr(part_acc)
    cdef real* pm = wptr(part_m)
    cdef double* pl = &part_l[0]
    cdef real scale_r = <real> scale
    cdef Py_ssize_t w, gi, sp, n0, g, kend
    cdef real* qs = NULL
    cdef real* s = NULL

    with nogil, parallel(num_threads=nt):
        qs = wp + omp_get_thread_num() * per
        s = qs + R * E
        for w in prange(nwork, schedule="dynamic"):
            gi = w // nsplit
            sp = w % nsplit
            n0 = gi * G
            for g in range(G):
                _tiles.prescale_rows(qp + q_off[n0 + g], qs + g * Lq * E, Lq * E,
                                     scale_r)
            kend = (sp + 1) * chunk if (sp + 1) * chunk < Lk else Lk
            _tiles.attend_few(
                qs, kp + k_off[n0], vp + v_off[n0], pa + w * R * Ev, pm + w * R,
                pl + w * R, G, Lq, sp * chunk, kend, Lk, E, Ev, shift,
                mp, mop + n0 if mop != NULL else NULL, mask_rs, mask_cs,
                bp, bop + n0 if bop != NULL else NULL, bias_rs, bias_cs, s)
    # serial: the merge is tiny, and a second parallel region would make every call
    # wait once more for all its threads (costly when the cores are oversubscribed)
    with nogil:
        for gi in range(ngroups):
            _tiles.merge_parts(pa + gi * nsplit * R * Ev, pm + gi * nsplit * R,
                               pl + gi * nsplit * R, nsplit, R, R, Ev,
                               op + gi * R * Ev,
                               lp + gi * R if lp != NULL else NULL)


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
