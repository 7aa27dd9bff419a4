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
from libc.math cimport INFINITY
from libc.stdint cimport uint16_t

from fastattn._scratch import scratch

from fastattn cimport _tiles
from fastattn._gemm cimport gemm, real
from fastattn._openmp cimport omp_get_thread_num
from fastattn._parallel cimport (Interrupt, aligned, interrupted, raise_interrupt,
                                 start_interrupt_checks)
from fastattn._plan cimport (BFLOAT16, DOT_FMA, FLOAT16, FLOAT32, KEY_BLOCK, NO_LIMIT,
                             QUERY_TILE, AttentionPlan, DType, Plan, dtype_code, rows_held)

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
    SPLIT_ITEMS = 32            # split the keys until there are this many items
    SPLIT_MIN_KEYS = 256        # ... but never into pieces of fewer keys than this
    TILE_SPLIT_MIN_KEYS = 1024  # ... (the tiled path: a piece's fixed costs are larger)

#: The constants of the path choice, for the Python side and the tests.
cdef extern from "fa_bf16.h":
    const bint FA_HAVE_AVX512_BF16

#: This module has the AVX512-BF16 scores kernel (src/fa_bf16.h): compiled into the
#: avx512 level's module by compilers that know the instructions.
HAS_AVX512_BF16 = bool(FA_HAVE_AVX512_BF16)

cdef extern from "fa_amx.h":
    const bint FA_HAVE_AMX_BF16
    const bint FA_AMX_EMULATED

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
        return ("decode", G, chunk, n_groups * ((p.Lk + chunk - 1) // chunk if p.Lk else 1))
    tiles = p.n_slices * ((p.Lq + QUERY_TILE - 1) // QUERY_TILE)
    chunk = tiled_chunk(p, tiles)
    return ("tiled", chunk, tiles * ((p.Lk + chunk - 1) // chunk if p.Lk else 1))


def forward_kernel(AttentionPlan plan):
    """What computes the fused forward's products for this plan: "amx_bf16",
    "avx512_bf16" or "fma", once its operands have been checked for the bfloat16 units
    (_tiles.bf16_units_safe: a plan whose operands do not suit them runs "fma")."""
    cdef const Plan* p = &plan.plan
    cdef Py_ssize_t n
    if p.dot_kernel != DOT_FMA and not use_decode_path(p):
        if not _tiles.bf16_scale_safe(p.scale):
            return "fma"
        for n in range(p.n_slices):
            if not _tiles.bf16_units_safe(p, n):
                return "fma"
    return plan.dot_kernel if not use_decode_path(p) else "fma"


def _scratch(Py_ssize_t threads, Py_ssize_t per_thread, dtype, Py_ssize_t shared=0):
    """Room for `threads` scratch areas of `per_thread` elements, then `shared` more,
    plus alignment (kept between calls: fastattn._scratch)."""
    return scratch(max(threads * per_thread + shared, 1) + 64, dtype)


cdef inline Py_ssize_t parts_size(Py_ssize_t rows, Py_ssize_t Ev) noexcept nogil:
    """Elements of scratch for the partial results of a split over `rows` rows (all
    items): acc (rows, Ev), m (rows), then l (rows, in double: one or two elements
    each), aligned (see parts_l)."""
    return rows * (Ev + 1) + 2 * rows + 32


cdef inline double* parts_l(real* m, Py_ssize_t rows) noexcept nogil:
    """Where l starts, after m (rows) in the scratch laid out by parts_size."""
    return <double*> aligned(m + rows)


cdef inline Py_ssize_t round_to_align(Py_ssize_t n) noexcept nogil:
    return (n + 15) // 16 * 16


# ------------------------------------------------------------------- the fused pass

def attention(AttentionPlan plan, int num_threads):
    """out (and lse, when the plan has one) of every slice of the plan."""
    cdef const Plan* p = &plan.plan
    if p.n_slices * p.Lq == 0:
        return
    if p.dtype == FLOAT32:
        if use_decode_path(p):
            _attention_decode(p, num_threads, <float*> NULL)
        else:
            _attention_tiled(p, num_threads, <float*> NULL)
    else:
        if use_decode_path(p):
            _attention_decode(p, num_threads, <double*> NULL)
        else:
            _attention_tiled(p, num_threads, <double*> NULL)


cdef inline Py_ssize_t tile_row(const Plan* p, Py_ssize_t item,
                                Py_ssize_t tiles) noexcept nogil:
    """The first query row of the tile of work item `item` (`tiles` per slice): the
    last tiles first, since under a causal rule they are the longest and handing out
    the long items first evens out the threads' finish; under a window (tiles of
    equal cost) in order, so that each tile's one new key block is its last, fetched
    while the others are computed (attend_tile)."""
    if p.window_left < NO_LIMIT:
        return (item % tiles) * QUERY_TILE
    return (tiles - 1 - item % tiles) * QUERY_TILE


cdef int _attention_tiled(const Plan* given, int num_threads, real* like) except -1:
    # Every query tile checks each key block's value rows for inf and NaN (they need
    # the exact path). With several tiles per slice, one check of all the values first
    # (each slice's in parallel) spares the tiles theirs when none has any. The same
    # pass checks that bfloat16 operands suit the bfloat16 units (_tiles.bf16_units_safe),
    # else the call runs the float32 path.
    cdef Plan plan = given[0]
    cdef const Plan* p = &plan
    cdef Py_ssize_t tiles = (p.Lq + QUERY_TILE - 1) // QUERY_TILE
    cdef Py_ssize_t n_tiles = p.n_slices * tiles
    cdef Py_ssize_t chunk = tiled_chunk(p, n_tiles)
    cdef Py_ssize_t n_split = (p.Lk + chunk - 1) // chunk if p.Lk > 0 else 1
    cdef Py_ssize_t n_items = n_tiles * n_split
    cdef int nt = <int> min(num_threads, n_items)
    cdef Py_ssize_t per = _tiles.attend_work_size(p)
    dtype = np.float32 if real is float else np.float64
    # a split: the partial results of every (tile, piece), QUERY_TILE rows each,
    # after the threads' scratch
    cdef Py_ssize_t R = QUERY_TILE if n_split > 1 else 0
    cdef real[::1] work = _scratch(nt, per, dtype,
                                   parts_size(n_items * R, p.Ev) if R else 0)
    cdef real* base = <real*> aligned(&work[0])
    cdef real* acc = base + nt * per
    cdef real* m = acc + n_items * R * p.Ev
    cdef double* l = parts_l(m, n_items * R)
    cdef Interrupt stop
    cdef Py_ssize_t w, n, i0, nrows, piece, item, first
    cdef real* mine = NULL
    cdef unsigned char[::1] finite, safe
    cdef bint bf16_units = p.dot_kernel != DOT_FMA
    if (tiles > 1 or bf16_units) and p.n_slices > 0:
        finite = np.zeros(p.n_slices, np.uint8)
        safe = np.ones(p.n_slices, np.uint8)
        with nogil, parallel(num_threads=<int> min(num_threads, p.n_slices)):
            for n in prange(p.n_slices, schedule="static"):
                if tiles > 1:
                    finite[n] = _tiles.values_finite(p, n, like)
                if bf16_units:
                    safe[n] = _tiles.bf16_units_safe(p, n)
        plan.values_finite = tiles > 1 and all(finite)
        if bf16_units and not (all(safe) and _tiles.bf16_scale_safe(p.scale)):
            plan.dot_kernel = DOT_FMA
    start_interrupt_checks(&stop)
    with nogil, parallel(num_threads=nt):
        mine = base + omp_get_thread_num() * per
        for w in prange(n_items, schedule="dynamic"):
            if interrupted(&stop):
                continue
            # the pieces of the keys in order, each over every tile (tiles reading the
            # same keys at about the same time: a (1,1,256,16384,128) call split in 8
            # pieces ran 0.83x as fast tile by tile on 2 Zen 5 threads, 0.97x so)
            item = w % n_tiles
            piece = w // n_tiles
            n = item // tiles
            i0 = tile_row(p, item, tiles)
            nrows = rows_held(p, n, i0, p.Lq - i0 if p.Lq - i0 < QUERY_TILE
                              else QUERY_TILE)
            if nrows <= 0:          # (a packed batch: past its sequence's rows)
                continue
            if n_split == 1:
                _tiles.attend_tile(p, n, i0, nrows, mine, &stop)
            else:
                _tiles.attend_keys(p, n, i0, nrows, mine, piece * chunk,
                                   min((piece + 1) * chunk, p.Lk),
                                   acc + (item * n_split + piece) * R * p.Ev,
                                   m + (item * n_split + piece) * R,
                                   l + (item * n_split + piece) * R, &stop)
    if stop.stop:
        return raise_interrupt()
    if n_split > 1:
        # serial: the merge is small (fewer than SPLIT_ITEMS tiles), as the decode
        # path's
        with nogil:
            for item in range(n_tiles):
                i0 = tile_row(p, item, tiles)
                first = item * n_split * R
                nrows = rows_held(p, item // tiles, i0, p.Lq - i0 if p.Lq - i0 < QUERY_TILE
                                  else QUERY_TILE)
                if nrows > 0:
                    _tiles.merge_rows(p, item // tiles, i0, nrows, acc + first * p.Ev,
                                      m + first, l + first, n_split, R)
    return 0


cdef int _attention_decode(const Plan* p, int num_threads, real* like) except -1:
    cdef Py_ssize_t G = decode_group(p)
    cdef Py_ssize_t R = G * p.Lq
    cdef Py_ssize_t n_groups = p.n_slices // G
    cdef Py_ssize_t chunk = decode_chunk(p, n_groups)
    cdef Py_ssize_t n_split = (p.Lk + chunk - 1) // chunk if p.Lk > 0 else 1
    cdef Py_ssize_t n_items = n_groups * n_split
    cdef int nt = <int> min(num_threads, n_items)
    cdef Py_ssize_t per = round_to_align(_tiles.few_work_size(p, G))
    dtype = np.float32 if real is float else np.float64
    # the partial results of every item, after the threads' scratch: acc (R, Ev),
    # m (R), l (R)
    cdef real[::1] work = _scratch(nt, per, dtype, parts_size(n_items * R, p.Ev))
    cdef real* base = <real*> aligned(&work[0])
    cdef real* acc = base + nt * per
    cdef real* m = acc + n_items * R * p.Ev
    cdef double* l = parts_l(m, n_items * R)
    cdef Interrupt stop
    cdef Py_ssize_t w, gi, piece, kend, g, first, rows
    cdef real* mine = NULL
    start_interrupt_checks(&stop)
    with nogil, parallel(num_threads=nt):
        mine = base + omp_get_thread_num() * per
        for w in prange(n_items, schedule="dynamic"):
            if interrupted(&stop):
                continue
            gi = w // n_split
            piece = w % n_split
            kend = (piece + 1) * chunk if (piece + 1) * chunk < p.Lk else p.Lk
            _tiles.attend_few(p, gi * G, G, piece * chunk, kend, acc + w * R * p.Ev,
                              m + w * R, l + w * R, mine, &stop)
    if stop.stop:
        return raise_interrupt()
    # serial: the merge is tiny, and a second parallel region would make every call
    # wait once more for all its threads (costly when the cores are oversubscribed)
    with nogil:
        for gi in range(n_groups):
            for g in range(G):
                first = gi * n_split * R + g * p.Lq        # row 0 of slice n, part 0
                rows = rows_held(p, gi * G + g, 0, p.Lq)
                if rows > 0:
                    _tiles.merge_rows(p, gi * G + g, 0, rows, acc + first * p.Ev,
                                      m + first, l + first, n_split, R)
    return 0


# ------------------------------------------------------------ the kernels, exposed

def scores(AttentionPlan plan, bint softmax, int num_threads):
    """out (Lq, Lk) of every slice = scale * q @ k^T + bias, entries that may not be
    attended -inf; then, with `softmax`, the softmax of each row."""
    cdef const Plan* p = &plan.plan
    if p.n_slices * p.Lq == 0:
        return
    if p.dtype == FLOAT32:
        _scores(p, softmax, num_threads, <float*> NULL)
    else:
        _scores(p, softmax, num_threads, <double*> NULL)


cdef int _scores(const Plan* p, bint softmax, int num_threads, real* like) except -1:
    cdef Py_ssize_t tiles = (p.Lq + QUERY_TILE - 1) // QUERY_TILE
    cdef Py_ssize_t n_items = p.n_slices * tiles
    cdef int nt = <int> min(num_threads, n_items)
    cdef Py_ssize_t per = _tiles.scores_work_size(p)
    cdef real[::1] work = _scratch(nt, per, np.float32 if real is float else np.float64)
    cdef real* base = <real*> aligned(&work[0])
    cdef Interrupt stop
    cdef Py_ssize_t w, n, i0, nrows
    cdef real* mine = NULL
    start_interrupt_checks(&stop)
    with nogil, parallel(num_threads=nt):
        mine = base + omp_get_thread_num() * per
        for w in prange(n_items, schedule="dynamic"):
            if interrupted(&stop):
                continue
            n = w // tiles
            i0 = (w % tiles) * QUERY_TILE
            nrows = p.Lq - i0 if p.Lq - i0 < QUERY_TILE else QUERY_TILE
            _tiles.score_tile(p, n, i0, nrows, softmax, mine)
    if stop.stop:
        return raise_interrupt()
    return 0


def weighted_sum(AttentionPlan plan, int num_threads):
    """out (Lq, Ev) of every slice = p @ v, with p (Lq, Lk) given as the plan's q
    (E = Lk) and v (Lk, Ev)."""
    cdef const Plan* p = &plan.plan
    if p.n_slices * p.Lq * p.Ev == 0:
        return
    if p.dtype == FLOAT32:
        _weighted_sum(p, num_threads, <float*> NULL)
    else:
        _weighted_sum(p, num_threads, <double*> NULL)


cdef int _weighted_sum(const Plan* p, int num_threads, real* like) except -1:
    cdef Py_ssize_t tiles = (p.Lq + QUERY_TILE - 1) // QUERY_TILE
    cdef Py_ssize_t n_items = p.n_slices * tiles
    cdef int nt = <int> min(num_threads, n_items)
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
            gemm(_tiles.q_rows(p, n, i0, like), p.q.row_stride, 1,
                 _tiles.v_rows(p, n, like), p.v.row_stride,
                 _tiles.out_rows(p, n, i0, like), p.out.row_stride,
                 nrows, p.Ev, p.Lk, False)
    if stop.stop:
        return raise_interrupt()
    return 0


cdef enum:
    NARROW_CHUNK = 1 << 15      # elements per work item of narrow()


def narrow(src, dst, int num_threads):
    """dst = src rounded to dst's dtype, bfloat16 or float16, to nearest even, bit for
    bit as NumPy's (ml_dtypes') ``astype`` rounds: src float32 and dst C-contiguous, of
    one size. A 16-bit result leaves the drivers through here (NumPy's own float16
    cast runs about 1.4 ns an element, on one thread)."""
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
                        num_threads)
        finally:
            PyBuffer_Release(&d)
    finally:
        PyBuffer_Release(&s)


cdef void _narrow(const float* src, Py_ssize_t n, uint16_t* dst, DType kind,
                  int num_threads) noexcept nogil:
    cdef Py_ssize_t items = (n + NARROW_CHUNK - 1) // NARROW_CHUNK, w, lo
    if items <= 1 or num_threads <= 1:         # (no parallel region to start)
        _tiles.fa_narrow_row(src, n, dst, kind)
        return
    with parallel(num_threads=<int> min(num_threads, items)):
        for w in prange(items, schedule="static"):
            lo = w * NARROW_CHUNK
            _tiles.fa_narrow_row(src + lo,
                                 n - lo if n - lo < NARROW_CHUNK else NARROW_CHUNK,
                                 dst + lo, kind)


def softmax(const real[::1] x, real[::1] out, Py_ssize_t rows, Py_ssize_t n,
            int num_threads):
    """out (rows, n) = softmax of each row of x (rows, n); x may alias out."""
    if not (x.shape[0] == out.shape[0] == rows * n):
        raise ValueError("internal error: softmax buffers do not agree")
    if rows * n == 0:
        return
    cdef int nt = <int> min(num_threads, rows)
    cdef const real* xp = &x[0]
    cdef real* op = &out[0]
    cdef Py_ssize_t r
    with nogil, parallel(num_threads=nt):
        for r in prange(rows, schedule="static"):
            _tiles.softmax_row(xp + r * n, op + r * n, n, -INFINITY)
