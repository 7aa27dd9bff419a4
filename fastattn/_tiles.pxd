# The arithmetic of the forward pass on tiles, written once for float and double.
#
# Every function is `cdef inline ... noexcept nogil` and takes (plan, work item,
# scratch): the plan (_plan.pxd) says where every operand lives and which keys each
# query may attend to; a work item is a slice and a range of its query rows (or, for
# decoding, of its keys); the scratch is the calling thread's own. Products go through
# the one micro-GEMM (_gemm.pxd). Nothing here allocates, touches Python objects or
# knows about threads; the module that cimports this file decides the instruction set.

from libc.math cimport INFINITY, NAN, isfinite, log

from fastattn._gemm cimport gemm, real, scaled_plus
from fastattn._parallel cimport Interrupt, interrupted
from libc.stdint cimport uint16_t

from fastattn._plan cimport (BFLOAT16, DECODE_KEYS, DOT_AMX_BF16, DOT_AVX512_BF16, FLOAT16,
                             FLOAT32, keys_of, queries_of,
                             KEY_BLOCK, NO_LIMIT, QUERY_TILE, DType, KeyRange, Operand, Plan,
                             element_size, key_begin, key_end, offset_of, slice_offset,
                             tile_keys)

cdef extern from "fa_exp.h":
    float fa_expf(float x) noexcept nogil
    double fa_exp(double x) noexcept nogil
    double fa_tanh(double x) noexcept nogil

cdef extern from "fa_half.h":
    void fa_widen_rows(const void* src, DType kind, Py_ssize_t src_rs, Py_ssize_t rows,
                       Py_ssize_t cols, float* dst) noexcept nogil
    float fa_widen(const void* src, DType kind, Py_ssize_t index) noexcept nogil
    void fa_narrow_row(const float* s, Py_ssize_t n, uint16_t* d,
                       DType kind) noexcept nogil

cdef extern from "fa_transpose.h":
    # 32-bit words (float32 or bfloat16 pairs), passed as void*
    void fa_transpose32(const void* src, Py_ssize_t src_rs, Py_ssize_t rows,
                        Py_ssize_t cols, void* dst, Py_ssize_t dst_rs,
                        Py_ssize_t dst_cols, const float* scale,
                        Py_ssize_t scale_step) noexcept nogil

cdef extern from "fa_dots.h":
    bint FA_HAVE_DOTS                   # this module has fa_dots, fa_pv (AVX-512)
    # k, v: float32, bfloat16 or float16 rows (kind: their DType), read in place
    void fa_dots(const float* q, Py_ssize_t q_rs, Py_ssize_t R, const void* k,
                 DType kind, Py_ssize_t k_rs, Py_ssize_t C, Py_ssize_t E, float* s,
                 Py_ssize_t s_rs, Py_ssize_t limit) noexcept nogil
    void fa_pv(const float* w, Py_ssize_t w_rs, Py_ssize_t R, const void* v, DType kind,
               Py_ssize_t v_rs, Py_ssize_t C, Py_ssize_t Ev, float* out,
               Py_ssize_t out_rs, Py_ssize_t limit) noexcept nogil

cdef extern from "fa_bf16.h":
    bint FA_HAVE_AVX512_BF16            # this module has the kernel
    # qp: 32-bit words (bfloat16 pairs), passed as void*
    void fa_bf16_pack_queries(const uint16_t* q, Py_ssize_t q_rs, Py_ssize_t nrows,
                              Py_ssize_t E, void* qp) noexcept nogil
    void fa_bf16_scores(const uint16_t* k, Py_ssize_t k_rs, Py_ssize_t bc,
                        const void* qp, Py_ssize_t E2, float alpha,
                        float* st) noexcept nogil
    # the backward's gradient products (bp: 32-bit words, bfloat16 pairs of rows)
    void fa_bf16_product(const uint16_t* a, Py_ssize_t a_rs, Py_ssize_t M,
                         const void* bp, Py_ssize_t bp_rs, Py_ssize_t K2, Py_ssize_t N,
                         float alpha, float* c, Py_ssize_t ldc,
                         bint accumulate) noexcept nogil
    void fa_bf16_pair_rows(const uint16_t* x, Py_ssize_t x_rs, Py_ssize_t nrows,
                           Py_ssize_t N, void* bp) noexcept nogil
    void fa_bf16_transpose_keys(const uint16_t* k, Py_ssize_t k_rs, Py_ssize_t nkeys,
                                Py_ssize_t E, uint16_t* kt, Py_ssize_t kt_rs) noexcept nogil
    void fa_bf16_round_tile(const float* st, Py_ssize_t bc, uint16_t* a) noexcept nogil

cdef extern from "fa_amx.h":
    bint FA_HAVE_AMX_BF16               # this module has the AMX kernels
    # qp, pp, vt: 32-bit words (bfloat16 pairs), passed as void*
    void fa_amx_begin() noexcept nogil
    void fa_amx_end() noexcept nogil
    void fa_amx_scores(const uint16_t* k, Py_ssize_t k_rs, Py_ssize_t bc, const void* qp,
                       Py_ssize_t E, Py_ssize_t nr, float alpha, float* st) noexcept nogil
    bint fa_amx_pack_values(const uint16_t* v, Py_ssize_t v_rs, Py_ssize_t bc,
                            Py_ssize_t Ev, void* vt) noexcept nogil
    void fa_amx_pv(const void* vt, Py_ssize_t bc, Py_ssize_t Ev, const float* st,
                   Py_ssize_t nr, void* pp, float* acc, bint first) noexcept nogil

cdef extern from "fa_softmax.h":
    bint FA_HAVE_BLOCK_SOFTMAX          # this module has them (AVX-512)
    void fa_block_max(float* st, Py_ssize_t bc, Py_ssize_t nr, float scale, float* m,
                      float* m_sub, float* alpha) noexcept nogil
    void fa_block_exp(float* st, Py_ssize_t bc, Py_ssize_t nr, const float* m_sub,
                      const float* alpha, double* l) noexcept nogil

cdef extern from "fa_prefetch.h":
    void fa_prefetch_rows(const void* p, Py_ssize_t rows, Py_ssize_t bytes,
                          Py_ssize_t stride) noexcept nogil

cdef extern from "philox.h":
    # counters are 32 and 64 bits by design (the C header converts)
    void fastattn_dropout_keep4(unsigned long long dropout_seed, Py_ssize_t slice_index,
                                Py_ssize_t row, Py_ssize_t key_group,
                                unsigned int dropout_threshold,
                                unsigned char keep[4]) noexcept nogil
    bint fastattn_dropout_keep(unsigned long long dropout_seed, Py_ssize_t slice_index,
                               Py_ssize_t row, Py_ssize_t key,
                               unsigned int dropout_threshold) noexcept nogil

cdef enum:
    ALIGN = 16              # scratch areas start on multiples of 16 elements
    CHECK_EVERY = 16        # blocks (or decode steps) between two looks for Ctrl-C
    LANES = 16              # partial sums kept by dot_ (vectorises without reassociation)


cdef inline real exp_(real x) noexcept nogil:
    """e^x, vectorisable (src/fa_exp.h)."""
    if real is float:
        return fa_expf(x)
    else:
        return fa_exp(x)


cdef inline Py_ssize_t round_up(Py_ssize_t n) noexcept nogil:
    return (n + ALIGN - 1) // ALIGN * ALIGN


# --------------------------------------------------------------- operands of a slice

cdef inline const real* q_rows(const Plan* p, Py_ssize_t n, Py_ssize_t i0,
                               const real* like) noexcept nogil:
    """Row i0 of slice n of q (`like` only selects the dtype)."""
    return <const real*> p.q.data + slice_offset(p, &p.q, n) + i0 * p.q.row_stride


cdef inline const real* k_rows(const Plan* p, Py_ssize_t n,
                               const real* like) noexcept nogil:
    return <const real*> p.k.data + slice_offset(p, &p.k, n)


cdef inline const real* v_rows(const Plan* p, Py_ssize_t n,
                               const real* like) noexcept nogil:
    return <const real*> p.v.data + slice_offset(p, &p.v, n)


cdef inline real* out_rows(const Plan* p, Py_ssize_t n, Py_ssize_t i0,
                           const real* like) noexcept nogil:
    return <real*> p.out.data + slice_offset(p, &p.out, n) + i0 * p.out.row_stride


cdef inline real* lse_rows(const Plan* p, Py_ssize_t n, Py_ssize_t i0,
                           const real* like) noexcept nogil:
    """Row i0 of slice n of lse, or NULL when the log-sum-exp is not wanted."""
    if p.lse.data == NULL:
        return NULL
    return <real*> p.lse.data + slice_offset(p, &p.lse, n) + i0 * p.lse.row_stride


cdef inline const unsigned char* mask_rows(const Plan* p, Py_ssize_t n,
                                           Py_ssize_t i0) noexcept nogil:
    if p.mask.data == NULL:
        return NULL
    return (<const unsigned char*> p.mask.data + slice_offset(p, &p.mask, n)
            + i0 * p.mask.row_stride)


cdef inline const real* bias_rows(const Plan* p, Py_ssize_t n, Py_ssize_t i0,
                                  const real* like) noexcept nogil:
    if p.bias.data == NULL:
        return NULL
    return <const real*> p.bias.data + slice_offset(p, &p.bias, n) + i0 * p.bias.row_stride


cdef inline double sink_of(const Plan* p, Py_ssize_t n) noexcept nogil:
    """The sink logit of slice n (attention sinks), -inf when the plan has none."""
    if p.sinks.data == NULL:
        return -INFINITY
    if p.dtype == FLOAT32:
        return (<const float*> p.sinks.data)[slice_offset(p, &p.sinks, n)]
    return (<const double*> p.sinks.data)[slice_offset(p, &p.sinks, n)]


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


# ------------------------------------------- operands of any storage dtype (16-bit too)
#
# q, k and v may be stored as bfloat16 or float16 (computed in float32): the fused pass
# and the scores reach them through these, which widen a block of rows into the
# thread's scratch when the operand is not stored as `real` and read it in place when
# it is.

cdef inline bint stored_reduced(const Operand* a) noexcept nogil:
    return a.dtype == BFLOAT16 or a.dtype == FLOAT16


cdef inline const char* operand_at(const Plan* p, const Operand* a, Py_ssize_t n,
                                   Py_ssize_t r0) noexcept nogil:
    """Row r0 of slice n of operand a, whatever its dtype."""
    return a.data + (slice_offset(p, a, n) + r0 * a.row_stride) * element_size(a.dtype)


cdef inline const char* row_of(const Operand* a, const char* rows,
                               Py_ssize_t j) noexcept nogil:
    """Row j of a, counted from `rows` (a pointer given by operand_at)."""
    return rows + j * a.row_stride * element_size(a.dtype)


cdef inline const real* rows_as_real(const Operand* a, const char* rows,
                                     Py_ssize_t nrows, Py_ssize_t cols, real* buf,
                                     Py_ssize_t* rs) noexcept nogil:
    """nrows x cols of operand a from `rows` as `real`: in place (rs = its row stride)
    when a holds `real`, else widened into buf (nrows x cols, rs = cols)."""
    if real is float:
        if stored_reduced(a):
            fa_widen_rows(rows, a.dtype, a.row_stride, nrows, cols, buf)
            rs[0] = cols
            return buf
    rs[0] = a.row_stride
    return <const real*> rows


cdef inline real element(const Operand* a, const char* rows, Py_ssize_t index,
                         const real* like) noexcept nogil:
    """Element `index` (counted in elements from `rows`) of operand a, as `real`."""
    if real is float:
        if stored_reduced(a):
            return fa_widen(rows, a.dtype, index)
    return (<const real*> rows)[index]


# ------------------------------------------------------------------ tile primitives

cdef inline real tanh_(real x) noexcept nogil:
    """tanh(x), branch-free so that a loop of it vectorises; NaN stays NaN.

    float: a rational minimax approximation on [-7.9988, 7.9988] (x clamped to it;
    beyond, tanh is 1 in float32), a degree-13 odd over a degree-6 even polynomial:
    absolute error below 3e-7, one division and no exp (Eigen's fast tanh). double:
    fa_tanh (src/fa_exp.h), expm1-based, within 2 ulp for every x."""
    cdef real a, x2, num, den
    if real is float:
        a = x if x < <float> 7.99881172180175781 else <float> 7.99881172180175781
        a = a if a > <float> -7.99881172180175781 else <float> -7.99881172180175781
        a = x if x != x else a                  # keep NaN
        x2 = a * a
        num = <float> -2.76076847742355e-16
        num = num * x2 + <float> 2.00018790482477e-13
        num = num * x2 + <float> -8.60467152213735e-11
        num = num * x2 + <float> 5.12229709037114e-08
        num = num * x2 + <float> 1.48572235717979e-05
        num = num * x2 + <float> 6.37261928875436e-04
        num = num * x2 + <float> 4.89352455891786e-03
        den = <float> 1.19825839466702e-06
        den = den * x2 + <float> 1.18534705686654e-04
        den = den * x2 + <float> 2.26843463243900e-03
        den = den * x2 + <float> 4.89352518554385e-03
        return a * num / den
    else:
        return fa_tanh(x)


cdef inline void cap_scores(real* s, Py_ssize_t s_rs, Py_ssize_t s_cs, Py_ssize_t nrows,
                            Py_ssize_t width, real cap, real* dcap) noexcept nogil:
    """s = cap * tanh(s / cap) on rows < nrows, columns < width; dcap (same layout, or
    NULL) = the derivative, 1 - tanh^2."""
    cdef Py_ssize_t r, c, x
    cdef real t, inv = 1 / cap
    for r in range(nrows):
        for c in range(width):
            x = r * s_rs + c * s_cs
            t = tanh_(s[x] * inv)
            s[x] = cap * t
            if dcap != NULL:
                dcap[x] = 1 - t * t


cdef inline bint has_score_terms(const Plan* p, const unsigned char* mask,
                                 const real* bias) noexcept nogil:
    """Does every block need apply_rules (not only those a position rule crosses)?"""
    return (mask != NULL or bias != NULL or p.softcap > 0
            or p.alibi_slopes.data != NULL)


cdef inline void apply_rules(real* s, Py_ssize_t s_rs, Py_ssize_t s_cs, const Plan* p,
                             Py_ssize_t n, Py_ssize_t nrows, Py_ssize_t i0,
                             Py_ssize_t j0, Py_ssize_t bc, Py_ssize_t width,
                             const unsigned char* mask, const real* bias,
                             real* dcap) noexcept nogil:
    """The score of query i0 + r and key j0 + c of slice n, s[r * s_rs + c * s_cs] for
    r < nrows and c < width (= scale * q.k), becomes, in this order: softcapped
    (c tanh(s / c); dcap, if not NULL, receives the derivative), plus the bias, minus
    slope * |i + d - j| (ALiBi), and -inf where the mask, the positions or the
    lengths forbid it. Columns bc..width are padding and become -inf. mask and bias
    (or NULL) point at row i0, key 0 of the slice.
    """
    cdef Py_ssize_t r, c, lo, hi, pos
    cdef Py_ssize_t m_rs = p.mask.row_stride, m_cs = p.mask.col_stride
    cdef Py_ssize_t b_rs = p.bias.row_stride, b_cs = p.bias.col_stride
    cdef real slope = 0
    cdef real* row
    if p.softcap > 0:
        if s_rs == 1:           # the transposed tile: rows are the contiguous axis
            cap_scores(s, s_cs, s_rs, width, nrows, <real> p.softcap, dcap)
        else:
            cap_scores(s, s_rs, s_cs, nrows, width, <real> p.softcap, dcap)
    if p.alibi_slopes.data != NULL:
        slope = (<const real*> p.alibi_slopes.data)[slice_offset(p, &p.alibi_slopes, n)]
    for r in range(nrows):
        row = s + r * s_rs
        if bias != NULL:
            for c in range(bc):
                row[c * s_cs] = row[c * s_cs] + bias[r * b_rs + (j0 + c) * b_cs]
        if slope != 0:
            pos = i0 + r + offset_of(p, n) - j0
            for c in range(bc):
                row[c * s_cs] = row[c * s_cs] - slope * <real> (
                    pos - c if pos >= c else c - pos)
        if mask != NULL:
            for c in range(bc):
                if not mask[r * m_rs + (j0 + c) * m_cs]:
                    row[c * s_cs] = -INFINITY
        lo = key_begin(p, n, i0 + r) - j0
        hi = key_end(p, n, i0 + r) - j0
        lo = 0 if lo < 0 else (lo if lo < width else width)
        hi = lo if hi < lo else (hi if hi < bc else bc)
        for c in range(lo):
            row[c * s_cs] = -INFINITY
        for c in range(hi, width):
            row[c * s_cs] = -INFINITY


cdef inline void rule_tile(real* st, const Plan* p, Py_ssize_t n, Py_ssize_t nrows,
                           Py_ssize_t i0, Py_ssize_t j0, Py_ssize_t bc,
                           const unsigned char* mask, const real* bias,
                           const Py_ssize_t* lo, const Py_ssize_t* hi,
                           bint positions) noexcept nogil:
    """apply_rules() for the fused pass's tile st (KEY_BLOCK, QUERY_TILE) (keys by
    query rows), with the query rows as the contiguous axis of every loop so that each
    term vectorises: softcap, bias, ALiBi, mask, then the key range [lo[r], hi[r]) of
    each row (computed once per tile by attend_tile)."""
    cdef Py_ssize_t r, c, j
    cdef Py_ssize_t m_rs = p.mask.row_stride, m_cs = p.mask.col_stride
    cdef Py_ssize_t b_rs = p.bias.row_stride, b_cs = p.bias.col_stride
    cdef real cap = <real> p.softcap, inv, t, slope, base, dist
    cdef real* col
    if p.softcap > 0:
        inv = 1 / cap
        for c in range(bc):
            col = st + c * QUERY_TILE
            for r in range(nrows):
                t = tanh_(col[r] * inv)
                col[r] = cap * t
    for c in range(bc):
        col = st + c * QUERY_TILE
        if bias != NULL:
            for r in range(nrows):
                col[r] = col[r] + bias[r * b_rs + (j0 + c) * b_cs]
        if mask != NULL:
            for r in range(nrows):
                col[r] = col[r] if mask[r * m_rs + (j0 + c) * m_cs] else -INFINITY
    if p.alibi_slopes.data != NULL:
        slope = (<const real*> p.alibi_slopes.data)[slice_offset(p, &p.alibi_slopes, n)]
        base = <real> (i0 + offset_of(p, n) - j0)
        for c in range(bc):
            col = st + c * QUERY_TILE
            for r in range(nrows):
                dist = <real> r + base - <real> c
                col[r] = col[r] - slope * (dist if dist >= 0 else -dist)
    if not positions:
        return
    for c in range(bc):
        col = st + c * QUERY_TILE
        j = j0 + c
        for r in range(nrows):          # (& not `and`: no branch, so it vectorises)
            col[r] = col[r] if (lo[r] <= j) & (j < hi[r]) else -INFINITY


cdef inline void dropout_tile(const Plan* p, Py_ssize_t n, real* s, Py_ssize_t s_rs,
                              Py_ssize_t s_cs, Py_ssize_t nrows, Py_ssize_t i0,
                              Py_ssize_t j0, Py_ssize_t width) noexcept nogil:
    """Dropout of the weights s[r * s_rs + c * s_cs] of query i0 + r and key j0 + c of
    slice n (r < nrows, c < width; j0 a multiple of 4): each is zeroed or scaled by
    1 / (1 - dropout_p) as the Philox word of (seed, n, i, j) says (src/philox.h)."""
    cdef unsigned char keep[4]
    cdef real kept = <real> (1.0 / (1.0 - p.dropout_p))
    cdef Py_ssize_t r, cb, t, c, x
    for r in range(nrows):
        for cb in range((width + 3) // 4):
            fastattn_dropout_keep4(p.dropout_seed, p.dropout_slice_base + n, i0 + r,
                                   j0 // 4 + cb, p.dropout_threshold, keep)
            for t in range(4):
                c = cb * 4 + t
                if c < width:
                    x = r * s_rs + c * s_cs
                    s[x] = s[x] * kept if keep[t] else 0


cdef inline void scaled_queries(const Plan* p, const real* q, Py_ssize_t q_rs,
                                Py_ssize_t nrows, Py_ssize_t padded,
                                real* qt) noexcept nogil:
    """qt (E, QUERY_TILE) = scale * q[:nrows]^T (q: row stride q_rs), rows
    nrows..padded zero."""
    cdef Py_ssize_t r, t
    cdef real scale = <real> p.scale
    if real is float:       # (fa_transpose.h: 16 x 16 blocks through registers)
        fa_transpose32(q, q_rs, nrows, p.E, qt, QUERY_TILE, padded, &scale, 0)
        return
    for r in range(nrows):
        for t in range(p.E):
            qt[t * QUERY_TILE + r] = q[r * q_rs + t] * scale
    for t in range(p.E):
        for r in range(nrows, padded):
            qt[t * QUERY_TILE + r] = 0


cdef inline void score_block(const Plan* p, const real* kb, Py_ssize_t k_rs,
                             Py_ssize_t bc, const real* qt, Py_ssize_t padded,
                             real* st) noexcept nogil:
    """st (bc, QUERY_TILE) = kb (bc keys, row stride k_rs) @ qt: scaled scores, keys by
    query rows."""
    gemm(kb, k_rs, 1, qt, QUERY_TILE, st, QUERY_TILE, bc, padded, p.E, False)


cdef inline real row_max(const real* x, Py_ssize_t n) noexcept nogil:
    """The largest entry, -inf for none; NaN entries are skipped here and caught later.

    LANES running maxima, lane x over entries x, x + LANES, ... (a max is exact in any
    order, so the result is that of one pass in order; `a if a > b else b` is vmaxps,
    which gcc vectorises without -ffast-math: a single running max is a chain of
    dependent vmaxss, one per entry, that the decode path waited on).
    """
    cdef Py_ssize_t c, x0, main = n - n % LANES
    cdef real part[LANES]
    cdef real m = -INFINITY
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
    (0 + 2) + (1 + 3), then the tail in order: one chain of dependent additions would
    wait 4 cycles an entry.
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


cdef inline bint values_finite(const Plan* p, Py_ssize_t n,
                               const real* like) noexcept nogil:
    """No inf and no NaN in the Lk value rows of slice n (16-bit ones: by their
    exponent bits, all ones exactly for those)."""
    cdef const char* v = operand_at(p, &p.v, n, 0)
    cdef const uint16_t* h
    cdef Py_ssize_t c, t
    cdef uint16_t ones = 0x7f80 if p.v.dtype == BFLOAT16 else 0x7c00
    cdef int flag = 0
    if p.v.dtype == BFLOAT16 or p.v.dtype == FLOAT16:
        for c in range(keys_of(p, n)):
            h = <const uint16_t*> row_of(&p.v, v, c)
            for t in range(p.Ev):
                flag = flag | ((h[t] & ones) == ones)
        return not flag
    for c in range(keys_of(p, n)):
        if not all_finite(<const real*> row_of(&p.v, v, c), 1, p.Ev, p.Ev):
            return False
    return True


# The bfloat16 units (vdpbf16ps, AMX tiles) treat subnormal inputs and products as
# zero, and sum the raw products q.k before the scale: a q.k beyond the float32 range
# overflows there even when the scaled score fits. They are used only where neither
# can matter: every nonzero bfloat16 operand within [2^-BF16_SAFE_EXP, 2^BF16_SAFE_EXP]
# (products then at least 2^-80, sums of them far below the float32 limit, and a
# flushed weight's term at most 2^-86 of a value) and the scale within the same range;
# any other call runs the float32 path, which computes as the float64 recomputation says.

cdef enum:
    BF16_SAFE_EXP = 40


cdef inline bint bf16_words_in_range(const uint16_t* h, Py_ssize_t n) noexcept nogil:
    """Every bfloat16 word of h[:n] is zero or has a magnitude in [2^-40, 2^40)
    (subnormals, inf and NaN are not)."""
    cdef Py_ssize_t t
    cdef unsigned int e
    cdef int flag = 0
    for t in range(n):
        e = (h[t] >> 7) & 0xff
        flag = flag | (((h[t] & 0x7fff) != 0) & (e - (127 - BF16_SAFE_EXP)
                                                  >= 2 * BF16_SAFE_EXP))
    return not flag


cdef inline bint bf16_rows_in_range(const Plan* p, const Operand* a, Py_ssize_t n,
                                    Py_ssize_t rows, Py_ssize_t cols) noexcept nogil:
    """bf16_words_in_range for rows 0..rows of slice n of a bfloat16 operand (True for
    an operand stored otherwise: it does not meet the bfloat16 units)."""
    cdef const char* x = operand_at(p, a, n, 0)
    cdef Py_ssize_t r
    if a.dtype != BFLOAT16:
        return True
    if a.col_stride == 1 and a.row_stride == cols:
        return bf16_words_in_range(<const uint16_t*> x, rows * cols)
    for r in range(rows):
        if not bf16_words_in_range(<const uint16_t*> row_of(a, x, r), cols):
            return False
    return True


cdef inline bint bf16_units_safe(const Plan* p, Py_ssize_t n) noexcept nogil:
    """May slice n run on the bfloat16 units (q, k, and v, whose products meet them
    too on AMX and in the backward)? See BF16_SAFE_EXP."""
    return (bf16_rows_in_range(p, &p.q, n, queries_of(p, n), p.E)
            and bf16_rows_in_range(p, &p.k, n, keys_of(p, n), p.E)
            and bf16_rows_in_range(p, &p.v, n, keys_of(p, n), p.Ev))


cdef inline bint bf16_scale_safe(double scale) noexcept nogil:
    cdef double a = scale if scale >= 0 else -scale
    return a == 0 or (a >= 1.0 / (<double> (1 << 20) * (1 << 20))
                      and a < <double> (1 << 20) * (1 << 20))


# ------------------------------------------------------------------ the scores pass

cdef inline Py_ssize_t scores_work_size(const Plan* p) noexcept nogil:
    """Elements of scratch score_tile needs: qt (E, QUERY_TILE), st (KEY_BLOCK,
    QUERY_TILE), wide (KEY_BLOCK, E): rows of q or k widened from 16 bits."""
    return (p.E + KEY_BLOCK) * QUERY_TILE + KEY_BLOCK * p.E


cdef inline void score_tile(const Plan* p, Py_ssize_t n, Py_ssize_t i0, Py_ssize_t nrows,
                            bint softmax, real* work) noexcept nogil:
    """out[i0:i0+nrows] of slice n = scale * q @ k^T + bias, entries that may not be
    attended -inf; then, with `softmax`, each row's softmax. out rows have Lk entries."""
    cdef real* qt = work
    cdef real* st = qt + p.E * QUERY_TILE
    cdef real* wide = st + KEY_BLOCK * QUERY_TILE
    cdef const char* k = operand_at(p, &p.k, n, 0)
    cdef real* out = out_rows(p, n, i0, qt)
    cdef const unsigned char* mask = mask_rows(p, n, i0)
    cdef const real* bias = bias_rows(p, n, i0, qt)
    cdef Py_ssize_t b, j0, bc, r, c, rs
    cdef const real* rows = rows_as_real(&p.q, operand_at(p, &p.q, n, i0), nrows, p.E,
                                         wide, &rs)
    scaled_queries(p, rows, rs, nrows, nrows, qt)
    for b in range((p.Lk + KEY_BLOCK - 1) // KEY_BLOCK):
        j0 = b * KEY_BLOCK
        bc = p.Lk - j0 if p.Lk - j0 < KEY_BLOCK else KEY_BLOCK
        rows = rows_as_real(&p.k, row_of(&p.k, k, j0), bc, p.E, wide, &rs)
        score_block(p, rows, rs, bc, qt, nrows, st)
        apply_rules(st, 1, QUERY_TILE, p, n, nrows, i0, j0, bc, bc, mask, bias, NULL)
        for r in range(nrows):
            for c in range(bc):
                out[r * p.out.row_stride + j0 + c] = st[c * QUERY_TILE + r]
    if softmax:
        for r in range(nrows):
            softmax_row(out + r * p.out.row_stride, out + r * p.out.row_stride, p.Lk,
                        sink_of(p, n) if i0 + r < queries_of(p, n) else -INFINITY)


# ----------------------------------------------------------- the fused forward pass
#
# A work item is one tile: up to QUERY_TILE query rows of one slice. Its queries are
# held transposed, qt (E, QUERY_TILE), so that the query rows are the vector axis of
# every loop: the score block st (KEY_BLOCK, QUERY_TILE) = K_block @ qt, the output
# accumulator acc (Ev, QUERY_TILE) += V_block^T @ st, and the row max, exp, row sum and
# rescaling of the online softmax are plain element-wise loops.

cdef inline Py_ssize_t attend_work_size(const Plan* p) noexcept nogil:
    """Elements of scratch attend_tile needs, term by term (see attend_tile)."""
    return (p.E * QUERY_TILE              # qt
            + KEY_BLOCK * QUERY_TILE      # st
            + p.Ev * QUERY_TILE           # acc
            + p.Ev * QUERY_TILE           # blk
            + 4 * QUERY_TILE              # m, m_new, alpha, tainted
            + 4 * QUERY_TILE              # l, l_blk (doubles: room for 2 x 2 floats)
            + 4 * QUERY_TILE              # lo, hi (Py_ssize_t: room for 2 x 2 floats)
            # kw, vw: rows widened from 16 bits (AMX: the weight pairs, the value pairs)
            + KEY_BLOCK * ((p.E if p.E > QUERY_TILE else QUERY_TILE) + p.Ev))


cdef inline void attend_tile(const Plan* p, Py_ssize_t n, Py_ssize_t i0,
                             Py_ssize_t nrows, real* work, Interrupt* stop) noexcept nogil:
    """Fused attention of query rows i0..i0+nrows (nrows <= QUERY_TILE) of slice n over
    every key they may attend to: out and lse of those rows (see attend_keys)."""
    attend_keys(p, n, i0, nrows, work, 0, p.Lk, <real*> NULL, <real*> NULL,
                <double*> NULL, stop)


cdef inline void attend_keys(const Plan* p, Py_ssize_t n, Py_ssize_t i0,
                             Py_ssize_t nrows, real* work, Py_ssize_t kbeg,
                             Py_ssize_t kend, real* part_acc, real* part_m,
                             double* part_l, Interrupt* stop) noexcept nogil:
    """Fused attention of query rows i0..i0+nrows (nrows <= QUERY_TILE) of slice n over
    the keys kbeg..kend they may attend to (online softmax). With part_acc NULL: out
    and lse of those rows (kbeg = 0 and kend = Lk: the whole row). Else the piece's
    partial result, as attend_few leaves it, for merge_parts: part_acc (nrows, Ev) =
    sum_j exp(s_j - m) v_j, part_m (nrows) the max (-inf for no allowed key) and
    part_l (nrows) = sum_j exp(s_j - m); kbeg and kend are then multiples of
    KEY_BLOCK (or kend = Lk), so that its blocks are those of the whole row. A row
    that gave weight to a NaN or inf value gets NaN in part_acc, and is left to the
    caller: its merged result is not finite where the part's weight does not
    underflow, and is then redone by attend_row_exactly.

    Keys are visited block by block; each row keeps its running max m, running sum l
    (double) and an unnormalised output accumulator, rescaled by exp(m_old - m_new)
    when the max grows. Blocks outside every row's key range are skipped, and the
    position rule is applied only to blocks that cross a row's range. A row with no
    allowed key gets zeros and lse = -inf. A value row holding NaN or inf reaches a
    query row exactly when attend_row_exactly says so (whatever the tiling).
    Scratch: attend_work_size(p) elements, aligned to 64 bytes for speed.

    With `stop` (or NULL), it looks for Ctrl-C every CHECK_EVERY blocks and returns
    unfinished once one is pending (the driver then raises; nothing it wrote is used).
    """
    cdef Py_ssize_t QB = QUERY_TILE
    cdef Py_ssize_t QV = 32          # query rows are padded to a multiple of this
    cdef real* qt = work                        # E x QB
    cdef real* st = qt + p.E * QB               # KEY_BLOCK x QB
    cdef real* acc = st + KEY_BLOCK * QB        # Ev x QB
    cdef real* blk = acc + p.Ev * QB            # Ev x QB
    cdef real* m = blk + p.Ev * QB              # QB
    cdef real* m_new = m + QB                   # QB
    cdef real* alpha = m_new + QB               # QB
    cdef real* tainted = alpha + QB             # QB
    cdef double* l = <double*> (tainted + QB)   # QB
    cdef double* l_blk = l + QB                 # QB
    cdef Py_ssize_t* lo = <Py_ssize_t*> (l_blk + QB)    # QB: each row's key range
    cdef Py_ssize_t* hi = lo + QB                        # QB
    cdef real* kw = <real*> (hi + QB)           # KEY_BLOCK x max(E, QB)
    cdef real* vw = kw + KEY_BLOCK * (p.E if p.E > QB else QB)     # KEY_BLOCK x Ev
    cdef const char* k = operand_at(p, &p.k, n, 0)
    cdef const char* v = operand_at(p, &p.v, n, 0)
    cdef const real* kb
    cdef const real* vb = NULL
    cdef real* out = out_rows(p, n, i0, qt)
    cdef real* lse = lse_rows(p, n, i0, qt)
    cdef const unsigned char* mask = mask_rows(p, n, i0)
    cdef const real* bias = bias_rows(p, n, i0, qt)
    cdef Py_ssize_t k_rs, v_rs = 0
    cdef Py_ssize_t Ev = p.Ev
    cdef Py_ssize_t nr = (nrows + QV - 1) // QV * QV
    cdef Py_ssize_t j0, bc, r, c, t, b, first_block, end_block, nxt
    cdef KeyRange keys = tile_keys(p, n, i0, nrows)
    cdef bint every_block = has_score_terms(p, mask, bias)
    cdef bint first = True, finite, crossing, rules
    # few blocks per tile, each new one to the cache (ascending tiles: the last one)
    cdef bint window = p.window_left < NO_LIMIT
    # bfloat16 q and k, and a module with the kernel: scores by AMX tiles (fa_amx.h)
    # or by vdpbf16ps (fa_bf16.h); with AMX, bfloat16 values too (V^T P on tiles)
    cdef bint amx = (real is float and FA_HAVE_AMX_BF16 and FA_HAVE_BLOCK_SOFTMAX
                     and p.dot_kernel == DOT_AMX_BF16)
    cdef bint bf16_dot = amx or (real is float and FA_HAVE_AVX512_BF16
                                 and p.dot_kernel == DOT_AVX512_BF16)
    cdef bint amx_pv = amx and p.v.dtype == BFLOAT16 and Ev % 16 == 0
    # the online softmax in two passes with AVX-512 (fa_softmax.h), float32 only
    cdef bint fused = real is float and FA_HAVE_BLOCK_SOFTMAX
    cdef void* pp = kw          # amx: the block's weight pairs (K is not widened)
    cdef void* vt = vw          # amx_pv: the block's value pairs, V^T

    if amx:
        fa_amx_begin()
    if bf16_dot:    # qt holds the query rows' bfloat16 pairs (unscaled)
        fa_bf16_pack_queries(<const uint16_t*> operand_at(p, &p.q, n, i0), p.q.row_stride,
                             nrows, p.E, <void*> qt)
    else:           # (the query rows are widened into kw: QUERY_TILE <= KEY_BLOCK)
        kb = rows_as_real(&p.q, operand_at(p, &p.q, n, i0), nrows, p.E, kw, &k_rs)
        scaled_queries(p, kb, k_rs, nrows, nr, qt)
    # (lanes nr.. of st, blk and acc are never written or read); the sink belongs to
    # the first piece of the keys
    start_rows(p, n, i0, nrows, QB, part_acc == NULL or kbeg == 0, m, l)
    for r in range(QB):
        tainted[r] = 0
    for r in range(nrows):
        lo[r] = key_begin(p, n, i0 + r)
        hi[r] = key_end(p, n, i0 + r)
    # the blocks holding keys some row may attend to, in this piece
    if keys.lo < kbeg:
        keys.lo = kbeg
    if keys.hi > kend:
        keys.hi = kend
    first_block = keys.lo // KEY_BLOCK
    end_block = (keys.hi + KEY_BLOCK - 1) // KEY_BLOCK if keys.hi > keys.lo else first_block

    for b in range(first_block, end_block):
        if stop != NULL and (b - first_block) % CHECK_EVERY == CHECK_EVERY - 1 \
                and interrupted(stop):
            if amx:
                fa_amx_end()
            return
        j0 = b * KEY_BLOCK
        bc = keys.hi - j0 if keys.hi - j0 < KEY_BLOCK else KEY_BLOCK
        if window and b + 1 < end_block:    # the next block's rows, meanwhile
            nxt = keys.hi - j0 - KEY_BLOCK
            nxt = nxt if nxt < KEY_BLOCK else KEY_BLOCK
            fa_prefetch_rows(row_of(&p.k, k, j0 + KEY_BLOCK), nxt,
                             p.E * element_size(p.k.dtype),
                             p.k.row_stride * element_size(p.k.dtype))
            fa_prefetch_rows(row_of(&p.v, v, j0 + KEY_BLOCK), nxt,
                             Ev * element_size(p.v.dtype),
                             p.v.row_stride * element_size(p.v.dtype))
        crossing = j0 < keys.all_from or j0 + bc > keys.all_to
        rules = every_block or crossing
        if amx:         # scaled here where rules follow, else by fa_block_max
            fa_amx_scores(<const uint16_t*> row_of(&p.k, k, j0), p.k.row_stride, bc,
                          <const void*> qt, p.E, nr, <float> p.scale if rules else 1,
                          <float*> st)
        elif bf16_dot:
            fa_bf16_scores(<const uint16_t*> row_of(&p.k, k, j0), p.k.row_stride, bc,
                           <const void*> qt, p.E // 2, <float> p.scale, <float*> st)
        else:
            kb = rows_as_real(&p.k, row_of(&p.k, k, j0), bc, p.E, kw, &k_rs)
            score_block(p, kb, k_rs, bc, qt, nr, st)
        if rules:
            rule_tile(st, p, n, nrows, i0, j0, bc, mask, bias, lo, hi, crossing)
        # (the element-wise steps over nr lanes; a constant for whole tiles)
        if fused:       # (the AMX path's scores may still need the scale)
            fa_block_max(<float*> st, bc, nr,
                         <float> p.scale if amx and not rules else 1,
                         <float*> m, <float*> m_new, <float*> alpha)
        elif nr == QB:
            running_max(st, bc, QB, m, m_new, alpha)
        else:
            running_max(st, bc, nr, m, m_new, alpha)
        if amx_pv:      # the values stay bfloat16 unless they hold NaN or inf
            finite = fa_amx_pack_values(<const uint16_t*> row_of(&p.v, v, j0),
                                        p.v.row_stride, bc, Ev, vt)
            if not finite:
                vb = rows_as_real(&p.v, row_of(&p.v, v, j0), bc, Ev, vw, &v_rs)
        else:
            vb = rows_as_real(&p.v, row_of(&p.v, v, j0), bc, Ev, vw, &v_rs)
            finite = p.values_finite or all_finite(vb, bc, Ev, v_rs)
        if not finite:      # rare: values with NaN or inf; their rows are redone later
            mark_tainted(p, vb, v_rs, st, bc, nr, tainted)
        if fused:
            fa_block_exp(<float*> st, bc, nr, <const float*> m_new, <const float*> alpha,
                         l)
        elif nr == QB:
            block_weights(st, bc, QB, m_new, alpha, l, l_blk)
        else:
            block_weights(st, bc, nr, m_new, alpha, l, l_blk)
        if p.dropout_p > 0:
            dropout_tile(p, n, st, 1, QB, nrows, i0, j0, bc)
        # acc (Ev, QB) = alpha * acc + V[j0:j0+bc]^T @ st, the block's product summed
        # on its own first (in the micro-GEMM's registers): summing block by block
        # keeps the rounding error of long rows at O(KEY_BLOCK + Lk / KEY_BLOCK)
        if finite and amx_pv:   # acc = alpha * acc, then acc += V^T P on the tiles
            if not first:
                rescale_rows(acc, Ev, nr, alpha)
            fa_amx_pv(vt, bc, Ev, <const float*> st, nr, pp, <float*> acc, first)
        elif finite:
            gemm(vb, 1, v_rs, st, QB, acc, QB, Ev, nr, bc, False,
                 NULL if first else alpha)
        else:
            weigh_finite_values(p, vb, v_rs, st, bc, nr, blk)
            add_block(acc, blk, Ev, nr, alpha, first)
        first = False
    if amx:
        fa_amx_end()

    if part_acc != NULL:    # a piece: acc^T, m and l as they are
        for r in range(nrows):
            part_m[r] = m[r] if l[r] != 0 else -INFINITY
            part_l[r] = l[r]
            alpha[r] = 1
        if not first:       # (no block: acc was never written)
            if real is float:
                fa_transpose32(acc, QB, Ev, nrows, part_acc, Ev, Ev, alpha, 1)
            else:
                for r in range(nrows):
                    for t in range(Ev):
                        part_acc[r * Ev + t] = acc[t * QB + r]
        for r in range(nrows):
            if first or l[r] == 0:      # no allowed key here: zeros
                for t in range(Ev):
                    part_acc[r * Ev + t] = 0
            elif tainted[r] != 0:       # its NaN or inf values were left out of acc:
                for t in range(Ev):     # NaN, so that the merge is not finite where
                    part_acc[r * Ev + t] = NAN      # this part counts
        return

    # out = acc^T / l, row by row (alpha holds 1 / l); no block: acc is zero
    for r in range(nrows):
        alpha[r] = <real> (1.0 / l[r]) if l[r] != 0 else 0
    if first:
        for r in range(nrows):
            for t in range(Ev):
                out[r * p.out.row_stride + t] = 0 * alpha[r]    # (NaN for a NaN sink)
    elif real is float:
        fa_transpose32(acc, QB, Ev, nrows, out, p.out.row_stride, Ev, alpha, 1)
    else:
        for r in range(nrows):
            for t in range(Ev):
                out[r * p.out.row_stride + t] = acc[t * QB + r] * alpha[r]
    for r in range(nrows):
        if l[r] == 0:       # no allowed key: zeros (acc * 0 is NaN where acc is inf)
            for t in range(Ev):
                out[r * p.out.row_stride + t] = 0
            if lse != NULL:
                lse[r * p.lse.row_stride] = -INFINITY
        elif lse != NULL:
            lse[r * p.lse.row_stride] = <real> (m[r] + log(l[r]))
    # rows that met a NaN or inf value, and rows whose result is not finite (inputs
    # with NaN or inf, or values so large that the running sums overflowed), by the
    # exact rule
    for r in range(nrows):
        if tainted[r] != 0 or not all_finite(out + r * p.out.row_stride, 1, Ev, Ev):
            attend_row_exactly(p, n, i0 + r, out + r * p.out.row_stride,
                               lse + r * p.lse.row_stride if lse != NULL else NULL)


cdef inline void running_max(real* st, Py_ssize_t bc, Py_ssize_t lanes, real* m,
                             real* m_new, real* alpha) noexcept nogil:
    """The step of attend_tile after a block's scores st (bc keys by QUERY_TILE lanes,
    the first `lanes` used): m = the new running max of each row (NaN scores are
    skipped here and reach the sums), m_new = the max to subtract ("-inf means 0"),
    alpha = exp(m_old - m_new), the factor of the earlier sums."""
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
    """st = exp(st - m_new) (the block's weights, before any dropout) and the running
    sums l = alpha * l + the block's row sums, summed in double."""
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


cdef inline void add_block(real* acc, const real* blk, Py_ssize_t Ev, Py_ssize_t lanes,
                           const real* alpha, bint first) noexcept nogil:
    """acc = alpha * acc + blk ((Ev, QUERY_TILE), the first `lanes` used); the first
    block is copied. alpha == 0 (the earlier weights underflowed) drops them, as
    0 * inf would be NaN. (The finite blocks' product does this inside gemm.)"""
    cdef Py_ssize_t r, t
    if first:
        for t in range(Ev):
            for r in range(lanes):
                acc[t * QUERY_TILE + r] = blk[t * QUERY_TILE + r]
        return
    for t in range(Ev):
        for r in range(lanes):
            acc[t * QUERY_TILE + r] = scaled_plus(acc[t * QUERY_TILE + r], alpha[r],
                                                  blk[t * QUERY_TILE + r])


cdef inline void rescale_rows(real* acc, Py_ssize_t Ev, Py_ssize_t lanes,
                              const real* alpha) noexcept nogil:
    """acc = alpha * acc ((Ev, QUERY_TILE), the first `lanes` used), as add_block
    does before it adds a block; nothing to do where every alpha is 1 (the rows'
    maxima did not grow: most blocks after the first few)."""
    cdef Py_ssize_t r, t, changed = 0
    for r in range(lanes):
        changed += alpha[r] != 1
    if changed == 0:
        return
    for t in range(Ev):
        for r in range(lanes):
            acc[t * QUERY_TILE + r] = (acc[t * QUERY_TILE + r] * alpha[r]
                                       if alpha[r] != 0 else 0)


cdef inline void mark_tainted(const Plan* p, const real* v, Py_ssize_t v_rs,
                              const real* st, Py_ssize_t bc, Py_ssize_t nr,
                              real* tainted) noexcept nogil:
    """In a block whose values v (row stride v_rs) hold NaN or inf: mark the rows that
    may attend to such a key (its score in st (bc, QUERY_TILE) is not -inf);
    attend_row_exactly redoes them."""
    cdef Py_ssize_t c, r
    for c in range(bc):
        if not all_finite(v + c * v_rs, 1, p.Ev, v_rs):
            for r in range(nr):
                if st[c * QUERY_TILE + r] != -INFINITY:
                    tainted[r] = 1


cdef inline void weigh_finite_values(const Plan* p, const real* v, Py_ssize_t v_rs,
                                     const real* pt, Py_ssize_t bc, Py_ssize_t nr,
                                     real* blk) noexcept nogil:
    """blk (Ev, QUERY_TILE) = V^T @ pt (bc, QUERY_TILE) over the value rows (row stride
    v_rs) that are finite (the others reach their rows through attend_row_exactly)."""
    cdef Py_ssize_t c, r, t
    cdef real a
    for t in range(p.Ev):
        for r in range(nr):
            blk[t * QUERY_TILE + r] = 0
    for c in range(bc):
        if all_finite(v + c * v_rs, 1, p.Ev, v_rs):
            for r in range(nr):
                a = pt[c * QUERY_TILE + r]
                for t in range(p.Ev):
                    blk[t * QUERY_TILE + r] = blk[t * QUERY_TILE + r] + a * v[c * v_rs + t]


cdef inline void attend_row_exactly(const Plan* p, Py_ssize_t n, Py_ssize_t i,
                                    real* out, real* lse) noexcept nogil:
    """Query row i of slice n, the plain way, for a row that may attend to a key whose
    value holds NaN or inf.

    The scores s_j of the allowed keys are computed as dot products, then
    m = max(max_j s_j, sink), w_j = exp(s_j - m), L = sum_j w_j + exp(sink - m) and
    out = sum_j (w_j / L) v_j, skipping every key whose weight w_j is exactly 0: so a
    NaN or inf value reaches the row iff its weight against the row's own maximum (the
    sink's included) does not underflow, a rule that does not depend on how rows and
    keys are cut into tiles. The weights are normalised before they meet the values,
    so values near the largest float give the finite mean the other paths' running
    (unnormalised) sums overflowed on. lse (or NULL) = m + log L. Without a sink,
    sink = -inf (exp(-inf) = 0).
    """
    cdef const char* q = operand_at(p, &p.q, n, i)
    cdef const char* k = operand_at(p, &p.k, n, 0)
    cdef const char* v = operand_at(p, &p.v, n, 0)
    cdef const unsigned char* mask = mask_rows(p, n, i)
    cdef const real* bias = bias_rows(p, n, i, out)
    cdef Py_ssize_t lo = key_begin(p, n, i), hi = key_end(p, n, i)
    cdef Py_ssize_t j, t
    cdef double sink = sink_of(p, n) if i < queries_of(p, n) else -INFINITY
    cdef real s, m = -INFINITY, w
    cdef real kept = <real> (1.0 / (1.0 - p.dropout_p))
    cdef double total = 0
    cdef real inv
    for t in range(p.Ev):
        out[t] = 0
    if sink != sink or sink == INFINITY:        # a NaN or +inf sink: NaN
        for t in range(p.Ev):
            out[t] = NAN
        if lse != NULL:
            lse[0] = NAN
        return
    for j in range(lo, hi):                     # pass 1: the row's maximum
        s = row_score(p, n, i, q, k, j, mask, bias)
        if s > m:
            m = s
    if sink > m:
        m = <real> sink
    if m == -INFINITY:                          # only NaN scores, or none allowed
        m = 0
    for j in range(lo, hi):                     # pass 2: the sum of the weights
        s = row_score(p, n, i, q, k, j, mask, bias)
        if s != -INFINITY:
            total += exp_(s - m)
    if sink != -INFINITY:
        total += exp_(<real> (sink - m))
    if total == 0:
        if lse != NULL:
            lse[0] = -INFINITY
        return
    if total != total:                          # a NaN score (or +inf): a NaN row,
        for t in range(p.Ev):                   # whatever dropout keeps
            out[t] = NAN
        if lse != NULL:
            lse[0] = NAN
        return
    inv = <real> (1.0 / total)
    for j in range(lo, hi):                     # pass 3: the normalised weights' sum
        s = row_score(p, n, i, q, k, j, mask, bias)
        if s == -INFINITY:
            continue
        w = exp_(s - m)
        if w == 0:                              # the weight underflows: not reached
            continue
        if p.dropout_p > 0:
            if not fastattn_dropout_keep(p.dropout_seed, p.dropout_slice_base + n, i, j,
                                         p.dropout_threshold):
                continue                        # dropped: not reached either
            w = w * kept
        w = w * inv
        for t in range(p.Ev):
            out[t] = out[t] + w * element(&p.v, v, j * p.v.row_stride + t, out)
    if lse != NULL:
        lse[0] = <real> (m + log(total))


cdef inline real row_score(const Plan* p, Py_ssize_t n, Py_ssize_t i, const char* q,
                           const char* k, Py_ssize_t j, const unsigned char* mask,
                           const real* bias) noexcept nogil:
    """The score of key j for query row i of slice n (q, mask, bias at that row; k at
    key 0), through apply_rules like every other score (the key must be inside the
    row's position range; -inf when the mask blocks it)."""
    cdef Py_ssize_t t
    cdef real s = 0
    cdef real scale = <real> p.scale
    for t in range(p.E):
        s = s + (element(&p.q, q, t, bias) * scale) * element(
            &p.k, k, j * p.k.row_stride + t, bias)
    apply_rules(&s, 1, 1, p, n, 1, i, j, 1, 1, mask, bias, NULL)
    return s


# ------------------------------------------------- few query rows (decoding), split keys
#
# With one or a few query rows per slice the tiles above would be mostly padding, and
# the work is reading K and V once. Here the vector axis is E: a score is a dot product
# kept in LANES partial sums, and the output accumulates whole V rows. The rows of the
# G slices of one grouped-query group share one K/V slice and are done together, so
# each K/V row is read once for the whole group. A work item covers a range of keys and
# leaves an unnormalised partial result (acc, m, l) that merge_parts combines in a
# fixed order.

cdef inline real dot_(const real* a, const real* b, Py_ssize_t n) noexcept nogil:
    """sum_t a[t] * b[t], in LANES partial sums added pairwise (vectorises, no fast-math)."""
    cdef real part[LANES]
    cdef Py_ssize_t t, x, nv = n // LANES
    for x in range(LANES):
        part[x] = 0
    for t in range(nv):
        for x in range(LANES):
            part[x] = part[x] + a[t * LANES + x] * b[t * LANES + x]
    for t in range(nv * LANES, n):
        part[t - nv * LANES] = part[t - nv * LANES] + a[t] * b[t]
    for x in range(8):
        part[x] = part[x] + part[x + 8]
    for x in range(4):
        part[x] = part[x] + part[x + 4]
    return (part[0] + part[2]) + (part[1] + part[3])


cdef inline void dot4_(const real* a, const real* b, Py_ssize_t b_rs, Py_ssize_t n,
                       real* out) noexcept nogil:
    """out[x] = dot_(a, b + x * b_rs, n) for x < 4, bit for bit: four independent chains
    of partial sums, so that each waits less on the one before (decoding is a long run
    of short dot products)."""
    cdef real part[4 * LANES]
    cdef Py_ssize_t t, x, y, nv = n // LANES
    cdef const real* b0 = b
    cdef const real* b1 = b + b_rs
    cdef const real* b2 = b + 2 * b_rs
    cdef const real* b3 = b + 3 * b_rs
    for x in range(4 * LANES):
        part[x] = 0
    for t in range(nv):
        for x in range(LANES):
            part[x] = part[x] + a[t * LANES + x] * b0[t * LANES + x]
            part[LANES + x] = part[LANES + x] + a[t * LANES + x] * b1[t * LANES + x]
            part[2 * LANES + x] = part[2 * LANES + x] + a[t * LANES + x] * b2[t * LANES + x]
            part[3 * LANES + x] = part[3 * LANES + x] + a[t * LANES + x] * b3[t * LANES + x]
    for t in range(nv * LANES, n):
        part[t - nv * LANES] = part[t - nv * LANES] + a[t] * b0[t]
        part[LANES + t - nv * LANES] = part[LANES + t - nv * LANES] + a[t] * b1[t]
        part[2 * LANES + t - nv * LANES] = part[2 * LANES + t - nv * LANES] + a[t] * b2[t]
        part[3 * LANES + t - nv * LANES] = part[3 * LANES + t - nv * LANES] + a[t] * b3[t]
    for y in range(4):
        for x in range(8):
            part[y * LANES + x] = part[y * LANES + x] + part[y * LANES + x + 8]
        for x in range(4):
            part[y * LANES + x] = part[y * LANES + x] + part[y * LANES + x + 4]
        out[y] = ((part[y * LANES] + part[y * LANES + 2])
                  + (part[y * LANES + 1] + part[y * LANES + 3]))


cdef inline Py_ssize_t few_work_size(const Plan* p, Py_ssize_t G) noexcept nogil:
    """Elements of scratch attend_few needs for G slices, term by term."""
    cdef Py_ssize_t R = G * p.Lq
    return (R * p.E                 # qs: the scaled query rows
            + R * DECODE_KEYS       # s: scores, then weights, of one block
            + R * p.Ev              # blk: this block's P·V
            + DECODE_KEYS * (p.E + p.Ev)    # kw, vw: K and V rows widened from 16 bits
            + 16)                   # alignment


cdef inline void attend_few(const Plan* p, Py_ssize_t n0, Py_ssize_t G, Py_ssize_t kbeg,
                            Py_ssize_t kend, real* acc, real* m, double* l,
                            real* work, Interrupt* stop) noexcept nogil:
    """Partial attention of the R = G * Lq query rows of slices n0..n0+G (which share
    one K/V slice) over keys kbeg..kend.

    Leaves acc (R, Ev) = sum_j exp(s_j - m) v_j, m (R) the max allowed score (-inf for
    none) and l (R) = sum_j exp(s_j - m), with the "-inf means 0" rule of exp_row; a
    zero weight is skipped, so a value row holding NaN or inf reaches only rows that
    give it a weight; the driver redoes every row whose result is not finite with
    attend_row_exactly (the rule for such values). The piece that starts at key 0
    holds the sink (start_rows). It looks for Ctrl-C (`stop`) every CHECK_EVERY steps
    and returns unfinished once one is pending.
    Scratch: few_work_size(p, G) elements.
    """
    cdef Py_ssize_t Lq = p.Lq, E = p.E, Ev = p.Ev
    cdef Py_ssize_t R = G * Lq
    cdef real* qs = work
    cdef real* s = qs + R * E
    cdef real* blk = s + R * DECODE_KEYS
    cdef real* kw = blk + R * p.Ev
    cdef real* vw = kw + DECODE_KEYS * E
    cdef const char* k = operand_at(p, &p.k, n0, 0)
    cdef const char* v = operand_at(p, &p.v, n0, 0)
    cdef const char* q
    cdef const real* kb
    cdef const real* vb
    cdef Py_ssize_t k_rs, v_rs
    cdef Py_ssize_t j0, bc, r, c, t, g, b, key_lo, key_hi, nb, all_from, all_to, valid
    cdef KeyRange keys
    cdef real m_new, m_sub, alpha, w
    cdef bint every_block = has_score_terms(p, <const unsigned char*> p.mask.data,
                                                    <const real*> p.bias.data)
    cdef real scale = <real> p.scale
    cdef double total
    cdef real* srow
    cdef real* arow
    cdef const real* vrow
    for g in range(G):
        q = operand_at(p, &p.q, n0 + g, 0)
        valid = queries_of(p, n0 + g)       # (rows past it give zeros; in a packed
        for r in range(Lq):                 # batch they are the next sequence's)
            for t in range(E):
                qs[(g * Lq + r) * E + t] = (element(&p.q, q, r * p.q.row_stride + t,
                                                    work) * scale if r < valid else 0)
    for t in range(R * Ev):
        acc[t] = 0
    for g in range(G):
        start_rows(p, n0 + g, 0, Lq, Lq, kbeg == 0, m + g * Lq, l + g * Lq)
    # the union of the G slices' key ranges, and the intersection of what all rows see
    key_lo, key_hi, all_from, all_to = p.Lk, 0, 0, p.Lk
    for g in range(G):
        keys = tile_keys(p, n0 + g, 0, Lq)
        if keys.hi > keys.lo:
            key_lo = keys.lo if keys.lo < key_lo else key_lo
            key_hi = keys.hi if keys.hi > key_hi else key_hi
        all_from = keys.all_from if keys.all_from > all_from else all_from
        all_to = keys.all_to if keys.all_to < all_to else all_to
    key_lo = key_lo // KEY_BLOCK * KEY_BLOCK     # blocks aligned as in the tiles
    if key_lo < kbeg:
        key_lo = kbeg
    if key_hi > kend:
        key_hi = kend
    nb = (key_hi - key_lo + DECODE_KEYS - 1) // DECODE_KEYS if key_hi > key_lo else 0
    for b in range(nb):
        if stop != NULL and b % CHECK_EVERY == CHECK_EVERY - 1 and interrupted(stop):
            return
        j0 = key_lo + b * DECODE_KEYS
        bc = key_hi - j0 if key_hi - j0 < DECODE_KEYS else DECODE_KEYS
        if real is float and FA_HAVE_DOTS:
            # the same sums, 16 at once, the keys read in place (16-bit ones widened in
            # registers) with the rows ahead prefetched, up to this item's last key
            fa_dots(qs, E, R, row_of(&p.k, k, j0), p.k.dtype, p.k.row_stride, bc, E, s,
                    DECODE_KEYS, key_hi - j0)
        else:
            kb = rows_as_real(&p.k, row_of(&p.k, k, j0), bc, E, kw, &k_rs)
            for r in range(R):
                for c in range(0, bc - bc % 4, 4):
                    dot4_(qs + r * E, kb + c * k_rs, k_rs, E, s + r * DECODE_KEYS + c)
                for c in range(bc - bc % 4, bc):
                    s[r * DECODE_KEYS + c] = dot_(qs + r * E, kb + c * k_rs, E)
        if every_block or j0 < all_from or j0 + bc > all_to:
            for g in range(G):
                apply_rules(s + g * Lq * DECODE_KEYS, DECODE_KEYS, 1, p, n0 + g, Lq, 0,
                            j0, bc, bc, mask_rows(p, n0 + g, 0),
                            bias_rows(p, n0 + g, 0, work), NULL)
        for r in range(R):
            srow = s + r * DECODE_KEYS
            m_new = row_max(srow, bc)
            if m[r] > m_new:
                m_new = m[r]
            m_sub = 0 if m_new == -INFINITY else m_new
            alpha = exp_(m[r] - m_sub)
            total = exp_row(srow, bc, m_new)
            l[r] = l[r] * alpha + total
            m[r] = m_new
            if alpha != 1:
                arow = acc + r * Ev
                for t in range(Ev):     # alpha == 0: drop them, as 0 * inf = NaN
                    arow[t] = arow[t] * alpha if alpha != 0 else 0
        if p.dropout_p > 0:
            for g in range(G):
                dropout_tile(p, n0 + g, s + g * Lq * DECODE_KEYS, DECODE_KEYS, 1, Lq, 0,
                             j0, bc)
        # this block's P·V on its own, then added (accuracy of long rows), the value
        # rows read once; an inf or NaN among them leaves blk not finite (the weights
        # are), and then the block is summed again skipping zero weights (0 * inf is
        # NaN, but such a key must add nothing)
        vb = NULL
        if real is float and FA_HAVE_DOTS:
            fa_pv(s, DECODE_KEYS, R, row_of(&p.v, v, j0), p.v.dtype, p.v.row_stride, bc,
                  Ev, blk, Ev, key_hi - j0)
        else:
            vb = rows_as_real(&p.v, row_of(&p.v, v, j0), bc, Ev, vw, &v_rs)
            gemm(s, DECODE_KEYS, 1, vb, v_rs, blk, Ev, R, Ev, bc, False)
        if not all_finite(blk, R, Ev, Ev):
            if vb == NULL:
                vb = rows_as_real(&p.v, row_of(&p.v, v, j0), bc, Ev, vw, &v_rs)
            for t in range(R * Ev):
                blk[t] = 0
            for c in range(bc):
                vrow = vb + c * v_rs
                for r in range(R):
                    w = s[r * DECODE_KEYS + c]
                    if w == 0:
                        continue
                    arow = blk + r * Ev
                    for t in range(Ev):
                        arow[t] = arow[t] + w * vrow[t]
        for t in range(R * Ev):
            acc[t] = acc[t] + blk[t]


cdef inline void merge_parts(const real* acc, const real* m, const double* l,
                             Py_ssize_t nparts, Py_ssize_t stride, Py_ssize_t R,
                             Py_ssize_t Ev, real* out, Py_ssize_t out_rs,
                             real* lse, Py_ssize_t lse_rs) noexcept nogil:
    """Combine nparts partial results of attend_few, in order, into out (R, Ev) (row
    stride out_rs) and lse (R) (stride lse_rs; or NULL).

    Part p is at acc + p * stride * Ev, m + p * stride, l + p * stride. With
    M = max_p m_p: out = sum_p exp(m_p - M) acc_p / L and lse = M + log L, where
    L = sum_p exp(m_p - M) l_p; zeros and -inf when L == 0 (no allowed key); NaN
    propagates.
    """
    cdef Py_ssize_t r, q, t
    cdef real M, w
    cdef double L, inv
    cdef real* o
    for r in range(R):
        o = out + r * out_rs
        M = -INFINITY
        for q in range(nparts):
            if m[q * stride + r] > M:
                M = m[q * stride + r]
        if M == -INFINITY:
            M = 0
        L = 0
        for q in range(nparts):
            L = L + l[q * stride + r] * <double> exp_(m[q * stride + r] - M)
        if L == 0:
            for t in range(Ev):
                o[t] = 0
            if lse != NULL:
                lse[r * lse_rs] = -INFINITY
            continue
        if L != L:          # a NaN score or sink in some part: a NaN row
            for t in range(Ev):
                o[t] = NAN
            if lse != NULL:
                lse[r * lse_rs] = NAN
            continue
        inv = 1.0 / L
        for t in range(Ev):
            o[t] = 0
        for q in range(nparts):
            w = exp_(m[q * stride + r] - M)
            if w == 0:          # a part whose weight underflows adds nothing (0 * inf):
                continue        # every key in it has a weight of 0 against the max
            w = <real> (w * inv)
            for t in range(Ev):
                o[t] = o[t] + acc[(q * stride + r) * Ev + t] * w
        if lse != NULL:
            lse[r * lse_rs] = <real> (M + log(L))


cdef inline void merge_rows(const Plan* p, Py_ssize_t n, Py_ssize_t i0, Py_ssize_t nrows,
                            const real* acc, const real* m, const double* l,
                            Py_ssize_t nparts, Py_ssize_t stride) noexcept nogil:
    """out and lse of query rows i0..i0+nrows of slice n from nparts partial results
    (merge_parts: part q of row r at acc + (q * stride + r) * Ev, m and l likewise);
    a row whose result is not finite met NaN or inf, and the rule for those is
    attend_row_exactly's (whatever the split)."""
    cdef Py_ssize_t r
    cdef real* out = out_rows(p, n, i0, acc)
    cdef real* lse = lse_rows(p, n, i0, acc)
    merge_parts(acc, m, l, nparts, stride, nrows, p.Ev, out, p.out.row_stride, lse,
                p.lse.row_stride)
    for r in range(nrows):
        if not all_finite(out + r * p.out.row_stride, 1, p.Ev, p.Ev):
            attend_row_exactly(p, n, i0 + r, out + r * p.out.row_stride,
                               lse + r * p.lse.row_stride if lse != NULL else NULL)
