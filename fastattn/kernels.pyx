"""The public C-level API declared in kernels.pxd: serial kernels on raw buffers.

The arithmetic lives in ``_gemm.pxd`` and ``_tiles.pxd`` and is shared with the
parallel drivers; the functions here describe one contiguous slice as a Plan and check
the sizes a caller passes.
"""

from libc.math cimport INFINITY, fabs, isfinite, isnan
from libc.stdlib cimport free, malloc

from fastattn cimport _tiles
from fastattn._engines cimport TileScratch, tile_scratch
from fastattn._gemm cimport gemm
from fastattn._parallel cimport aligned
from fastattn._plan cimport (FLOAT32, FLOAT64, NO_LIMIT, QUERY_TILE, UINT8, DType, Plan,
                             plan_init, set_operand)
from fastattn._softmax cimport softmax_row

cdef extern from "Python.h":
    const Py_ssize_t PY_SSIZE_T_MAX

cdef extern from "philox.h":
    unsigned int fastattn_dropout_threshold(double dropout_p) noexcept nogil


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


cdef int attention_slice(const floating* q, const floating* k, const floating* v,
                         floating* out, floating* lse, Py_ssize_t Lq, Py_ssize_t Lk,
                         Py_ssize_t E, Py_ssize_t Ev, floating scale,
                         int causal) noexcept nogil:
    return attention_slice_variants(q, k, v, out, lse, Lq, Lk, E, Ev, scale, causal,
                                    NULL, NULL, WINDOW_UNBOUNDED, WINDOW_UNBOUNDED,
                                    0, 0, LENGTH_ALL, LENGTH_ALL, 0, 0, 0)


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
        softmax_row(x + i * n, y + i * n, n, -INFINITY)
    return 0


cdef int weighted_sum_checked(const floating* p, const floating* v, floating* out,
                              Py_ssize_t m, Py_ssize_t n, Py_ssize_t ev) noexcept nogil:
    if not (size_ok(m, n) and size_ok(n, ev) and size_ok(m, ev)):
        return ERROR_BAD_SIZE
    gemm(p, n, 1, v, ev, out, ev, m, ev, n, False)
    return 0


cdef inline Py_ssize_t window_side(Py_ssize_t side, double limit) noexcept nogil:
    """A window side as the Plan holds it: NO_LIMIT when unbounded or when it is at
    least ``limit`` (wider than any |i + d - j|, so it restricts nothing)."""
    if side == WINDOW_UNBOUNDED or <double> side >= limit:
        return NO_LIMIT
    return side


cdef int attention_slice_variants(const floating* q, const floating* k,
                                  const floating* v, floating* out, floating* lse,
                                  Py_ssize_t Lq, Py_ssize_t Lk, Py_ssize_t E,
                                  Py_ssize_t Ev, floating scale, int causal,
                                  const unsigned char* mask, const floating* bias,
                                  Py_ssize_t window_left, Py_ssize_t window_right,
                                  double softcap, double alibi_slope,
                                  Py_ssize_t q_length, Py_ssize_t kv_length,
                                  double dropout_p, unsigned long long dropout_seed,
                                  Py_ssize_t slice_index) noexcept nogil:
    return attention_slice_sinks(q, k, v, out, lse, Lq, Lk, E, Ev, scale, causal, mask,
                                 bias, window_left, window_right, softcap, alibi_slope,
                                 -INFINITY, q_length, kv_length, dropout_p,
                                 dropout_seed, slice_index)


# ------------------------------------------------------------------ added in 0.3

cdef int attention_slice_sinks(const floating* q, const floating* k,
                               const floating* v, floating* out, floating* lse,
                               Py_ssize_t Lq, Py_ssize_t Lk, Py_ssize_t E,
                               Py_ssize_t Ev, floating scale, int causal,
                               const unsigned char* mask, const floating* bias,
                               Py_ssize_t window_left, Py_ssize_t window_right,
                               double softcap, double alibi_slope, double sink,
                               Py_ssize_t q_length, Py_ssize_t kv_length,
                               double dropout_p, unsigned long long dropout_seed,
                               Py_ssize_t slice_index) noexcept nogil:
    cdef Plan p
    cdef Py_ssize_t b, i0, nrows, offset
    cdef Py_ssize_t q_len = Lq if q_length == LENGTH_ALL else q_length
    cdef Py_ssize_t kv_len = Lk if kv_length == LENGTH_ALL else kv_length
    cdef floating slope = <floating> alibi_slope
    cdef floating sink_value = <floating> sink
    cdef double limit
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
    if (window_left < WINDOW_UNBOUNDED or window_right < WINDOW_UNBOUNDED
            or q_len < 0 or q_len > Lq or kv_len < 0 or kv_len > Lk
            or not (isfinite(softcap) and softcap >= 0) or not isfinite(alibi_slope)
            or not (dropout_p >= 0 and dropout_p < 1) or slice_index < 0
            or isnan(sink) or sink == INFINITY):
        return ERROR_BAD_ARGUMENT
    if Lq == 0 or (Ev == 0 and lse == NULL):
        return 0                            # nothing to write
    offset = kv_len - q_len if causal == CAUSAL_BOTTOM_RIGHT else 0
    limit = <double> Lq + <double> Lk + fabs(<double> offset) + 1
    plan_init(&p, dtype, Lq, Lk, E, Ev, scale)
    p.query_offset = offset
    p.window_left = window_side(window_left, limit)
    p.window_right = window_side(window_right, limit)
    if causal != CAUSAL_NONE:
        p.window_right = 0                  # j <= i + d, and a right side is >= 0
    p.bottom_right = causal == CAUSAL_BOTTOM_RIGHT
    p.softcap = softcap
    p.q_lengths = NULL if q_length == LENGTH_ALL else &q_len
    p.kv_lengths = NULL if kv_length == LENGTH_ALL else &kv_len
    p.dropout_p = dropout_p
    p.dropout_seed = dropout_seed
    p.dropout_threshold = fastattn_dropout_threshold(dropout_p)
    p.dropout_slice_base = slice_index
    set_operand(&p.alibi_slopes, &slope if alibi_slope != 0 else NULL, dtype, 0, 1)
    set_operand(&p.sinks, &sink_value if sink != -INFINITY else NULL, dtype, 0, 1)
    set_operand(&p.q, q, dtype, E, 1)
    set_operand(&p.k, k, dtype, E, 1)
    set_operand(&p.v, v, dtype, Ev, 1)
    set_operand(&p.out, out, dtype, Ev, 1)
    set_operand(&p.lse, lse, dtype, 1, 1)
    set_operand(&p.mask, mask, UINT8, Lk, 1)
    set_operand(&p.bias, bias, dtype, Lk, 1)
    cdef TileScratch s
    cdef void* block = malloc(tile_scratch(&p, NULL, &s) + 64)
    if block == NULL:
        return ERROR_NO_MEMORY
    tile_scratch(&p, <char*> aligned(block), &s)
    for b in range((Lq + QUERY_TILE - 1) // QUERY_TILE):
        i0 = b * QUERY_TILE
        nrows = Lq - i0 if Lq - i0 < QUERY_TILE else QUERY_TILE
        _tiles.attend_tile(&p, 0, i0, nrows, &s, NULL)
    free(block)
    return 0
