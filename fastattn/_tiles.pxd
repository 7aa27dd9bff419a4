# The work items of the forward pass, written once for float and double.
#
# Every function is `cdef inline ... noexcept nogil` and takes (plan, work item,
# scratch): the plan (_plan.pxd) says where every operand lives and which keys each
# query may attend to; a work item is a slice and a range of its query rows (or, for
# decoding, of its keys: _decode.pxd); the scratch is the calling thread's own, laid out
# by _engines.tile_scratch. A tile is a loop over its key blocks of named steps:
#
#     scores  -> rules -> softmax (max) -> values (load) -> softmax (weights)
#             -> dropout -> values (add)
#
# with the steps in _engines.pxd (scores and values, per kernel), _rules.pxd and
# _softmax.pxd, and one epilogue (write_rows, or write_piece for a piece of the keys
# merged later by merge_rows). Nothing here allocates, touches Python objects or knows
# about threads; the module that cimports this file decides the instruction set.

from libc.math cimport INFINITY, NAN, isfinite, log
from libc.stdint cimport uint16_t

from fastattn._csrc cimport (fa_bf16_narrow_row, fa_bf16_words_in_range, fa_narrow_row,
                             fa_prefetch_rows_to, fa_transpose32, fastattn_dropout_keep)
from fastattn._engines cimport (PAD_ROWS, TileScratch, add_values, block_scores,
                                engine_begin, engine_end, load_queries, load_values,
                                mark_tainted, pair_weights, scaled_queries,
                                weights_as_pairs)
from fastattn._gemm cimport gemm, real
from fastattn._operands cimport (Carve, Rows, carving, element, in_place, operand_at,
                                 row_at, rows_as_real, rows_of, run_from, scales_at,
                                 scale_step, sink_of, take, value_at)
from fastattn._parallel cimport Interrupt, fa_read_byte, fa_write_byte, interrupted
from fastattn._plan cimport (BFLOAT16, DOT_FMA, FLOAT16, FLOAT32, FLOAT8_E4M3,
                             FLOAT8_E5M2, KEY_BLOCK, NO_LIMIT, QUERY_TILE, DType,
                             KeyRange, Operand, Plan, element_size, is_code, key_begin,
                             key_end, keys_of, queries_of, tile_keys)
from fastattn._rules cimport ScoreRows, dropout_weights, rule_scores, rules_every_block
from fastattn._softmax cimport (all_finite, exp_, softmax_max, softmax_row,
                                softmax_weights, start_rows)

cdef enum:
    CHECK_EVERY = 16        # key blocks (or decoding steps) between two looks for Ctrl-C


# ----------------------------------------------------------- the fused forward pass
#
# A work item is one tile: up to QUERY_TILE query rows of one slice. Its queries are
# held transposed (E, QUERY_TILE), so that the query rows are the vector axis of every
# loop: a block's scores qk (KEY_BLOCK, QUERY_TILE) = K_block Q^T, the output sums dst
# (Ev, QUERY_TILE) += V_block^T P, and the online softmax's steps are element-wise.

cdef inline void attend_tile(const Plan* p, Py_ssize_t n, Py_ssize_t i0,
                             Py_ssize_t nrows, const TileScratch* s, Interrupt* stop,
                             bint ahead=False) noexcept nogil:
    """Fused attention of query rows i0..i0+nrows (nrows <= QUERY_TILE) of slice n over
    every key they may attend to: out and lse of those rows (see attend_keys)."""
    if p.dtype == FLOAT32:
        attend_keys(p, n, i0, nrows, s, 0, p.Lk, <float*> NULL, NULL, NULL, stop,
                    ahead)
    else:
        attend_keys(p, n, i0, nrows, s, 0, p.Lk, <double*> NULL, NULL, NULL, stop,
                    ahead)


cdef inline void attend_keys(const Plan* p, Py_ssize_t n, Py_ssize_t i0,
                             Py_ssize_t nrows, const TileScratch* s, Py_ssize_t kbeg,
                             Py_ssize_t kend, real* part_acc, real* part_m,
                             double* part_l, Interrupt* stop,
                             bint ahead=False) noexcept nogil:
    """Fused attention of query rows i0..i0+nrows (nrows <= QUERY_TILE) of slice n over
    the keys kbeg..kend they may attend to (online softmax). With part_acc NULL: out
    and lse of those rows (kbeg = 0 and kend = Lk: the whole row). Else the piece's
    partial result for merge_rows (write_piece); kbeg and kend are then multiples of
    KEY_BLOCK (or kend = Lk), so that its blocks are those of the whole row.

    Keys are visited block by block; each row keeps its running max m, running sum l
    (double) and unnormalised output sums, rescaled by exp(m_old - m_new) when the max
    grows. Blocks outside every row's key range are skipped, and the position rule is
    applied only to blocks that cross a row's range. A value row holding NaN or inf
    reaches a query row exactly when attend_row_exactly says so (whatever the tiling).
    It looks for Ctrl-C (`stop`, or NULL) every CHECK_EVERY blocks and returns
    unfinished once one is pending (the driver then raises). With `ahead` (keys this
    thread has not read yet), and always under a window, each block asks for the next
    block's rows while it is computed (prefetch_next_block)."""
    cdef Py_ssize_t nr = (nrows + PAD_ROWS - 1) // PAD_ROWS * PAD_ROWS
    cdef Rows k = rows_of(p, &p.k, &p.k_scale, n)
    cdef Rows v = rows_of(p, &p.v, &p.v_scale, n)
    cdef real* qk = <real*> s.qk
    cdef const real* vb = NULL
    cdef Py_ssize_t v_rs = 0, j0, bc, b, r, first_block, end_block
    cdef KeyRange keys = tile_keys(p, n, i0, nrows)
    cdef ScoreRows rows
    cdef real prescale
    cdef bint first = True, finite, crossing, rules, scaled, pairs
    score_rows(p, n, i0, nrows, s, &rows)
    # the blocks holding keys some row may attend to, in this piece
    keys.lo = keys.lo if keys.lo > kbeg else kbeg
    keys.hi = keys.hi if keys.hi < kend else kend
    first_block = keys.lo // KEY_BLOCK
    end_block = (keys.hi + KEY_BLOCK - 1) // KEY_BLOCK if keys.hi > keys.lo else first_block
    # the sink belongs to the first piece of the keys
    start_rows(p, n, i0, nrows, QUERY_TILE, part_acc == NULL or kbeg == 0,
               <real*> s.sm.m, s.sm.l)
    for r in range(QUERY_TILE):
        (<real*> s.tainted)[r] = 0
    engine_begin(p)
    load_queries(p, n, i0, nrows, nr, <real*> s.q_tile, s)
    for b in range(first_block, end_block):
        if stop != NULL and (b - first_block) % CHECK_EVERY == CHECK_EVERY - 1 \
                and interrupted(stop):
            engine_end(p)
            return
        j0 = b * KEY_BLOCK
        bc = keys.hi - j0 if keys.hi - j0 < KEY_BLOCK else KEY_BLOCK
        if b + 1 < end_block and (ahead or p.window_left < NO_LIMIT):
            prefetch_next_block(p, &k, &v, j0, keys.hi)
        crossing = j0 < keys.all_from or j0 + bc > keys.all_to
        rules = rules_every_block(p, &rows) or crossing
        # S = K_block Q^T (scaled, unless the softmax's first pass is to scale it)
        scaled = block_scores(p, &k, j0, bc, nr, rules, qk, s)
        if rules:
            rule_scores(p, &rows, qk, 1, QUERY_TILE, j0, bc, crossing, NULL)
        prescale = 1 if scaled else <real> p.scale
        finite = load_values(p, &v, n, j0, bc, &vb, &v_rs, s)
        pairs = weights_as_pairs(p, bc, prescale, finite)
        if pairs:
            # m_new and alpha, then P as the values' product reads it (bfloat16 pairs)
            # and l = alpha l + rowsum(P)
            pair_weights(qk, bc, nr, prescale, s)
        else:
            # m_new = max(m, max_j s_j), alpha = e^(m - m_new)
            softmax_max(qk, bc, nr, prescale, &s.sm)
            if not finite:  # rare: values with NaN or inf; their rows are redone later
                mark_tainted(p, vb, v_rs, qk, bc, nr, <real*> s.tainted)
            # P = e^(S - m_new), l = alpha l + rowsum(P)
            softmax_weights(qk, bc, nr, &s.sm)
            if p.dropout_p > 0:
                dropout_weights(p, n, qk, 1, QUERY_TILE, nrows, i0, j0, bc)
        # dst = alpha dst + V_block^T P
        add_values(p, bc, nr, finite, first, pairs, vb, v_rs, <real*> s.dst, s)
        first = False
    engine_end(p)
    if part_acc != NULL:
        write_piece(p, nrows, first, s, part_acc, part_m, part_l)
    else:
        write_rows(p, n, i0, nrows, first, s, <real*> s.dst)


cdef inline void score_rows(const Plan* p, Py_ssize_t n, Py_ssize_t i0, Py_ssize_t nrows,
                            const TileScratch* s, ScoreRows* rows) noexcept nogil:
    """What rules the scores of the tile's rows: the mask and bias rows, and each row's
    allowed keys (once per tile, in s.lo and s.hi)."""
    cdef Py_ssize_t r
    rows.n, rows.i0, rows.nrows = n, i0, nrows
    rows.mask = <const unsigned char*> operand_at(p, &p.mask, n, i0)
    rows.bias = operand_at(p, &p.bias, n, i0)
    for r in range(nrows):
        s.lo[r] = key_begin(p, n, i0 + r)
        s.hi[r] = key_end(p, n, i0 + r)
    rows.lo, rows.hi = s.lo, s.hi


cdef inline void prefetch_next_block(const Plan* p, const Rows* k, const Rows* v,
                                     Py_ssize_t j0, Py_ssize_t end) noexcept nogil:
    """The rows of the block after j0 (up to key end), meanwhile: under a window a tile
    has few blocks, each new one, to every cache level; else to the level-2 cache,
    where the tile's first pass over a slice's keys would meet them from memory."""
    cdef Py_ssize_t last = j0 + 2 * KEY_BLOCK
    cdef bint near = p.window_left < NO_LIMIT
    prefetch_rows(k, j0 + KEY_BLOCK, last if last < end else end, p.E, near)
    prefetch_rows(v, j0 + KEY_BLOCK, last if last < end else end, p.Ev, near)


cdef inline void prefetch_tile(const Plan* p, Py_ssize_t n, Py_ssize_t i0,
                               Py_ssize_t nrows, bint keys) noexcept nogil:
    """Ask for the query rows of the tile a thread takes next (rows i0..i0+nrows of
    slice n) and, with `keys` (a slice the present tile does not read), its first key
    and value block, to the level-2 cache while the present tile is computed."""
    cdef Rows q = rows_of(p, &p.q, NULL, n)
    cdef Rows k, v
    cdef KeyRange r
    cdef Py_ssize_t j0
    prefetch_rows(&q, i0, i0 + nrows, p.E, False)
    if keys:
        r = tile_keys(p, n, i0, nrows)
        if r.hi > r.lo:
            j0 = r.lo // KEY_BLOCK * KEY_BLOCK
            k = rows_of(p, &p.k, &p.k_scale, n)
            v = rows_of(p, &p.v, &p.v_scale, n)
            prefetch_rows(&k, j0, j0 + KEY_BLOCK if j0 + KEY_BLOCK < r.hi else r.hi,
                          p.E, False)
            prefetch_rows(&v, j0, j0 + KEY_BLOCK if j0 + KEY_BLOCK < r.hi else r.hi,
                          p.Ev, False)


cdef inline void prefetch_rows(const Rows* r, Py_ssize_t j, Py_ssize_t end,
                               Py_ssize_t cols, bint near) noexcept nogil:
    """Ask for the cache lines of rows j..end (cols elements each), run by run: with
    near to every cache level, else to the level-2 cache."""
    cdef Py_ssize_t run
    while j < end:
        run = run_from(r, j, end)
        fa_prefetch_rows_to(row_at(r, j), run, cols * element_size(r.dtype),
                            r.row_bytes, near)
        j += run


cdef inline void write_rows(const Plan* p, Py_ssize_t n, Py_ssize_t i0, Py_ssize_t nrows,
                            bint no_block, const TileScratch* s,
                            const real* dst) noexcept nogil:
    """out = dst^T / l and lse = m + log l of the tile's rows; zeros and -inf for a row
    with no allowed key. A row that met a NaN or inf value, or whose result is not
    finite (NaN or inf inputs, or running sums that overflowed on values near the
    largest float), is redone by attend_row_exactly. A 16-bit out (narrow_out) gets
    the rows in float32 in s.blk first (its last use is over), then rounded once."""
    cdef char* dest = operand_at(p, &p.out, n, i0)
    cdef bint narrow = narrow_out(p)
    cdef real* out = <real*> s.blk if narrow else <real*> dest
    cdef real* lse = <real*> operand_at(p, &p.lse, n, i0)
    cdef real* inv = <real*> s.sm.alpha           # (its last use is over)
    cdef const real* m = <const real*> s.sm.m
    cdef const real* tainted = <const real*> s.tainted
    cdef const double* l = s.sm.l
    cdef Py_ssize_t r, t, Ev = p.Ev
    cdef Py_ssize_t o_rs = Ev if narrow else p.out.row_stride
    for r in range(nrows):
        inv[r] = <real> (1.0 / l[r]) if l[r] != 0 else 0
    if no_block:                # dst was never written: zero (NaN for a NaN sink)
        for r in range(nrows):
            for t in range(Ev):
                out[r * o_rs + t] = 0 * inv[r]
    elif real is float:
        fa_transpose32(dst, QUERY_TILE, Ev, nrows, out, o_rs, Ev, inv, 1)
    else:
        for r in range(nrows):
            for t in range(Ev):
                out[r * o_rs + t] = dst[t * QUERY_TILE + r] * inv[r]
    for r in range(nrows):
        if l[r] == 0:           # no allowed key: zeros (dst * 0 is NaN where dst is inf)
            for t in range(Ev):
                out[r * o_rs + t] = 0
            if lse != NULL:
                lse[r * p.lse.row_stride] = -INFINITY
        elif lse != NULL:
            lse[r * p.lse.row_stride] = <real> (m[r] + log(l[r]))
    for r in range(nrows):
        if tainted[r] != 0 or not all_finite(out + r * o_rs, 1, Ev, Ev):
            attend_row_exactly(p, n, i0 + r, out + r * o_rs,
                               lse + r * p.lse.row_stride if lse != NULL else NULL)
    if narrow:
        narrow_rows(p, <const float*> out, nrows, dest)


cdef inline bint narrow_out(const Plan* p) noexcept nogil:
    """Is out stored in 16 bits (bfloat16 or float16) while the computation is float32?
    Its rows are then computed in float32 and rounded once as they are written (the
    bits of rounding a float32 result afterwards)."""
    return p.dtype == FLOAT32 and (p.out.dtype == BFLOAT16 or p.out.dtype == FLOAT16)


cdef inline void narrow_rows(const Plan* p, const float* rows, Py_ssize_t nrows,
                             char* dest) noexcept nogil:
    """Rows (nrows, Ev) of float32, one after another, rounded into the 16-bit out
    rows at dest (the first of them)."""
    cdef Py_ssize_t r
    if p.out.row_stride == p.Ev:
        narrow_row(p, rows, nrows * p.Ev, <uint16_t*> dest)
        return
    for r in range(nrows):
        narrow_row(p, rows + r * p.Ev, p.Ev, <uint16_t*> dest + r * p.out.row_stride)


cdef inline void narrow_row(const Plan* p, const float* row, Py_ssize_t n,
                            uint16_t* dest) noexcept nogil:
    """narrow_16 into out's dtype, on the units where the plan runs on them (the CPU
    then has AVX512-BF16)."""
    narrow_16(row, n, dest, p.out.dtype, p.dot_kernel != DOT_FMA)


cdef inline void narrow_16(const float* src, Py_ssize_t n, uint16_t* dst, DType kind,
                           bint units) noexcept nogil:
    """fa_narrow_row; bfloat16 by vcvtne2ps2bf16 (fa_bf16_narrow_row: the same bits)
    with `units`, only where the CPU has AVX512-BF16."""
    if units and kind == BFLOAT16:
        fa_bf16_narrow_row(src, n, dst)
    else:
        fa_narrow_row(src, n, dst, kind)


cdef inline void write_piece(const Plan* p, Py_ssize_t nrows, bint no_block,
                             const TileScratch* s, real* part_acc, real* part_m,
                             double* part_l) noexcept nogil:
    """A piece's partial result, as attend_few leaves one: part_acc (nrows, Ev) =
    sum_j e^(s_j - m) v_j, part_m (nrows) the max (-inf for no allowed key) and part_l
    (nrows) = sum_j e^(s_j - m). A row that met a NaN or inf value gets NaN, so that
    its merged result is not finite where this piece counts, and is redone exactly."""
    cdef real* ones = <real*> s.sm.alpha          # (its last use is over)
    cdef const real* m = <const real*> s.sm.m
    cdef const real* tainted = <const real*> s.tainted
    cdef const real* dst = <const real*> s.dst
    cdef Py_ssize_t r, t, Ev = p.Ev
    for r in range(nrows):
        part_m[r] = m[r] if s.sm.l[r] != 0 else -INFINITY
        part_l[r] = s.sm.l[r]
        ones[r] = 1
    if not no_block:
        if real is float:
            fa_transpose32(dst, QUERY_TILE, Ev, nrows, part_acc, Ev, Ev, ones, 1)
        else:
            for r in range(nrows):
                for t in range(Ev):
                    part_acc[r * Ev + t] = dst[t * QUERY_TILE + r]
    for r in range(nrows):
        if no_block or s.sm.l[r] == 0:      # no allowed key here: zeros
            for t in range(Ev):
                part_acc[r * Ev + t] = 0
        elif tainted[r] != 0:
            for t in range(Ev):
                part_acc[r * Ev + t] = NAN


# --------------------------------------------------------- merging pieces of the keys

cdef struct Parts:
    # the partial results of a split of the keys: one row per (item, piece, query row)
    void* acc           # rows x Ev: sum_j e^(s_j - m) v_j, in the computation dtype
    void* m             # rows: the max (-inf for no allowed key)
    double* l           # rows: sum_j e^(s_j - m)
    void* row           # Ev: one merged row, for a 16-bit out (merge_rows)


cdef inline Py_ssize_t parts_scratch(const Plan* p, Py_ssize_t rows, char* base,
                                     Parts* s) noexcept nogil:
    """The partial results of `rows` rows: their size in bytes; with `base`, their
    pointers."""
    cdef Carve c = carving(base)
    cdef Py_ssize_t r = element_size(p.dtype)
    s.acc = take(&c, rows * p.Ev, r)
    s.m = take(&c, rows, r)
    s.l = <double*> take(&c, rows, sizeof(double))
    s.row = take(&c, p.Ev, r)
    return c.size


cdef inline void merge_parts(const real* acc, const real* m, const double* l,
                             Py_ssize_t nparts, Py_ssize_t stride, Py_ssize_t R,
                             Py_ssize_t Ev, real* out, Py_ssize_t out_rs,
                             real* lse, Py_ssize_t lse_rs) noexcept nogil:
    """Combine nparts partial results, in order, into out (R, Ev) (row stride out_rs)
    and lse (R) (stride lse_rs; or NULL).

    Part p is at acc + p * stride * Ev, m + p * stride, l + p * stride. With
    M = max_p m_p: out = sum_p exp(m_p - M) acc_p / L and lse = M + log L, where
    L = sum_p exp(m_p - M) l_p; zeros and -inf when L == 0 (no allowed key); a NaN L
    (a NaN score or sink in some part) makes the row NaN.
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
        if L == 0 or L != L:
            for t in range(Ev):
                o[t] = 0 if L == 0 else NAN
            if lse != NULL:
                lse[r * lse_rs] = -INFINITY if L == 0 else NAN
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
                            Py_ssize_t nparts, Py_ssize_t stride,
                            real* row) noexcept nogil:
    """out and lse of query rows i0..i0+nrows of slice n from nparts partial results
    (merge_parts: part q of row r at acc + (q * stride + r) * Ev, m and l likewise);
    a row whose result is not finite met NaN or inf, and the rule for those is
    attend_row_exactly's (whatever the split). A 16-bit out (narrow_out) is merged
    row by row into `row` (Ev elements of scratch), then rounded."""
    cdef Py_ssize_t r
    cdef char* dest = operand_at(p, &p.out, n, i0)
    cdef real* out = <real*> dest
    cdef real* lse = <real*> operand_at(p, &p.lse, n, i0)
    cdef real* lse_r
    if narrow_out(p):
        for r in range(nrows):
            lse_r = lse + r * p.lse.row_stride if lse != NULL else NULL
            merge_parts(acc + r * p.Ev, m + r, l + r, nparts, stride, 1, p.Ev, row,
                        p.Ev, lse_r, 0)
            if not all_finite(row, 1, p.Ev, p.Ev):
                attend_row_exactly(p, n, i0 + r, row, lse_r)
            narrow_rows(p, <const float*> row, 1,
                        dest + r * p.out.row_stride * element_size(p.out.dtype))
        return
    merge_parts(acc, m, l, nparts, stride, nrows, p.Ev, out, p.out.row_stride, lse,
                p.lse.row_stride)
    for r in range(nrows):
        if not all_finite(out + r * p.out.row_stride, 1, p.Ev, p.Ev):
            attend_row_exactly(p, n, i0 + r, out + r * p.out.row_stride,
                               lse + r * p.lse.row_stride if lse != NULL else NULL)


# ------------------------------------------------------------ one row, the exact rule

cdef inline void attend_row_exactly(const Plan* p, Py_ssize_t n, Py_ssize_t i,
                                    real* out, real* lse) noexcept nogil:
    """Query row i of slice n, the plain way, for a row that may attend to a key whose
    value holds NaN or inf, or whose result came out not finite.

    The scores s_j of the allowed keys are computed as dot products, then
    m = max(max_j s_j, sink), w_j = exp(s_j - m), L = sum_j w_j + exp(sink - m) and
    out = sum_j (w_j / L) v_j, skipping every key whose weight w_j is exactly 0 (or that
    dropout drops): so a NaN or inf value reaches the row iff its weight against the
    row's own maximum (the sink's included) does not underflow, a rule that does not
    depend on how rows and keys are cut into tiles. The weights are normalised before
    they meet the values, so values near the largest float give their finite mean. A
    NaN L (a NaN or +inf score or sink) makes the row NaN. lse (or NULL) = m + log L.
    """
    cdef const char* q = operand_at(p, &p.q, n, i)
    cdef Rows k = rows_of(p, &p.k, &p.k_scale, n)
    cdef Rows v = rows_of(p, &p.v, &p.v_scale, n)
    cdef ScoreRows rows
    cdef Py_ssize_t lo = key_begin(p, n, i), hi = key_end(p, n, i)
    cdef Py_ssize_t j, t
    cdef double sink = sink_of(p, n) if i < queries_of(p, n) else -INFINITY
    cdef real s, m = -INFINITY, w
    cdef real kept = <real> (1.0 / (1.0 - p.dropout_p))
    cdef double total = 0
    cdef real inv
    rows.n, rows.i0, rows.nrows, rows.lo, rows.hi = n, i, 1, NULL, NULL
    rows.mask = <const unsigned char*> operand_at(p, &p.mask, n, i)
    rows.bias = operand_at(p, &p.bias, n, i)
    for t in range(p.Ev):
        out[t] = 0
    if sink != sink or sink == INFINITY:        # a NaN or +inf sink: NaN
        nan_row(p, out, lse)
        return
    for j in range(lo, hi):                     # pass 1: the row's maximum
        row_score(p, &rows, q, &k, j, &s)
        if s > m:
            m = s
    if sink > m:
        m = <real> sink
    if m == -INFINITY:                          # only NaN scores, or none allowed
        m = 0
    for j in range(lo, hi):                     # pass 2: the sum of the weights
        row_score(p, &rows, q, &k, j, &s)
        if s != -INFINITY:
            total += exp_(s - m)
    if sink != -INFINITY:
        total += exp_(<real> (sink - m))
    if total == 0:
        if lse != NULL:
            lse[0] = -INFINITY
        return
    if total != total:                          # a NaN score (or +inf): a NaN row,
        nan_row(p, out, lse)                    # whatever dropout keeps
        return
    inv = <real> (1.0 / total)
    for j in range(lo, hi):                     # pass 3: the normalised weights' sum
        row_score(p, &rows, q, &k, j, &s)
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
            out[t] = out[t] + w * <real> value_at(&v, j, t)
    if lse != NULL:
        lse[0] = <real> (m + log(total))


cdef inline void nan_row(const Plan* p, real* out, real* lse) noexcept nogil:
    cdef Py_ssize_t t
    for t in range(p.Ev):
        out[t] = NAN
    if lse != NULL:
        lse[0] = NAN


cdef inline void row_score(const Plan* p, const ScoreRows* rows, const char* q,
                           const Rows* k, Py_ssize_t j, real* s) noexcept nogil:
    """s = the score of key j for the one query row of `rows` (q at that row, k at key
    0), through rule_scores like every other score (the key lies in the row's range by
    position; -inf where the mask blocks it)."""
    cdef Py_ssize_t t
    cdef real scale = <real> p.scale
    s[0] = 0
    for t in range(p.E):
        s[0] = s[0] + (<real> element(&p.q, q, t) * scale) * <real> value_at(k, j, t)
    rule_scores(p, rows, s, 1, 1, j, 1, True, NULL)


# ------------------------------------------------------ checks before the work items

cdef inline bint values_finite(const Plan* p, Py_ssize_t n) noexcept nogil:
    """No inf and no NaN in the value rows of slice n (16-bit ones and 8-bit codes: by
    their exponent bits; codes with a finite scale)."""
    cdef Rows v = rows_of(p, &p.v, &p.v_scale, n)
    cdef Py_ssize_t j, run
    j = 0
    while j < keys_of(p, n):
        run = run_from(&v, j, keys_of(p, n))
        if not run_finite(&v, j, run, p.Ev):
            return False
        j += run
    return True


cdef inline bint run_finite(const Rows* r, Py_ssize_t j, Py_ssize_t run,
                            Py_ssize_t cols) noexcept nogil:
    """No inf and no NaN among rows j..j+run of one run."""
    cdef const char* x = row_at(r, j)
    cdef const float* sc = scales_at(r, j)
    cdef const uint16_t* h
    cdef const unsigned char* b
    cdef Py_ssize_t c, t
    cdef uint16_t ones = 0x7f80 if r.dtype == BFLOAT16 else 0x7c00
    cdef unsigned char code_mask = 0x7f if r.dtype == FLOAT8_E4M3 else 0x7c
    cdef int flag = 0
    if sc != NULL:
        for c in range(run):
            flag = flag | (not isfinite(sc[c * scale_step(r)]))
    if r.dtype == BFLOAT16 or r.dtype == FLOAT16:
        for c in range(run):
            h = <const uint16_t*> (x + c * r.row_bytes)
            for t in range(cols):
                flag = flag | ((h[t] & ones) == ones)
    elif r.dtype == FLOAT8_E4M3 or r.dtype == FLOAT8_E5M2:
        for c in range(run):
            b = <const unsigned char*> (x + c * r.row_bytes)
            for t in range(cols):
                flag = flag | ((b[t] & code_mask) == code_mask)
    elif r.dtype == FLOAT32:
        for c in range(run):
            flag = flag | (not all_finite(<const float*> (x + c * r.row_bytes), 1, cols,
                                          cols))
    elif not is_code(r.dtype):
        for c in range(run):
            flag = flag | (not all_finite(<const double*> (x + c * r.row_bytes), 1,
                                          cols, cols))
    return not flag


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
    return fa_bf16_words_in_range(h, n, BF16_SAFE_EXP)


cdef inline bint bf16_rows_in_range(const Plan* p, const Operand* a, Py_ssize_t n,
                                    Py_ssize_t first, Py_ssize_t rows,
                                    Py_ssize_t cols) noexcept nogil:
    """bf16_words_in_range for rows first..first+rows of slice n of a bfloat16 operand
    (True for an operand stored otherwise: it does not meet the bfloat16 units)."""
    cdef Rows x = rows_of(p, a, NULL, n)
    cdef Py_ssize_t r
    if a.dtype != BFLOAT16:
        return True
    if in_place(&x) and a.col_stride == 1 and a.row_stride == cols:
        return bf16_words_in_range(<const uint16_t*> row_at(&x, first), rows * cols)
    for r in range(first, first + rows):
        if not bf16_words_in_range(<const uint16_t*> row_at(&x, r), cols):
            return False
    return True


cdef inline bint bf16_units_safe(const Plan* p, Py_ssize_t n) noexcept nogil:
    """May slice n run on the bfloat16 units (q, k, and v, whose products meet them
    too on AMX and in the backward)? See BF16_SAFE_EXP."""
    return (bf16_rows_in_range(p, &p.q, n, 0, queries_of(p, n), p.E)
            and bf16_keys_in_range(p, n))


cdef inline bint bf16_keys_in_range(const Plan* p, Py_ssize_t n) noexcept nogil:
    """bf16_rows_in_range for slice n's k and v."""
    return (bf16_rows_in_range(p, &p.k, n, 0, keys_of(p, n), p.E)
            and bf16_rows_in_range(p, &p.v, n, 0, keys_of(p, n), p.Ev))


# What the tiled forward knows of a slice's operands on the bfloat16 units
# (plan.units_checked[n]): found by its driver before the tiles (every operand), or by
# the first tile of the slice to look (k and v; each tile then checks its own query
# rows). Either way it depends on the slice's data only: the same for any number of
# threads, and whatever the other slices of the call hold.

cdef enum UnitsCheck:
    UNITS_UNKNOWN = 0       # no tile has looked yet
    UNITS_SAFE = 1          # every operand of the slice suits the units
    UNITS_KEYS_SAFE = 2     # k and v suit them: each tile checks its query rows
    UNITS_UNSAFE = 3        # the slice runs the float32 path


cdef inline bint tile_units_safe(const Plan* p, Py_ssize_t n, Py_ssize_t i0,
                                 Py_ssize_t nrows) noexcept nogil:
    """May the tile of query rows i0..i0+nrows of slice n run on the plan's bfloat16
    units (True for a plan on the float32 path: nothing to choose)? Where no one has
    looked at the slice yet, the tile checks k and v (the data it is about to read:
    then in its core's cache) and records what it found for the slice's other tiles."""
    cdef unsigned char state
    if p.units_checked == NULL:
        return True
    state = fa_read_byte(&p.units_checked[n])
    if state == UNITS_UNKNOWN:
        state = UNITS_KEYS_SAFE if bf16_keys_in_range(p, n) else UNITS_UNSAFE
        fa_write_byte(&p.units_checked[n], state)
    if state == UNITS_KEYS_SAFE:
        return bf16_rows_in_range(p, &p.q, n, i0, nrows, p.E)
    return state == UNITS_SAFE


cdef inline bint bf16_scale_safe(double scale) noexcept nogil:
    cdef double a = scale if scale >= 0 else -scale
    return a == 0 or (a >= 1.0 / (<double> (1 << 20) * (1 << 20))
                      and a < <double> (1 << 20) * (1 << 20))


# ------------------------------------------------------------------ the scores pass

cdef struct ScoresScratch:
    # one work item of the scores pass (QT = QUERY_TILE lanes)
    void* q_tile        # E x QT: scale * Q^T
    void* qk            # KEY_BLOCK x QT: a block's scores
    void* rows          # KEY_BLOCK x E: rows of q or k widened from 16 bits


cdef inline Py_ssize_t scores_scratch(const Plan* p, char* base,
                                      ScoresScratch* s) noexcept nogil:
    """The scratch of one scores tile: its size in bytes; with `base`, its pointers."""
    cdef Carve c = carving(base)
    cdef Py_ssize_t r = element_size(p.dtype)
    s.q_tile = take(&c, p.E * QUERY_TILE, r)
    s.qk = take(&c, KEY_BLOCK * QUERY_TILE, r)
    s.rows = take(&c, KEY_BLOCK * p.E, r)
    return c.size


cdef inline void score_tile(const Plan* p, Py_ssize_t n, Py_ssize_t i0, Py_ssize_t nrows,
                            bint softmax, real* out,
                            const ScoresScratch* s) noexcept nogil:
    """out (the rows i0..i0+nrows of slice n, Lk entries each) = scale * q @ k^T +
    bias, entries that may not be attended -inf; then, with `softmax`, each row's
    softmax (with the slice's sink)."""
    cdef real* qt = <real*> s.q_tile
    cdef real* qk = <real*> s.qk
    cdef Rows q = rows_of(p, &p.q, NULL, n)
    cdef Rows k = rows_of(p, &p.k, &p.k_scale, n)
    cdef ScoreRows rows
    cdef Py_ssize_t b, j0, bc, r, c, rs
    cdef const real* block = rows_as_real(&q, i0, nrows, p.E, <real*> s.rows, &rs)
    rows.n, rows.i0, rows.nrows, rows.lo, rows.hi = n, i0, nrows, NULL, NULL
    rows.mask = <const unsigned char*> operand_at(p, &p.mask, n, i0)
    rows.bias = operand_at(p, &p.bias, n, i0)
    scaled_queries(p, block, rs, nrows, nrows, qt)
    for b in range((p.Lk + KEY_BLOCK - 1) // KEY_BLOCK):
        j0 = b * KEY_BLOCK
        bc = p.Lk - j0 if p.Lk - j0 < KEY_BLOCK else KEY_BLOCK
        block = rows_as_real(&k, j0, bc, p.E, <real*> s.rows, &rs)
        gemm(block, rs, 1, qt, QUERY_TILE, qk, QUERY_TILE, bc, nrows, p.E, False)
        rule_scores(p, &rows, qk, 1, QUERY_TILE, j0, bc, True, NULL)
        for r in range(nrows):
            for c in range(bc):
                out[r * p.out.row_stride + j0 + c] = qk[c * QUERY_TILE + r]
    if softmax:
        for r in range(nrows):
            softmax_row(out + r * p.out.row_stride, out + r * p.out.row_stride, p.Lk,
                        sink_of(p, n) if i0 + r < queries_of(p, n) else -INFINITY)
