# The forward drivers: the choice of path and the parallel loops over work items.
# Compiled once per instruction-set level into the _drivers_<level> modules (see
# setup.py and _dispatch.py); self-contained: it cimports everything it uses.
#
# Each driver takes an AttentionPlan (built and bounds-checked by fastattn._plan),
# releases the GIL, and hands each work item to a tile function of _tiles.pxd with the
# plan and the thread's own scratch. A work item is always computed whole by one thread
# in a fixed order, and how the work is cut depends only on the shapes, so results are
# bit-identical for any number of threads.

import numpy as np

from cpython.buffer cimport (PyBUF_C_CONTIGUOUS, PyBUF_WRITABLE, PyBuffer_Release,
                             PyObject_GetBuffer)
from cython.parallel cimport parallel, prange
from libc.float cimport DBL_MAX
from libc.math cimport INFINITY, fabs, ldexp, nearbyint
from libc.stdint cimport int8_t, uint8_t, uint16_t, uint32_t

from fastattn._scratch import kept, scratch

from fastattn cimport _tiles
from fastattn._csrc cimport fa_bf16_pack_values
from fastattn._decode cimport FewScratch, attend_few, few_scratch
from fastattn._engines cimport (TileScratch, key_blocks, pair_block_words, packed_keys,
                                tile_scratch, values_as_pairs, widened_keys)
from fastattn._gemm cimport gemm, real
from fastattn._openmp cimport omp_get_thread_num
from fastattn._operands cimport Rows, operand_at, rows_of, rows_stored
from fastattn._parallel cimport (Interrupt, aligned, interrupted, raise_interrupt,
                                 start_interrupt_checks)
from fastattn._softmax cimport softmax_row
from fastattn._tiles cimport Parts, ScoresScratch, parts_scratch, scores_scratch
from fastattn._plan cimport (BFLOAT16, DOT_AMX_BF16, DOT_AVX512_BF16, DOT_FMA, FLOAT16,
                             FLOAT32, FLOAT8_E4M3, FLOAT8_E5M2, INT8, KEY_BLOCK,
                             NO_LIMIT, QUERY_TILE, AttentionPlan,
                             DotKernel, DType, Operand, Plan, dtype_code, element_size,
                             keys_of, rows_held)

# ------------------------------------------------------------------ choosing a path
#
# The forward pass takes one of two paths:
#   use_decode_path: at most DECODE_ROWS query rows per slice (decoding one or a few
#       tokens against a long key-value cache). The rows of a grouped-query group are
#       done together (each K/V row read once per group), and when there are fewer
#       than SPLIT_ITEMS groups the keys are split into pieces of at least
#       SPLIT_MIN_KEYS, merged afterwards in key order ("split-KV").
#   otherwise the tiled path: one work item per (slice, tile of QUERY_TILE query rows),
#       handed out dynamically, the longest (last, under a causal rule) first; when
#       there are fewer than SPLIT_ITEMS tiles, the keys are split too, into pieces of
#       at least TILE_SPLIT_MIN_KEYS, merged afterwards in key order.
# Both splits depend on the shapes only, so the bits do not depend on the threads.

cdef enum:
    DECODE_ROWS = 4             # at most this many query rows per slice: decode path
    DECODE_GROUP_ROWS = 64      # query rows (over a grouped-query group) in one item
    DECODE_BATCH_ROWS = 256     # query rows (over K/V heads side by side) in one item
    SPLIT_ITEMS = 32            # split the keys until there are this many items
    SPLIT_MIN_KEYS = 256        # ... but never into pieces of fewer keys than this
    TILE_SPLIT_MIN_KEYS = 1024  # ... (the tiled path: a piece's fixed costs are larger)
    FINITE_ONCE_TILES = 3       # tiles per slice from which value rows of the
                                # computation dtype are checked for inf and NaN once,
                                # before the tiles (fewer: each tile checks the blocks
                                # it reads in place, in its cache); 16-bit and 8-bit
                                # ones from 2 tiles
    PAIRS_ONCE_TILES = 4        # tiles per slice from which the bfloat16 units' V^T
                                # is packed once, before the tiles (fewer: each tile
                                # packs the blocks it reads, in its cache)
    TILES_TAKEN = 4             # work items of the tiled pass a thread takes at a
                                # time (with 4 * TILES_TAKEN items per thread or more;
                                # else one): it knows its next item and asks for that
                                # item's rows ahead

#: The constants of the path choice, for the Python side and the tests.
cdef extern from "fa_bf16.h":
    const bint FA_HAVE_AVX512_BF16

#: This module has the AVX512-BF16 scores kernel (src/fa_bf16.h): compiled into the
#: avx512 level's module by compilers that know the instructions.
HAS_AVX512_BF16 = bool(FA_HAVE_AVX512_BF16)

cdef extern from "fa_pairs.h":
    const bint FA_HAVE_PAIRS
    bint fa_pairs_usable() noexcept nogil

#: A decoding step's float8 codes meet bfloat16 queries on vdpbf16ps here
#: (src/fa_pairs.h): this module has the kernels and the CPU runs them (AVX512-BF16
#: and AVX512-VBMI).
FLOAT8_PAIRS = bool(FA_HAVE_PAIRS and fa_pairs_usable())

cdef extern from "fa_amx.h":
    const bint FA_HAVE_AMX_BF16
    const bint FA_AMX_EMULATED

cdef extern from "fa_softmax.h":
    const bint FA_HAVE_BLOCK_SOFTMAX

#: This module has the AMX-BF16 kernels (src/fa_amx.h): compiled into the avx512 level's
#: module where the assembler knows the tile instructions.
HAS_AMX_BF16 = bool(FA_HAVE_AMX_BF16)
#: ... as C functions standing in for the tile instructions (a test build,
#: ``FASTATTN_CFLAGS=-DFA_AMX_EMULATE``: runs on any AVX512-BF16 CPU, slowly).
AMX_EMULATED = bool(FA_AMX_EMULATED)

PATH_CONSTANTS = {"DECODE_ROWS": DECODE_ROWS, "DECODE_GROUP_ROWS": DECODE_GROUP_ROWS,
                  "SPLIT_ITEMS": SPLIT_ITEMS, "SPLIT_MIN_KEYS": SPLIT_MIN_KEYS,
                  "TILE_SPLIT_MIN_KEYS": TILE_SPLIT_MIN_KEYS, "QUERY_TILE": QUERY_TILE,
                  "KEY_BLOCK": KEY_BLOCK}


cdef inline bint use_decode_path(const Plan* p) noexcept nogil:
    return p.Lq <= DECODE_ROWS


cdef inline Py_ssize_t decode_group(const Plan* p) noexcept nogil:
    """Slices done together on the decode path: the largest divisor of the GQA group
    size whose rows fit one item (consecutive slices of a group share K and V)."""
    cdef Py_ssize_t g = p.groups
    while g > 1 and (p.groups % g or g * p.Lq > DECODE_GROUP_ROWS):
        g -= 1
    return g


cdef inline Py_ssize_t kv_heads_of(const Plan* p) noexcept nogil:
    """The K/V heads (the last batch axis over the grouped-query groups)."""
    return p.batch_shape[p.n_batch_axes - 1] // p.groups if p.n_batch_axes > 0 else 1


cdef inline bint heads_side_by_side(const Plan* p, const Operand* a) noexcept nogil:
    """Do the rows of a's K/V heads for one token lie side by side (a (B, L, Hkv, E)
    array, a token-major paged cache): the next head's row 0 after the head's, all
    of them within one row stride?"""
    cdef Py_ssize_t kv_heads = kv_heads_of(p)
    cdef Py_ssize_t gap
    if kv_heads < 2 or p.n_slices < kv_heads * p.groups:
        return False
    gap = rows_of(p, a, NULL, p.groups).data - rows_of(p, a, NULL, 0).data
    return 0 < gap and gap * kv_heads <= a.row_stride * element_size(a.dtype)


cdef inline Py_ssize_t decode_heads(const Plan* p, Py_ssize_t G, Py_ssize_t n_split,
                                    int num_threads) noexcept nogil:
    """K/V heads per decode item: 1, or where K's and V's heads lie side by side, as
    many as still leave 2 items per thread (a divisor of the K/V heads, rows within
    DECODE_BATCH_ROWS), so that a step reads each token's heads in one pass rather
    than one strided pass per head. Each head's sums are the same either way."""
    cdef Py_ssize_t kv_heads = kv_heads_of(p)
    cdef Py_ssize_t h = kv_heads
    if G != p.groups or not (heads_side_by_side(p, &p.k)
                             and heads_side_by_side(p, &p.v)):
        return 1
    while h > 1 and (kv_heads % h or h * G * p.Lq > DECODE_BATCH_ROWS
                     or p.n_slices // (h * G) * n_split < 2 * num_threads):
        h -= 1
    return h


cdef inline Py_ssize_t split_chunk(Py_ssize_t Lk, Py_ssize_t n_items,
                                   Py_ssize_t min_keys) noexcept nogil:
    """Keys per piece when n_items items share Lk keys: enough pieces for SPLIT_ITEMS
    items, of at least min_keys keys, a multiple of KEY_BLOCK (Lk or more means no
    split)."""
    cdef Py_ssize_t pieces, chunk
    if n_items >= SPLIT_ITEMS or Lk < 2 * min_keys:
        return Lk if Lk > 0 else 1
    pieces = (SPLIT_ITEMS + n_items - 1) // n_items
    if pieces > Lk // min_keys:
        pieces = Lk // min_keys
    chunk = (Lk + pieces - 1) // pieces
    return (chunk + KEY_BLOCK - 1) // KEY_BLOCK * KEY_BLOCK


cdef inline Py_ssize_t pieces_of(const Plan* p, Py_ssize_t chunk) noexcept nogil:
    """How many pieces of `chunk` keys a split cuts the keys into (one for none)."""
    return (p.Lk + chunk - 1) // chunk if p.Lk > 0 else 1


cdef inline Py_ssize_t decode_chunk(const Plan* p, Py_ssize_t n_groups) noexcept nogil:
    """Keys per piece of the decode path's split: a function of the shapes only."""
    return split_chunk(p.Lk, n_groups, SPLIT_MIN_KEYS)


cdef inline Py_ssize_t tiled_chunk(const Plan* p, Py_ssize_t tiles) noexcept nogil:
    """Keys per piece of the tiled path's split (`tiles`: the (slice, query tile)
    items): a function of the shapes only."""
    return split_chunk(p.Lk, tiles, TILE_SPLIT_MIN_KEYS)


def forward_path(AttentionPlan plan):
    """The path attention() takes for this plan and how it cuts the work:
    ("decode", slices per item, keys per piece, items) or ("tiled", keys per piece,
    items); keys per piece of Lk or more: no split."""
    cdef const Plan* p = &plan.plan
    cdef Py_ssize_t G, chunk, n_groups, tiles
    if use_decode_path(p):
        G = decode_group(p)
        n_groups = p.n_slices // G
        chunk = decode_chunk(p, n_groups)
        return ("decode", G, chunk, n_groups * pieces_of(p, chunk))
    tiles = p.n_slices * ((p.Lq + QUERY_TILE - 1) // QUERY_TILE)
    chunk = tiled_chunk(p, tiles)
    return ("tiled", chunk, tiles * pieces_of(p, chunk))


def decode_heads_per_item(AttentionPlan plan, int num_threads):
    """K/V heads per work item of the decode path on `num_threads` threads
    (decode_heads): above 1 where K's and V's heads lie side by side."""
    cdef const Plan* p = &plan.plan
    cdef Py_ssize_t G, chunk
    if not use_decode_path(p):
        return 1
    G = decode_group(p)
    chunk = decode_chunk(p, p.n_slices // G)
    return decode_heads(p, G, pieces_of(p, chunk), num_threads)


def forward_kernel(AttentionPlan plan):
    """What computes the fused forward's products for this plan: "amx_bf16",
    "avx512_bf16" or "fma", as this module runs it once its operands have been checked
    for the bfloat16 units (_tiles.bf16_units_safe): "fma" where the scale, or any
    slice's operands, do not suit them (with a scale that does, the call still runs
    the units for the slices whose operands suit them); the decode path runs "fma"."""
    cdef Plan local = plan.plan
    cdef Py_ssize_t n
    if use_decode_path(&local):
        return "fma"
    local.dot_kernel = runnable_kernel(&local)
    if local.dot_kernel != DOT_FMA:
        if not _tiles.bf16_scale_safe(local.scale):
            return "fma"
        for n in range(local.n_slices):
            if not _tiles.bf16_units_safe(&local, n):
                return "fma"
    return {DOT_AMX_BF16: "amx_bf16",
            DOT_AVX512_BF16: "avx512_bf16"}.get(local.dot_kernel, "fma")


cdef inline int team(int num_threads, Py_ssize_t items) noexcept nogil:
    """The threads of a parallel region over `items` work items: one where there is at
    most one item, else all `num_threads` of the call, even where there are fewer
    items (the others find no work). libgomp ends the threads of its pool that a
    smaller team leaves out and starts new ones for the next larger team: regions of
    varying sizes, within a call or from one call to the next, would start threads
    every time (8 per call at (1,8,512,512,64) on 16 threads, where the operands'
    check ran on 8). A team of one leaves the pool alone."""
    return 1 if items <= 1 or num_threads <= 1 else num_threads


def _scratch(Py_ssize_t bytes_needed, int nt):
    """Room for `bytes_needed` bytes of scratch on a cache line, shared by a team of
    `nt` threads (kept between calls: fastattn._scratch)."""
    return scratch(_with_alignment(bytes_needed), np.uint8, "work", nt)


cdef bint _scratch_kept(Py_ssize_t bytes_needed, int nt) except -1:
    """Is _scratch(bytes_needed, nt) served from the calling thread's kept buffers?"""
    return kept(_with_alignment(bytes_needed), nt)


cdef inline Py_ssize_t _with_alignment(Py_ssize_t bytes_needed) noexcept:
    """What _scratch asks for: room to start on a cache line (aligned())."""
    return bytes_needed + 64


cdef inline Py_ssize_t per_thread(Py_ssize_t size) noexcept nogil:
    """A thread's share of the scratch: `size` bytes, up to a cache line."""
    return (size + 63) // 64 * 64


cdef DotKernel runnable_kernel(const Plan* p) noexcept nogil:
    """The plan's kernel for the fused forward, as this module can run it: the
    bfloat16 kernels only where it has them (and the AVX-512 softmax steps beside
    AMX), for float32 computations; else the micro-GEMM."""
    if p.dtype != FLOAT32:
        return DOT_FMA
    if p.dot_kernel == DOT_AMX_BF16 and FA_HAVE_AMX_BF16 and FA_HAVE_BLOCK_SOFTMAX:
        return DOT_AMX_BF16
    if p.dot_kernel == DOT_AVX512_BF16 and FA_HAVE_AVX512_BF16:
        return DOT_AVX512_BF16
    return DOT_FMA


# ------------------------------------------------------------------- the fused pass

def attention(AttentionPlan plan, int num_threads):
    """out (and lse, when the plan has one) of every slice of the plan."""
    cdef const Plan* p = &plan.plan
    if p.n_slices * p.Lq == 0:
        return
    if use_decode_path(p):
        _attention_decode(p, num_threads)
    else:
        _attention_tiled(p, num_threads)


cdef inline Py_ssize_t tile_row(const Plan* p, Py_ssize_t item,
                                Py_ssize_t tiles) noexcept nogil:
    """The first query row of the tile of work item `item` (`tiles` per slice): the
    last tiles first, since under a causal rule they are the longest and handing out
    the long items first evens out the threads' finish; under a window (tiles of
    equal cost) in order, so that each tile's one new key block is its last, fetched
    while the others are computed (attend_keys)."""
    if p.window_left < NO_LIMIT:
        return (item % tiles) * QUERY_TILE
    return (tiles - 1 - item % tiles) * QUERY_TILE


cdef inline Py_ssize_t tile_rows(const Plan* p, Py_ssize_t n, Py_ssize_t i0) noexcept nogil:
    """The query rows of the tile that starts at row i0 of slice n (<= 0: none)."""
    return rows_held(p, n, i0, p.Lq - i0 if p.Lq - i0 < QUERY_TILE else QUERY_TILE)


cdef int check_operands(Plan* plan, Py_ssize_t tiles, int num_threads,
                        unsigned char[::1] checked) except -1:
    """Before the tiles run, in one parallel pass over the slices: whether any value
    row holds inf or NaN (with several tiles per slice, FINITE_ONCE_TILES, one check
    here spares every tile its own: plan.values_finite), and, on the bfloat16 units,
    which slices' operands suit them (_tiles.UnitsCheck, a byte per slice in
    `checked`, zeros, which becomes plan.units_checked; None off the units): here
    where V^T is packed once (PAIRS_ONCE_TILES tiles per slice or more: the packing
    needs values_finite), else by each slice's first tile (_tiles.tile_units_safe),
    the data then in its cache.
    A slice whose operands do not suit the units runs the float32 path; the others
    keep them. A scale that does not suit them sends the whole plan there
    (plan.dot_kernel becomes DOT_FMA)."""
    cdef const Plan* p = plan
    cdef bint units = p.dot_kernel != DOT_FMA
    cdef unsigned char[::1] finite
    cdef Py_ssize_t n
    if units and not _tiles.bf16_scale_safe(p.scale):
        plan.dot_kernel = DOT_FMA
        units = False
    if units and p.n_slices > 0:
        plan.units_checked = &checked[0]
        if tiles < PAIRS_ONCE_TILES:
            return 0        # (values_finite then stays False: each block is checked)
    if tiles < FINITE_ONCE_TILES and p.v.dtype == p.dtype:
        tiles = 1
    if not (tiles > 1 or units) or p.n_slices == 0:
        return 0
    finite = np.zeros(p.n_slices, np.uint8)
    with nogil, parallel(num_threads=team(num_threads, p.n_slices)):
        for n in prange(p.n_slices, schedule="static"):
            if units:
                checked[n] = (_tiles.UNITS_SAFE if _tiles.bf16_units_safe(p, n)
                              else _tiles.UNITS_UNSAFE)
            if tiles > 1:       # (bfloat16 values in the units' range are finite)
                finite[n] = ((units and checked[n] == _tiles.UNITS_SAFE
                              and p.v.dtype == BFLOAT16)
                             or _tiles.values_finite(p, n))
    plan.values_finite = tiles > 1 and all(finite)
    return 0


# V^T packed once per call for the bfloat16 units (_engines.packed_values): where a
# slice's values are read by PAIRS_ONCE_TILES tiles or more, each would otherwise pack
# every block it reads.

cdef Py_ssize_t pair_slots(const Plan* p, Py_ssize_t* slot) noexcept nogil:
    """How many slots the packed values take; with `slot`, each slice's. A slice whose
    values are the rows of the slice before, with as many keys (a group's query heads,
    a broadcast batch), shares its slot."""
    cdef Py_ssize_t n, count = 0
    cdef Rows here, before
    for n in range(p.n_slices):
        here = rows_of(p, &p.v, NULL, n)
        if (n == 0 or here.data != before.data or here.pages != before.pages
                or keys_of(p, n) != keys_of(p, n - 1)):
            count += 1
        if slot != NULL:
            slot[n] = count - 1
        before = here
    return count


cdef inline Py_ssize_t pairs_scratch(const Plan* p, Py_ssize_t slots) noexcept nogil:
    """Bytes of the slot table and of the packed values of `slots` slots, each on a
    cache line."""
    return 2 * 64 + slot_table(p) + slots * key_blocks(p) * pair_block_words(p) * 4


cdef inline Py_ssize_t slot_table(const Plan* p) noexcept nogil:
    return (p.n_slices * sizeof(Py_ssize_t) + 63) // 64 * 64


cdef void pack_values_once(Plan* plan, char* pairs, char* base, Py_ssize_t per,
                           int nt) noexcept nogil:
    """plan.pair_slot and plan.value_pairs = every slot's blocks of V^T as bfloat16
    pairs, packed at `pairs` (pairs_scratch bytes; the slot table first), in parallel
    over the blocks (a block of a paged cache gathered in the thread's tile scratch at
    base + thread * per)."""
    cdef const Plan* p = plan
    cdef Py_ssize_t blocks = key_blocks(p)
    cdef Py_ssize_t* slot = <Py_ssize_t*> aligned(pairs)
    cdef uint32_t* packed = <uint32_t*> (<char*> slot + slot_table(p))
    cdef Py_ssize_t item, n, j0, bc, ws
    cdef const char* words
    cdef TileScratch s
    cdef Rows v
    pair_slots(p, slot)
    with parallel(num_threads=nt):
        s = carve_tile(p, base + omp_get_thread_num() * per)
        for item in prange(p.n_slices * blocks, schedule="static"):
            n = item // blocks
            j0 = item % blocks * KEY_BLOCK
            if (n > 0 and slot[n] == slot[n - 1]) or j0 >= keys_of(p, n):
                continue        # (a shared slot's first slice packs it)
            v = rows_of(p, &p.v, NULL, n)
            bc = packed_keys(p, n, j0)
            words = rows_stored(&v, j0, bc, p.Ev, <char*> s.gathered, &ws)
            fa_bf16_pack_values(<const uint16_t*> words, ws, bc, p.Ev,
                                packed + (slot[n] * blocks + j0 // KEY_BLOCK)
                                * pair_block_words(p))
    plan.pair_slot = slot
    plan.value_pairs = packed


cdef TileScratch carve_tile(const Plan* p, char* base) noexcept nogil:
    cdef TileScratch s
    tile_scratch(p, base, &s)
    return s


cdef int _attention_tiled(const Plan* given, int num_threads) except -1:
    """The tiled pass: one work item per (slice, tile of QUERY_TILE query rows), or
    per (tile, piece of the keys) when the keys are split (tiled_chunk), the pieces'
    partial results then merged in key order."""
    cdef Plan plan = given[0]
    cdef const Plan* p = &plan
    cdef Py_ssize_t tiles = (p.Lq + QUERY_TILE - 1) // QUERY_TILE
    cdef Py_ssize_t n_tiles = p.n_slices * tiles
    cdef Py_ssize_t chunk = tiled_chunk(p, n_tiles)
    cdef Py_ssize_t n_split = pieces_of(p, chunk)
    cdef Py_ssize_t n_items = n_tiles * n_split
    cdef Py_ssize_t R = QUERY_TILE if n_split > 1 else 0   # rows of an item's part
    cdef int nt = team(num_threads, n_items)
    cdef TileScratch s
    cdef Parts parts
    cdef unsigned char[::1] checked = None      # (on the bfloat16 units only)
    plan.dot_kernel = runnable_kernel(p)
    if plan.dot_kernel != DOT_FMA:
        checked = np.zeros(max(p.n_slices, 1), np.uint8)
    check_operands(&plan, tiles, num_threads, checked)
    plan.wide_keys = widened_keys(p, tiles)
    cdef Py_ssize_t per = per_thread(tile_scratch(p, NULL, &s))
    cdef Py_ssize_t shared = parts_scratch(p, n_items * R, NULL, &parts)
    if plan.wide_keys and not _scratch_kept(nt * per + shared, nt):
        # each thread's widened slice would take the scratch past what is kept between
        # calls: new pages on every call would cost more than widening block by block
        plan.wide_keys = 0
        per = per_thread(tile_scratch(p, NULL, &s))
    cdef Py_ssize_t pairs = 0
    if values_as_pairs(p) and plan.values_finite and tiles >= PAIRS_ONCE_TILES:
        pairs = pairs_scratch(p, pair_slots(p, NULL))
        if not _scratch_kept(nt * per + shared + pairs, nt):
            pairs = 0       # (packing per tile costs less than new pages every call)
    cdef unsigned char[::1] work = _scratch(nt * per + shared + pairs, nt)
    cdef char* base = <char*> aligned(&work[0])
    parts_scratch(p, n_items * R, base + nt * per, &parts)
    if pairs:
        pack_values_once(&plan, base + nt * per + shared, base, per, nt)
    # a tile whose operands do not suit the bfloat16 units runs the float32 path
    cdef Plan fma = plan
    fma.dot_kernel = DOT_FMA
    fma.units_checked = NULL
    fma.value_pairs = NULL
    fma.pair_slot = NULL
    cdef const Plan* tp
    cdef Interrupt stop
    cdef Py_ssize_t w, n, i0, nrows, piece, item, at
    cdef Py_ssize_t taken = TILES_TAKEN if n_items >= 4 * TILES_TAKEN * nt else 1
    start_interrupt_checks(&stop)
    with nogil, parallel(num_threads=nt):
        s = carve_tile(p, base + omp_get_thread_num() * per)
        for w in prange(n_items, schedule="dynamic", chunksize=taken):
            if interrupted(&stop):
                continue
            if n_split == 1 and (w + 1) % taken != 0 and w + 1 < n_items:
                prefetch_item(p, w + 1, n_tiles, tiles)
            # the pieces of the keys in order, each over every tile (tiles reading the
            # same keys at about the same time)
            item = w % n_tiles
            piece = w // n_tiles
            n = item // tiles
            i0 = tile_row(p, item, tiles)
            nrows = tile_rows(p, n, i0)
            if nrows <= 0:          # (a packed batch: past its sequence's rows)
                continue
            tp = p if _tiles.tile_units_safe(p, n, i0, nrows) else &fma
            if n_split == 1:    # (ahead: the first of its slice this thread takes)
                _tiles.attend_tile(tp, n, i0, nrows, &s, &stop,
                                   w % taken == 0 or new_slice(w, n_tiles, tiles))
                continue
            at = (item * n_split + piece) * R
            if p.dtype == FLOAT32:
                _tiles.attend_keys(tp, n, i0, nrows, &s, piece * chunk,
                                   min((piece + 1) * chunk, p.Lk),
                                   <float*> parts.acc + at * p.Ev, <float*> parts.m + at,
                                   parts.l + at, &stop)
            else:
                _tiles.attend_keys(tp, n, i0, nrows, &s, piece * chunk,
                                   min((piece + 1) * chunk, p.Lk),
                                   <double*> parts.acc + at * p.Ev,
                                   <double*> parts.m + at, parts.l + at, &stop)
    if stop.stop:
        return raise_interrupt()
    if n_split > 1:     # serial: the merge is small (fewer than SPLIT_ITEMS tiles)
        with nogil:
            for item in range(n_tiles):
                i0 = tile_row(p, item, tiles)
                nrows = tile_rows(p, item // tiles, i0)
                if nrows > 0:
                    merge_item(p, item // tiles, i0, nrows, &parts, item * n_split * R,
                               n_split, R)
    return 0


cdef inline void prefetch_item(const Plan* p, Py_ssize_t w, Py_ssize_t n_tiles,
                              Py_ssize_t tiles) noexcept nogil:
    """Ask for the rows of work item w (of the unsplit tiled pass), which the calling
    thread takes next, while it computes the one before: its query rows, and its
    slice's first key and value block where the slice differs (the one before reads
    the same keys)."""
    cdef Py_ssize_t n = (w % n_tiles) // tiles, i0 = tile_row(p, w % n_tiles, tiles)
    cdef Py_ssize_t nrows = tile_rows(p, n, i0)
    if nrows > 0:
        _tiles.prefetch_tile(p, n, i0, nrows, new_slice(w, n_tiles, tiles))


cdef inline bint new_slice(Py_ssize_t w, Py_ssize_t n_tiles,
                           Py_ssize_t tiles) noexcept nogil:
    """Does work item w (of the unsplit tiled pass) read another slice than w - 1?"""
    return w == 0 or (w % n_tiles) // tiles != ((w - 1) % n_tiles) // tiles


cdef inline void merge_item(const Plan* p, Py_ssize_t n, Py_ssize_t i0,
                            Py_ssize_t nrows, const Parts* parts, Py_ssize_t first,
                            Py_ssize_t nparts, Py_ssize_t stride) noexcept nogil:
    """merge_rows of the parts of one item, the first at row `first` of the parts."""
    if p.dtype == FLOAT32:
        _tiles.merge_rows(p, n, i0, nrows, <const float*> parts.acc + first * p.Ev,
                          <const float*> parts.m + first, parts.l + first, nparts, stride,
                          <float*> parts.row)
    else:
        _tiles.merge_rows(p, n, i0, nrows, <const double*> parts.acc + first * p.Ev,
                          <const double*> parts.m + first, parts.l + first, nparts,
                          stride, <double*> parts.row)


cdef FewScratch carve_few(const Plan* p, Py_ssize_t G, Py_ssize_t heads,
                          char* base) noexcept nogil:
    cdef FewScratch s
    few_scratch(p, G, heads, base, &s)
    return s


cdef object longest_first(const Plan* p, Py_ssize_t n_groups, Py_ssize_t GH):
    """The decode path's groups of GH slices in the order their items are handed out:
    the most keys first (ties in order), where the sequences' lengths differ; else
    None (in order). A long sequence then does not start last and run on alone after
    the others are done (longest first). The order of the work changes no sum."""
    cdef Py_ssize_t gi
    if p.kv_lengths == NULL:
        return None
    for gi in range(1, n_groups):       # (no allocation on the common, even batch)
        if keys_of(p, gi * GH) != keys_of(p, 0):
            break
    else:
        return None
    keys = np.empty(n_groups, np.intp)
    cdef Py_ssize_t[::1] k = keys
    for gi in range(n_groups):
        k[gi] = keys_of(p, gi * GH)
    return np.argsort(-keys, kind="stable")


cdef int _attention_decode(const Plan* p, int num_threads) except -1:
    """The decode path: one work item per (grouped-query group of G slices, piece of
    the keys), or per (`heads` such groups, piece) where the K/V heads lie side by
    side (decode_heads), the pieces' partial results merged in key order; the groups
    with the most keys first (longest_first). The pieces depend on the shapes only;
    `heads` on the threads too, but not the sums."""
    cdef Py_ssize_t G = decode_group(p)
    cdef Py_ssize_t chunk = decode_chunk(p, p.n_slices // G)
    cdef Py_ssize_t n_split = pieces_of(p, chunk)
    cdef Py_ssize_t heads = decode_heads(p, G, n_split, num_threads)
    cdef Py_ssize_t GH = G * heads          # slices per item
    cdef Py_ssize_t R = GH * p.Lq           # query rows per item
    cdef Py_ssize_t n_groups = p.n_slices // GH
    cdef Py_ssize_t n_items = n_groups * n_split
    cdef int nt = team(num_threads, n_items)
    cdef FewScratch s
    cdef Parts parts
    cdef Py_ssize_t per = per_thread(few_scratch(p, G, heads, NULL, &s))
    cdef Py_ssize_t shared = parts_scratch(p, n_items * R, NULL, &parts)
    cdef unsigned char[::1] work = _scratch(nt * per + shared, nt)
    cdef char* base = <char*> aligned(&work[0])
    parts_scratch(p, n_items * R, base + nt * per, &parts)
    order = longest_first(p, n_groups, GH)
    cdef const Py_ssize_t[::1] ranked = order
    cdef const Py_ssize_t* first = &ranked[0] if order is not None else NULL
    cdef Interrupt stop
    cdef Py_ssize_t w, gi, piece, kend, g, rows, at
    start_interrupt_checks(&stop)
    with nogil, parallel(num_threads=nt):
        s = carve_few(p, G, heads, base + omp_get_thread_num() * per)
        for w in prange(n_items, schedule="dynamic"):
            if interrupted(&stop):
                continue
            gi = w // n_split if first == NULL else first[w // n_split]
            piece = w % n_split
            at = (gi * n_split + piece) * R     # the item's part, in key order
            kend = (piece + 1) * chunk if (piece + 1) * chunk < p.Lk else p.Lk
            if p.dtype == FLOAT32:
                attend_few(p, gi * GH, G, heads, piece * chunk, kend,
                           <float*> parts.acc + at * p.Ev, <float*> parts.m + at,
                           parts.l + at, &s, &stop)
            else:
                attend_few(p, gi * GH, G, heads, piece * chunk, kend,
                           <double*> parts.acc + at * p.Ev, <double*> parts.m + at,
                           parts.l + at, &s, &stop)
    if stop.stop:
        return raise_interrupt()
    # serial: the merge is tiny, and a second parallel region would make every call
    # wait once more for all its threads (costly when the cores are oversubscribed)
    with nogil:
        for gi in range(n_groups):
            for g in range(GH):
                rows = rows_held(p, gi * GH + g, 0, p.Lq)
                if rows > 0:        # row 0 of slice gi * GH + g, part 0
                    merge_item(p, gi * GH + g, 0, rows, &parts,
                               gi * n_split * R + g * p.Lq, n_split, R)
    return 0


# ------------------------------------------------------------ the kernels, exposed

cdef ScoresScratch carve_scores(const Plan* p, char* base) noexcept nogil:
    cdef ScoresScratch s
    scores_scratch(p, base, &s)
    return s


def scores(AttentionPlan plan, bint softmax, int num_threads):
    """out (Lq, Lk) of every slice = scale * q @ k^T + bias, entries that may not be
    attended -inf; then, with `softmax`, the softmax of each row."""
    cdef const Plan* p = &plan.plan
    if p.n_slices * p.Lq == 0:
        return
    cdef Py_ssize_t tiles = (p.Lq + QUERY_TILE - 1) // QUERY_TILE
    cdef Py_ssize_t n_items = p.n_slices * tiles
    cdef int nt = team(num_threads, n_items)
    cdef ScoresScratch s
    cdef Py_ssize_t per = per_thread(scores_scratch(p, NULL, &s))
    cdef unsigned char[::1] work = _scratch(nt * per, nt)
    cdef char* base = <char*> aligned(&work[0])
    cdef Interrupt stop
    cdef Py_ssize_t w, n, i0, nrows
    cdef char* out
    start_interrupt_checks(&stop)
    with nogil, parallel(num_threads=nt):
        s = carve_scores(p, base + omp_get_thread_num() * per)
        for w in prange(n_items, schedule="dynamic"):
            if interrupted(&stop):
                continue
            n = w // tiles
            i0 = (w % tiles) * QUERY_TILE
            nrows = p.Lq - i0 if p.Lq - i0 < QUERY_TILE else QUERY_TILE
            out = operand_at(p, &p.out, n, i0)
            if p.dtype == FLOAT32:
                _tiles.score_tile(p, n, i0, nrows, softmax, <float*> out, &s)
            else:
                _tiles.score_tile(p, n, i0, nrows, softmax, <double*> out, &s)
    if stop.stop:
        raise_interrupt()


def weighted_sum(AttentionPlan plan, int num_threads):
    """out (Lq, Ev) of every slice = p @ v, with p (Lq, Lk) given as the plan's q
    (E = Lk) and v (Lk, Ev)."""
    cdef const Plan* p = &plan.plan
    if p.n_slices * p.Lq * p.Ev == 0:
        return
    cdef Py_ssize_t tiles = (p.Lq + QUERY_TILE - 1) // QUERY_TILE
    cdef Py_ssize_t n_items = p.n_slices * tiles
    cdef int nt = team(num_threads, n_items)
    cdef Interrupt stop
    cdef Py_ssize_t w, n, i0, nrows
    start_interrupt_checks(&stop)
    with nogil, parallel(num_threads=nt):
        for w in prange(n_items, schedule="static"):
            if interrupted(&stop):
                continue
            n = w // tiles
            i0 = (w % tiles) * QUERY_TILE
            nrows = p.Lq - i0 if p.Lq - i0 < QUERY_TILE else QUERY_TILE
            if p.dtype == FLOAT32:
                weigh_rows(p, n, i0, nrows, <float*> operand_at(p, &p.out, n, i0))
            else:
                weigh_rows(p, n, i0, nrows, <double*> operand_at(p, &p.out, n, i0))
    if stop.stop:
        raise_interrupt()


cdef inline void weigh_rows(const Plan* p, Py_ssize_t n, Py_ssize_t i0, Py_ssize_t nrows,
                            real* out) noexcept nogil:
    """out (rows i0..i0+nrows of slice n) = p @ v: one micro-GEMM."""
    gemm(<const real*> operand_at(p, &p.q, n, i0), p.q.row_stride, 1,
         <const real*> operand_at(p, &p.v, n, 0), p.v.row_stride, out, p.out.row_stride,
         nrows, p.Ev, p.Lk, False)


cdef enum:
    NARROW_CHUNK = 1 << 15      # elements per work item of narrow()


def narrow(src, dst, int num_threads, bint units=False):
    """dst = src rounded to dst's dtype, bfloat16 or float16, to nearest even, bit for
    bit as NumPy's (ml_dtypes') ``astype`` rounds: src float32 and dst C-contiguous, of
    one size. A 16-bit result leaves the drivers through here (NumPy's own float16
    cast runs about 1.4 ns an element, on one thread). With ``units`` (only where the
    CPU has AVX512-BF16 and this module its kernels) bfloat16 is rounded as the tiles
    on the bfloat16 units round their output rows (fa_bf16_narrow_row)."""
    cdef DType kind = dtype_code(dst.dtype)
    cdef Py_buffer s, d
    if not ((kind == BFLOAT16 or kind == FLOAT16) and src.dtype.char == "f"):
        raise ValueError("internal error: narrow takes float32 to bfloat16 or float16")
    PyObject_GetBuffer(src, &s, PyBUF_C_CONTIGUOUS)
    try:
        PyObject_GetBuffer(dst, &d, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE)
        try:
            if s.len // 4 != d.len // 2:
                raise ValueError("internal error: narrow buffers do not agree")
            with nogil:
                _narrow(<const float*> s.buf, s.len // 4, <uint16_t*> d.buf, kind,
                        num_threads, units and FA_HAVE_AVX512_BF16)
        finally:
            PyBuffer_Release(&d)
    finally:
        PyBuffer_Release(&s)


cdef void _narrow(const float* src, Py_ssize_t n, uint16_t* dst, DType kind,
                  int num_threads, bint units) noexcept nogil:
    cdef Py_ssize_t items = (n + NARROW_CHUNK - 1) // NARROW_CHUNK, w, lo
    if items <= 1 or num_threads <= 1:         # (no parallel region to start)
        _tiles.narrow_16(src, n, dst, kind, units)
        return
    with parallel(num_threads=team(num_threads, items)):
        for w in prange(items, schedule="static"):
            lo = w * NARROW_CHUNK
            _tiles.narrow_16(src + lo, n - lo if n - lo < NARROW_CHUNK else NARROW_CHUNK,
                             dst + lo, kind, units)



def softmax(const real[::1] x, real[::1] out, Py_ssize_t rows, Py_ssize_t n,
            int num_threads):
    """out (rows, n) = softmax of each row of x (rows, n); x may alias out."""
    if not (x.shape[0] == out.shape[0] == rows * n):
        raise ValueError("internal error: softmax buffers do not agree")
    if rows * n == 0:
        return
    cdef int nt = team(num_threads, rows)
    cdef const real* xp = &x[0]
    cdef real* op = &out[0]
    cdef Py_ssize_t r
    with nogil, parallel(num_threads=nt):
        for r in prange(rows, schedule="static"):
            softmax_row(xp + r * n, op + r * n, n, -INFINITY)


# ------------------------------------------------------- the 8-bit codes of a cache

cdef enum:
    QUANTIZE_ROWS = 256         # rows per work item of quantize_codes()

cdef extern from *:
    """
    #include <float.h>
    #include <string.h>
    #ifndef FLT_TRUE_MIN
    #define FLT_TRUE_MIN 1.40129846e-45F
    #endif
    static inline unsigned long long fa_bits_of(double x) {
        unsigned long long u;
        memcpy(&u, &x, sizeof u);
        return u;
    }
    """
    float FLT_TRUE_MIN
    unsigned long long fa_bits_of(double x) noexcept nogil


cdef struct CodeFormat:
    double limit        # the largest magnitude of a code
    int kind            # INT8, FLOAT8_E4M3 or FLOAT8_E5M2
    int mbits           # float8: mantissa bits ...
    int emin            # ... the smallest normal exponent ...
    int bias            # ... and the exponent's bias
    double normal       # 2^emin, the smallest normal magnitude
    double steps        # 2^(mbits - emin): subnormal steps per unit


def quantize_codes(const real[:, ::1] x, uint8_t[:, ::1] codes, float[::1] scale,
                   str name, int num_threads):
    """codes (rows, D) as bytes, scale (rows,) = each row of x (rows, D) as 8-bit codes
    (`name`: "int8", "float8_e4m3fn" or "float8_e5m2") and its float32 scale, as
    ``fastattn.quantize_kv`` says, bit for bit: the row's largest magnitude over the
    codes' largest (127, 448 or 57344), rounded to float32 (1 for an all-zero row; the
    smallest float32 above 0 where that rounds to 0), each element divided by it in
    float64, clipped to the codes' range and rounded to the nearest code, ties to
    even. False (codes and scale then unspecified) where a row holds inf or NaN."""
    cdef Py_ssize_t rows = x.shape[0], D = x.shape[1], items, w, r, hi
    cdef CodeFormat f
    if name == "int8":
        f.kind, f.limit, f.mbits, f.emin, f.bias = INT8, 127.0, 0, 0, 0
    elif name == "float8_e4m3fn":
        f.kind, f.limit, f.mbits, f.emin, f.bias = FLOAT8_E4M3, 448.0, 3, -6, 7
    elif name == "float8_e5m2":
        f.kind, f.limit, f.mbits, f.emin, f.bias = FLOAT8_E5M2, 57344.0, 2, -14, 15
    else:
        raise ValueError("internal error: quantize_codes takes int8 or float8 codes")
    f.normal, f.steps = ldexp(1.0, f.emin), ldexp(1.0, f.mbits - f.emin)
    if codes.shape[0] != rows or codes.shape[1] != D or scale.shape[0] != rows:
        raise ValueError("internal error: quantize_codes buffers do not agree")
    cdef int bad = 0
    if rows == 0:
        return True
    if D == 0:
        scale[:] = 1
        return True
    cdef const real* xp = &x[0, 0]
    cdef uint8_t* cp = &codes[0, 0]
    cdef float* sp = &scale[0]
    items = (rows + QUANTIZE_ROWS - 1) // QUANTIZE_ROWS
    with nogil, parallel(num_threads=team(num_threads, items)):
        for w in prange(items, schedule="static"):
            hi = rows if rows - w * QUANTIZE_ROWS < QUANTIZE_ROWS else (
                w * QUANTIZE_ROWS + QUANTIZE_ROWS)
            for r in range(w * QUANTIZE_ROWS, hi):
                bad += not quantize_row(xp + r * D, D, cp + r * D, sp + r, &f)
    return bad == 0


cdef inline bint quantize_row(const real* x, Py_ssize_t n, uint8_t* codes, float* scale,
                              const CodeFormat* f) noexcept nogil:
    """One row of quantize_codes; False where it holds inf or NaN."""
    cdef double top = 0, a, y, s, limit = f.limit
    cdef bint finite = True
    cdef float sc
    cdef Py_ssize_t i
    for i in range(n):
        a = fabs(<double> x[i])
        finite = finite & (a <= DBL_MAX)
        top = a if a > top else top
    if not finite:
        return False
    sc = <float> (top / limit) if top > 0 else 1.0
    if sc == 0:
        sc = FLT_TRUE_MIN
    s = sc
    for i in range(n):
        y = <double> x[i] / s
        y = limit if y > limit else (-limit if y < -limit else y)
        if f.kind == INT8:
            codes[i] = <uint8_t> <int8_t> nearbyint(y)
        else:
            codes[i] = float8_code(y, f)
    scale[0] = sc
    return True


cdef inline uint8_t float8_code(double y, const CodeFormat* f) noexcept nogil:
    """The float8 code nearest y (|y| within the format's range), ties to even: below
    the smallest normal 2^emin a multiple of the subnormal step (whose count is the
    code's magnitude bits), above it y's float64 bits rounded to mbits mantissa bits
    (a carry moves into the exponent) and re-biased."""
    cdef unsigned long long u = fa_bits_of(y), low, half
    cdef uint8_t sign = <uint8_t> ((u >> 56) & 0x80)
    cdef double a = fabs(y)
    cdef int drop = 52 - f.mbits
    if a < f.normal:
        return sign | <uint8_t> nearbyint(a * f.steps)
    u &= 0x7FFFFFFFFFFFFFFFULL
    half = 1ULL << (drop - 1)
    low = u & ((1ULL << drop) - 1)
    u >>= drop                              # exponent and mantissa bits, truncated
    u += (low > half) | ((low == half) & (u & 1))   # (no branch: a coin toss per code)
    return sign | <uint8_t> (u - (<unsigned long long> (1023 - f.bias) << f.mbits))
