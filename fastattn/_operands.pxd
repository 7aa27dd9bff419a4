# Where a work item finds its operands, and how its scratch is laid out.
#
# An operand is read through these accessors only: `operand_at` finds a slice's row
# (batch strides, grouped-query heads, a packed batch's row offsets: _plan.slice_offset)
# and `row_of` steps along it. Keys and values (and the queries, through the same
# calls) are read as `Rows`: a slice's rows wherever they live (in one strided run,
# or in the blocks of a paged cache) and however they are stored (the computation
# dtype, 16 bits, or 8-bit codes with a scale per row). `rows_as_real` hands the
# arithmetic a block of them in the computation dtype, read in place when they are
# stored so in one run and widened (gathered, dequantized) into scratch otherwise;
# `rows_stored` hands the bfloat16 units their stored words, `value_at` one value
# exactly. A new way of storing or addressing K and V is a case here, not in the
# loops.
#
# A work item's scratch is described once, term by term, by a function that fills a
# struct of pointers from a Carve: measuring (base NULL) gives the bytes a thread needs,
# carving (base set) gives the pointers, from the same lines.

from libc.math cimport INFINITY, isfinite, NAN
from libc.string cimport memcpy

from fastattn._csrc cimport fa_widen, fa_widen_code, fa_widen_codes, fa_widen_rows
from fastattn._gemm cimport real
from fastattn._plan cimport (BFLOAT16, FLOAT16, FLOAT32, FLOAT64, DType, Operand, Plan,
                             element_size, is_code, queries_of, slice_offset)


# ------------------------------------------------------------------------ operands

cdef inline char* operand_at(const Plan* p, const Operand* a, Py_ssize_t n,
                             Py_ssize_t r0) noexcept nogil:
    """Row r0 of slice n of operand a, whatever its dtype; NULL when a is absent (or
    paged: its rows are found through `Rows`)."""
    if a.data == NULL:
        return NULL
    return a.data + (slice_offset(p, a, n) + r0 * a.row_stride) * element_size(a.dtype)


cdef inline const char* row_of(const Operand* a, const char* rows,
                               Py_ssize_t j) noexcept nogil:
    """Row j of a, counted from `rows` (a pointer given by operand_at)."""
    return rows + j * a.row_stride * element_size(a.dtype)


cdef inline bint stored_in_16_bits(const Operand* a) noexcept nogil:
    return a.dtype == BFLOAT16 or a.dtype == FLOAT16


cdef struct Rows:
    # the rows of one slice of an operand (row j from 0), as the loops read them
    const char* data        # row 0 (paged: the slice's place inside a block)
    DType dtype
    Py_ssize_t row_bytes    # from one row to the next inside a run
    const Py_ssize_t* pages # paged: the sequence's block table entries; NULL: one run
    Py_ssize_t page_rows    # rows per block
    Py_ssize_t page_bytes   # from one block to the next
    const char* scale       # the float32 scales of 8-bit codes (NULL: none, 1)
    Py_ssize_t scale_row_bytes, scale_page_bytes


cdef inline Rows rows_of(const Plan* p, const Operand* a, const Operand* scale,
                         Py_ssize_t n) noexcept nogil:
    """The rows of slice n of operand a (with their scales, or NULL for none)."""
    cdef Rows r
    cdef Py_ssize_t esize = element_size(a.dtype)
    r.data = operand_at(p, a, n, 0)
    r.dtype = a.dtype
    r.row_bytes = a.row_stride * esize
    r.pages = NULL
    r.page_rows = 1
    r.page_bytes = 0
    r.scale = NULL
    r.scale_row_bytes = r.scale_page_bytes = 0
    if a.pages != NULL:
        r.pages = a.pages + (n // p.slices_per_sequence) * a.pages_stride
        r.page_rows = a.page_rows
        r.page_bytes = a.page_stride * esize
    if scale != NULL and scale.data != NULL:
        r.scale = operand_at(p, scale, n, 0)
        r.scale_row_bytes = scale.row_stride * 4
        r.scale_page_bytes = scale.page_stride * 4
    return r


cdef inline const char* row_at(const Rows* r, Py_ssize_t j) noexcept nogil:
    """Row j."""
    if r.pages == NULL:
        return r.data + j * r.row_bytes
    return (r.data + r.pages[j // r.page_rows] * r.page_bytes
            + (j % r.page_rows) * r.row_bytes)


cdef inline const float* scales_at(const Rows* r, Py_ssize_t j) noexcept nogil:
    """The scale of row j (and of the rest of its run, scale_step() apart); NULL
    without scales."""
    if r.scale == NULL:
        return NULL
    if r.pages == NULL:
        return <const float*> (r.scale + j * r.scale_row_bytes)
    return <const float*> (r.scale + r.pages[j // r.page_rows] * r.scale_page_bytes
                           + (j % r.page_rows) * r.scale_row_bytes)


cdef inline Py_ssize_t scale_step(const Rows* r) noexcept nogil:
    """Elements from one row's scale to the next inside a run."""
    return r.scale_row_bytes // 4


cdef inline Py_ssize_t run_from(const Rows* r, Py_ssize_t j,
                                Py_ssize_t end) noexcept nogil:
    """How many rows from row j (up to `end`) follow each other row_bytes apart: to
    the end of j's block when paged."""
    cdef Py_ssize_t last
    if r.pages == NULL:
        return end - j
    last = (j // r.page_rows + 1) * r.page_rows
    return (last if last < end else end) - j


cdef inline bint in_place(const Rows* r) noexcept nogil:
    """Are the rows one strided run without scales (a block of them is read where it
    lies)?"""
    return r.pages == NULL and r.scale == NULL


cdef inline bint read_in_place(const Rows* r, real like) noexcept nogil:
    """Are the rows one strided run of `real` values without scales (rows_as_real hands
    them out where they lie)?"""
    return in_place(r) and ((real is float and r.dtype == FLOAT32)
                            or (real is double and r.dtype == FLOAT64))


cdef inline bint runs_of_real(const Rows* r, real like) noexcept nogil:
    """Are the rows a paged cache of `real` values without scales (each run can be read
    where it lies, though a block of rows may span several)?"""
    return r.pages != NULL and r.scale == NULL and (
        (real is float and r.dtype == FLOAT32) or (real is double and r.dtype == FLOAT64))


cdef inline const real* rows_as_real(const Rows* r, Py_ssize_t j0, Py_ssize_t nrows,
                                     Py_ssize_t cols, real* buf,
                                     Py_ssize_t* rs) noexcept nogil:
    """Rows j0..j0+nrows (cols each) as `real`: in place (rs = their row stride in
    elements) when they are stored as `real` in one run, else widened, gathered and
    dequantized into buf (nrows x cols, rs = cols)."""
    cdef Py_ssize_t j, run, esize = element_size(r.dtype)
    if read_in_place(r, <real> 0):
        rs[0] = r.row_bytes // esize
        return <const real*> (r.data + j0 * r.row_bytes)
    rs[0] = cols
    j = j0
    while j < j0 + nrows:
        run = run_from(r, j, j0 + nrows)
        widen_run(r, j, run, cols, buf + (j - j0) * cols)
        j += run
    return buf


cdef inline void widen_run(const Rows* r, Py_ssize_t j, Py_ssize_t run,
                           Py_ssize_t cols, real* dst) noexcept nogil:
    """dst (run, cols) = rows j..j+run of one run, as `real`."""
    cdef const char* src = row_at(r, j)
    cdef Py_ssize_t esize = element_size(r.dtype), c, t
    if real is float:
        if r.dtype == BFLOAT16 or r.dtype == FLOAT16:
            fa_widen_rows(src, r.dtype, r.row_bytes // esize, run, cols, dst)
            return
        if is_code(r.dtype):
            fa_widen_codes(src, r.dtype, r.row_bytes, run, cols, scales_at(r, j),
                           scale_step(r), dst)
            return
    for c in range(run):
        memcpy(dst + c * cols, src + c * r.row_bytes, cols * sizeof(real))


cdef inline const char* rows_stored(const Rows* r, Py_ssize_t j0, Py_ssize_t nrows,
                                    Py_ssize_t cols, char* buf,
                                    Py_ssize_t* rs) noexcept nogil:
    """Rows j0..j0+nrows as stored (the bfloat16 units read their words): in place
    (rs = their row stride in elements) when they lie in one run, else gathered into
    buf (nrows x cols, rs = cols)."""
    cdef Py_ssize_t j, c, run, esize = element_size(r.dtype)
    if r.pages == NULL or run_from(r, j0, j0 + nrows) == nrows:
        rs[0] = r.row_bytes // esize
        return row_at(r, j0)
    rs[0] = cols
    for j in range(nrows):
        memcpy(buf + j * cols * esize, row_at(r, j0 + j), cols * esize)
    return buf


cdef inline double value_at(const Rows* r, Py_ssize_t j, Py_ssize_t t) noexcept nogil:
    """Element t of row j, exactly (dequantized: float(code) * scale)."""
    cdef const char* row = row_at(r, j)
    cdef const float* sc
    if is_code(r.dtype):
        sc = scales_at(r, j)
        return fa_widen_code(row, r.dtype, t) * (1.0 if sc == NULL else <double> sc[0])
    if r.dtype == BFLOAT16 or r.dtype == FLOAT16:
        return fa_widen(row, r.dtype, t)
    if r.dtype == FLOAT32:
        return (<const float*> row)[t]
    return (<const double*> row)[t]


cdef inline double element(const Operand* a, const char* rows,
                           Py_ssize_t index) noexcept nogil:
    """Element `index` (counted in elements from `rows`) of operand a, exactly."""
    if stored_in_16_bits(a):
        return fa_widen(rows, a.dtype, index)
    if a.dtype == FLOAT32:
        return (<const float*> rows)[index]
    return (<const double*> rows)[index]


cdef inline double per_slice(const Plan* p, const Operand* a, Py_ssize_t n,
                             double absent) noexcept nogil:
    """The value of a per-slice operand (ALiBi slopes, sinks) for slice n; `absent`
    when the plan has none."""
    if a.data == NULL:
        return absent
    return element(a, a.data, slice_offset(p, a, n))


cdef inline double sink_of(const Plan* p, Py_ssize_t n) noexcept nogil:
    """The sink logit of slice n (attention sinks), -inf when the plan has none."""
    return per_slice(p, &p.sinks, n, -INFINITY)


# ------------------------------------------------------------------------ scratch

cdef enum:
    SCRATCH_ALIGN = 64      # bytes: every area starts on a cache line


cdef struct Carve:
    char* base              # where the areas are cut from; NULL while measuring
    Py_ssize_t size         # bytes taken so far


cdef inline Carve carving(char* base) noexcept nogil:
    cdef Carve c
    c.base = base
    c.size = 0
    return c


cdef inline void* take(Carve* c, Py_ssize_t count, Py_ssize_t itemsize) noexcept nogil:
    """The next area of `count` items of `itemsize` bytes, on a cache line (NULL
    while measuring)."""
    cdef Py_ssize_t at = (c.size + SCRATCH_ALIGN - 1) // SCRATCH_ALIGN * SCRATCH_ALIGN
    c.size = at + count * itemsize
    return NULL if c.base == NULL else c.base + at
