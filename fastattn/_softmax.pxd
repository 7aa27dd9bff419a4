# The softmax, max-subtracted, as a row at a time (softmax_row, exp_row: decoding,
# the scores pass) and as the online softmax of a tile (the running max m, the running
# sum l of the weights, and the factor alpha = e^(m_old - m_new) of the earlier sums),
# which a tile advances one key block at a time:
#
#     m_new = max(m, max_j s_j)       softmax_max (a NaN score is skipped here and
#     alpha = e^(m - m_new)                        reaches the sums)
#     p_j   = e^(s_j - m_new)         softmax_weights
#     l     = alpha l + sum_j p_j
#
# ("-inf means 0": a row with no allowed key yet subtracts 0, so -inf scores give
# weight 0.) With AVX-512 or AVX2 and float32, the block steps run in src/fa_softmax.h
# (two passes over the block, eight keys' weights added in float32 before the sum in
# double: the row sums agree with the loops below to float32 rounding); elsewhere the
# portable loops below.

from libc.math cimport INFINITY, NAN, isfinite

from fastattn._csrc cimport (FA_HAVE_BLOCK_SOFTMAX, fa_block_exp, fa_block_max, fa_exp,
                             fa_expf, fa_row_max)
from fastattn._gemm cimport real
from fastattn._operands cimport sink_of
from fastattn._plan cimport QUERY_TILE, Plan, queries_of

cdef enum:
    LANES = 16              # partial maxima and sums (vectorise without reassociation)


cdef inline real exp_(real x) noexcept nogil:
    """e^x, vectorisable; 0 below the dtype's smallest normal number (src/fa_exp.h)."""
    if real is float:
        return fa_expf(x)
    else:
        return fa_exp(x)


cdef inline bint all_finite(const real* x, Py_ssize_t rows, Py_ssize_t cols,
                            Py_ssize_t row_stride) noexcept nogil:
    """No NaN and no inf in x (rows, cols) (x - x is NaN exactly for those)."""
    cdef Py_ssize_t r, c
    cdef real d
    cdef int flag = 0
    if row_stride == cols:          # contiguous rows: one flat loop
        cols = rows * cols
        rows = 1
    for r in range(rows):
        for c in range(cols):
            d = x[r * row_stride + c] - x[r * row_stride + c]
            flag = flag | (d != d)
    return not flag


# --------------------------------------------------------------------- one row

cdef inline real row_max(const real* x, Py_ssize_t n) noexcept nogil:
    """The largest entry, -inf for none; NaN entries are skipped here and caught later.

    LANES running maxima, lane x over entries x, x + LANES, ... (a max is exact in any
    order, so the result is that of one pass in order; `a if a > b else b` is vmaxps,
    which gcc may vectorise without -ffast-math, where a single running max would be
    a chain of dependent instructions; with AVX-512 or AVX2, fa_row_max, the same
    steps in vector form).
    """
    cdef Py_ssize_t c, x0, main = n - n % LANES
    cdef real part[LANES]
    cdef real m = -INFINITY
    if real is float and FA_HAVE_BLOCK_SOFTMAX:
        return fa_row_max(x, n)
    if main:
        for x0 in range(LANES):
            part[x0] = -INFINITY
        for c in range(main // LANES):
            for x0 in range(LANES):
                part[x0] = (x[c * LANES + x0] if x[c * LANES + x0] > part[x0]
                            else part[x0])
        for x0 in range(LANES):
            m = part[x0] if part[x0] > m else m
    for c in range(main, n):
        if x[c] > m:
            m = x[c]
    return m


cdef inline double exp_row(real* x, Py_ssize_t n, real m) noexcept nogil:
    """x[c] = exp(x[c] - m) in place; returns the sum (in double).

    ``m == -inf`` (nothing allowed yet) subtracts 0 instead, so -inf entries give 0
    and NaN entries stay NaN and reach the sum. The sum: LANES partial sums in double
    (entry c into lane c % LANES, in order), then lanes x + 8 into x, x + 4 into x,
    (0 + 2) + (1 + 3), then the tail in order.
    """
    cdef Py_ssize_t c, x0, main = n - n % LANES
    cdef double part[LANES]
    cdef double total = 0
    if m == -INFINITY:
        m = 0
    for c in range(n):              # vectorised
        x[c] = exp_(x[c] - m)
    if main:
        for x0 in range(LANES):
            part[x0] = 0
        for c in range(main // LANES):
            for x0 in range(LANES):
                part[x0] = part[x0] + x[c * LANES + x0]
        for x0 in range(8):
            part[x0] = part[x0] + part[x0 + 8]
        for x0 in range(4):
            part[x0] = part[x0] + part[x0 + 4]
        total = (part[0] + part[2]) + (part[1] + part[3])
    for c in range(main, n):        # in order
        total += x[c]
    return total


cdef inline void softmax_row(const real* x, real* y, Py_ssize_t n,
                             double sink) noexcept nogil:
    """y = softmax(x) over n entries, max-subtracted; all -inf gives zeros (x may be y).
    With a sink (not -inf), one more logit joins the softmax with no entry of its own:
    y = exp(x - m) / (sum exp(x - m) + exp(sink - m)), m the max of both."""
    cdef Py_ssize_t c
    cdef real m = row_max(x, n)
    cdef double total
    cdef real inv
    if sink > m:
        m = <real> sink
    for c in range(n):
        y[c] = x[c]
    total = exp_row(y, n, m)
    if sink != -INFINITY:       # (NaN or +inf: a NaN total, and a NaN row)
        total += exp_(<real> (sink - m))
    if total == 0:
        for c in range(n):
            y[c] = 0
        return
    inv = <real> (1.0 / total)
    for c in range(n):
        y[c] = y[c] * inv


# ------------------------------------------------------- the online softmax of a tile

cdef struct Softmax:
    # the online softmax of a tile's rows, one lane each (QUERY_TILE lanes)
    void* m             # the running max (PyTorch: qk_max), in the computation dtype
    void* m_sub         # the max the block's weights subtract ("-inf means 0")
    void* alpha         # e^(m_old - m_new): the factor of the earlier sums
    double* l           # the running sum of the weights (PyTorch: qk_sum)
    double* l_blk       # the block's row sums (the portable path)


cdef inline void start_rows(const Plan* p, Py_ssize_t n, Py_ssize_t i0, Py_ssize_t nrows,
                            Py_ssize_t lanes, bint with_sink, real* m,
                            double* l) noexcept nogil:
    """The online softmax's state before any key, m = -inf and l = 0, in `lanes`
    lanes for query rows i0..i0+nrows of slice n. With the sink (in the piece that
    holds it), each of those rows that is inside its sequence starts as if it had met
    one key of score `sink` and no value: m = sink, l = 1; a NaN or +inf sink makes
    l NaN, and with it the row's result."""
    cdef Py_ssize_t r, valid
    cdef double sink = sink_of(p, n) if with_sink else -INFINITY
    for r in range(lanes):
        m[r] = -INFINITY
        l[r] = 0
    if sink == -INFINITY:
        return
    valid = queries_of(p, n) - i0
    if valid > nrows:
        valid = nrows
    for r in range(valid):
        if isfinite(sink):
            m[r] = <real> sink
            l[r] = 1
        else:
            l[r] = NAN


cdef inline void softmax_max(real* st, Py_ssize_t bc, Py_ssize_t nr, real prescale,
                             const Softmax* sm) noexcept nogil:
    """The block's scores st (bc keys by QUERY_TILE lanes, the first nr used; times
    `prescale` first where it is not 1): the new running max m, the max to subtract
    m_sub, and alpha. (nr is QUERY_TILE for whole tiles: a constant to the loops.)"""
    if real is float:
        if FA_HAVE_BLOCK_SOFTMAX:
            fa_block_max(<float*> st, bc, nr, prescale, <float*> sm.m, <float*> sm.m_sub,
                         <float*> sm.alpha)
            return
    if nr == QUERY_TILE:
        running_max(st, bc, QUERY_TILE, <real*> sm.m, <real*> sm.m_sub,
                    <real*> sm.alpha)
    else:
        running_max(st, bc, nr, <real*> sm.m, <real*> sm.m_sub, <real*> sm.alpha)


cdef inline void softmax_weights(real* st, Py_ssize_t bc, Py_ssize_t nr,
                                 const Softmax* sm) noexcept nogil:
    """st = e^(st - m_sub) (the block's weights, before any dropout) and
    l = alpha l + the block's row sums (summed in double)."""
    if real is float:
        if FA_HAVE_BLOCK_SOFTMAX:
            fa_block_exp(<float*> st, bc, nr, <const float*> sm.m_sub,
                         <const float*> sm.alpha, sm.l)
            return
    if nr == QUERY_TILE:
        block_weights(st, bc, QUERY_TILE, <const real*> sm.m_sub,
                      <const real*> sm.alpha, sm.l, sm.l_blk)
    else:
        block_weights(st, bc, nr, <const real*> sm.m_sub, <const real*> sm.alpha, sm.l,
                      sm.l_blk)


cdef inline void running_max(real* st, Py_ssize_t bc, Py_ssize_t lanes, real* m,
                             real* m_new, real* alpha) noexcept nogil:
    """softmax_max, portable: m = the new running max of each lane, m_new = the max to
    subtract, alpha = exp(m_old - m_new)."""
    cdef Py_ssize_t r, c
    cdef real x, m_old
    for r in range(lanes):
        m_new[r] = m[r]
    for c in range(bc):
        for r in range(lanes):
            x = st[c * QUERY_TILE + r]
            m_new[r] = x if x > m_new[r] else m_new[r]
    for r in range(lanes):
        m_old = m[r]
        m[r] = m_new[r]
        m_new[r] = 0 if m_new[r] == -INFINITY else m_new[r]
        alpha[r] = exp_(m_old - m_new[r])


cdef inline void block_weights(real* st, Py_ssize_t bc, Py_ssize_t lanes,
                               const real* m_new, const real* alpha, double* l,
                               double* l_blk) noexcept nogil:
    """softmax_weights, portable: st = exp(st - m_new) and l = alpha * l + the block's
    row sums, summed in double."""
    cdef Py_ssize_t r, c
    for c in range(bc):
        for r in range(lanes):
            st[c * QUERY_TILE + r] = exp_(st[c * QUERY_TILE + r] - m_new[r])
    for r in range(lanes):
        l_blk[r] = 0
    for c in range(bc):
        for r in range(lanes):
            l_blk[r] = l_blk[r] + <double> st[c * QUERY_TILE + r]
    for r in range(lanes):
        l[r] = l[r] * alpha[r] + l_blk[r]
