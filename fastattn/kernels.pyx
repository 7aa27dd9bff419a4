"""The public C-level API declared in kernels.pxd: serial kernels on raw buffers.

The arithmetic lives in ``_gemm.pxd`` and ``_tiles.pxd`` and is shared with the
parallel drivers; the functions here describe one contiguous slice as a Plan and check
the sizes a caller passes.
"""

from libc.stdlib cimport free, malloc

from fastattn cimport _tiles
from fastattn._gemm cimport gemm
from fastattn._parallel cimport aligned
from fastattn._plan cimport (FLOAT32, FLOAT64, MAX_BATCH_AXES, NO_LIMIT, QUERY_TILE,
                             UINT8, DType, Operand, Plan)

cdef extern from "Python.h":
    const Py_ssize_t PY_SSIZE_T_MAX


cdef inline bint size_ok(Py_ssize_t a, Py_ssize_t b) noexcept nogil:
    """a >= 0, b >= 0 and a * b fits in a Py_ssize_t."""
    return a >= 0 and b >= 0 and (b == 0 or a <= PY_SSIZE_T_MAX // b)


# ------------------------------------------------------------------ released in 0.1

cdef void dot_scores(const floating* q, const floating* k, floating* s, Py_ssize_t m,
                     Py_ssize_t n, Py_ssize_t e, floating scale) noexcept nogil:
    dot_scores_checked(q, k, s, m, n, e, scale)


cdef void softmax_rows(const floating* x, floating* y, Py_ssize_t m,
                       Py_ssize_t n) noexcept nogil:
    softmax_rows_checked(x, y, m, n)


cdef void weighted_sum(const floating* p, const floating* v, floating* out, Py_ssize_t m,
                       Py_ssize_t n, Py_ssize_t ev) noexcept nogil:
    weighted_sum_checked(p, v, out, m, n, ev)


cdef void contiguous_operand(Operand* op, const void* data, Py_ssize_t row_stride,
                             DType dtype) noexcept nogil:
    cdef Py_ssize_t d
    op.data = <char*> data
    op.dtype = dtype
    for d in range(MAX_BATCH_AXES):
        op.batch_strides[d] = 0
    op.head_divisor = 1
    op.row_stride = row_stride
    op.col_stride = 1


cdef int attention_slice(const floating* q, const floating* k, const floating* v,
                         floating* out, floating* lse, Py_ssize_t Lq, Py_ssize_t Lk,
                         Py_ssize_t E, Py_ssize_t Ev, floating scale,
                         int causal) noexcept nogil:
    cdef Plan p
    cdef Py_ssize_t b, i0, nrows, per
    cdef DType dtype = FLOAT32 if floating is float else FLOAT64
    if causal != CAUSAL_NONE and causal != CAUSAL_TOP_LEFT \
            and causal != CAUSAL_BOTTOM_RIGHT:
        return ERROR_BAD_CAUSAL
    if not (size_ok(Lq, E) and size_ok(Lk, E) and size_ok(Lk, Ev) and size_ok(Lq, Ev)):
        return ERROR_BAD_SIZE
    # the scratch, (E + KEY_BLOCK + 2 Ev + 8) * QUERY_TILE elements, must fit too
    if E > PY_SSIZE_T_MAX // 64 // QUERY_TILE // <Py_ssize_t> sizeof(floating) \
            or Ev > PY_SSIZE_T_MAX // 64 // QUERY_TILE // <Py_ssize_t> sizeof(floating):
        return ERROR_BAD_SIZE
    p.dtype = dtype
    p.n_batch_axes = 0
    p.n_slices = 1
    p.Lq, p.Lk, p.E, p.Ev = Lq, Lk, E, Ev
    p.scale = scale
    p.groups = 1
    p.query_offset = Lk - Lq if causal == CAUSAL_BOTTOM_RIGHT else 0
    p.window_left = NO_LIMIT
    p.window_right = NO_LIMIT if causal == CAUSAL_NONE else 0
    p.bottom_right = causal == CAUSAL_BOTTOM_RIGHT
    p.slices_per_sequence = 1
    p.softcap = 0
    p.q_lengths = NULL
    p.kv_lengths = NULL
    p.dropout_p = 0
    p.dropout_seed = 0
    p.dropout_threshold = 0
    p.dropout_slice_base = 0
    contiguous_operand(&p.alibi_slopes, NULL, 0, dtype)
    contiguous_operand(&p.q, q, E, dtype)
    contiguous_operand(&p.k, k, E, dtype)
    contiguous_operand(&p.v, v, Ev, dtype)
    contiguous_operand(&p.out, out, Ev, dtype)
    contiguous_operand(&p.lse, lse, 1, dtype)
    contiguous_operand(&p.mask, NULL, 0, UINT8)
    contiguous_operand(&p.bias, NULL, 0, dtype)
    if Lq == 0:
        return 0
    per = _tiles.attend_work_size(&p)
    cdef void* block = malloc(per * sizeof(floating) + 64)
    if block == NULL:
        return ERROR_NO_MEMORY
    for b in range((Lq + QUERY_TILE - 1) // QUERY_TILE):
        i0 = b * QUERY_TILE
        nrows = Lq - i0 if Lq - i0 < QUERY_TILE else QUERY_TILE
        _tiles.attend_tile(&p, 0, i0, nrows, <floating*> aligned(block))
    free(block)
    return 0


# ------------------------------------------------------------------ added in 0.2

cdef int dot_scores_checked(const floating* q, const floating* k, floating* s,
                            Py_ssize_t m, Py_ssize_t n, Py_ssize_t e,
                            floating scale) noexcept nogil:
    cdef Py_ssize_t i, j
    if not (size_ok(m, n) and size_ok(m, e) and size_ok(n, e)):
        return ERROR_BAD_SIZE
    # s^T column by column would need k^T; instead each row of s is k @ q_i
    for i in range(m):
        gemm(k, e, 1, q + i * e, 1, s + i * n, 1, n, 1, e, False)
        for j in range(n):
            s[i * n + j] = scale * s[i * n + j]
    return 0


cdef int softmax_rows_checked(const floating* x, floating* y, Py_ssize_t m,
                              Py_ssize_t n) noexcept nogil:
    cdef Py_ssize_t i
    if not size_ok(m, n):
        return ERROR_BAD_SIZE
    for i in range(m):
        _tiles.softmax_row(x + i * n, y + i * n, n)
    return 0


cdef int weighted_sum_checked(const floating* p, const floating* v, floating* out,
                              Py_ssize_t m, Py_ssize_t n, Py_ssize_t ev) noexcept nogil:
    if not (size_ok(m, n) and size_ok(n, ev) and size_ok(m, ev)):
        return ERROR_BAD_SIZE
    gemm(p, n, 1, v, ev, out, ev, m, ev, n, False)
    return 0
