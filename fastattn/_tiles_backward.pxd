# The arithmetic of the attention backward pass on tiles, for float and double.
#
# Like _tiles.pxd, every function is `cdef inline ... noexcept nogil` and takes (plan,
# work item, scratch); nothing allocates or knows about threads. The probabilities are
# rebuilt tile by tile from the forward's log-sum-exp, and the three gradient products
#
#     dV_j += P^T dO_i,    dK_j += dS^T (scale·Q_i),    dQ_i += dS K_j
#
# go through the one micro-GEMM (_gemm.pxd), as do the two score-like products
# S^T = K_j (scale·Q_i)^T and dP^T = V_j dO_i^T, unless q and k (v and grad_out) are
# bfloat16 and the forward's scores run on vdpbf16ps (src/fa_bf16.h; the plan's
# dot_kernel is DOT_AVX512_BF16), which then computes them as the forward does. A
# tile holds the KEY_BLOCK keys of block j against query rows i (at most
# BACKWARD_ROWS, the contiguous axis, "lanes"), as the forward's tiles do.

from libc.math cimport INFINITY
from libc.stdint cimport uint16_t

from fastattn._gemm cimport gemm, real
from fastattn._parallel cimport Interrupt, interrupted
from fastattn._plan cimport (BFLOAT16, DOT_AVX512_BF16, FLOAT16, KEY_BLOCK, DType, KeyRange,
                             Plan, element_size, tile_keys)
from fastattn cimport _tiles
from fastattn._tiles cimport (FA_HAVE_AVX512_BF16, fa_bf16_pack_queries,
                              fa_bf16_pair_rows, fa_bf16_product,
                              fa_bf16_round_tile, fa_bf16_scores, fa_bf16_transpose_keys,
                              fa_narrow_row, fa_widen, fa_widen_rows)

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


cdef inline double row_dot(const real* x, const real* y, Py_ssize_t n) noexcept nogil:
    """sum_t x[t] * y[t], accumulated in double."""
    cdef Py_ssize_t t
    cdef double total = 0
    for t in range(n):
        total += <double> x[t] * <double> y[t]
    return total


cdef inline double stored_value(const void* x, DType kind, Py_ssize_t t,
                                const real* like) noexcept nogil:
    """Element t of a row of `real` or (real is float) of bfloat16/float16 words."""
    if real is float:
        if kind == BFLOAT16 or kind == FLOAT16:
            return fa_widen(x, kind, t)
    return (<const real*> x)[t]


cdef inline double row_dot_stored(const void* x, DType x_kind, const void* y,
                                  DType y_kind, Py_ssize_t n,
                                  const real* like) noexcept nogil:
    """row_dot of two rows each held as `real` or in 16 bits (widened exactly)."""
    cdef Py_ssize_t t
    cdef double total = 0
    if real is float:
        if (x_kind == BFLOAT16 or x_kind == FLOAT16
                or y_kind == BFLOAT16 or y_kind == FLOAT16):
            for t in range(n):
                total += (stored_value(x, x_kind, t, like)
                          * stored_value(y, y_kind, t, like))
            return total
    return row_dot(<const real*> x, <const real*> y, n)


cdef inline void transpose_rows(const real* x, Py_ssize_t x_rs, Py_ssize_t nrows,
                                Py_ssize_t cols, real* xt) noexcept nogil:
    """xt (cols, BACKWARD_ROWS) = x[:nrows]^T, lanes nrows.. zero: dO_i^T, the
    right-hand side of dP^T = V_j dO_i^T (_tiles.scaled_queries makes (scale Q_i)^T)."""
    cdef Py_ssize_t t, r
    for t in range(cols):
        for r in range(nrows):
            xt[t * BACKWARD_ROWS + r] = x[r * x_rs + t]
        for r in range(nrows, BACKWARD_ROWS):
            xt[t * BACKWARD_ROWS + r] = 0


cdef inline void probs_tile(real* st, Py_ssize_t bc, const real* shift) noexcept nogil:
    """st (bc, BACKWARD_ROWS) = exp(st - shift[r]) in place: the softmax probabilities
    of key c and query lane r rebuilt from the forward's log-sum-exp (shift: lse, or 0
    for a lane with none; such lanes are cleared by clear_lanes). The exp runs as one
    flat loop over the tile (the shape in which a compiler vectorises it)."""
    cdef Py_ssize_t c, r, x
    cdef real* col
    for c in range(bc):
        col = st + c * BACKWARD_ROWS
        for r in range(BACKWARD_ROWS):
            col[r] = col[r] - shift[r]
    for x in range(bc * BACKWARD_ROWS):
        st[x] = _tiles.exp_(st[x])


cdef inline void dscores_tile(const real* pt, real* dst, Py_ssize_t bc,
                              const real* delta) noexcept nogil:
    """dst (bc, BACKWARD_ROWS) = pt * (dst - delta[r]) in place: the gradient of the
    scores, keys by query lanes."""
    cdef Py_ssize_t c, r
    cdef const real* pcol
    cdef real* dcol
    for c in range(bc):
        pcol = pt + c * BACKWARD_ROWS
        dcol = dst + c * BACKWARD_ROWS
        for r in range(BACKWARD_ROWS):
            dcol[r] = pcol[r] * (dcol[r] - delta[r])


cdef inline void clear_lanes(real* st, Py_ssize_t bc, const unsigned char* live) noexcept nogil:
    """Lanes r of st (bc, BACKWARD_ROWS) with live[r] == 0 become zeros: query rows
    past the tile, and rows with no allowed key (lse = -inf), whatever their scores."""
    cdef Py_ssize_t c, r
    for r in range(BACKWARD_ROWS):
        if not live[r]:
            for c in range(bc):
                st[c * BACKWARD_ROWS + r] = 0


cdef inline bint bf16_gradients(const Plan* p, const Gradients* g) noexcept nogil:
    """Do the three gradient products run on vdpbf16ps (src/fa_bf16.h:
    fa_bf16_product), P and dS rounded to bfloat16 for them as PyTorch's CPU backward
    rounds them? Where S and dP do (bfloat16 q, k, v and grad_out, the plan's
    dot_kernel DOT_AVX512_BF16), with E and Ev multiples of 64."""
    return (FA_HAVE_AVX512_BF16 and p.dot_kernel == DOT_AVX512_BF16
            and p.v.dtype == BFLOAT16 and p.v.col_stride == 1
            and g.grad_kind == BFLOAT16 and p.E % 64 == 0 and p.Ev % 64 == 0)


cdef inline Py_ssize_t key_value_work_size(const Plan* p,
                                           const Gradients* g) noexcept nogil:
    """Elements of scratch key_value_item needs, term by term."""
    cdef Py_ssize_t R = _tiles.round_up(BACKWARD_ROWS * KEY_BLOCK)
    cdef Py_ssize_t QE = _tiles.round_up(BACKWARD_ROWS * p.E)
    cdef Py_ssize_t QV = _tiles.round_up(BACKWARD_ROWS * p.Ev)
    cdef Py_ssize_t chunk_keys = g.chunk_keys
    return (_tiles.round_up(chunk_keys * p.E)       # kw: the chunk's K, widened (or
                                                    # its bfloat16 transpose)
            + _tiles.round_up(chunk_keys * p.Ev)    # vw: the chunk's V, widened
            + 3 * QE                                # qs, qt, dqa
            + 2 * QV                                # dow, dot
            + 4 * R                                 # st, dst, dcap, zs
            + 3 * BACKWARD_ROWS                     # shift, delta, live
            + (_tiles.round_up(chunk_keys * p.E)    # 16-bit gradients: the chunk's
               + _tiles.round_up(chunk_keys * p.Ev)     # dK, dV sums
               if narrowing(g) else 0)
            + (2 * R + QE if bf16_gradients(p, g) else 0))  # P, dS in bfloat16; dQ^T


cdef inline void clear_chunk(const Plan* p, const Gradients* g, Py_ssize_t u,
                             Py_ssize_t chunk, real* like) noexcept nogil:
    """dK, dV of the keys of chunk `chunk` of key/value slice u = 0 (no output reads
    the slice)."""
    cdef Py_ssize_t k0 = chunk * g.chunk_keys
    cdef Py_ssize_t k1 = k0 + g.chunk_keys if k0 + g.chunk_keys < p.Lk else p.Lk
    cdef real* dk = <real*> g.dk + u * p.Lk * p.E
    cdef real* dv = <real*> g.dv + u * p.Lk * p.Ev
    cdef uint16_t* dk16 = <uint16_t*> g.dk + u * p.Lk * p.E
    cdef uint16_t* dv16 = <uint16_t*> g.dv + u * p.Lk * p.Ev
    cdef Py_ssize_t x
    if narrowing(g):        # (+0 in bfloat16 and float16 alike)
        for x in range(k0 * p.E, k1 * p.E):
            dk16[x] = 0
        for x in range(k0 * p.Ev, k1 * p.Ev):
            dv16[x] = 0
        return
    for x in range(k0 * p.E, k1 * p.E):
        dk[x] = 0
    for x in range(k0 * p.Ev, k1 * p.Ev):
        dv[x] = 0


cdef inline void key_value_item(const Plan* p, const Gradients* g, Py_ssize_t u,
                                Py_ssize_t chunk, const Py_ssize_t* users,
                                Py_ssize_t n_users, real* work,
                                Interrupt* stop) noexcept nogil:
    """dK, dV of the keys of chunk `chunk` of key/value slice u, and the partial dQ of
    that chunk for every output slice in users[:n_users] (the slices that read u, in
    increasing order; users[0] locates k and v). Scratch: key_value_work_size().

    The tiles are keys by query lanes, st (KEY_BLOCK, BACKWARD_ROWS) = K_j (scale
    Q_i)^T and dst = V_j dO_i^T, so that P^T and dS^T are the tiles themselves and the
    product dS K_j reads dst with swapped strides: no transposes. With bfloat16 q and
    k (v and grad_out) and the plan's dot_kernel DOT_AVX512_BF16, those two products
    read K (V) in place and the query rows (dO rows) as bfloat16 pairs
    (src/fa_bf16.h), as the forward does; otherwise 16-bit operands are widened once
    per chunk (K, V) or query tile (Q, dO). The three gradient products run on the
    float32 micro-GEMM, or, where bf16_gradients(), on vdpbf16ps with P and dS
    rounded to bfloat16 (dQ^T += K^T dS^T: the chunk's keys transposed once).

    An item covers every query row, which can take a long time: it looks for Ctrl-C
    (``interrupted(stop)``) between query tiles and every CHECK_EVERY key blocks, and
    returns unfinished once one is
    pending (the driver then raises; nothing it wrote is used)."""
    cdef Py_ssize_t E = p.E, Ev = p.Ev, Lq = p.Lq, BR = BACKWARD_ROWS
    cdef Py_ssize_t k0 = chunk * g.chunk_keys
    cdef Py_ssize_t k1 = k0 + g.chunk_keys if k0 + g.chunk_keys < p.Lk else p.Lk
    cdef Py_ssize_t QE = _tiles.round_up(BR * E)
    cdef Py_ssize_t QV = _tiles.round_up(BR * Ev)
    cdef Py_ssize_t R = _tiles.round_up(BR * KEY_BLOCK)
    cdef real* kw = work
    cdef real* vw = kw + _tiles.round_up(g.chunk_keys * E)
    cdef real* qs = vw + _tiles.round_up(g.chunk_keys * Ev)
    cdef real* qt = qs + QE             # (scale Q_i)^T, or Q_i's bfloat16 pairs
    cdef real* dqa = qt + QE
    cdef real* dow = dqa + QE           # dO_i widened from 16 bits
    cdef real* dot = dow + QV           # dO_i^T, or dO_i's bfloat16 pairs
    cdef real* st = dot + QV
    cdef real* dst = st + R
    cdef real* dcap = dst + R
    cdef real* zs = dcap + R
    cdef real* shift = zs + R
    cdef real* delta = shift + BR
    cdef unsigned char* live = <unsigned char*> (delta + BR)
    # this chunk's dK and dV sums (rows k0 to k1): in place, or with 16-bit gradients
    # in float32 here, rounded at the end
    cdef bint narrow = real is float and narrowing(g)
    cdef real* dk = (shift + 3 * BR if narrow
                     else <real*> g.dk + (u * p.Lk + k0) * E)
    cdef real* dv = (dk + _tiles.round_up(g.chunk_keys * E) if narrow
                     else <real*> g.dv + (u * p.Lk + k0) * Ev)
    # the gradient products on vdpbf16ps: P and dS of a block rounded to bfloat16
    # (rows), the rounded dS's pairs of keys, and dQ_i^T += K_j^T dS^T summed here;
    # the chunk's K^T in kw, Q_i's and dO_i's pairs of rows in qs and dow
    cdef bint bf16_g = real is float and bf16_gradients(p, g)
    cdef real* after = (dv + _tiles.round_up(g.chunk_keys * Ev) if narrow
                        else shift + 3 * BR)
    cdef uint16_t* p16 = <uint16_t*> after
    cdef uint16_t* ds16 = p16 + BR * KEY_BLOCK
    cdef real* ds_pairs = after + R
    cdef real* dqt = ds_pairs + R
    cdef bint capped = p.softcap > 0
    cdef bint dropped = p.dropout_p > 0
    # bfloat16 pairs by vdpbf16ps for S (q, k) and dP (grad_out, v), where the forward
    # uses them too (not beside AMX: Intel's vdpbf16ps is no faster than its FMAs)
    cdef bint bf16_s = (real is float and FA_HAVE_AVX512_BF16
                        and p.dot_kernel == DOT_AVX512_BF16)
    cdef bint bf16_dp = (bf16_s and p.v.dtype == BFLOAT16 and p.v.col_stride == 1
                         and g.grad_kind == BFLOAT16 and Ev % 2 == 0)
    cdef Py_ssize_t grad_size = element_size(g.grad_kind)
    cdef const char* k = _tiles.operand_at(p, &p.k, users[0], k0)
    cdef const char* v = _tiles.operand_at(p, &p.v, users[0], k0)
    cdef Py_ssize_t kc_rs, vc_rs = Ev, q_rs
    # K and V of the chunk as `real` (in place, or widened once)
    cdef const real* kc = NULL
    cdef const real* vc = vw
    cdef Py_ssize_t nqb = (Lq + BR - 1) // BR
    cdef Py_ssize_t b, b_first, b_end, j0, bc, x, ui, n, ib, i0, nr, r, t, lo, hi
    cdef real scale = <real> p.scale
    cdef bint all_live = True
    cdef const char* q_src
    cdef const char* do_src
    cdef const real* qb
    cdef const real* dob = NULL
    cdef const real* lse_i
    cdef const real* delta_i
    cdef const unsigned char* mask_i
    cdef const real* bias_i
    cdef real* dq_out
    cdef KeyRange keys

    if bf16_g:
        fa_bf16_transpose_keys(<const uint16_t*> k, p.k.row_stride, k1 - k0, E,
                               <uint16_t*> kw, g.chunk_keys)
    else:
        kc = _tiles.rows_as_real(&p.k, k, k1 - k0, E, kw, &kc_rs)
    if not bf16_dp:
        vc = _tiles.rows_as_real(&p.v, v, k1 - k0, Ev, vw, &vc_rs)
    for x in range((k1 - k0) * E):
        dk[x] = 0
    for x in range((k1 - k0) * Ev):
        dv[x] = 0

    for ui in range(n_users):
        n = users[ui]
        for ib in range(nqb):
            if interrupted(stop):
                return
            i0 = ib * BR
            nr = BR if Lq - i0 > BR else Lq - i0
            if bf16_g:
                for x in range(E * BR):
                    dqt[x] = 0
            else:
                for x in range(nr * E):
                    dqa[x] = 0
            # the blocks of this chunk that some row of the tile may attend to
            keys = tile_keys(p, n, i0, nr)
            lo, hi = keys.lo, keys.hi
            lo = k0 if lo < k0 else lo
            hi = k1 if hi > k1 else hi
            b_first = (lo - k0) // KEY_BLOCK
            b_end = (hi - k0 + KEY_BLOCK - 1) // KEY_BLOCK if hi > lo else b_first
            if b_end > b_first:
                # scale Q_i (rows) and its transpose or pairs; dO_i and its transpose
                # or pairs; each lane's lse and delta (lanes past nr: none)
                q_src = _tiles.operand_at(p, &p.q, n, i0)
                if bf16_g:
                    fa_bf16_pack_queries(<const uint16_t*> q_src, p.q.row_stride, nr, E,
                                         <void*> qt)
                    fa_bf16_pair_rows(<const uint16_t*> q_src, p.q.row_stride, nr, E,
                                      <void*> qs)
                else:
                    qb = _tiles.rows_as_real(&p.q, q_src, nr, E, qs, &q_rs)
                    if bf16_s:
                        fa_bf16_pack_queries(<const uint16_t*> q_src, p.q.row_stride, nr,
                                             E, <void*> qt)
                    else:   # (the forward's qt: BACKWARD_ROWS == QUERY_TILE lanes)
                        _tiles.scaled_queries(p, qb, q_rs, nr, BR, qt)
                    for r in range(nr):     # (after: qb may be qs, widened)
                        for t in range(E):
                            qs[r * E + t] = qb[r * q_rs + t] * scale
                do_src = <const char*> g.grad_out + (n * Lq + i0) * Ev * grad_size
                if bf16_g:
                    fa_bf16_pair_rows(<const uint16_t*> do_src, Ev, nr, Ev, <void*> dow)
                elif real is float and (g.grad_kind == BFLOAT16
                                        or g.grad_kind == FLOAT16):
                    fa_widen_rows(do_src, g.grad_kind, Ev, nr, Ev, <float*> dow)
                    dob = dow
                else:
                    dob = <const real*> do_src
                if bf16_dp:
                    fa_bf16_pack_queries(<const uint16_t*> do_src, Ev, nr, Ev, <void*> dot)
                else:
                    transpose_rows(dob, Ev, nr, Ev, dot)
                lse_i = _tiles.lse_rows(p, n, i0, work)
                delta_i = <const real*> g.delta + n * Lq + i0
                all_live = nr == BR
                for r in range(BR):
                    live[r] = False
                    shift[r] = 0
                    delta[r] = 0
                for r in range(nr):
                    if lse_i[r * p.lse.row_stride] != -INFINITY:
                        live[r] = True
                        shift[r] = lse_i[r * p.lse.row_stride]
                        delta[r] = delta_i[r]
                    else:
                        all_live = False
                mask_i = _tiles.mask_rows(p, n, i0)
                bias_i = _tiles.bias_rows(p, n, i0, work)
            for b in range(b_first, b_end):
                if (b - b_first) % _tiles.CHECK_EVERY == _tiles.CHECK_EVERY - 1 \
                        and interrupted(stop):
                    return
                j0 = k0 + b * KEY_BLOCK
                bc = KEY_BLOCK if k1 - j0 > KEY_BLOCK else k1 - j0
                # S^T = K_j (scale Q_i)^T, the rules, P^T = exp(S^T - lse);
                # dP^T = V_j dO_i^T
                if bf16_s:
                    fa_bf16_scores(<const uint16_t*> _tiles.row_of(&p.k, k, j0 - k0),
                                   p.k.row_stride, bc, <const void*> qt, E // 2,
                                   <float> scale, <float*> st)
                else:
                    _tiles.score_block(p, kc + (j0 - k0) * kc_rs, kc_rs, bc, qt, BR, st)
                _tiles.apply_rules(st, 1, BR, p, n, nr, i0, j0, bc, bc, mask_i, bias_i,
                                   dcap if capped else NULL)
                probs_tile(st, bc, shift)
                if bf16_dp:
                    fa_bf16_scores(<const uint16_t*> _tiles.row_of(&p.v, v, j0 - k0),
                                   p.v.row_stride, bc, <const void*> dot, Ev // 2, 1,
                                   <float*> dst)
                else:
                    gemm(vc + (j0 - k0) * vc_rs, vc_rs, 1, dot, BR, dst, BR, bc, BR, Ev,
                         False)
                if dropped:
                    # O used P Z (Z: 0 or 1 / (1 - p)): dP is dO V^T Z, and dV takes P Z
                    for x in range(bc * BR):
                        zs[x] = 1
                    _tiles.dropout_tile(p, n, zs, 1, BR, nr, i0, j0, bc)
                    for x in range(bc * BR):
                        dst[x] = dst[x] * zs[x]
                dscores_tile(st, dst, bc, delta)
                if capped:          # through the softcap: times 1 - tanh^2
                    for x in range(bc * BR):
                        dst[x] = dst[x] * dcap[x]
                if dropped:
                    for x in range(bc * BR):
                        st[x] = st[x] * zs[x]
                if not all_live:
                    clear_lanes(st, bc, live)
                    clear_lanes(dst, bc, live)
                # dV_j += (P Z)^T dO_i ; dK_j += dS^T (scale Q_i) ; dQ_i += dS K_j
                if bf16_g:
                    fa_bf16_round_tile(<const float*> st, bc, p16)
                    fa_bf16_round_tile(<const float*> dst, bc, ds16)
                    fa_bf16_pair_rows(ds16, BR, bc, BR, <void*> ds_pairs)
                    fa_bf16_product(p16, BR, bc, <const void*> dow, Ev, BR // 2, Ev, 1,
                                    <float*> dv + (j0 - k0) * Ev, Ev, True)
                    fa_bf16_product(ds16, BR, bc, <const void*> qs, E, BR // 2, E,
                                    <float> scale, <float*> dk + (j0 - k0) * E, E, True)
                    fa_bf16_product(<const uint16_t*> kw + (j0 - k0), g.chunk_keys, E,
                                    <const void*> ds_pairs, BR, (bc + 1) // 2, BR, 1,
                                    <float*> dqt, BR, True)
                    continue
                gemm(st, BR, 1, dob, Ev, dv + (j0 - k0) * Ev, Ev, bc, Ev, nr, True)
                gemm(dst, BR, 1, qs, E, dk + (j0 - k0) * E, E, bc, E, nr, True)
                gemm(dst, 1, BR, kc + (j0 - k0) * kc_rs, kc_rs, dqa, E, nr, E, bc, True)
            if bf16_g:      # dQ_i = (dQ_i^T)^T
                _tiles.fa_transpose32(dqt, BR, E, nr, dqa, E, E, NULL, 0)
            if real is float:
                if g.dq != NULL:    # dQ itself, 16-bit: rounded here
                    for x in range(nr * E):
                        dqa[x] = dqa[x] * scale
                    fa_narrow_row(dqa, nr * E, <uint16_t*> g.dq + (n * Lq + i0) * E,
                                  g.out_kind)
                    continue
            dq_out = <real*> g.dq_part + ((n * g.n_chunks + chunk) * Lq + i0) * E
            for x in range(nr * E):
                dq_out[x] = dqa[x] * scale
    if real is float:
        if narrow:
            fa_narrow_row(dk, (k1 - k0) * E, <uint16_t*> g.dk + (u * p.Lk + k0) * E,
                          g.out_kind)
            fa_narrow_row(dv, (k1 - k0) * Ev, <uint16_t*> g.dv + (u * p.Lk + k0) * Ev,
                          g.out_kind)
