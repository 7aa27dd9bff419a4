"""The public C-level API declared in kernels.pxd: serial kernels on raw buffers.

The arithmetic itself lives in ``_tiles.pxd`` and is shared with the parallel drivers;
the functions here only adapt it to plain pointer-plus-size signatures.
"""

from libc.stdlib cimport free, malloc

from fastattn cimport _tiles


cdef void dot_scores(const floating* q, const floating* k, floating* s, Py_ssize_t m,
                     Py_ssize_t n, Py_ssize_t e, floating scale) noexcept nogil:
    cdef Py_ssize_t i, j, t
    cdef floating acc
    for i in range(m):
        for j in range(n):
            acc = 0
            for t in range(e):
                acc = acc + q[i * e + t] * k[j * e + t]
            s[i * n + j] = scale * acc


cdef void softmax_rows(const floating* x, floating* y, Py_ssize_t m,
                       Py_ssize_t n) noexcept nogil:
    cdef Py_ssize_t i
    for i in range(m):
        _tiles.softmax_row(x + i * n, y + i * n, n)


cdef void weighted_sum(const floating* p, const floating* v, floating* out, Py_ssize_t m,
                       Py_ssize_t n, Py_ssize_t ev) noexcept nogil:
    _tiles.weighted_rows(p, v, out, m, n, ev)



cdef int attention_slice(const floating* q, const floating* k, const floating* v,
                         floating* out, floating* lse, Py_ssize_t Lq, Py_ssize_t Lk,
                         Py_ssize_t E, Py_ssize_t Ev, floating scale,
                         int causal) noexcept nogil:
    cdef Py_ssize_t shift
    if causal == CAUSAL_NONE:
        shift = Lk
    elif causal == CAUSAL_TOP_LEFT:
        shift = 0
    elif causal == CAUSAL_BOTTOM_RIGHT:
        shift = Lk - Lq
    else:
        return -2
    cdef Py_ssize_t b, i0, nrows
    cdef floating* work = <floating*> malloc(
        _tiles.attend_work_size(E, Ev) * sizeof(floating))
    if work == NULL:
        return -1
    for b in range((Lq + _tiles.QUERY_TILE - 1) // _tiles.QUERY_TILE):
        i0 = b * _tiles.QUERY_TILE
        nrows = Lq - i0 if Lq - i0 < _tiles.QUERY_TILE else _tiles.QUERY_TILE
        _tiles.attend_rows(q + i0 * E, k, v, out + i0 * Ev,
                           lse + i0 if lse != NULL else NULL,
                           nrows, i0, Lk, E, Ev, scale, shift,
                           NULL, 0, 0, NULL, 0, 0, work)
    free(work)
    return 0
