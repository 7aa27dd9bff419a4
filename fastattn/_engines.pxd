# The block engines of the fused forward: what computes a key block's scores and its
# product with V, one implementation per kernel, chosen by the plan's `dot_kernel`
# (the driver settles it before the work items run: a kernel this module or these
# operands cannot use has become DOT_FMA by then):
#
#   DOT_FMA          the micro-GEMM (_gemm.pxd); 16-bit rows widened into scratch
#   DOT_AVX512_BF16  scores by vdpbf16ps from bfloat16 rows read in place
#                    (src/fa_bf16.h); the values' product too where V is bfloat16
#                    with Ev a multiple of 16 and the plan rounds the weights once to
#                    bfloat16 (round_weights: precision=None), else on the micro-GEMM
#   DOT_AMX_BF16     scores on AMX tiles (src/fa_amx.h), and the values' product too
#                    where V is bfloat16 with Ev a multiple of 16 (the weights
#                    rounded once, or as two bfloat16 parts without round_weights)
#
# A tile calls, per block: block_scores, then (after the rules) load_values, then
# (after the softmax: pair_weights where weights_as_pairs) add_values. A new kernel or
# storage kind is a new case in these functions.

from libc.float cimport FLT_MAX
from libc.math cimport INFINITY
from libc.stdint cimport uint16_t, uint32_t

from fastattn._csrc cimport (fa_amx_begin, fa_amx_end, fa_amx_pv, fa_amx_scores,
                             fa_bf16_pack_queries, fa_bf16_pack_values,
                             fa_bf16_pack_weights, fa_bf16_pv, fa_bf16_scores,
                             fa_bf16_weight_pairs, fa_block_max_unscaled, fa_transpose32)
from fastattn._gemm cimport gemm, real, scaled_plus
from fastattn._operands cimport (Carve, Rows, carving, read_in_place, row_at, rows_as_real,
                                 rows_of, rows_stored, run_from, runs_of_real, take)
from fastattn._plan cimport (BFLOAT16, DOT_AMX_BF16, DOT_AVX512_BF16, DOT_FMA, FLOAT32,
                             KEY_BLOCK, QUERY_TILE, Operand, Plan, element_size, keys_of)
from fastattn._softmax cimport Softmax, all_finite

cdef enum:
    PAD_ROWS = 32       # a tile's rows are padded to a multiple of this in every lane
                        # loop (a short tile does not pay for all 64 lanes)
    WIDE_BYTES = 512 * 1024     # a thread's widened K and V rows of one slice, at most
                                # (widened_keys: about a core's L2)


cdef struct TileScratch:
    # one work item of the fused forward, term by term (QT = QUERY_TILE lanes,
    # KB = KEY_BLOCK keys; elements of the computation dtype unless said)
    void* q_tile        # E x QT: scale * Q^T, or the rows' bfloat16 pairs (unscaled)
    void* qk            # KB x QT: a block's scores, then its weights (PyTorch: qk),
                        # or their bfloat16 pairs (pair_weights)
    void* dst           # Ev x QT: the running output sums, unnormalised (PyTorch: dst)
    void* blk           # Ev x QT: a block's product with V, for blocks with NaN or inf
    void* tainted       # QT: rows that met a NaN or inf value (redone exactly)
    Py_ssize_t* lo      # QT: each row's allowed keys [lo, hi) by position and length
    Py_ssize_t* hi
    void* k_rows        # KB x max(E, QT): K (or the tile's Q) rows widened from 16
                        # bits; values as pairs: the block's weights as bfloat16 pairs
                        # where they were first stored in float32 (fa_bf16_pack_weights)
    void* v_rows        # KB x Ev: V rows widened; values as pairs: the block's V^T
    void* gathered      # KB x max(E, Ev) 16-bit words: a block of a paged cache's rows
                        # gathered for the bfloat16 units
    void* wide_k        # W x E, W = plan.wide_keys: the K rows of the slice last read,
    void* wide_v        # W x Ev: and its V rows, widened as blocks are first needed
    Py_ssize_t* wide_done   # 2 x W / KB: rows of each block widened so far (K, then V)
    const void** wide_of    # 6: the slice they hold: K's rows, pages and scales; V's
    Softmax sm          # m, m_sub, alpha (QT each), l, l_blk (QT doubles each)


cdef inline Py_ssize_t tile_scratch(const Plan* p, char* base,
                                    TileScratch* s) noexcept nogil:
    """The scratch of one tile: its size in bytes; with `base`, its pointers into it."""
    cdef Carve c = carving(base)
    cdef Py_ssize_t r = element_size(p.dtype)
    cdef Py_ssize_t QT = QUERY_TILE
    s.q_tile = take(&c, p.E * QT, r)
    s.qk = take(&c, KEY_BLOCK * QT, r)
    s.dst = take(&c, p.Ev * QT, r)
    s.blk = take(&c, p.Ev * QT, r)
    s.tainted = take(&c, QT, r)
    s.lo = <Py_ssize_t*> take(&c, QT, sizeof(Py_ssize_t))
    s.hi = <Py_ssize_t*> take(&c, QT, sizeof(Py_ssize_t))
    s.k_rows = take(&c, KEY_BLOCK * (p.E if p.E > QT else QT), r)
    s.v_rows = take(&c, KEY_BLOCK * p.Ev, r)
    s.gathered = take(&c, KEY_BLOCK * (p.E if p.E > p.Ev else p.Ev), 2)
    s.wide_k = take(&c, p.wide_keys * p.E, r)
    s.wide_v = take(&c, p.wide_keys * p.Ev, r)
    s.wide_done = <Py_ssize_t*> take(&c, 2 * wide_blocks(p), sizeof(Py_ssize_t))
    s.wide_of = <const void**> take(&c, 6, sizeof(void*))
    s.sm.m = take(&c, QT, r)
    s.sm.m_sub = take(&c, QT, r)
    s.sm.alpha = take(&c, QT, r)
    s.sm.l = <double*> take(&c, QT, sizeof(double))
    s.sm.l_blk = <double*> take(&c, QT, sizeof(double))
    cdef int i
    if base != NULL:        # no slice widened yet
        for i in range(6):
            s.wide_of[i] = NULL
    return c.size


cdef inline Py_ssize_t widened_keys(const Plan* p, Py_ssize_t tiles) noexcept nogil:
    """plan.wide_keys for a tiled forward of `tiles` query tiles per slice: all of a
    slice's keys where its K or V rows are widened (16 bits, 8-bit codes, a paged
    cache), more than one tile (or query head) reads them, and they fit WIDE_BYTES
    widened; else 0 (each tile widens each block it reads)."""
    cdef Py_ssize_t row = (p.E + p.Ev) * element_size(p.dtype)
    if values_as_pairs(p):      # (the bfloat16 units read K as stored, V as pairs)
        return 0
    if tiles * p.groups < 2 or p.Lk > WIDE_BYTES // (row if row > 0 else 1):
        return 0
    if not (widened_operand(p, &p.k, &p.k_scale) or widened_operand(p, &p.v, &p.v_scale)):
        return 0
    return p.Lk


cdef inline bint widened_operand(const Plan* p, const Operand* a,
                                 const Operand* scale) noexcept nogil:
    """Does rows_as_real widen (or gather) operand a's rows rather than read them where
    they lie?"""
    return a.dtype != p.dtype or a.pages != NULL or scale.data != NULL


cdef inline Py_ssize_t wide_blocks(const Plan* p) noexcept nogil:
    return (p.wide_keys + KEY_BLOCK - 1) // KEY_BLOCK


cdef inline const real* block_rows(const Plan* p, const Rows* r, bint values,
                                   Py_ssize_t j0, Py_ssize_t bc, Py_ssize_t cols,
                                   real* buf, Py_ssize_t* rs,
                                   const TileScratch* s) noexcept nogil:
    """rows_as_real of the key block at j0 (a multiple of KEY_BLOCK) of K (values
    False) or V: where the plan keeps a slice widened (wide_keys), from the thread's
    copy, widened the first time a tile reads the block, so that the slice's other
    tiles (and query heads) read it as it is; the same values, so the same bits."""
    cdef const void** held = s.wide_of + 3 * values
    cdef Py_ssize_t* done = s.wide_done + values * wide_blocks(p)
    cdef real* wide = <real*> (s.wide_v if values else s.wide_k)
    cdef Py_ssize_t b = j0 // KEY_BLOCK, i
    if j0 + bc > p.wide_keys or read_in_place(r, <real> 0):
        return rows_as_real(r, j0, bc, cols, buf, rs)
    if held[0] != <const void*> r.data or held[1] != <const void*> r.pages \
            or held[2] != <const void*> r.scale:
        held[0], held[1], held[2] = r.data, r.pages, r.scale
        for i in range(wide_blocks(p)):
            done[i] = 0
    wide += j0 * cols
    if done[b] < bc:
        rows_as_real(r, j0, bc, cols, wide, rs)
        done[b] = bc
    rs[0] = cols
    return wide


cdef inline void engine_begin(const Plan* p) noexcept nogil:
    """Before a work item's first block (AMX: configure the thread's tiles)."""
    if p.dot_kernel == DOT_AMX_BF16:
        fa_amx_begin()


cdef inline void engine_end(const Plan* p) noexcept nogil:
    if p.dot_kernel == DOT_AMX_BF16:
        fa_amx_end()


cdef inline void load_queries(const Plan* p, Py_ssize_t n, Py_ssize_t i0,
                              Py_ssize_t nrows, Py_ssize_t nr, real* q_tile,
                              const TileScratch* s) noexcept nogil:
    """q_tile = query rows i0..i0+nrows of slice n as the engine reads them: the
    bfloat16 units their pairs (unscaled), the micro-GEMM scale * Q^T (rows nrows..nr
    zero; 16-bit rows widened into k_rows first: QUERY_TILE <= KEY_BLOCK)."""
    cdef Rows q = rows_of(p, &p.q, NULL, n)
    cdef const real* rows
    cdef Py_ssize_t rs
    if real is float:
        if p.dot_kernel != DOT_FMA:
            fa_bf16_pack_queries(<const uint16_t*> (q.data + i0 * q.row_bytes),
                                 p.q.row_stride, nrows, p.E, <void*> q_tile)
            return
    rows = rows_as_real(&q, i0, nrows, p.E, <real*> s.k_rows, &rs)
    scaled_queries(p, rows, rs, nrows, nr, q_tile)


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


cdef inline bint block_scores(const Plan* p, const Rows* k, Py_ssize_t j0, Py_ssize_t bc,
                              Py_ssize_t nr, bint rules, real* qk,
                              const TileScratch* s) noexcept nogil:
    """qk (bc, QUERY_TILE) = the block's scores, keys by query rows, from key rows
    j0..j0+bc; returns whether they are scaled. AMX leaves the scale to the softmax's
    first pass unless rules follow (they need the scaled scores)."""
    cdef const real* rows
    cdef const char* words
    cdef Py_ssize_t rs, j, run
    if real is float:
        if p.dot_kernel == DOT_AMX_BF16 or p.dot_kernel == DOT_AVX512_BF16:
            words = rows_stored(k, j0, bc, p.E, <char*> s.gathered, &rs)
        if p.dot_kernel == DOT_AMX_BF16:
            fa_amx_scores(<const uint16_t*> words, rs, bc, <const void*> s.q_tile, p.E,
                          nr, <float> p.scale if rules else 1, <float*> qk)
            return rules
        if p.dot_kernel == DOT_AVX512_BF16:
            fa_bf16_scores(<const uint16_t*> words, rs, bc, <const void*> s.q_tile,
                           p.E // 2, <float> p.scale, <float*> qk)
            return True
    if runs_of_real(k, <real> 0):       # a paged cache of `real`: each run in place
        j = j0                          # (a key's score is its own: the same bits)
        while j < j0 + bc:
            run = run_from(k, j, j0 + bc)
            gemm(<const real*> row_at(k, j), k.row_bytes // sizeof(real), 1,
                 <const real*> s.q_tile, QUERY_TILE, qk + (j - j0) * QUERY_TILE,
                 QUERY_TILE, run, nr, p.E, False)
            j += run
        return True
    rows = block_rows(p, k, False, j0, bc, p.E, <real*> s.k_rows, &rs, s)
    gemm(rows, rs, 1, <const real*> s.q_tile, QUERY_TILE, qk, QUERY_TILE, bc, nr, p.E,
         False)
    return True


cdef inline bint values_as_pairs(const Plan* p) noexcept nogil:
    """Does the values' product run on the bfloat16 units, V^T and the weights as
    bfloat16 pairs (bfloat16 V, Ev a multiple of 16; AVX512-BF16 only where the
    weights may be rounded once)?"""
    if p.v.dtype != BFLOAT16 or p.Ev % 16 != 0:
        return False
    return p.dot_kernel == DOT_AMX_BF16 or (p.dot_kernel == DOT_AVX512_BF16
                                             and p.round_weights)


# V^T as bfloat16 pairs, packed once per call (the tiled forward's driver,
# pack_values_once): every key block of a slice's values in the layout of
# fa_bf16_pack_values, pair_block_words apart, the blocks of slice n from
# pair_slot[n] on (slices that read the same values, as a group's query heads do,
# share a slot). A block is packed with all the keys it holds (packed_keys); a tile
# that reads fewer of them (a block a causal rule or a window cuts) packs its own.

cdef inline Py_ssize_t key_blocks(const Plan* p) noexcept nogil:
    """Key blocks of a slice's Lk keys (the last one may be short)."""
    return (p.Lk + KEY_BLOCK - 1) // KEY_BLOCK


cdef inline Py_ssize_t pair_block_words(const Plan* p) noexcept nogil:
    """uint32 words of one key block's V^T pairs: Ev columns of KEY_BLOCK / 2 pairs."""
    return KEY_BLOCK // 2 * p.Ev


cdef inline Py_ssize_t packed_keys(const Plan* p, Py_ssize_t n,
                                   Py_ssize_t j0) noexcept nogil:
    """The keys of slice n's block at j0 as packed once: all of them, up to its keys."""
    cdef Py_ssize_t left = keys_of(p, n) - j0
    return left if left < KEY_BLOCK else KEY_BLOCK


cdef inline const void* packed_values(const Plan* p, Py_ssize_t n,
                                      Py_ssize_t j0) noexcept nogil:
    """The packed V^T pairs of slice n's block at j0."""
    return (<const uint32_t*> p.value_pairs
            + (p.pair_slot[n] * key_blocks(p) + j0 // KEY_BLOCK) * pair_block_words(p))


cdef inline bint load_values(const Plan* p, const Rows* v, Py_ssize_t n, Py_ssize_t j0,
                             Py_ssize_t bc, const real** rows, Py_ssize_t* rs,
                             const TileScratch* s) noexcept nogil:
    """Value rows j0..j0+bc of slice n as the engine reads them (on the bfloat16 units:
    V^T as bfloat16 pairs, packed once per call or into v_rows; else rows as `real`,
    in place or widened); returns whether they are all finite. Rows with NaN or inf
    are also handed out as `real`."""
    cdef bint finite
    cdef const char* words
    cdef Py_ssize_t ws
    if real is float:
        if values_as_pairs(p):
            if p.value_pairs != NULL and bc == packed_keys(p, n, j0):
                rows[0] = <const real*> packed_values(p, n, j0)
                return True     # (packed only where every value is finite)
            words = rows_stored(v, j0, bc, p.Ev, <char*> s.gathered, &ws)
            finite = fa_bf16_pack_values(<const uint16_t*> words, ws, bc, p.Ev, s.v_rows)
            rows[0] = <const real*> s.v_rows
            if not finite:
                rows[0] = block_rows(p, v, True, j0, bc, p.Ev, <real*> s.v_rows, rs, s)
            return finite
    rows[0] = block_rows(p, v, True, j0, bc, p.Ev, <real*> s.v_rows, rs, s)
    return p.values_finite or all_finite(rows[0], bc, p.Ev, rs[0])


cdef inline bint weights_as_pairs(const Plan* p, Py_ssize_t bc, double prescale,
                                  bint finite) noexcept nogil:
    """Do the block's weights go from the softmax straight into bfloat16 pairs
    (pair_weights), never stored in float32? Where the values' product takes them as
    pairs rounded once (the weights' only use then), the values are finite, no
    dropout follows, the block is whole groups of 32 keys and the scale left to apply
    (prescale) is positive."""
    return (finite and p.dtype == FLOAT32 and values_as_pairs(p) and p.round_weights
            and p.dropout_p == 0 and bc % 32 == 0 and 0 < prescale <= FLT_MAX)


cdef inline void pair_weights(real* qk, Py_ssize_t bc, Py_ssize_t nr, real prescale,
                              const TileScratch* s) noexcept nogil:
    """softmax_max and softmax_weights of a block that weights_as_pairs allows, the
    weights as bfloat16 pairs (fa_bf16_pack_weights' layout) written over the scores
    in qk, from which they are made (the block's data stays within one buffer, for
    the level-1 cache), their exponential the shorter fa_pow2_16 (within 5e-6 of e^x:
    the pairs' rounding errs by up to 2^-9); the scores are times prescale only as
    they are read."""
    if real is float:
        fa_block_max_unscaled(qk, bc, nr, prescale, <float*> s.sm.m, <float*> s.sm.m_sub,
                              <float*> s.sm.alpha)
        fa_bf16_weight_pairs(qk, bc, nr, prescale, <const float*> s.sm.m_sub,
                             <const float*> s.sm.alpha, s.sm.l, <void*> qk)


cdef inline void add_values(const Plan* p, Py_ssize_t bc, Py_ssize_t nr, bint finite,
                            bint first, bint pairs, const real* v, Py_ssize_t v_rs,
                            real* dst, const TileScratch* s) noexcept nogil:
    """dst (Ev, QUERY_TILE) = alpha dst + V_block^T P, P the block's weights in qk (or,
    with pairs, already as bfloat16 pairs there: pair_weights).

    The block's product is summed on its own first (in registers, or in blk) and then
    added: summing block by block keeps the rounding error of long rows at
    O(KEY_BLOCK + Lk / KEY_BLOCK). alpha = 0 (the earlier weights underflowed) drops
    the earlier sums (0 * inf would be NaN). A block with NaN or inf values adds its
    finite rows only (the others reach their rows through attend_row_exactly)."""
    cdef real* alpha = <real*> s.sm.alpha
    cdef void* pp = s.qk if pairs else s.k_rows     # the weights' pairs (32-bit
    cdef void* pl = NULL            # words), and with precision="highest" their low
    if not p.round_weights:         # parts after them
        pl = <uint32_t*> pp + 32 * QUERY_TILE
    if real is float:
        if finite and values_as_pairs(p):   # dst = alpha dst + V^T P
            if not pairs:
                fa_bf16_pack_weights(<const float*> s.qk, bc, nr, pp, pl)
            if p.dot_kernel == DOT_AMX_BF16:
                if not first:
                    rescale_rows(dst, p.Ev, nr, alpha)
                fa_amx_pv(<const void*> v, bc, p.Ev, pp, pl, nr, dst, first)
            else:               # (the rescale fused into the product's stores)
                fa_bf16_pv(<const void*> v, bc, p.Ev, pp, nr, dst, first,
                           alpha if not first and rescaled(nr, alpha) else NULL)
            return
    if finite:
        gemm(v, 1, v_rs, <const real*> s.qk, QUERY_TILE, dst, QUERY_TILE, p.Ev, nr, bc,
             False, NULL if first else alpha)
        return
    weigh_finite_values(p, v, v_rs, <const real*> s.qk, bc, nr, <real*> s.blk,
                        <real*> s.v_rows)
    add_block(dst, <const real*> s.blk, p.Ev, nr, alpha, first)


cdef inline bint rescaled(Py_ssize_t lanes, const real* alpha) noexcept nogil:
    """Does any of the first `lanes` factors differ from 1 (a row's maximum grew)?"""
    cdef Py_ssize_t r, changed = 0
    for r in range(lanes):
        changed += alpha[r] != 1
    return changed != 0


cdef inline void rescale_rows(real* acc, Py_ssize_t Ev, Py_ssize_t lanes,
                              const real* alpha) noexcept nogil:
    """acc = alpha * acc ((Ev, QUERY_TILE), the first `lanes` used); nothing to do
    where every alpha is 1 (the rows' maxima did not grow: most blocks after the first
    few)."""
    cdef Py_ssize_t r, t
    if not rescaled(lanes, alpha):
        return
    for t in range(Ev):
        for r in range(lanes):
            acc[t * QUERY_TILE + r] = (acc[t * QUERY_TILE + r] * alpha[r]
                                       if alpha[r] != 0 else 0)


cdef inline void add_block(real* acc, const real* blk, Py_ssize_t Ev, Py_ssize_t lanes,
                           const real* alpha, bint first) noexcept nogil:
    """acc = alpha * acc + blk ((Ev, QUERY_TILE), the first `lanes` used); the first
    block is copied."""
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


cdef inline void weigh_finite_values(const Plan* p, const real* v, Py_ssize_t v_rs,
                                     const real* pt, Py_ssize_t bc, Py_ssize_t nr,
                                     real* blk, real* rows) noexcept nogil:
    """blk (Ev, QUERY_TILE) = V^T @ pt (bc, QUERY_TILE) over the value rows (row stride
    v_rs) that are finite: gemm() over the block with the other rows as zeros (copied
    into `rows`, KEY_BLOCK x Ev of scratch, which v may already be), so that a query
    row's sums are those of the same block without those keys, bit for bit, however
    the build computes gemm()."""
    cdef Py_ssize_t c, t
    cdef bint finite
    for c in range(bc):
        finite = all_finite(v + c * v_rs, 1, p.Ev, v_rs)
        for t in range(p.Ev):
            rows[c * p.Ev + t] = v[c * v_rs + t] if finite else 0
    gemm(rows, 1, p.Ev, pt, QUERY_TILE, blk, QUERY_TILE, p.Ev, nr, bc, False)


cdef inline void mark_tainted(const Plan* p, const real* v, Py_ssize_t v_rs,
                              const real* qk, Py_ssize_t bc, Py_ssize_t nr,
                              real* tainted) noexcept nogil:
    """In a block whose values v hold NaN or inf: mark the rows that may attend to such
    a key (its score in qk is not -inf); attend_row_exactly redoes them."""
    cdef Py_ssize_t c, r
    for c in range(bc):
        if not all_finite(v + c * v_rs, 1, p.Ev, v_rs):
            for r in range(nr):
                if qk[c * QUERY_TILE + r] != -INFINITY:
                    tainted[r] = 1
