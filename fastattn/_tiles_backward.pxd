# The arithmetic of the attention backward pass on tiles, for float and double.
#
# Like _tiles.pxd, every function is `cdef inline ... noexcept nogil` on raw row-major
# pointers and sizes; nothing allocates or knows about threads. The forward primitives
# (pack_keys, block_tile, exp_) come from _tiles.pxd; what is new here is
# the rebuilding of P and dS from the saved log-sum-exp and a small register-tiled
# "C += A·B" used for the three gradient products
#
#     dV_j += P^T dO_i,    dK_j += dS^T (scale·Q_i),    dQ_i += dS K_j
#
# where a tile holds query rows i (at most KEY_BLOCK of them) against the KEY_BLOCK keys
# of block j, with row stride KEY_BLOCK, exactly as score_tile writes it.

from libc.math cimport INFINITY

from fastattn cimport _tiles
from fastattn._tiles cimport KEY_BLOCK, real

cdef enum:
    NR = 32         # columns of C per register tile (2 zmm of float, 4 of double)


cdef inline void scaled_copy(const real* x, real* y, Py_ssize_t n,
                             real scale) noexcept nogil:
    """y[t] = scale * x[t] for t < n."""
    cdef Py_ssize_t t
    for t in range(n):
        y[t] = x[t] * scale


cdef inline double row_dot(const real* x, const real* y, Py_ssize_t n) noexcept nogil:
    """sum_t x[t] * y[t], accumulated in double."""
    cdef Py_ssize_t t
    cdef double total = 0
    for t in range(n):
        total += <double> x[t] * <double> y[t]
    return total


cdef inline void probs_tile(real* s, Py_ssize_t nrows, const real* lse) noexcept nogil:
    """s (nrows, KEY_BLOCK) = exp(s - lse[r]) in place: the softmax probabilities
    rebuilt from the forward's log-sum-exp. A row with lse = -inf (no allowed key)
    becomes zeros, whatever its scores.

    The exp runs as one flat loop over the whole tile (the shape in which a compiler
    vectorises it); no row sums are needed here.
    """
    cdef Py_ssize_t r, c, x
    cdef real shift
    cdef real* srow
    for r in range(nrows):
        srow = s + r * KEY_BLOCK
        shift = lse[r] if lse[r] != -INFINITY else 0
        for c in range(KEY_BLOCK):
            srow[c] = srow[c] - shift
    for x in range(nrows * KEY_BLOCK):
        s[x] = _tiles.exp_(s[x])
    for r in range(nrows):
        if lse[r] == -INFINITY:
            srow = s + r * KEY_BLOCK
            for c in range(KEY_BLOCK):
                srow[c] = 0


cdef inline void dscores_tile(const real* p, real* dp, Py_ssize_t nrows,
                              const real* delta, const real* lse) noexcept nogil:
    """dp (nrows, KEY_BLOCK) = p * (dp - delta[r]) in place: the gradient of the
    scores; rows with lse = -inf (no allowed key) become zeros."""
    cdef Py_ssize_t r, c
    cdef real d
    cdef real* drow
    cdef const real* prow
    for r in range(nrows):
        drow = dp + r * KEY_BLOCK
        if lse[r] == -INFINITY:
            for c in range(KEY_BLOCK):
                drow[c] = 0
        else:
            prow = p + r * KEY_BLOCK
            d = delta[r]
            for c in range(KEY_BLOCK):
                drow[c] = prow[c] * (drow[c] - d)


cdef inline void transpose_tile(const real* s, real* st, Py_ssize_t nrows,
                                Py_ssize_t ncols) noexcept nogil:
    """st[c, r] = s[r, c] for r < nrows, c < ncols; both with row stride KEY_BLOCK.

    gemm_acc then reads P^T and dS^T with unit stride along x, the access pattern gcc
    keeps in registers (with a_is = 1 it unrolls the x loop and spills the tile)."""
    cdef Py_ssize_t r, c
    for c in range(ncols):
        for r in range(nrows):
            st[c * KEY_BLOCK + r] = s[r * KEY_BLOCK + c]


cdef inline void gemm_micro4(const real* a, Py_ssize_t a_is, Py_ssize_t a_xs,
                             const real* b, Py_ssize_t ldb, real* c, Py_ssize_t ldc,
                             Py_ssize_t X) noexcept nogil:
    """c[0:4, 0:NR] += sum_x a[i*a_is + x*a_xs] * b[x*ldb + 0:NR], in a local tile."""
    cdef real acc[4 * NR]
    cdef real a0, a1, a2, a3
    cdef const real* brow
    cdef const real* ax
    cdef Py_ssize_t x, t, r
    for t in range(4 * NR):
        acc[t] = 0
    for x in range(X):
        brow = b + x * ldb
        ax = a + x * a_xs
        a0 = ax[0]
        a1 = ax[a_is]
        a2 = ax[2 * a_is]
        a3 = ax[3 * a_is]
        for t in range(NR):
            acc[t] = acc[t] + a0 * brow[t]
            acc[NR + t] = acc[NR + t] + a1 * brow[t]
            acc[2 * NR + t] = acc[2 * NR + t] + a2 * brow[t]
            acc[3 * NR + t] = acc[3 * NR + t] + a3 * brow[t]
    for r in range(4):
        for t in range(NR):
            c[r * ldc + t] = c[r * ldc + t] + acc[r * NR + t]


cdef inline void gemm_micro8(const real* a, Py_ssize_t a_is, Py_ssize_t a_xs,
                             const real* b, Py_ssize_t ldb, real* c, Py_ssize_t ldc,
                             Py_ssize_t X) noexcept nogil:
    """c[0:8, 0:NR] += sum_x a[i*a_is + x*a_xs] * b[x*ldb + 0:NR], in a local tile."""
    cdef real acc[8 * NR]
    cdef real a0, a1, a2, a3, a4, a5, a6, a7
    cdef const real* brow
    cdef const real* ax
    cdef Py_ssize_t x, t, r
    for t in range(8 * NR):
        acc[t] = 0
    for x in range(X):
        brow = b + x * ldb
        ax = a + x * a_xs
        a0 = ax[0]
        a1 = ax[a_is]
        a2 = ax[2 * a_is]
        a3 = ax[3 * a_is]
        a4 = ax[4 * a_is]
        a5 = ax[5 * a_is]
        a6 = ax[6 * a_is]
        a7 = ax[7 * a_is]
        for t in range(NR):
            acc[t] = acc[t] + a0 * brow[t]
            acc[NR + t] = acc[NR + t] + a1 * brow[t]
            acc[2 * NR + t] = acc[2 * NR + t] + a2 * brow[t]
            acc[3 * NR + t] = acc[3 * NR + t] + a3 * brow[t]
            acc[4 * NR + t] = acc[4 * NR + t] + a4 * brow[t]
            acc[5 * NR + t] = acc[5 * NR + t] + a5 * brow[t]
            acc[6 * NR + t] = acc[6 * NR + t] + a6 * brow[t]
            acc[7 * NR + t] = acc[7 * NR + t] + a7 * brow[t]
    for r in range(8):
        for t in range(NR):
            c[r * ldc + t] = c[r * ldc + t] + acc[r * NR + t]


cdef inline void gemm_edge(const real* a, Py_ssize_t a_is, Py_ssize_t a_xs,
                           const real* b, Py_ssize_t ldb, real* c, Py_ssize_t ldc,
                           Py_ssize_t M, Py_ssize_t X, Py_ssize_t W) noexcept nogil:
    """The plain loop for the edges: c[i, 0:W] += sum_x a[i, x] * b[x, 0:W]."""
    cdef Py_ssize_t i, x, t
    cdef real av
    cdef real* crow
    cdef const real* brow
    for i in range(M):
        crow = c + i * ldc
        for x in range(X):
            av = a[i * a_is + x * a_xs]
            brow = b + x * ldb
            for t in range(W):
                crow[t] = crow[t] + av * brow[t]


cdef inline void gemm_acc(const real* a, Py_ssize_t a_is, Py_ssize_t a_xs,
                          const real* b, Py_ssize_t ldb, real* c, Py_ssize_t ldc,
                          Py_ssize_t M, Py_ssize_t X, Py_ssize_t W) noexcept nogil:
    """c (M, W) += A (M, X) @ b (X, W), with A[i, x] = a[i*a_is + x*a_xs].

    b and c are row-major with row strides ldb and ldc; the strides of A let the same
    function read a tile as A (a_is = KEY_BLOCK, a_xs = 1) or as its transpose
    (a_is = 1, a_xs = KEY_BLOCK). The order of the sums depends only on the sizes.
    """
    # float: 8 rows x 32 columns = 16 zmm accumulators; double: 4 x 32 = 16 as well
    cdef Py_ssize_t mr = 8 if real is float else 4
    cdef Py_ssize_t ib, wb, i, w
    cdef Py_ssize_t m_main = M - M % mr
    cdef Py_ssize_t w_main = W - W % NR
    for ib in range(m_main // mr):
        i = ib * mr
        for wb in range(w_main // NR):
            w = wb * NR
            if real is float:
                gemm_micro8(a + i * a_is, a_is, a_xs, b + w, ldb, c + i * ldc + w, ldc, X)
            else:
                gemm_micro4(a + i * a_is, a_is, a_xs, b + w, ldb, c + i * ldc + w, ldc, X)
    if w_main < W:
        gemm_edge(a, a_is, a_xs, b + w_main, ldb, c + w_main, ldc, m_main, X,
                  W - w_main)
    if m_main < M:
        gemm_edge(a + m_main * a_is, a_is, a_xs, b, ldb, c + m_main * ldc, ldc,
                  M - m_main, X, W)


cdef inline Py_ssize_t panel_size(Py_ssize_t E) noexcept nogil:
    """Elements of a panel copy of KEY_BLOCK rows of E columns (see pack_panels)."""
    return (E + KEY_BLOCK - 1) // KEY_BLOCK * KEY_BLOCK * KEY_BLOCK


cdef inline void pack_panels(const real* x, real* xp, Py_ssize_t nrows, Py_ssize_t E,
                             real scale) noexcept nogil:
    """xp = scale * x (nrows <= KEY_BLOCK, E), stored as column panels of KEY_BLOCK
    columns: panel p holds columns 64p.. as (nrows, KEY_BLOCK) with row stride
    KEY_BLOCK (the last panel is not padded past E)."""
    cdef Py_ssize_t p, r, t, w
    cdef real* dst
    cdef const real* src
    for p in range((E + KEY_BLOCK - 1) // KEY_BLOCK):
        w = E - p * KEY_BLOCK if E - p * KEY_BLOCK < KEY_BLOCK else KEY_BLOCK
        for r in range(nrows):
            dst = xp + p * KEY_BLOCK * KEY_BLOCK + r * KEY_BLOCK
            src = x + r * E + p * KEY_BLOCK
            for t in range(w):
                dst[t] = src[t] * scale


cdef inline void product_tile(const real* xp, const real* yt, real* s, Py_ssize_t nrows,
                              Py_ssize_t E) noexcept nogil:
    """s (nrows, KEY_BLOCK) = x (nrows, E) @ yt (E, KEY_BLOCK), x given as panels
    (pack_panels): what _tiles.score_tile computes, through the register-tiled
    gemm_acc (score_tile keeps each output row in memory across the E products,
    which makes it store-bound here)."""
    cdef Py_ssize_t t, p, w
    for t in range(nrows * KEY_BLOCK):
        s[t] = 0
    for p in range((E + KEY_BLOCK - 1) // KEY_BLOCK):
        w = E - p * KEY_BLOCK if E - p * KEY_BLOCK < KEY_BLOCK else KEY_BLOCK
        gemm_acc(xp + p * KEY_BLOCK * KEY_BLOCK, KEY_BLOCK, 1,
                 yt + p * KEY_BLOCK * KEY_BLOCK, KEY_BLOCK, s, KEY_BLOCK, nrows, w,
                 KEY_BLOCK)
