# The one matrix product of fastattn: every product of the kernels goes through gemm()
# below (scores Q·Kᵀ, the weighted sum P·V, the backward's five products and the
# public kernels.pxd functions).
#
#     C (M, N) (+)= A (M, K) · B (K, N)
#     C (M, N)  = c_scale ⊙ C + A · B       (each column j of C times c_scale[j]: the
#                                             online softmax's rescale, fused)
#
# It is written once for float and double; the register tile (MR x NR, from
# src/fa_microtile.h) is a property of the instruction set the including module is
# compiled for, so each per-instruction-set driver module gets its own implementation
# of the same interface. Nothing here allocates or knows about threads.

ctypedef fused real:
    float
    double

cdef extern from "fa_microtile.h":
    enum:
        FA_NR_F
        FA_MR_F
        FA_NR_D
        FA_MR_D
        FA_MICROTILE_MAX
    bint FA_HAVE_MICROTILE_F            # float32 tiles written out (AVX-512, AVX2)
    bint FA_HAVE_MICROTILE_D            # float64 tiles written out (AVX2)
    void fa_microtile_f32(const float* const* a, Py_ssize_t a_cs, const float* b,
                          Py_ssize_t b_rs, Py_ssize_t K, float* const* c, Py_ssize_t j0,
                          Py_ssize_t rows, Py_ssize_t mode,
                          const float* c_scale) noexcept nogil
    void fa_microtile_f64(const double* const* a, Py_ssize_t a_cs, const double* b,
                          Py_ssize_t b_rs, Py_ssize_t K, double* const* c,
                          Py_ssize_t j0, Py_ssize_t rows, Py_ssize_t mode,
                          const double* c_scale) noexcept nogil


cdef inline real scaled_plus(real c, real scale, real s) noexcept nogil:
    """scale * c + s, where scale 0 drops c (0 * inf would be NaN): the rescale of the
    online softmax, whose factor underflows to 0 when a row's maximum jumps."""
    return (c * scale if scale != 0 else 0) + s


cdef inline void microtile(const real* const* a, Py_ssize_t a_cs, const real* b,
                           Py_ssize_t b_rs, Py_ssize_t K, real* const* c, Py_ssize_t j0,
                           Py_ssize_t rows, Py_ssize_t mode,
                           const real* c_scale) noexcept nogil:
    """One register tile written out (fa_microtile.h), of float32 or float64: rows
    a[0..MR) of A (column stride a_cs) times columns j0.. of B into c[i] + j0, the
    first `rows` stored; mode 0: C = A B, 1: C += A B, 2: C = c_scale * C + A B."""
    if real is float:
        fa_microtile_f32(a, a_cs, b, b_rs, K, c, j0, rows, mode, c_scale)
    else:
        fa_microtile_f64(a, a_cs, b, b_rs, K, c, j0, rows, mode, c_scale)


cdef inline void gemm_columns(const real* a, Py_ssize_t a_rs, Py_ssize_t a_cs,
                              const real* b, Py_ssize_t b_rs, real* c, Py_ssize_t c_rs,
                              Py_ssize_t M, Py_ssize_t W, Py_ssize_t K,
                              bint accumulate, const real* c_scale) noexcept nogil:
    """C (M, W) (+)= A (M, K) @ B (K, W) by the plain loop, every sum over t in order:
    gemm()'s path for the columns past its last micro-tile and for one or two rows.
    With c_scale: C = c_scale * C + A @ B, each product summed on its own first."""
    cdef Py_ssize_t i, t, j
    cdef real s
    cdef real* c_out
    cdef const real* b_row
    for i in range(M):
        c_out = c + i * c_rs
        if c_scale != NULL:
            for j in range(W):
                s = 0
                for t in range(K):
                    s = s + a[i * a_rs + t * a_cs] * b[t * b_rs + j]
                c_out[j] = scaled_plus(c_out[j], c_scale[j], s)
            continue
        if not accumulate:
            for j in range(W):
                c_out[j] = 0
        for t in range(K):
            s = a[i * a_rs + t * a_cs]
            b_row = b + t * b_rs
            for j in range(W):
                c_out[j] = c_out[j] + s * b_row[j]


cdef inline void gemm(const real* a, Py_ssize_t a_rs, Py_ssize_t a_cs,
                      const real* b, Py_ssize_t b_rs, real* c, Py_ssize_t c_rs,
                      Py_ssize_t M, Py_ssize_t N, Py_ssize_t K,
                      bint accumulate, const real* c_scale=NULL) noexcept nogil:
    """C (M, N) (+)= A (M, K) @ B (K, N); with c_scale (N,) given (accumulate is then
    not read), C = c_scale * C + A @ B: column j of C times c_scale[j], a factor 0
    dropping it.

    A[i, t] = a[i * a_rs + t * a_cs] (any strides: a tile read as itself or as its
    transpose); B and C are row-major with row strides b_rs and c_rs. The columns are
    cut into micro-tiles of NR (the vector axis), the rows into micro-tiles of MR (one
    broadcast scalar of A each); the last row micro-tile re-reads row M - 1 in its
    unused places and does not store them, and the columns past the last whole
    micro-tile take a plain loop. Every sum runs over t in order, so the result depends
    only on the sizes. With c_scale the product is summed from zero in registers and
    then added to the scaled C (as a separate product and pass would, rounding for
    rounding), so that a long row's running sums still take one addition per block.
    """
    cdef Py_ssize_t NR = FA_NR_F if real is float else FA_NR_D
    cdef Py_ssize_t MR = FA_MR_F if real is float else FA_MR_D
    cdef real acc[FA_MICROTILE_MAX]
    cdef const real* a_row[FA_MICROTILE_MAX]
    cdef real* c_row[FA_MICROTILE_MAX]
    cdef Py_ssize_t n_main = N - N % NR
    cdef Py_ssize_t ib, i0, ii, x, jb, j, t, rows_here
    cdef const real* b_row
    cdef real* c_out
    cdef real s
    cdef const real* sc
    cdef Py_ssize_t m_tiled = M
    cdef bint written_out = FA_HAVE_MICROTILE_F if real is float else FA_HAVE_MICROTILE_D
    cdef Py_ssize_t mode = 2 if c_scale != NULL else 1 if accumulate else 0
    if M <= 0 or N <= 0:
        return
    if 0 < M % MR and (M % MR) * 3 <= MR and M < 2 * MR:
        # one or two rows left over of a few (a decoding query): the plain loop beats
        # a micro-tile that would compute the same row MR times; below a larger
        # product (a tile's 64 rows over 3-row micro-tiles) the micro-tile's few
        # repeated rows cost less than the plain loop's one chain per sum
        m_tiled = M - M % MR
        gemm_columns(a + m_tiled * a_rs, a_rs, a_cs, b, b_rs, c + m_tiled * c_rs, c_rs,
                     M - m_tiled, N, K, accumulate, c_scale)
    for ib in range((m_tiled + MR - 1) // MR):
        i0 = ib * MR
        rows_here = m_tiled - i0
        for ii in range(MR):
            x = i0 + ii if ii < rows_here else m_tiled - 1
            a_row[ii] = a + x * a_rs
            c_row[ii] = c + x * c_rs
        if written_out:                 # (the same sums: fa_microtile.h)
            for jb in range(n_main // NR):
                microtile(a_row, a_cs, b + jb * NR, b_rs, K, c_row, jb * NR, rows_here,
                          mode, c_scale + jb * NR if c_scale != NULL else NULL)
            continue
        for jb in range(n_main // NR):
            if accumulate and c_scale == NULL:
                for ii in range(MR):
                    c_out = c_row[ii] + jb * NR
                    for j in range(NR):
                        acc[ii * NR + j] = c_out[j]
            else:
                for ii in range(MR):
                    for j in range(NR):
                        acc[ii * NR + j] = 0
            for t in range(K):
                b_row = b + t * b_rs + jb * NR
                for ii in range(MR):
                    s = a_row[ii][t * a_cs]
                    for j in range(NR):
                        acc[ii * NR + j] = acc[ii * NR + j] + s * b_row[j]
            if c_scale != NULL:
                sc = c_scale + jb * NR
                for ii in range(MR):
                    if ii < rows_here:
                        c_out = c_row[ii] + jb * NR
                        for j in range(NR):
                            c_out[j] = scaled_plus(c_out[j], sc[j], acc[ii * NR + j])
            else:
                for ii in range(MR):
                    if ii < rows_here:
                        c_out = c_row[ii] + jb * NR
                        for j in range(NR):
                            c_out[j] = acc[ii * NR + j]
    if n_main < N:
        gemm_columns(a, a_rs, a_cs, b + n_main, b_rs, c + n_main, c_rs, m_tiled,
                     N - n_main, K, accumulate,
                     c_scale + n_main if c_scale != NULL else NULL)
