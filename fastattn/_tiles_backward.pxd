# The work items of the attention backward pass, for float and double.
#
# Like _tiles.pxd, every function is `cdef inline ... noexcept nogil` and takes (plan,
# work item, scratch); nothing allocates or knows about threads. A work item owns the
# dK and dV of one chunk of keys of one key/value slice; it rebuilds the probabilities
# tile by tile from the forward's log-sum-exp, for every query tile of every output
# slice that reads it, and per key block takes these steps:
#
#     P^T  = e^(S^T - lse), S^T = K_j (scale Q_i)^T ruled      (block_probabilities)
#     dP^T = Z V_j dO_i^T,  dS^T = P^T (dP^T - delta)          (block_score_gradients)
#     dV_j += (P Z)^T dO_i,  dK_j += dS^T (scale Q_i),  dQ_i += dS K_j
#                                                               (block_products)
#
# (Z: the dropout factors; dS times the softcap's derivative where there is one.) The
# products run on the one micro-GEMM (_gemm.pxd), S^T and dP^T on vdpbf16ps where the
# forward's scores do (bfloat16 q, k; v, grad_out), and the three gradient products
# too where all four are bfloat16 and E, Ev multiples of 64 (P and dS then rounded to
# bfloat16, as PyTorch's CPU backward rounds them: bf16_gradients). A tile holds the
# KEY_BLOCK keys of a block against BACKWARD_ROWS query rows (the contiguous axis,
# "lanes"), as the forward's tiles do.

from libc.math cimport INFINITY
from libc.stdint cimport uint16_t

from fastattn._csrc cimport (FA_HAVE_AVX512_BF16, fa_bf16_pack_queries, fa_bf16_pair_rows,
                             fa_bf16_product, fa_bf16_round_tile, fa_bf16_scores,
                             fa_bf16_transpose_keys, fa_narrow_row, fa_transpose32,
                             fa_widen, fa_widen_rows)
from fastattn._engines cimport scaled_queries
from fastattn._gemm cimport gemm, real
from fastattn._operands cimport (Carve, Rows, carving, operand_at, row_of, rows_as_real,
                                 rows_of, take)
from fastattn._parallel cimport Interrupt, interrupted
from fastattn._plan cimport (BFLOAT16, DOT_AVX512_BF16, FLOAT16, FLOAT32, FLOAT64, KEY_BLOCK, DType,
                             KeyRange, Plan, element_size, tile_keys)
from fastattn._rules cimport ScoreRows, dropout_weights, rule_scores
from fastattn._softmax cimport exp_
from fastattn._tiles cimport CHECK_EVERY

cdef enum:
    BACKWARD_ROWS = 64      # query rows per tile (its lanes) and per dQ reduction
                            # item; the forward's QUERY_TILE and FA_BF16_LANES, whose
                            # scaled_queries and fa_bf16_scores fill the tiles


cdef struct Gradients:
    # Every buffer C-contiguous, in the computation dtype (N output slices, U key/value
    # slices, n_chunks key chunks), except grad_out, which may be 16-bit, and the
    # gradients, which are 16-bit when out_kind is (their sums then kept in float32 in
    # the item's scratch and rounded once, by fa_narrow_row):
    const void* grad_out    # (N, Lq, Ev)
    DType grad_kind         # grad_out's dtype: the computation dtype, BFLOAT16, FLOAT16
    const void* delta       # (N, Lq): rowsum(grad_out * out)
    void* dq_part           # (N, n_chunks, Lq, E): dQ of each output slice, per chunk
    void* dq                # (N, Lq, E) in out_kind, or NULL: with 16-bit gradients,
                            # one chunk and no query slice shared, dQ itself (rounded
                            # by the item; dq_part unused)
    void* dk                # (U, Lk, E)
    void* dv                # (U, Lk, Ev)
    DType out_kind          # dk, dv (and dq)'s dtype: the computation's, BFLOAT16, FLOAT16
    Py_ssize_t n_chunks
    Py_ssize_t chunk_keys   # keys per chunk (a multiple of KEY_BLOCK)


cdef inline bint narrowing(const Gradients* g) noexcept nogil:
    """Are the gradients 16-bit (summed in float32, rounded once)?"""
    return g.out_kind == BFLOAT16 or g.out_kind == FLOAT16


cdef inline bint bf16_scores(const Plan* p) noexcept nogil:
    """S^T (and, with bfloat16 v and grad_out, dP^T) on vdpbf16ps, as the forward's
    scores (not beside AMX: Intel's vdpbf16ps is no faster than its FMAs)."""
    return FA_HAVE_AVX512_BF16 and p.dot_kernel == DOT_AVX512_BF16


cdef inline bint bf16_dp(const Plan* p, const Gradients* g) noexcept nogil:
    return (bf16_scores(p) and p.v.dtype == BFLOAT16 and p.v.col_stride == 1
            and g.grad_kind == BFLOAT16 and p.Ev % 2 == 0)


cdef inline bint bf16_gradients(const Plan* p, const Gradients* g) noexcept nogil:
    """Do the three gradient products run on vdpbf16ps (fa_bf16_product), P and dS
    rounded to bfloat16 for them as PyTorch's CPU backward rounds them? Where S and dP
    do, with E and Ev multiples of 64."""
    return bf16_dp(p, g) and p.E % 64 == 0 and p.Ev % 64 == 0


# ---------------------------------------------------------------------- row sums

cdef enum:
    ROW_DOT_PIECE = 64      # elements of a row widened at a time (row_dot)


cdef inline double row_dot(const void* x, DType x_kind, const void* y, DType y_kind,
                           Py_ssize_t n) noexcept nogil:
    """sum_t x[t] * y[t] of two rows each held in the computation dtype or in 16 bits
    (widened exactly), accumulated in double, in order."""
    cdef Py_ssize_t t, t0, c
    cdef double total = 0
    cdef float xw[ROW_DOT_PIECE]
    cdef float yw[ROW_DOT_PIECE]
    cdef const float* xf
    cdef const float* yf
    if x_kind == y_kind and x_kind == FLOAT64:
        for t in range(n):
            total += (<const double*> x)[t] * (<const double*> y)[t]
    elif x_kind == FLOAT64 or y_kind == FLOAT64:
        for t in range(n):
            total += stored_value(x, x_kind, t) * stored_value(y, y_kind, t)
    else:
        # float32 and 16-bit rows: the 16-bit ones widened (exactly) a piece at a time
        # by the vector conversions (float32 ones read in place), then summed in order
        t0 = 0
        while t0 < n:
            c = n - t0 if n - t0 < ROW_DOT_PIECE else ROW_DOT_PIECE
            xf = widened_piece(x, x_kind, t0, c, xw)
            yf = widened_piece(y, y_kind, t0, c, yw)
            for t in range(c):
                total += <double> xf[t] * <double> yf[t]
            t0 += c
    return total


cdef inline const float* widened_piece(const void* x, DType kind, Py_ssize_t t0,
                                       Py_ssize_t c, float* buf) noexcept nogil:
    """Elements t0..t0+c of a float32 or 16-bit row as float32: in place, or widened
    into buf."""
    if kind == FLOAT32:
        return <const float*> x + t0
    fa_widen_rows(<const char*> x + t0 * element_size(kind), kind, c, 1, c, buf)
    return buf


cdef inline double stored_value(const void* x, DType kind, Py_ssize_t t) noexcept nogil:
    if kind == BFLOAT16 or kind == FLOAT16:
        return fa_widen(x, kind, t)
    if kind == FLOAT32:
        return (<const float*> x)[t]
    return (<const double*> x)[t]


# ---------------------------------------------------------------------- scratch

cdef struct ChunkScratch:
    # one work item of the backward, term by term (BR = BACKWARD_ROWS lanes,
    # KB = KEY_BLOCK keys, C = chunk_keys; the computation dtype unless said)
    void* k_rows        # C x E: the chunk's K widened (bf16 products: K^T, bfloat16)
    void* v_rows        # C x Ev: the chunk's V widened
    void* q_rows        # BR x E: scale Q_i, rows (bf16 products: Q_i's pairs of rows)
    void* q_tile        # E x BR: (scale Q_i)^T, or Q_i's bfloat16 pairs
    void* dq            # BR x E: this chunk's dQ_i
    void* do_rows       # BR x Ev: dO_i widened (bf16 products: its pairs of rows)
    void* do_tile       # Ev x BR: dO_i^T, or its bfloat16 pairs
    void* qk            # KB x BR: S^T, then P^T (times Z)
    void* dqk           # KB x BR: dP^T, then dS^T
    void* dcap          # KB x BR: the softcap's derivative
    void* kept          # KB x BR: the dropout factors Z
    void* lse           # BR: each lane's lse (0 for a lane with none)
    void* delta         # BR: each lane's rowsum(dO * O)
    unsigned char* live # BR: lanes with a row that has an allowed key
    void* dk            # C x E float32: 16-bit gradients' dK sums (else dK in place)
    void* dv            # C x Ev float32: ... dV sums
    uint16_t* p16       # KB x BR bfloat16: P (bf16 products)
    uint16_t* ds16      # KB x BR bfloat16: dS
    void* ds_pairs      # KB/2 x BR: dS's pairs of keys
    void* dq_t          # E x BR: dQ_i^T (bf16 products)


cdef inline Py_ssize_t chunk_scratch(const Plan* p, const Gradients* g, char* base,
                                     ChunkScratch* s) noexcept nogil:
    """The scratch of one backward item: its size in bytes; with `base`, its pointers
    (the bfloat16 products' and the 16-bit sums' areas only where they are used)."""
    cdef Carve c = carving(base)
    cdef Py_ssize_t r = element_size(p.dtype), BR = BACKWARD_ROWS, C = g.chunk_keys
    s.k_rows = take(&c, C * p.E, r)
    s.v_rows = take(&c, C * p.Ev, r)
    s.q_rows = take(&c, BR * p.E, r)
    s.q_tile = take(&c, BR * p.E, r)
    s.dq = take(&c, BR * p.E, r)
    s.do_rows = take(&c, BR * p.Ev, r)
    s.do_tile = take(&c, BR * p.Ev, r)
    s.qk = take(&c, BR * KEY_BLOCK, r)
    s.dqk = take(&c, BR * KEY_BLOCK, r)
    s.dcap = take(&c, BR * KEY_BLOCK, r)
    s.kept = take(&c, BR * KEY_BLOCK, r)
    s.lse = take(&c, BR, r)
    s.delta = take(&c, BR, r)
    s.live = <unsigned char*> take(&c, BR, 1)
    s.dk = s.dv = s.p16 = s.ds16 = s.ds_pairs = s.dq_t = NULL
    if narrowing(g) and r == 4:
        s.dk = take(&c, C * p.E, 4)
        s.dv = take(&c, C * p.Ev, 4)
    if bf16_gradients(p, g) and r == 4:
        s.p16 = <uint16_t*> take(&c, BR * KEY_BLOCK, 2)
        s.ds16 = <uint16_t*> take(&c, BR * KEY_BLOCK, 2)
        s.ds_pairs = take(&c, BR * KEY_BLOCK // 2, 4)
        s.dq_t = take(&c, BR * p.E, 4)
    return c.size


# ---------------------------------------------------------------------- an item

cdef inline void clear_chunk(const Plan* p, const Gradients* g, Py_ssize_t u,
                             Py_ssize_t chunk) noexcept nogil:
    """dK, dV of the keys of chunk `chunk` of key/value slice u = 0 (no output reads
    the slice): +0 in every dtype, all bits clear."""
    cdef Py_ssize_t k0 = chunk * g.chunk_keys
    cdef Py_ssize_t k1 = k0 + g.chunk_keys if k0 + g.chunk_keys < p.Lk else p.Lk
    cdef Py_ssize_t size = element_size(g.out_kind), x
    cdef char* dk = <char*> g.dk + (u * p.Lk + k0) * p.E * size
    cdef char* dv = <char*> g.dv + (u * p.Lk + k0) * p.Ev * size
    for x in range((k1 - k0) * p.E * size):
        dk[x] = 0
    for x in range((k1 - k0) * p.Ev * size):
        dv[x] = 0


cdef inline void key_value_item(const Plan* p, const Gradients* g, Py_ssize_t u,
                                Py_ssize_t chunk, const Py_ssize_t* users,
                                Py_ssize_t n_users, const ChunkScratch* s, real* dk,
                                real* dv, Interrupt* stop) noexcept nogil:
    """dK, dV of the keys of chunk `chunk` of key/value slice u, and the partial dQ of
    that chunk for every output slice in users[:n_users] (the slices that read u, in
    increasing order; users[0] locates k and v). dk and dv: where the chunk's sums go
    (the gradients themselves, or with 16-bit gradients s.dk and s.dv, rounded at the
    end). It looks for Ctrl-C (`stop`) between query tiles and every CHECK_EVERY key
    blocks, and returns unfinished once one is pending (the driver then raises)."""
    cdef Py_ssize_t k0 = chunk * g.chunk_keys
    cdef Py_ssize_t k1 = k0 + g.chunk_keys if k0 + g.chunk_keys < p.Lk else p.Lk
    cdef const char* k = operand_at(p, &p.k, users[0], k0)
    cdef const char* v = operand_at(p, &p.v, users[0], k0)
    cdef Rows k_rows = rows_of(p, &p.k, NULL, users[0])
    cdef Rows v_rows = rows_of(p, &p.v, NULL, users[0])
    cdef const real* kc = NULL
    cdef const real* vc = <const real*> s.v_rows
    cdef Py_ssize_t kc_rs = p.E, vc_rs = p.Ev, ui, n, ib, i0, nr, b, j0, bc, x
    cdef Py_ssize_t b_first, b_end
    cdef const real* do = NULL
    cdef ScoreRows rows
    cdef bint all_live = True
    # K and V of the chunk as the products read them (in place, widened once, or K^T)
    if real is float and bf16_gradients(p, g):
        fa_bf16_transpose_keys(<const uint16_t*> k, p.k.row_stride, k1 - k0, p.E,
                               <uint16_t*> s.k_rows, g.chunk_keys)
    else:
        kc = rows_as_real(&k_rows, k0, k1 - k0, p.E, <real*> s.k_rows, &kc_rs)
    if not bf16_dp(p, g):
        vc = rows_as_real(&v_rows, k0, k1 - k0, p.Ev, <real*> s.v_rows, &vc_rs)
    for x in range((k1 - k0) * p.E):
        dk[x] = 0
    for x in range((k1 - k0) * p.Ev):
        dv[x] = 0
    for ui in range(n_users):
        n = users[ui]
        for ib in range((p.Lq + BACKWARD_ROWS - 1) // BACKWARD_ROWS):
            if interrupted(stop):
                return
            i0 = ib * BACKWARD_ROWS
            nr = BACKWARD_ROWS if p.Lq - i0 > BACKWARD_ROWS else p.Lq - i0
            clear_dq(p, g, nr, <real*> s.dq, s)
            tile_blocks(p, n, i0, nr, k0, k1, &b_first, &b_end)
            if b_end > b_first:
                all_live = load_query_tile(p, g, n, i0, nr, <real*> s.q_rows, s, &rows)
                do = load_grad_out(p, g, n, i0, nr, <real*> s.do_tile, s)
            for b in range(b_first, b_end):
                if (b - b_first) % CHECK_EVERY == CHECK_EVERY - 1 and interrupted(stop):
                    return
                j0 = k0 + b * KEY_BLOCK
                bc = KEY_BLOCK if k1 - j0 > KEY_BLOCK else k1 - j0
                block_probabilities(p, &rows, k, kc, kc_rs, j0, k0, bc, <real*> s.qk, s)
                block_score_gradients(p, g, &rows, v, vc, vc_rs, j0, k0, bc, all_live,
                                      <real*> s.dqk, s)
                block_products(p, g, kc, kc_rs, do, j0 - k0, bc, nr, dk, dv, s)
            finish_dq(p, g, n, chunk, i0, nr, <real*> s.dq, s)
    if real is float:
        if narrowing(g):
            fa_narrow_row(<const float*> dk, (k1 - k0) * p.E,
                          <uint16_t*> g.dk + (u * p.Lk + k0) * p.E, g.out_kind)
            fa_narrow_row(<const float*> dv, (k1 - k0) * p.Ev,
                          <uint16_t*> g.dv + (u * p.Lk + k0) * p.Ev, g.out_kind)


cdef inline void tile_blocks(const Plan* p, Py_ssize_t n, Py_ssize_t i0, Py_ssize_t nr,
                             Py_ssize_t k0, Py_ssize_t k1, Py_ssize_t* b_first,
                             Py_ssize_t* b_end) noexcept nogil:
    """The blocks of the chunk k0..k1 that some row of the query tile may attend to."""
    cdef KeyRange keys = tile_keys(p, n, i0, nr)
    cdef Py_ssize_t lo = k0 if keys.lo < k0 else keys.lo
    cdef Py_ssize_t hi = k1 if keys.hi > k1 else keys.hi
    b_first[0] = (lo - k0) // KEY_BLOCK
    b_end[0] = (hi - k0 + KEY_BLOCK - 1) // KEY_BLOCK if hi > lo else b_first[0]


cdef inline void clear_dq(const Plan* p, const Gradients* g, Py_ssize_t nr, real* dq,
                          const ChunkScratch* s) noexcept nogil:
    """dq (nr, E) = 0 (bf16 products: their dQ_i^T, dq_t)."""
    cdef Py_ssize_t x
    if real is float:
        if bf16_gradients(p, g):
            for x in range(p.E * BACKWARD_ROWS):
                (<float*> s.dq_t)[x] = 0
            return
    for x in range(nr * p.E):
        dq[x] = 0


cdef inline bint load_query_tile(const Plan* p, const Gradients* g, Py_ssize_t n,
                                 Py_ssize_t i0, Py_ssize_t nr, real* qs,
                                 const ChunkScratch* s, ScoreRows* rows) noexcept nogil:
    """Query rows i0..i0+nr of slice n as the products read them: qs = scale Q_i
    (rows; bf16 products: its pairs of rows) and its transpose (or pairs) in q_tile,
    each lane's lse and delta (lanes past nr, or with no
    allowed key, are not live), and what rules their scores. Returns whether every
    lane is live."""
    cdef const char* q = operand_at(p, &p.q, n, i0)
    cdef Rows q_rows = rows_of(p, &p.q, NULL, n)
    cdef const real* lse = <const real*> operand_at(p, &p.lse, n, i0)
    cdef const real* delta = <const real*> g.delta + n * p.Lq + i0
    cdef const real* qb
    cdef Py_ssize_t q_rs, r, t
    cdef real scale = <real> p.scale
    cdef bint all_live = nr == BACKWARD_ROWS
    if real is float and bf16_gradients(p, g):
        fa_bf16_pack_queries(<const uint16_t*> q, p.q.row_stride, nr, p.E, s.q_tile)
        fa_bf16_pair_rows(<const uint16_t*> q, p.q.row_stride, nr, p.E, s.q_rows)
    else:
        qb = rows_as_real(&q_rows, i0, nr, p.E, qs, &q_rs)
        if real is float and bf16_scores(p):
            fa_bf16_pack_queries(<const uint16_t*> q, p.q.row_stride, nr, p.E, s.q_tile)
        else:   # (the forward's q_tile: BACKWARD_ROWS == QUERY_TILE lanes)
            scaled_queries(p, qb, q_rs, nr, BACKWARD_ROWS, <real*> s.q_tile)
        for r in range(nr):     # (after: qb may be qs, widened)
            for t in range(p.E):
                qs[r * p.E + t] = qb[r * q_rs + t] * scale
    for r in range(BACKWARD_ROWS):
        s.live[r] = False
        (<real*> s.lse)[r] = 0
        (<real*> s.delta)[r] = 0
    for r in range(nr):
        if lse[r * p.lse.row_stride] != -INFINITY:
            s.live[r] = True
            (<real*> s.lse)[r] = lse[r * p.lse.row_stride]
            (<real*> s.delta)[r] = delta[r]
        else:
            all_live = False
    rows.n, rows.i0, rows.nrows, rows.lo, rows.hi = n, i0, nr, NULL, NULL
    rows.mask = <const unsigned char*> operand_at(p, &p.mask, n, i0)
    rows.bias = operand_at(p, &p.bias, n, i0)
    return all_live


cdef inline const real* load_grad_out(const Plan* p, const Gradients* g, Py_ssize_t n,
                                      Py_ssize_t i0, Py_ssize_t nr, real* do_tile,
                                      const ChunkScratch* s) noexcept nogil:
    """dO_i (rows i0..i0+nr of slice n) as the products read it: do_tile = its
    transpose (or bfloat16 pairs), and its rows: pairs of rows in do_rows (bf16
    products), else as `real` (widened into do_rows, or in place), which it returns."""
    cdef const char* do = (<const char*> g.grad_out
                           + (n * p.Lq + i0) * p.Ev * element_size(g.grad_kind))
    cdef const real* rows = <const real*> do
    cdef Py_ssize_t t, r, Ev = p.Ev
    if real is float:
        if bf16_gradients(p, g):
            fa_bf16_pair_rows(<const uint16_t*> do, Ev, nr, Ev, s.do_rows)
        elif g.grad_kind == BFLOAT16 or g.grad_kind == FLOAT16:
            fa_widen_rows(do, g.grad_kind, Ev, nr, Ev, <float*> s.do_rows)
            rows = <const real*> s.do_rows
        if bf16_dp(p, g):
            fa_bf16_pack_queries(<const uint16_t*> do, Ev, nr, Ev, s.do_tile)
            return rows
    for t in range(Ev):             # dO_i^T, lanes nr.. zero
        for r in range(nr):
            do_tile[t * BACKWARD_ROWS + r] = rows[r * Ev + t]
        for r in range(nr, BACKWARD_ROWS):
            do_tile[t * BACKWARD_ROWS + r] = 0
    return rows


cdef inline void block_probabilities(const Plan* p, const ScoreRows* rows,
                                     const char* k, const real* kc, Py_ssize_t kc_rs,
                                     Py_ssize_t j0, Py_ssize_t k0, Py_ssize_t bc,
                                     real* qk, const ChunkScratch* s) noexcept nogil:
    """qk (bc, BACKWARD_ROWS) = P^T of the block at key j0 (k and kc: the chunk's
    first key, k0): S^T = K_j (scale Q_i)^T, its rules (the softcap's derivative into
    dcap), then e^(S^T - lse) as one flat loop (the shape in which a compiler
    vectorises it)."""
    cdef Py_ssize_t c, r, x
    cdef const real* lse = <const real*> s.lse
    if real is float and bf16_scores(p):
        fa_bf16_scores(<const uint16_t*> row_of(&p.k, k, j0 - k0), p.k.row_stride, bc,
                       s.q_tile, p.E // 2, <float> p.scale, qk)
    else:
        gemm(kc + (j0 - k0) * kc_rs, kc_rs, 1, <const real*> s.q_tile, BACKWARD_ROWS,
             qk, BACKWARD_ROWS, bc, BACKWARD_ROWS, p.E, False)
    rule_scores(p, rows, qk, 1, BACKWARD_ROWS, j0, bc, True,
                <real*> s.dcap if p.softcap > 0 else NULL)
    for c in range(bc):
        for r in range(BACKWARD_ROWS):
            qk[c * BACKWARD_ROWS + r] = qk[c * BACKWARD_ROWS + r] - lse[r]
    for x in range(bc * BACKWARD_ROWS):
        qk[x] = exp_(qk[x])


cdef inline void block_score_gradients(const Plan* p, const Gradients* g,
                                       const ScoreRows* rows, const char* v,
                                       const real* vc, Py_ssize_t vc_rs, Py_ssize_t j0,
                                       Py_ssize_t k0, Py_ssize_t bc, bint all_live,
                                       real* dqk, const ChunkScratch* s) noexcept nogil:
    """dqk (bc, BACKWARD_ROWS) = dS^T of the block at key j0: dP^T = V_j dO_i^T (times
    the dropout factors Z: O used P Z), dS^T = P^T (dP^T - delta) (times the
    softcap's derivative); then qk = P^T Z, the weights that met V; lanes that are not
    live cleared in both (rows past the tile or with no allowed key)."""
    cdef real* qk = <real*> s.qk
    cdef real* z = <real*> s.kept
    cdef real* dcap = <real*> s.dcap
    cdef const real* delta = <const real*> s.delta
    cdef Py_ssize_t c, r, x, BR = BACKWARD_ROWS
    if real is float and bf16_dp(p, g):
        fa_bf16_scores(<const uint16_t*> row_of(&p.v, v, j0 - k0), p.v.row_stride, bc,
                       s.do_tile, p.Ev // 2, 1, dqk)
    else:
        gemm(vc + (j0 - k0) * vc_rs, vc_rs, 1, <const real*> s.do_tile, BR, dqk, BR, bc,
             BR, p.Ev, False)
    if p.dropout_p > 0:
        for x in range(bc * BR):
            z[x] = 1
        dropout_weights(p, rows.n, z, 1, BR, rows.nrows, rows.i0, j0, bc)
        for x in range(bc * BR):
            dqk[x] = dqk[x] * z[x]
    for c in range(bc):
        for r in range(BR):
            dqk[c * BR + r] = qk[c * BR + r] * (dqk[c * BR + r] - delta[r])
    if p.softcap > 0:           # through the softcap: times 1 - tanh^2
        for x in range(bc * BR):
            dqk[x] = dqk[x] * dcap[x]
    if p.dropout_p > 0:
        for x in range(bc * BR):
            qk[x] = qk[x] * z[x]
    if not all_live:
        clear_lanes(qk, bc, s.live)
        clear_lanes(dqk, bc, s.live)


cdef inline void clear_lanes(real* st, Py_ssize_t bc,
                             const unsigned char* live) noexcept nogil:
    """Lanes r of st (bc, BACKWARD_ROWS) with live[r] == 0 become zeros."""
    cdef Py_ssize_t c, r
    for r in range(BACKWARD_ROWS):
        if not live[r]:
            for c in range(bc):
                st[c * BACKWARD_ROWS + r] = 0


cdef inline void block_products(const Plan* p, const Gradients* g, const real* kc,
                                Py_ssize_t kc_rs, const real* do, Py_ssize_t j,
                                Py_ssize_t bc, Py_ssize_t nr, real* dk, real* dv,
                                const ChunkScratch* s) noexcept nogil:
    """dV_j += (P Z)^T dO_i, dK_j += dS^T (scale Q_i), dQ_i += dS K_j for the block at
    key j of the chunk (qk: P^T Z, dqk: dS^T; do: dO_i's rows as `real`); on vdpbf16ps
    with P and dS rounded to bfloat16 (dQ_i^T += K_j^T dS^T) where bf16_gradients."""
    cdef Py_ssize_t BR = BACKWARD_ROWS
    if real is float:
        if bf16_gradients(p, g):
            fa_bf16_round_tile(<const float*> s.qk, bc, s.p16)
            fa_bf16_round_tile(<const float*> s.dqk, bc, s.ds16)
            fa_bf16_pair_rows(s.ds16, BR, bc, BR, s.ds_pairs)
            fa_bf16_product(s.p16, BR, bc, s.do_rows, p.Ev, BR // 2, p.Ev, 1,
                            dv + j * p.Ev, p.Ev, True)
            fa_bf16_product(s.ds16, BR, bc, s.q_rows, p.E, BR // 2, p.E,
                            <float> p.scale, dk + j * p.E, p.E, True)
            fa_bf16_product(<const uint16_t*> s.k_rows + j, g.chunk_keys, p.E,
                            s.ds_pairs, BR, (bc + 1) // 2, BR, 1, <float*> s.dq_t, BR,
                            True)
            return
    gemm(<const real*> s.qk, BR, 1, do, p.Ev, dv + j * p.Ev, p.Ev, bc, p.Ev, nr, True)
    gemm(<const real*> s.dqk, BR, 1, <const real*> s.q_rows, p.E, dk + j * p.E, p.E, bc,
         p.E, nr, True)
    gemm(<const real*> s.dqk, 1, BR, kc + j * kc_rs, kc_rs, <real*> s.dq, p.E, nr, p.E,
         bc, True)


cdef inline void finish_dq(const Plan* p, const Gradients* g, Py_ssize_t n,
                           Py_ssize_t chunk, Py_ssize_t i0, Py_ssize_t nr, real* dq,
                           const ChunkScratch* s) noexcept nogil:
    """The query tile's dQ_i of this chunk, times the scale: into dQ itself when the
    gradients are 16-bit and unshared (rounded here), else into the chunk's partial
    dQ of slice n (summed in step 3 of the driver). (bf16 products: dQ_i =
    (dQ_i^T)^T first.)"""
    cdef Py_ssize_t x, E = p.E
    cdef real scale = <real> p.scale
    cdef real* dq_out
    if real is float:
        if bf16_gradients(p, g):
            fa_transpose32(s.dq_t, BACKWARD_ROWS, E, nr, dq, E, E, NULL, 0)
        if g.dq != NULL:
            for x in range(nr * E):
                dq[x] = dq[x] * scale
            fa_narrow_row(dq, nr * E, <uint16_t*> g.dq + (n * p.Lq + i0) * E, g.out_kind)
            return
    dq_out = <real*> g.dq_part + ((n * g.n_chunks + chunk) * p.Lq + i0) * E
    for x in range(nr * E):
        dq_out[x] = dq[x] * scale
