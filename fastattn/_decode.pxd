# The work items of the decode path: one or a few query rows per slice against many keys.
#
# The tiles of _tiles.pxd would be mostly padding here, and the work is reading K and V
# once. The vector axis is E: a score is a dot product, and the output accumulates
# whole V rows. The rows of the G slices of one grouped-query group share one K/V
# slice and are done together, so each K/V row is read once for the whole group. A
# work item covers a range of keys and leaves an unnormalised partial result
# (acc, m, l) that _tiles.merge_rows combines in a fixed order. Its loop, a step of
# DECODE_KEYS keys at a time:
#
#     scores (few_scores) -> rules -> softmax (per row) -> dropout -> values (few_values)
#
# The dot products and the weighted sum of values run on AVX-512 or AVX2
# (src/fa_dots.h: K and V read in place, 16-bit rows and 8-bit codes widened in
# registers) where the module has them, else on the portable dot_/dot4_ and the
# micro-GEMM. With AMX (Plan.amx_codes), 16-bit queries' scores against int8 key codes
# run on AMX-INT8 tiles instead, exactly (src/fa_amx.h: code_scores), and
# (Plan.amx_values) bfloat16 queries' weights meet int8 value codes on AMX-BF16 tiles
# (code_values). On the bfloat16 units of AVX512-BF16 CPUs (Plan.pair_codes,
# Plan.pair_values), bfloat16 queries meet float8 key and value codes by vdpbf16ps, the
# codes widened exactly to bfloat16 (src/fa_pairs.h: pair_scores, pair_values).

from libc.math cimport INFINITY

from libc.stdint cimport int8_t, uint16_t, uint32_t

from fastattn._csrc cimport (FA_E4M3_UNIT, FA_HAVE_DOTS, FA_PREFETCH_BYTES,
                             fa_amx_begin, fa_amx_code_heads, fa_amx_code_limbs,
                             fa_amx_code_values, fa_amx_end, fa_code_limbs_t,
                             fa_code_sets, fa_code_values_bytes, fa_dots,
                             fa_dots_heads, fa_e4m3_nan, fa_heads_t, fa_pair_dots,
                             fa_pair_pv, fa_pair_queries, fa_pair_row_words,
                             fa_pair_weights, fa_pairs_usable, fa_prefetch_span,
                             fa_pv, fa_rows_t, fa_widen_rows)
from fastattn._gemm cimport gemm, real
from fastattn._operands cimport (Carve, Rows, carving, element, operand_at, row_at,
                                 rows_as_real, rows_of, run_from, scale_step, scales_at,
                                 stored_in_16_bits, take)
from fastattn._parallel cimport Interrupt, interrupted
from fastattn._plan cimport (DECODE_KEYS, FLOAT8_E4M3, KEY_BLOCK, DType, KeyRange,
                             Operand, Plan, element_size, queries_of, tile_keys)
from fastattn._rules cimport ScoreRows, dropout_weights, rule_scores
from fastattn._softmax cimport LANES, all_finite, exp_, exp_row, row_max, start_rows
from fastattn._tiles cimport CHECK_EVERY


cdef enum:
    PAGED_AHEAD_BYTES = 8192    # stream_ahead: row data asked for ahead in a paged
                                # cache whose blocks hold each head's rows as a run
    SIDE_KEYS = 32      # keys per pass across the heads of an item (side_keys)...
    SIDE_KEYS_WIDE = 8  # ...where a head's part of a value row has WIDE_PART bytes or
    WIDE_PART = 256     # more
    TILE_ROWS_MIN = 5   # code_values: the fewest query rows per key head it takes (with
                        # fewer, the FMAs cost no more than widening the codes)


cdef struct FewScratch:
    # one work item of `heads` K/V heads, R = G * Lq query rows each (elements of the
    # computation dtype); the rows widened and the tables serve one head at a time
    void* q_rows        # heads * R x E: the scaled query rows
    void* s             # heads * R x DECODE_KEYS: a step's scores, then its weights
    void* blk           # heads * R x Ev: the step's product with V
    void* k_rows        # DECODE_KEYS x E: K rows widened from 16 bits (portable path)
    void* v_rows        # DECODE_KEYS x Ev: V rows widened from 16 bits
    void* w             # heads * R x DECODE_KEYS: the weights times the values'
                        # scales (where weighed())
    const char** k_table    # a paged cache: the addresses of a step's key rows and of
    const char** v_table    # the rows ahead the kernels ask for (paged_ahead() more)
    # p.amx_codes or p.pair_codes:
    void* q_plain       # heads * R x E: the query rows, not scaled
    # p.pair_codes only (pair_queries, pair_scores):
    void* q_pairs       # heads * R x fa_pair_row_words(E) bfloat16 words: the rows
    void* q_factors     # heads * R floats: what each row's sums are multiplied by
    # p.pair_values only (pair_values):
    void* w_pairs       # heads * R x DECODE_KEYS / 2: the weights' bfloat16 pairs
    # p.amx_codes only (code_limbs, code_scores):
    void* limbs         # heads x fa_code_sets(R) fa_code_limbs_t: the rows as bytes
    void* code_rows     # 16 x E bytes: a tile's key codes, where they are not at one
                        # stride (paged blocks of fewer than 16 rows, the last keys)
    # p.amx_values only (code_values):
    void* value_tiles   # the weights' and the value pairs' tiles of a step


cdef inline bint weighed(const Plan* p) noexcept nogil:
    """Do the values' kernels take the weights times a factor per key (the scales of
    8-bit codes, the unit of e4m3 codes), in FewScratch.w?"""
    return p.v_scale.data != NULL or p.v.dtype == FLOAT8_E4M3


cdef inline Py_ssize_t few_scratch(const Plan* p, Py_ssize_t G, Py_ssize_t heads,
                                   char* base, FewScratch* s) noexcept nogil:
    """The scratch of one decoding item of `heads` K/V heads of G slices each: its size
    in bytes; with `base`, its pointers."""
    cdef Carve c = carving(base)
    cdef Py_ssize_t r = element_size(p.dtype), R = G * p.Lq
    s.q_rows = take(&c, heads * R * p.E, r)
    s.s = take(&c, heads * R * DECODE_KEYS, r)
    s.blk = take(&c, heads * R * p.Ev, r)
    s.k_rows = take(&c, DECODE_KEYS * p.E, r)
    s.v_rows = take(&c, DECODE_KEYS * p.Ev, r)
    s.w = take(&c, heads * R * DECODE_KEYS if weighed(p) else 0, r)
    s.k_table = <const char**> take(&c, DECODE_KEYS + paged_ahead(p.k.dtype, p.E)
                                    if p.k.pages != NULL else 0, sizeof(char*))
    s.v_table = <const char**> take(&c, DECODE_KEYS + paged_ahead(p.v.dtype, p.Ev)
                                    if p.v.pages != NULL else 0, sizeof(char*))
    s.q_plain = take(&c, heads * R * p.E if p.amx_codes or p.pair_codes else 0, r)
    s.q_pairs = take(&c, heads * R * fa_pair_row_words(p.E) if p.pair_codes else 0,
                     sizeof(uint16_t))
    s.q_factors = take(&c, heads * R if p.pair_codes else 0, sizeof(float))
    s.w_pairs = take(&c, heads * R * (DECODE_KEYS // 2) if p.pair_values else 0,
                     sizeof(uint32_t))
    s.limbs = take(&c, heads * fa_code_sets(R) if p.amx_codes else 0,
                   sizeof(fa_code_limbs_t))
    s.code_rows = take(&c, 16 * p.E if p.amx_codes else 0, 1)
    s.value_tiles = take(&c, fa_code_values_bytes(DECODE_KEYS) if p.amx_values else 0,
                         1)
    return c.size


cdef inline void attend_few(const Plan* p, Py_ssize_t n0, Py_ssize_t G, Py_ssize_t heads,
                            Py_ssize_t kbeg, Py_ssize_t kend, real* acc, real* m,
                            double* l, const FewScratch* fs,
                            Interrupt* stop) noexcept nogil:
    """Partial attention of the query rows of slices n0..n0+heads*G over keys
    kbeg..kend: `heads` K/V heads (more than one where the heads of a key lie side
    by side: _drivers.decode_heads), each shared by G consecutive slices (R = G * Lq
    rows), step by step together. Each head's sums are those it has alone.

    Leaves acc (heads * R, Ev) = sum_j exp(s_j - m) v_j, m (heads * R) the max allowed
    score (-inf for none) and l (heads * R) = sum_j exp(s_j - m), with the "-inf means
    0" rule of exp_row; a zero weight is skipped, so a value row holding NaN or inf
    reaches only rows that give it a weight; the driver redoes every row whose result
    is not finite with attend_row_exactly (the rule for such values). The piece that
    starts at key 0 holds the sink (start_rows). It looks for Ctrl-C (`stop`) every
    CHECK_EVERY steps and returns unfinished once one is pending.
    """
    cdef Py_ssize_t Lq = p.Lq, R = G * Lq, Ev = p.Ev, HR = heads * R, t, g, h, b, j0, bc
    cdef Py_ssize_t nb
    cdef real* s = <real*> fs.s
    cdef real* blk = <real*> fs.blk
    cdef KeyRange keys
    cdef bint amx = False, pairs = False
    if real is float and p.pair_codes and fa_pairs_usable():
        pairs = pair_queries(p, n0, G, heads, fs)
    if not pairs:
        few_queries(p, n0, heads * G, <real*> fs.q_rows, <real> p.scale)
    if real is float and p.amx_codes:
        amx = code_limbs(p, n0, G, heads, fs)
    for t in range(HR * Ev):
        acc[t] = 0
    for g in range(heads * G):
        start_rows(p, n0 + g, 0, Lq, Lq, kbeg == 0, m + g * Lq, l + g * Lq)
    keys = few_keys(p, n0, heads * G, kbeg, kend)
    nb = (keys.hi - keys.lo + DECODE_KEYS - 1) // DECODE_KEYS if keys.hi > keys.lo else 0
    if nb > 0:
        scales_ahead(p, n0, G, heads, keys.lo, keys.hi)
    for b in range(nb):
        if stop != NULL and b % CHECK_EVERY == CHECK_EVERY - 1 and interrupted(stop):
            return
        j0 = keys.lo + b * DECODE_KEYS
        bc = keys.hi - j0 if keys.hi - j0 < DECODE_KEYS else DECODE_KEYS
        scales_ahead(p, n0, G, heads, j0 + bc, keys.hi)     # the next step's
        # S = Q K_step^T
        if real is float and amx:
            code_scores(p, n0, G, heads, j0, bc, keys.hi, s, fs)
        elif real is float and pairs:
            pair_scores(p, n0, G, heads, j0, bc, keys.hi, s, fs)
        else:
            few_scores(p, n0, G, heads, j0, bc, keys.hi, s, fs)
        # m_new = max(m, max_j s_j), P = e^(S - m_new), l = alpha l + rowsum(P),
        # acc = alpha acc
        for h in range(heads):
            few_weights(p, n0 + h * G, G, j0, bc, &keys, s + h * R * DECODE_KEYS,
                        acc + h * R * Ev, m + h * R, l + h * R)
        # acc += P V_step (the step's product summed on its own first)
        few_values(p, n0, G, heads, j0, bc, keys.hi, s, blk, fs)
        for t in range(HR * Ev):
            acc[t] = acc[t] + blk[t]


cdef inline void scales_ahead(const Plan* p, Py_ssize_t n0, Py_ssize_t G,
                              Py_ssize_t heads, Py_ssize_t j0,
                              Py_ssize_t end) noexcept nogil:
    """Ask for the K and V scales of the step from key j0 (DECODE_KEYS keys, below
    `end`) of a paged cache, a step ahead: the CPU's own prefetchers do not follow its
    blocks, and each block's scales would be waited for when the step weighs its
    scores and values."""
    if p.k.pages != NULL and p.k_scale.data != NULL:
        ask_scales(p, &p.k, &p.k_scale, n0, G, heads, j0, end)
    if p.v.pages != NULL and p.v_scale.data != NULL:
        ask_scales(p, &p.v, &p.v_scale, n0, G, heads, j0, end)


cdef inline void ask_scales(const Plan* p, const Operand* a, const Operand* scale,
                            Py_ssize_t n0, Py_ssize_t G, Py_ssize_t heads,
                            Py_ssize_t j0, Py_ssize_t end) noexcept nogil:
    """scales_ahead for one operand: each block's run of the heads' scales (slices n0,
    n0 + G, ...), the heads' together where they lie side by side in each token's."""
    cdef Rows r = rows_of(p, a, scale, n0)
    cdef Py_ssize_t last = j0 + DECODE_KEYS if j0 + DECODE_KEYS < end else end
    cdef Py_ssize_t together = 1, h, j, run
    if (heads > 1 and scale_step(&r) >= heads
            and rows_of(p, a, scale, n0 + G).scale - r.scale == 4):
        together = heads
    h = 0
    while h < heads:
        r = rows_of(p, a, scale, n0 + h * G)
        j = j0
        while j < last:
            run = run_from(&r, j, last)
            fa_prefetch_span(scales_at(&r, j), ((run - 1) * scale_step(&r) + together) * 4)
            j += run
        h += together


cdef inline void few_weights(const Plan* p, Py_ssize_t n0, Py_ssize_t G, Py_ssize_t j0,
                             Py_ssize_t bc, const KeyRange* keys, real* s, real* acc,
                             real* m, double* l) noexcept nogil:
    """The step's weights, in s (R = G * Lq rows, DECODE_KEYS apart), from the scores
    of slices n0..n0+G there: the rules, the online softmax's step (m, l and acc
    carried on) and dropout."""
    cdef Py_ssize_t Lq = p.Lq, g
    if (p.mask.data != NULL or p.bias.data != NULL or p.softcap > 0
            or p.alibi_slopes.data != NULL or j0 < keys.all_from or j0 + bc > keys.all_to):
        for g in range(G):
            few_rules(p, n0 + g, j0, bc, s + g * Lq * DECODE_KEYS)
    few_softmax(p, G * Lq, bc, s, m, l, acc)
    if p.dropout_p > 0:
        for g in range(G):
            dropout_weights(p, n0 + g, s + g * Lq * DECODE_KEYS, DECODE_KEYS, 1, Lq,
                            0, j0, bc)


cdef inline void few_queries(const Plan* p, Py_ssize_t n0, Py_ssize_t G, real* qs,
                             real scale) noexcept nogil:
    """qs (G * Lq, E) = scale * the query rows of slices n0..n0+G; rows past a
    sequence's length zero (their result is zeros; in a packed batch they are the
    next sequence's)."""
    cdef Py_ssize_t g, r, t, valid, Lq = p.Lq, E = p.E
    cdef const char* q
    cdef real* row
    for g in range(G):
        q = operand_at(p, &p.q, n0 + g, 0)
        valid = queries_of(p, n0 + g)
        for r in range(Lq):
            row = qs + (g * Lq + r) * E
            if r >= valid:
                for t in range(E):
                    row[t] = 0
            elif real is float and stored_in_16_bits(&p.q):    # widened, then scaled
                fa_widen_rows(q + r * p.q.row_stride * element_size(p.q.dtype),
                              p.q.dtype, 0, 1, E, row)
                for t in range(E):
                    row[t] = row[t] * scale
            else:
                for t in range(E):
                    row[t] = <real> element(&p.q, q, r * p.q.row_stride + t) * scale


cdef inline KeyRange few_keys(const Plan* p, Py_ssize_t n0, Py_ssize_t G,
                              Py_ssize_t kbeg, Py_ssize_t kend) noexcept nogil:
    """The keys of the item: the union of the G slices' key ranges (from a block edge,
    as the tiles' blocks, and within kbeg..kend) and the keys every row sees."""
    cdef KeyRange keys, got
    cdef Py_ssize_t g
    got.lo, got.hi, got.all_from, got.all_to = p.Lk, 0, 0, p.Lk
    for g in range(G):
        keys = tile_keys(p, n0 + g, 0, p.Lq)
        if keys.hi > keys.lo:
            got.lo = keys.lo if keys.lo < got.lo else got.lo
            got.hi = keys.hi if keys.hi > got.hi else got.hi
        got.all_from = keys.all_from if keys.all_from > got.all_from else got.all_from
        got.all_to = keys.all_to if keys.all_to < got.all_to else got.all_to
    got.lo = got.lo // KEY_BLOCK * KEY_BLOCK
    got.lo = got.lo if got.lo > kbeg else kbeg
    got.hi = got.hi if got.hi < kend else kend
    return got


cdef inline void few_rules(const Plan* p, Py_ssize_t n, Py_ssize_t j0, Py_ssize_t bc,
                           real* s) noexcept nogil:
    """rule_scores for the Lq rows of slice n (one row each DECODE_KEYS apart)."""
    cdef ScoreRows rows
    rows.n, rows.i0, rows.nrows, rows.lo, rows.hi = n, 0, p.Lq, NULL, NULL
    rows.mask = <const unsigned char*> operand_at(p, &p.mask, n, 0)
    rows.bias = operand_at(p, &p.bias, n, 0)
    rule_scores(p, &rows, s, DECODE_KEYS, 1, j0, bc, True, NULL)


cdef inline void few_scores(const Plan* p, Py_ssize_t n0, Py_ssize_t G, Py_ssize_t heads,
                            Py_ssize_t j0, Py_ssize_t bc, Py_ssize_t end, real* s,
                            const FewScratch* fs) noexcept nogil:
    """s (heads * R, DECODE_KEYS) = each head's R = G * Lq query rows' dot products
    with its key rows j0..j0+bc (times their scales), head by head (head_scores); on
    AVX-512 or AVX2, with several heads, each block of keys for every head in turn
    instead (fa_dots_heads), so that the keys' rows are read in memory order (the same
    sums), then, for a head whose e4m3 keys hold a NaN, exact_scores."""
    cdef const real* qs = <const real*> fs.q_rows
    cdef Rows k
    cdef Py_ssize_t R = G * p.Lq, E = p.E, h
    cdef fa_heads_t side
    cdef bint nan
    if real is float:
        if heads > 1 and FA_HAVE_DOTS:
            k = rows_of(p, &p.k, &p.k_scale, n0)
            side.n, side.q, side.s = heads, R * E, R * DECODE_KEYS
            side.bytes = rows_of(p, &p.k, NULL, n0 + G).data - k.data
            fa_dots_heads(qs, E, R,
                          step_rows(&k, j0, bc, end, stream_ahead(&k, E), fs.k_table),
                          k.dtype, bc, E, s, DECODE_KEYS, end - j0, side)
            nan = side_by_side_nan(&k, j0, bc, heads, side.bytes, E)
            for h in range(heads):
                k = rows_of(p, &p.k, &p.k_scale, n0 + h * G)
                if nan and e4m3_nan(&k, j0, bc, E):
                    exact_scores(&k, j0, bc, R, E, qs + h * R * E,
                                 s + h * R * DECODE_KEYS, fs)
                else:
                    scale_scores(&k, j0, bc, R, s + h * R * DECODE_KEYS, kernel_units(&k))
            return
    for h in range(heads):
        k = rows_of(p, &p.k, &p.k_scale, n0 + h * G)
        head_scores(p, &k, j0, bc, R, end, qs + h * R * E, s + h * R * DECODE_KEYS, fs)


cdef inline bint code_limbs(const Plan* p, Py_ssize_t n0, Py_ssize_t G,
                            Py_ssize_t heads, const FewScratch* fs) noexcept nogil:
    """The query rows of the item (unscaled) as the integer bytes of code_scores, in
    fs.limbs (fa_amx_code_limbs: four rows to a set); False where a row cannot be
    written so (its elements span more than 31 binary orders, or one is not finite):
    the item then takes few_scores."""
    few_queries(p, n0, heads * G, <float*> fs.q_plain, 1.0)
    return fa_amx_code_limbs(<float*> fs.q_plain, heads, G * p.Lq, p.E, p.scale,
                             <fa_code_limbs_t*> fs.limbs)


cdef inline void code_scores(const Plan* p, Py_ssize_t n0, Py_ssize_t G,
                             Py_ssize_t heads, Py_ssize_t j0, Py_ssize_t bc,
                             Py_ssize_t end, float* s,
                             const FewScratch* fs) noexcept nogil:
    """few_scores for int8 key codes on AMX-INT8 (Plan.amx_codes): each head's rows
    by the integer bytes code_limbs wrote, exactly, scaled (in double) and rounded
    (fa_amx_code_heads: runs of keys that stay in the level-1 cache while every head
    and set of rows passes over them; the first pass asks for whole rows ahead), then
    times the keys' scales. With several heads their parts of a key row lie side by
    side."""
    cdef Rows k = rows_of(p, &p.k, &p.k_scale, n0)
    cdef Py_ssize_t R = G * p.Lq, E = p.E, h, side = 0
    cdef Py_ssize_t ahead = rows_ahead(k.dtype, E * heads)
    if heads > 1:
        side = rows_of(p, &p.k, NULL, n0 + G).data - k.data
    fa_amx_begin()
    fa_amx_code_heads(step_rows(&k, j0, bc, end, ahead, fs.k_table), heads, side, bc, E,
                      <const fa_code_limbs_t*> fs.limbs, R, s, DECODE_KEYS,
                      <int8_t*> fs.code_rows, ahead, heads * side if heads > 1 else E,
                      end - j0)
    fa_amx_end()
    for h in range(heads):
        k = rows_of(p, &p.k, &p.k_scale, n0 + h * G)
        scale_scores(&k, j0, bc, R, s + h * R * DECODE_KEYS, kernel_units(&k))


cdef inline bint pair_queries(const Plan* p, Py_ssize_t n0, Py_ssize_t G,
                              Py_ssize_t heads, const FewScratch* fs) noexcept nogil:
    """The query rows of the item (unscaled) as the bfloat16 words of pair_scores, in
    fs.q_pairs, and their factors (a power of two times the softmax scale) in
    fs.q_factors (fa_pair_queries); False where a row cannot be written so exactly
    (an element not finite, nonzero elements more than 2^100 apart, or a factor outside
    2^-100..2^100): the item then takes few_scores."""
    few_queries(p, n0, heads * G, <float*> fs.q_plain, 1.0)
    return fa_pair_queries(<const float*> fs.q_plain, p.E, heads * G * p.Lq, p.E,
                           p.scale, <uint16_t*> fs.q_pairs, <float*> fs.q_factors)


cdef inline void pair_scores(const Plan* p, Py_ssize_t n0, Py_ssize_t G,
                             Py_ssize_t heads, Py_ssize_t j0, Py_ssize_t bc,
                             Py_ssize_t end, float* s,
                             const FewScratch* fs) noexcept nogil:
    """few_scores for float8 key codes against bfloat16 queries on vdpbf16ps
    (Plan.pair_codes): each head's rows by the words pair_queries wrote, the codes
    widened exactly in registers, the sums times the rows' factors (fa_pair_dots: a
    NaN or inf code gives the score the exact sum gives), then times the keys' scales.
    With several heads, their parts of a key row lie side by side and are read at
    once, in memory order."""
    cdef Rows k = rows_of(p, &p.k, &p.k_scale, n0)
    cdef Py_ssize_t R = G * p.Lq, E = p.E, h
    cdef fa_heads_t side
    side.n, side.q, side.s = heads, R * fa_pair_row_words(E), R * DECODE_KEYS
    side.bytes = 0
    if heads > 1:
        side.bytes = rows_of(p, &p.k, NULL, n0 + G).data - k.data
    fa_pair_dots(<const uint16_t*> fs.q_pairs, R,
                 step_rows(&k, j0, bc, end, stream_ahead(&k, E), fs.k_table),
                 k.dtype, bc, E, <const float*> fs.q_factors, s, DECODE_KEYS, end - j0,
                 side)
    for h in range(heads):
        k = rows_of(p, &p.k, &p.k_scale, n0 + h * G)
        scale_scores(&k, j0, bc, R, s + h * R * DECODE_KEYS, 1)


cdef inline void head_scores(const Plan* p, const Rows* k, Py_ssize_t j0, Py_ssize_t bc,
                             Py_ssize_t R, Py_ssize_t end, const real* qs, real* s,
                             const FewScratch* fs) noexcept nogil:
    """s (R, DECODE_KEYS) = the R query rows qs' dot products with key rows j0..j0+bc
    (times their scales): several keys at once on AVX-512 or AVX2, K read in place (a
    paged cache through a table of its rows) with the rows ahead prefetched up to key
    `end`; else, and for e4m3 codes among which a NaN hides (looked for once the kernel
    has brought the rows into the cache), exact_scores."""
    if real is float:
        if FA_HAVE_DOTS:
            fa_dots(qs, p.E, R,
                    step_rows(k, j0, bc, end, stream_ahead(k, p.E), fs.k_table),
                    k.dtype, bc, p.E, s, DECODE_KEYS, end - j0)
            if not e4m3_nan(k, j0, bc, p.E):
                scale_scores(k, j0, bc, R, s, kernel_units(k))
                return
    exact_scores(k, j0, bc, R, p.E, qs, s, fs)


cdef inline void exact_scores(const Rows* k, Py_ssize_t j0, Py_ssize_t bc, Py_ssize_t R,
                              Py_ssize_t E, const real* qs, real* s,
                              const FewScratch* fs) noexcept nogil:
    """head_scores' sums by dot4_/dot_ (the same sums, in the same order), the codes
    widened exactly (an e4m3 NaN code a NaN) and then scaled."""
    cdef const real* kb
    cdef Rows bare
    cdef Py_ssize_t r, c, rs
    bare = k[0]                     # codes as they are: the same sums as fa_dots
    bare.scale = NULL
    kb = rows_as_real(&bare, j0, bc, E, <real*> fs.k_rows, &rs)
    for r in range(R):
        for c in range(0, bc - bc % 4, 4):
            dot4_(qs + r * E, kb + c * rs, rs, E, s + r * DECODE_KEYS + c)
        for c in range(bc - bc % 4, bc):
            s[r * DECODE_KEYS + c] = dot_(qs + r * E, kb + c * rs, E)
    scale_scores(k, j0, bc, R, s, 1)


cdef inline double kernel_units(const Rows* r) noexcept nogil:
    """What the decode kernels' values of r's rows are to be multiplied by: 1, or the
    inverse of the unit they read e4m3 codes in (a power of two)."""
    return 1 / <double> FA_E4M3_UNIT if r.dtype == FLOAT8_E4M3 else 1


cdef inline bint e4m3_nan(const Rows* r, Py_ssize_t j0, Py_ssize_t bc,
                          Py_ssize_t cols) noexcept nogil:
    """Are rows j0..j0+bc e4m3 codes with a NaN among them (which the decode kernels
    do not see)? Rows that lie side by side are looked through at once."""
    cdef Py_ssize_t j, run, c
    if r.dtype != FLOAT8_E4M3:
        return False
    j = j0
    while j < j0 + bc:
        run = run_from(r, j, j0 + bc)
        if r.row_bytes == cols:
            if fa_e4m3_nan(row_at(r, j), run * cols):
                return True
        else:
            for c in range(run):
                if fa_e4m3_nan(row_at(r, j + c), cols):
                    return True
        j += run
    return False


cdef inline bint side_by_side_nan(const Rows* r, Py_ssize_t j0, Py_ssize_t bc,
                                  Py_ssize_t heads, Py_ssize_t gap,
                                  Py_ssize_t cols) noexcept nogil:
    """e4m3_nan for the rows of `heads` heads side by side (r: the first head's; the
    next head's row `gap` bytes on), looked through at once: from the first head's
    first code to the last head's last, each row (one run where nothing else lies
    between the rows). A code between the heads' parts counts too: a NaN there only
    sends the step to e4m3_nan head by head."""
    return e4m3_nan(r, j0, bc, (heads - 1) * gap + cols)


cdef inline Py_ssize_t rows_ahead(DType dtype, Py_ssize_t cols) noexcept nogil:
    """How many rows past the one they read the decode kernels ask for (rows of cols
    elements of dtype: FA_PREFETCH_BYTES of row data, at least one, as fa_dots.h's
    fa_rows_ahead)."""
    return rows_in(FA_PREFETCH_BYTES, dtype, cols)


cdef inline Py_ssize_t paged_ahead(DType dtype, Py_ssize_t cols) noexcept nogil:
    """rows_ahead over PAGED_AHEAD_BYTES: how far ahead the kernels ask for the rows of
    a paged cache whose blocks hold each head's rows as one run (stream_ahead)."""
    return rows_in(PAGED_AHEAD_BYTES, dtype, cols)


cdef inline Py_ssize_t rows_in(Py_ssize_t nbytes, DType dtype,
                               Py_ssize_t cols) noexcept nogil:
    """The rows of cols elements of dtype that nbytes of row data hold, at least one."""
    cdef Py_ssize_t row_bytes = cols * element_size(dtype)
    cdef Py_ssize_t rows = nbytes // row_bytes if row_bytes > 0 else 0
    return rows if rows > 0 else 1


cdef inline Py_ssize_t stream_ahead(const Rows* r, Py_ssize_t cols) noexcept nogil:
    """How many rows past the one they read the decode kernels ask for, over rows r
    of cols elements: rows_ahead, or paged_ahead where r is a paged cache whose blocks
    hold each head's rows as one run (blocks stored heads first, or of one K/V head):
    a block's run is then a few KiB at a place of its own, which the CPU's own
    prefetchers do not follow from the run before, so the rows are asked for further
    ahead (docs/performance.md)."""
    if r.pages != NULL and r.row_bytes == cols * element_size(r.dtype):
        return paged_ahead(r.dtype, cols)
    return rows_ahead(r.dtype, cols)


cdef inline fa_rows_t step_rows(const Rows* r, Py_ssize_t j0, Py_ssize_t bc,
                                Py_ssize_t end, Py_ssize_t ahead,
                                const char** table) noexcept nogil:
    """Rows j0..j0+bc as the decode kernels read them, asking for `ahead` rows past
    the one they read: from row j0 one stride apart, or (a paged cache) through
    `table`, filled with the addresses of those rows and of the `ahead` rows after
    them (below `end`)."""
    cdef fa_rows_t rows
    cdef Py_ssize_t j, c, run, last
    rows.base = row_at(r, j0)
    rows.stride = r.row_bytes
    rows.rows = NULL
    rows.ahead = ahead
    if r.pages == NULL:
        return rows
    last = j0 + bc + ahead if j0 + bc + ahead < end else end
    j = j0
    while j < last:
        run = run_from(r, j, last)
        rows.base = row_at(r, j)
        for c in range(run):
            table[j - j0 + c] = rows.base + c * r.row_bytes
        j += run
    rows.rows = table
    return rows


cdef inline void times_scales(const Rows* r, Py_ssize_t j0, Py_ssize_t bc,
                              Py_ssize_t R, const real* src, real* dst,
                              double units) noexcept nogil:
    """dst[:, c] = src[:, c] * units * the scale of row j0 + c (1 without scales); the
    R rows DECODE_KEYS apart in both (dst may be src), bc <= DECODE_KEYS. The factors
    are gathered first (a scale's rows lie a stride apart, or in blocks), so that the
    products run along contiguous rows."""
    cdef real f[DECODE_KEYS]
    cdef const float* sc
    cdef Py_ssize_t j, run, i, c, step
    if r.scale == NULL:
        for c in range(bc):
            f[c] = <real> units
    else:
        step = scale_step(r)
        j = j0
        while j < j0 + bc:
            run = run_from(r, j, j0 + bc)
            sc = scales_at(r, j)
            for c in range(run):
                f[j - j0 + c] = <real> (units * sc[c * step])
            j += run
    for i in range(R):
        for c in range(bc):
            dst[i * DECODE_KEYS + c] = src[i * DECODE_KEYS + c] * f[c]


cdef inline void scale_scores(const Rows* k, Py_ssize_t j0, Py_ssize_t bc, Py_ssize_t R,
                              real* s, double units) noexcept nogil:
    """s[:, c] *= units * the scale of key j0 + c (8-bit codes dotted as they are, in
    the kernels' units)."""
    if k.scale != NULL or units != 1:
        times_scales(k, j0, bc, R, s, s, units)


cdef inline void few_softmax(const Plan* p, Py_ssize_t R, Py_ssize_t bc, real* s,
                             real* m, double* l, real* acc) noexcept nogil:
    """The online softmax's step for each of the R rows: the new max, the step's
    weights (in s) and sum, and the earlier sums rescaled (alpha == 0 drops them, as
    0 * inf would be NaN)."""
    cdef Py_ssize_t r, t, Ev = p.Ev
    cdef real m_new, m_sub, alpha
    cdef double total
    cdef real* srow
    cdef real* arow
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
            for t in range(Ev):
                arow[t] = arow[t] * alpha if alpha != 0 else 0


cdef inline void few_values(const Plan* p, Py_ssize_t n0, Py_ssize_t G, Py_ssize_t heads,
                            Py_ssize_t j0, Py_ssize_t bc, Py_ssize_t end, const real* s,
                            real* blk, const FewScratch* fs) noexcept nogil:
    """blk (heads * R, Ev) = each head's step weights s (R = G * Lq rows, DECODE_KEYS
    apart) times its value rows j0..j0+bc, head by head (head_values); on AVX-512 or
    AVX2, with several heads, SIDE_KEYS keys at a time across them instead (each sum's
    chain carried on from one pass to the next: the same sums), then, for a head whose
    e4m3 values hold a NaN, exact_values, and for one whose sums are not finite,
    values_again. Where the tiles take the item (tiled_values), head by head."""
    cdef const real* w
    cdef Rows v
    cdef Py_ssize_t R = G * p.Lq, Ev = p.Ev, side = side_keys(p), h, c, nc
    cdef bint nan
    if real is float:
        if (p.pair_values and fa_pairs_usable()
                and pair_values(p, n0, G, heads, j0, bc, end, s, blk, fs)):
            return
        if heads > 1 and FA_HAVE_DOTS and not tiled_values(p, R):
            c = 0
            while c < bc:
                nc = bc - c if bc - c < side else side
                for h in range(heads):
                    v = rows_of(p, &p.v, &p.v_scale, n0 + h * G)
                    w = weights_for(&v, j0 + c, nc, R, s + h * R * DECODE_KEYS + c,
                                    <real*> fs.w + h * R * DECODE_KEYS + c,
                                    kernel_units(&v))
                    fa_pv(w, DECODE_KEYS, R,
                          step_rows(&v, j0 + c, nc, end, stream_ahead(&v, Ev),
                                    fs.v_table),
                          v.dtype, nc, Ev, blk + h * R * Ev, Ev, c > 0, end - j0 - c)
                c += nc
            v = rows_of(p, &p.v, NULL, n0)
            nan = side_by_side_nan(&v, j0, bc, heads,
                                   rows_of(p, &p.v, NULL, n0 + G).data - v.data, Ev)
            for h in range(heads):
                v = rows_of(p, &p.v, &p.v_scale, n0 + h * G)
                if nan and e4m3_nan(&v, j0, bc, Ev):
                    exact_values(&v, j0, bc, R, Ev, s + h * R * DECODE_KEYS,
                                 blk + h * R * Ev, <real*> fs.w + h * R * DECODE_KEYS, fs)
                if not all_finite(blk + h * R * Ev, R, Ev, Ev):
                    values_again(&v, j0, bc, R, Ev, s + h * R * DECODE_KEYS,
                                 blk + h * R * Ev, fs)
            return
    for h in range(heads):
        v = rows_of(p, &p.v, &p.v_scale, n0 + h * G)
        head_values(p, &v, j0, bc, R, end, s + h * R * DECODE_KEYS, blk + h * R * Ev,
                    <real*> fs.w + h * R * DECODE_KEYS, fs)


cdef inline Py_ssize_t side_keys(const Plan* p) noexcept nogil:
    """Keys per pass of the values' product across heads side by side: few where a
    head's part of a value row is wide (16-bit values: the passes then read the token
    rows nearly in memory order, as the scores do), more for 8-bit codes (whose
    product costs more per byte: the passes' own work then weighs most)."""
    return SIDE_KEYS_WIDE if p.Ev * element_size(p.v.dtype) >= WIDE_PART else SIDE_KEYS


cdef inline bint pair_values(const Plan* p, Py_ssize_t n0, Py_ssize_t G,
                             Py_ssize_t heads, Py_ssize_t j0, Py_ssize_t bc,
                             Py_ssize_t end, const float* s, float* blk,
                             const FewScratch* fs) noexcept nogil:
    """few_values for float8 value codes on vdpbf16ps (Plan.pair_values): each head's
    weights times its values' scales (weights_for, in fs.w) rounded once to bfloat16
    pairs (fa_pair_weights, in fs.w_pairs), times the pairs of its value rows widened
    exactly (fa_pair_pv); with several heads side by side, SIDE_KEYS keys at a time
    across them (each sum's chain carried on from pass to pass); then values_again for
    a head whose sums are not finite (a NaN or inf among its codes or scales). False,
    blk not written, where a weight cannot be rounded so (not finite, 2^127 or more, or
    nonzero and under 2^-100, where the products would flush to zero): the caller then
    sums the step on its own kernels."""
    cdef Rows v
    cdef Py_ssize_t R = G * p.Lq, Ev = p.Ev, W2 = DECODE_KEYS // 2, h, c, nc
    cdef Py_ssize_t step = side_keys(p) if heads > 1 else bc
    for h in range(heads):
        v = rows_of(p, &p.v, &p.v_scale, n0 + h * G)
        if not fa_pair_weights(weights_for(&v, j0, bc, R, s + h * R * DECODE_KEYS,
                                           <float*> fs.w + h * R * DECODE_KEYS, 1),
                               DECODE_KEYS, R, bc, <uint32_t*> fs.w_pairs + h * R * W2,
                               W2):
            return False
    c = 0
    while c < bc:
        nc = bc - c if bc - c < step else step
        for h in range(heads):
            v = rows_of(p, &p.v, NULL, n0 + h * G)
            fa_pair_pv(<const uint32_t*> fs.w_pairs + h * R * W2 + c // 2, W2, R,
                       step_rows(&v, j0 + c, nc, end, stream_ahead(&v, Ev),
                                 fs.v_table),
                       v.dtype, nc, Ev, blk + h * R * Ev, Ev, c > 0, end - j0 - c)
        c += nc
    for h in range(heads):
        if not all_finite(blk + h * R * Ev, R, Ev, Ev):
            v = rows_of(p, &p.v, &p.v_scale, n0 + h * G)
            values_again(&v, j0, bc, R, Ev, s + h * R * DECODE_KEYS, blk + h * R * Ev,
                         fs)
    return True


cdef inline void head_values(const Plan* p, const Rows* v, Py_ssize_t j0, Py_ssize_t bc,
                             Py_ssize_t R, Py_ssize_t end, const real* s, real* blk,
                             real* w, const FewScratch* fs) noexcept nogil:
    """blk (R, Ev) = the step's weights s times value rows j0..j0+bc, each value row
    read once (AVX-512 or AVX2: in place, run by run, one chain of sums across the
    runs, rows prefetched up to key `end`; 8-bit codes weighed by weight * scale, in
    w; int8 codes on AMX-BF16 tiles where they take the item: code_values); else, and
    for e4m3 codes among which a NaN hides (looked for once the kernel has brought the
    rows into the cache), exact_values. An inf or NaN among the values (or the scales)
    leaves blk not finite (the weights are), and then values_again sums the step
    again."""
    cdef const real* wv
    cdef Py_ssize_t Ev = p.Ev
    if real is float and FA_HAVE_DOTS:
        wv = weights_for(v, j0, bc, R, s, w, kernel_units(v))
        if not (tiled_values(p, R) and code_values(p, v, j0, bc, R, end, wv, blk, fs)):
            fa_pv(wv, DECODE_KEYS, R, step_rows(v, j0, bc, end, stream_ahead(v, Ev),
                                                fs.v_table),
                  v.dtype, bc, Ev, blk, Ev, False, end - j0)
        if e4m3_nan(v, j0, bc, Ev):
            exact_values(v, j0, bc, R, Ev, s, blk, w, fs)
    else:
        exact_values(v, j0, bc, R, Ev, s, blk, w, fs)
    if not all_finite(blk, R, Ev, Ev):
        values_again(v, j0, bc, R, Ev, s, blk, fs)


cdef inline bint tiled_values(const Plan* p, Py_ssize_t R) noexcept nogil:
    """Does code_values take a step of R query rows per key head (Plan.amx_values,
    R >= TILE_ROWS_MIN)?"""
    return p.amx_values and R >= TILE_ROWS_MIN


cdef inline bint code_values(const Plan* p, const Rows* v, Py_ssize_t j0, Py_ssize_t bc,
                             Py_ssize_t R, Py_ssize_t end, const float* w, float* blk,
                             const FewScratch* fs) noexcept nogil:
    """blk (R, Ev) = the weights w (R rows DECODE_KEYS apart, times the values' scales)
    times int8 value codes j0..j0+bc on AMX-BF16 tiles (fa_amx_code_values: the weights
    rounded once to bfloat16, the codes widened exactly, 16 rows per pass at most; the
    rows ahead asked for up to key `end`); False where a weight is nonzero but under
    2^-100 (the tiles would flush sums to zero): the caller then takes fa_pv, which
    writes every row of blk again."""
    cdef Py_ssize_t ahead = rows_ahead(v.dtype, p.Ev)
    cdef fa_rows_t rows = step_rows(v, j0, bc, end, ahead, fs.v_table)
    cdef bint done = fa_amx_code_values(w, DECODE_KEYS, R, rows, bc, p.Ev, blk, p.Ev,
                                        fs.value_tiles, ahead, p.Ev, end - j0)
    fa_amx_end()
    return done


cdef inline void exact_values(const Rows* v, Py_ssize_t j0, Py_ssize_t bc, Py_ssize_t R,
                              Py_ssize_t Ev, const real* s, real* blk, real* w,
                              const FewScratch* fs) noexcept nogil:
    """head_values' sum by the micro-GEMM, the codes widened exactly (an e4m3 NaN
    code a NaN) and weighed by weight * scale (in w)."""
    cdef const real* vb
    cdef const real* wv
    cdef Rows bare
    cdef Py_ssize_t rs
    wv = weights_for(v, j0, bc, R, s, w, 1)
    bare = v[0]                     # codes as they are, weighed by weight * scale
    bare.scale = NULL
    vb = rows_as_real(&bare, j0, bc, Ev, <real*> fs.v_rows, &rs)
    gemm(wv, DECODE_KEYS, 1, vb, rs, blk, Ev, R, Ev, bc, False)


cdef inline void values_again(const Rows* v, Py_ssize_t j0, Py_ssize_t bc, Py_ssize_t R,
                              Py_ssize_t Ev, const real* s, real* blk,
                              const FewScratch* fs) noexcept nogil:
    """blk (R, Ev) = the weights s times value rows j0..j0+bc (dequantized), skipping
    zero weights: among values holding inf or NaN, a key must add nothing where its
    weight is 0."""
    cdef const real* vb
    cdef const real* vrow
    cdef real* arow
    cdef real x
    cdef Py_ssize_t rs, r, c, t
    vb = rows_as_real(v, j0, bc, Ev, <real*> fs.v_rows, &rs)
    for t in range(R * Ev):
        blk[t] = 0
    for c in range(bc):
        vrow = vb + c * rs
        for r in range(R):
            x = s[r * DECODE_KEYS + c]
            if x == 0:
                continue
            arow = blk + r * Ev
            for t in range(Ev):
                arow[t] = arow[t] + x * vrow[t]


cdef inline const real* weights_for(const Rows* v, Py_ssize_t j0, Py_ssize_t bc,
                                    Py_ssize_t R, const real* s, real* w,
                                    double units) noexcept nogil:
    """The weights the values' kernel multiplies the stored rows by: s, or for 8-bit
    codes s times each key's scale and `units` (the kernel's unit of the codes), in
    w."""
    if v.scale == NULL and units == 1:
        return s
    times_scales(v, j0, bc, R, s, w, units)
    return w


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
    of partial sums, so that each waits less on the one before."""
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
