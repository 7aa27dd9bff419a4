# Where a work item finds its operands, and how its scratch is laid out.
#
# An operand is read through these accessors only: `operand_at` finds a slice's row
# (batch strides, grouped-query heads, a packed batch's row offsets: _plan.slice_offset),
# `row_of` steps along it, and `rows_as_real` hands the arithmetic a block of rows in
# the computation dtype, read in place when it is stored so and widened into scratch
# when it is stored in 16 bits. A new way of storing or addressing K and V is a case
# here, not in the loops.
#
# A work item's scratch is described once, term by term, by a function that fills a
# struct of pointers from a Carve: measuring (base NULL) gives the bytes a thread needs,
# carving (base set) gives the pointers, from the same lines.

from libc.math cimport INFINITY, isfinite, NAN

from fastattn._csrc cimport fa_widen, fa_widen_rows
from fastattn._gemm cimport real
from fastattn._plan cimport (BFLOAT16, FLOAT16, FLOAT32, Operand, Plan, element_size,
                             queries_of, slice_offset)


# ------------------------------------------------------------------------ operands

cdef inline char* operand_at(const Plan* p, const Operand* a, Py_ssize_t n,
                             Py_ssize_t r0) noexcept nogil:
    """Row r0 of slice n of operand a, whatever its dtype; NULL when a is absent."""
    if a.data == NULL:
        return NULL
    return a.data + (slice_offset(p, a, n) + r0 * a.row_stride) * element_size(a.dtype)


cdef inline const char* row_of(const Operand* a, const char* rows,
                               Py_ssize_t j) noexcept nogil:
    """Row j of a, counted from `rows` (a pointer given by operand_at)."""
    return rows + j * a.row_stride * element_size(a.dtype)


cdef inline bint stored_in_16_bits(const Operand* a) noexcept nogil:
    return a.dtype == BFLOAT16 or a.dtype == FLOAT16


cdef inline const real* rows_as_real(const Operand* a, const char* rows,
                                     Py_ssize_t nrows, Py_ssize_t cols, real* buf,
                                     Py_ssize_t* rs) noexcept nogil:
    """nrows x cols of operand a from `rows` as `real`: in place (rs = its row stride)
    when a holds `real`, else widened into buf (nrows x cols, rs = cols)."""
    if real is float:
        if stored_in_16_bits(a):
            fa_widen_rows(rows, a.dtype, a.row_stride, nrows, cols, buf)
            rs[0] = cols
            return buf
    rs[0] = a.row_stride
    return <const real*> rows


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
