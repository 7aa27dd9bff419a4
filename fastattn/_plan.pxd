# The description of one attention problem: what every layer below the Python API
# takes instead of loose sizes, pointers and offsets.
#
# A Plan is built once per call by ``fastattn._plan`` from validated arguments (see
# ``attention_plan`` in _plan.pyx) and handed to the drivers, which give the tiles
# (plan, work item, scratch). Every operand is a pointer plus element strides per axis,
# so broadcast, transposed and grouped-query operands reach the kernels without copies.
#
# Terms: a *slice* is one entry of the output's batch (one (batch, head) pair), numbered
# in C order; a *block* is KEY_BLOCK consecutive keys of a slice; a *tile* is up to
# QUERY_TILE consecutive query rows of a slice (the rows one work item computes).
#
# Positions: key j sits at position j; query row i sits at position i + query_offset.
# Query i may attend to key j iff
#     i + query_offset - window_left <= j <= i + query_offset + window_right
# (NO_LIMIT: that side is unbounded), the mask allows it and its score is not -inf.
# Causal attention is window_right = 0: top-left has query_offset 0, bottom-right
# Lk - Lq (``fastattn._validation.query_offset`` owns that rule). With per-sequence
# lengths, keys j >= kv_length are never attended, rows i >= q_length attend to none,
# and bottom-right alignment uses the sequence's own lengths.

cdef extern from "fa_limits.h":
    const Py_ssize_t NO_LIMIT "FA_NO_LIMIT"

cdef enum:
    MAX_BATCH_AXES = 8      # batch axes a plan describes (more are collapsed or copied)
    KEY_BLOCK = 64          # keys per block (the width of a score tile)
    QUERY_TILE = 64         # query rows per tile of the fused pass
    DECODE_KEYS = 256       # keys per step of the decode path (fewer switches between
                            # the K and V streams: more bandwidth from one core)

cdef enum DType:
    FLOAT32 = 0
    FLOAT64 = 1
    UINT8 = 2               # masks (True = may attend)
    BFLOAT16 = 3            # q, k, v stored in 16 bits (computed in float32)
    FLOAT16 = 4
    INT8 = 5                # k, v stored as 8-bit codes (quantized caches: a value is
    FLOAT8_E4M3 = 6         # float(code) * its row's scale; computed in float32)
    FLOAT8_E5M2 = 7


cdef DType dtype_code(dtype) except *    # the DType of a NumPy dtype (KeyError if none)


cdef inline Py_ssize_t element_size(DType d) noexcept nogil:
    """Bytes per element of an operand of dtype d."""
    if d == FLOAT64:
        return 8
    if d == FLOAT32:
        return 4
    if d == UINT8 or d == INT8 or d == FLOAT8_E4M3 or d == FLOAT8_E5M2:
        return 1
    return 2


cdef inline bint is_code(DType d) noexcept nogil:
    """Is d an 8-bit code of a quantized cache?"""
    return d == INT8 or d == FLOAT8_E4M3 or d == FLOAT8_E5M2


cdef struct Operand:
    char* data                                  # element [0, ..., 0]; NULL: absent
    DType dtype                                 # of its elements
    Py_ssize_t batch_strides[MAX_BATCH_AXES]    # elements per step of each output batch
                                                # axis (0 where it broadcasts)
    Py_ssize_t head_divisor                     # the index along the last batch axis is
                                                # divided by this (GQA: k and v)
    Py_ssize_t row_stride                       # elements per step along axis -2
    Py_ssize_t col_stride                       # ... along axis -1 (1 for q, k, v, out)
    const Py_ssize_t* row_starts                # a packed batch: the first row of each
                                                # sequence (slice n: sequence
                                                # n // slices_per_sequence); NULL: none
    # a paged cache (rows in blocks of page_rows, found through a block table): row j
    # of sequence b is row j % page_rows of block pages[b * pages_stride +
    # j // page_rows], blocks page_stride elements apart; pages NULL: not paged
    const Py_ssize_t* pages
    Py_ssize_t pages_stride, page_rows, page_stride


cdef enum DotKernel:
    DOT_FMA = 0             # every product through the micro-GEMM (_gemm.pxd)
    DOT_AVX512_BF16 = 1     # bfloat16 scores by vdpbf16ps (src/fa_bf16.h), in the
                            # driver modules that have it
    DOT_AMX_BF16 = 2        # bfloat16 scores (and bfloat16 values' products) on AMX
                            # tiles (src/fa_amx.h)


cdef struct Plan:
    DType dtype                                 # the computation dtype (FLOAT32
                                                # or FLOAT64; q, k, v may be
                                                # BFLOAT16/FLOAT16 with FLOAT32)
    Py_ssize_t n_batch_axes
    Py_ssize_t batch_shape[MAX_BATCH_AXES]      # the output's batch shape (collapsed)
    Py_ssize_t n_slices                         # prod(batch_shape)
    Py_ssize_t Lq, Lk, E, Ev
    double scale
    Py_ssize_t groups                           # query heads per key/value head
    Py_ssize_t query_offset                     # see "Positions" above
    Py_ssize_t window_left
    Py_ssize_t window_right
    bint bottom_right                           # with lengths: each sequence's own
                                                # Lk - Lq is its query offset
    # the attention variants (absent: 0 / NULL)
    double softcap                              # c > 0: scores become c tanh(s / c)
    Operand alibi_slopes                        # slope per slice (rows, columns: 0)
    const Py_ssize_t* q_lengths                 # valid rows per sequence ...
    const Py_ssize_t* kv_lengths                # ... and keys; sequence = n // this:
    Py_ssize_t slices_per_sequence
    double dropout_p                            # 0: no dropout
    unsigned long long dropout_seed
    Py_ssize_t dropout_slice_base               # slice n draws as slice base + n
    unsigned int dropout_threshold              # a Philox word >= this keeps a weight
    Operand sinks                               # one extra logit per slice that joins
                                                # every row's softmax and carries no
                                                # value (attention sinks; rows,
                                                # columns: 0); absent: data NULL
    DotKernel dot_kernel                        # how the fused pass computes scores
    bint packed                                 # the sequences are packed one after
                                                # another (attention_varlen): rows
                                                # past a sequence's q_lengths do not
                                                # exist (never read or written)
    bint values_finite                          # no inf or NaN in any value row: set
                                                # by the tiled forward's driver (then
                                                # no key block is checked again)
    bint amx_codes                              # the decode path's scores of int8 key
                                                # codes on AMX-INT8 tiles, exact
                                                # (src/fa_amx.h), for 16-bit queries
    bint amx_values                             # its product of int8 value codes on
                                                # AMX-BF16 tiles, the weights rounded
                                                # once to bfloat16 (bfloat16 queries,
                                                # round_weights)
    bint pair_codes                             # the decode path's scores of float8 key
                                                # codes against bfloat16 queries on
                                                # vdpbf16ps (src/fa_pairs.h; where the
                                                # CPU has AVX512-VBMI too)
    bint pair_values                            # its product of float8 value codes on
                                                # vdpbf16ps, the weights rounded once
                                                # to bfloat16 (round_weights)
    bint round_weights                          # the bfloat16 units may round the
                                                # weights once to bfloat16 for the
                                                # product with bfloat16 values
                                                # (precision=None); else they keep 16
                                                # bits or meet V in float32
    Py_ssize_t wide_keys                        # the tiled forward (set by its driver):
                                                # each thread keeps this many keys of a
                                                # slice's K and V rows widened, for
                                                # the next tiles that read them
                                                # (_engines.block_rows); 0: none
    const void* value_pairs                     # the tiled forward on the bfloat16
    const Py_ssize_t* pair_slot                 # units (set by its driver): V^T as
                                                # bfloat16 pairs, packed once for all
                                                # the tiles that read it, each key
                                                # block of slice n at pair_slot[n]
                                                # (_engines.packed_values); NULL: each
                                                # tile packs the blocks it reads
    unsigned char* units_checked                # the tiled forward on the bfloat16
                                                # units (set by its driver): per
                                                # slice, whether its operands suit
                                                # them (UnitsCheck, _tiles.pxd), 0
                                                # until a tile has looked
    # the operands; q (Lq, E), k (Lk, E), v (Lk, Ev), out (Lq, Ev), lse (Lq),
    # mask and bias (Lq, Lk) per slice; k_scale and v_scale (Lk) the float32 scales of
    # 8-bit k and v codes, one per row (absent: 1; addressed as k and v are)
    Operand q, k, v, out, lse, mask, bias, k_scale, v_scale


cdef class AttentionPlan:
    cdef Plan plan
    cdef object _arrays         # keeps every operand's buffer alive


cdef inline void clear_operand(Operand* op) noexcept nogil:
    """op = absent: no data, no strides."""
    cdef Py_ssize_t d
    op.data = NULL
    op.dtype = FLOAT32
    for d in range(MAX_BATCH_AXES):
        op.batch_strides[d] = 0
    op.head_divisor = 1
    op.row_stride = 0
    op.col_stride = 0
    op.row_starts = NULL
    op.pages = NULL
    op.pages_stride = 0
    op.page_rows = 1
    op.page_stride = 0


cdef inline void set_operand(Operand* op, const void* data, DType dtype,
                             Py_ssize_t row_stride, Py_ssize_t col_stride) noexcept nogil:
    """op = rows of `dtype` at data (NULL: absent), each row_stride elements after the
    last, their elements col_stride apart; no batch strides, no grouped heads, no row
    offsets (a writer sets those its layout has)."""
    clear_operand(op)
    op.data = <char*> data
    op.dtype = dtype
    op.row_stride = row_stride
    op.col_stride = col_stride


cdef inline void plan_init(Plan* p, DType dtype, Py_ssize_t Lq, Py_ssize_t Lk,
                           Py_ssize_t E, Py_ssize_t Ev, double scale) noexcept nogil:
    """The plan of one slice of the given sizes with every operand and variant
    absent: every field set, so that a writer fills in only what its call has (its
    operands, batch shape, positions and variants)."""
    cdef Py_ssize_t d
    p.dtype = dtype
    p.n_batch_axes = 0
    for d in range(MAX_BATCH_AXES):
        p.batch_shape[d] = 1
    p.n_slices = 1
    p.Lq, p.Lk, p.E, p.Ev = Lq, Lk, E, Ev
    p.scale = scale
    p.groups = 1
    p.query_offset = 0
    p.window_left = NO_LIMIT
    p.window_right = NO_LIMIT
    p.bottom_right = False
    p.softcap = 0
    p.q_lengths = NULL
    p.kv_lengths = NULL
    p.slices_per_sequence = 1
    p.dropout_p = 0
    p.dropout_seed = 0
    p.dropout_slice_base = 0
    p.dropout_threshold = 0
    p.dot_kernel = DOT_FMA
    p.packed = False
    p.values_finite = False
    p.round_weights = False
    p.amx_codes = False
    p.amx_values = False
    p.pair_codes = False
    p.pair_values = False
    p.wide_keys = 0
    p.value_pairs = NULL
    p.pair_slot = NULL
    p.units_checked = NULL
    clear_operand(&p.alibi_slopes)
    clear_operand(&p.sinks)
    clear_operand(&p.q)
    clear_operand(&p.k)
    clear_operand(&p.v)
    clear_operand(&p.out)
    clear_operand(&p.lse)
    clear_operand(&p.mask)
    clear_operand(&p.bias)
    clear_operand(&p.k_scale)
    clear_operand(&p.v_scale)


# ------------------------------------------------------------- the rules, in one place

cdef inline Py_ssize_t slice_offset(const Plan* p, const Operand* a,
                                    Py_ssize_t n) noexcept nogil:
    """The element offset of slice n (C-order index into the output batch) in a: its
    batch axes, and in a packed batch the first row of its sequence."""
    cdef Py_ssize_t off = 0, d, idx
    if a.row_starts != NULL:
        off = a.row_starts[n // p.slices_per_sequence] * a.row_stride
    for d in range(p.n_batch_axes - 1, -1, -1):
        idx = n % p.batch_shape[d]
        n = n // p.batch_shape[d]
        if d == p.n_batch_axes - 1:
            idx = idx // a.head_divisor
        off += idx * a.batch_strides[d]
    return off


cdef inline Py_ssize_t queries_of(const Plan* p, Py_ssize_t n) noexcept nogil:
    """The valid query rows of slice n (q_lengths of its sequence, else Lq)."""
    if p.q_lengths == NULL:
        return p.Lq
    return p.q_lengths[n // p.slices_per_sequence]


cdef inline Py_ssize_t keys_of(const Plan* p, Py_ssize_t n) noexcept nogil:
    """The valid keys of slice n (kv_lengths of its sequence, else Lk)."""
    if p.kv_lengths == NULL:
        return p.Lk
    return p.kv_lengths[n // p.slices_per_sequence]


cdef inline Py_ssize_t rows_held(const Plan* p, Py_ssize_t n, Py_ssize_t i0,
                                 Py_ssize_t nrows) noexcept nogil:
    """How many of query rows i0..i0+nrows of slice n the plan holds: all of them, or
    in a packed batch those inside the sequence (the next sequence's rows follow;
    <= 0 for none)."""
    cdef Py_ssize_t valid
    if not p.packed:
        return nrows
    valid = queries_of(p, n) - i0
    return valid if valid < nrows else nrows


cdef inline Py_ssize_t offset_of(const Plan* p, Py_ssize_t n) noexcept nogil:
    """The query offset of slice n: bottom-right alignment uses its own lengths."""
    if p.bottom_right and (p.q_lengths != NULL or p.kv_lengths != NULL):
        return keys_of(p, n) - queries_of(p, n)
    return p.query_offset


cdef inline Py_ssize_t key_end(const Plan* p, Py_ssize_t n, Py_ssize_t i) noexcept nogil:
    """One past the last key query row i of slice n may attend to by position and
    length, in [0, Lk]; 0 for a row past its sequence's length."""
    cdef Py_ssize_t e, lk = keys_of(p, n)
    if i >= queries_of(p, n):
        return 0
    if p.window_right >= NO_LIMIT:
        return lk
    e = i + offset_of(p, n) + p.window_right + 1
    if e < 0:
        return 0
    return e if e < lk else lk


cdef inline Py_ssize_t key_begin(const Plan* p, Py_ssize_t n, Py_ssize_t i) noexcept nogil:
    """The first key query row i of slice n may attend to by position, in [0, Lk]."""
    cdef Py_ssize_t b, lk = keys_of(p, n)
    if i >= queries_of(p, n) or p.window_left >= NO_LIMIT:
        return 0
    b = i + offset_of(p, n) - p.window_left
    if b < 0:
        return 0
    return b if b < lk else lk


cdef struct KeyRange:
    Py_ssize_t lo, hi           # keys some row of the tile may attend to: [lo, hi)
    Py_ssize_t all_from, all_to # keys every row may attend to: [all_from, all_to)


cdef inline KeyRange tile_keys(const Plan* p, Py_ssize_t n, Py_ssize_t i0,
                               Py_ssize_t nrows) noexcept nogil:
    """The key ranges of query rows i0..i0+nrows of slice n (ranges move right with
    the row). A block inside [all_from, all_to) needs no position rule; rows past the
    sequence's length have no keys, so their presence empties [all_from, all_to)."""
    cdef KeyRange r
    cdef Py_ssize_t last = i0 + nrows - 1, valid = queries_of(p, n)
    if last >= valid:
        last = valid - 1
    if last < i0:                       # no valid row
        r.lo = r.hi = r.all_from = r.all_to = 0
        return r
    r.lo = key_begin(p, n, i0)
    r.hi = key_end(p, n, last)
    r.all_from = key_begin(p, n, last)
    r.all_to = key_end(p, n, i0) if i0 + nrows - 1 == last else 0
    if r.hi < r.lo:
        r.hi = r.lo
    return r
