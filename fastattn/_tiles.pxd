# The arithmetic of attention on tiles, written once for float and double.
#
# Every function is `cdef inline ... noexcept nogil` on raw row-major pointers and
# sizes, and is compiled into each module that cimports this file: the parallel drivers
# (which may be built for several instruction sets) and the public C-level API in
# kernels.pyx. Nothing here allocates, touches Python objects or knows about threads.
#
# Conventions: a "slice" is one (batch, head) pair: q (Lq, E), k (Lk, E), v (Lk, Ev),
# out (Lq, Ev). Keys are visited in blocks of KEY_BLOCK. A query row i may attend to key
# j iff j <= i + shift (shift >= Lk means no causal limit), mask[i, j] != 0 (when a mask
# is given) and the score is not -inf.

from libc.math cimport INFINITY, log

ctypedef fused real:
    float
    double

cdef enum:
    KEY_BLOCK = 64          # keys per block (the width of a score tile)
    ALIGN = 16              # scratch arrays start on multiples of 16 elements
    QUERY_TILE = 64         # query rows attend_rows takes at once (the vector axis)
    LANES = 16              # partial sums kept by dot_ (vectorises without reassociation)

# exp and the register-tile sizes, in C: the exp must be inlined and vectorised by the
# compiler, and the tile sizes follow the vector registers of the instruction set the
# including module is compiled for.
cdef extern from *:
    """
    #include <stdint.h>

    /* exp(x) by range reduction x = n ln2 + r, |r| <= ln2/2, a polynomial for e^r
       (Cephes' degree 5 for float, Taylor degree 13 for double; both within ~1 ulp)
       and 2^n built in the exponent bits. Branch-free, so a loop of it vectorises on
       any instruction set. exp(-inf) = 0, exp(NaN) = NaN, +inf above the overflow
       limit; results below ~1e-38 (float) / ~1e-307 (double) are flushed to 0. */
    static inline float fa_expf(float x) {
        union { float f; int32_t i; } t, s, m;
        float xc, n, r, p;
        xc = x < -87.3f ? -87.3f : x;                /* NaN passes both clamps */
        xc = xc > 88.72283f ? 88.72283f : xc;
        m.f = 12582912.0f;                           /* 1.5 * 2^23: round to integer */
        t.f = xc * 1.44269504088896341f + m.f;
        n = t.f - m.f;
        r = xc - n * 0.693359375f;
        r = r - n * -2.12194440e-4f;
        p = 1.9875691500e-4f;
        p = p * r + 1.3981999507e-3f;
        p = p * r + 8.3334519073e-3f;
        p = p * r + 4.1665795894e-2f;
        p = p * r + 1.6666665459e-1f;
        p = p * r + 5.0000001201e-1f;
        p = p * (r * r) + r + 1.0f;
        s.i = (t.i - m.i + 126) << 23;               /* 2^(n-1); 0 when n = -126 */
        p = p * s.f * 2.0f;
        return x > 88.72283f ? (float)INFINITY : p;
    }

    static inline double fa_exp(double x) {
        union { double f; int64_t i; } t, s, m;
        double xc, n, r, p;
        xc = x < -708.39 ? -708.39 : x;
        xc = xc > 709.782712893384 ? 709.782712893384 : xc;
        m.f = 6755399441055744.0;                    /* 1.5 * 2^52 */
        t.f = xc * 1.4426950408889634 + m.f;
        n = t.f - m.f;
        r = xc - n * 0.693145751953125;
        r = r - n * 1.42860682030941723212e-6;
        p = 1.0 / 6227020800.0;
        p = p * r + 1.0 / 479001600.0;
        p = p * r + 1.0 / 39916800.0;
        p = p * r + 1.0 / 3628800.0;
        p = p * r + 1.0 / 362880.0;
        p = p * r + 1.0 / 40320.0;
        p = p * r + 1.0 / 5040.0;
        p = p * r + 1.0 / 720.0;
        p = p * r + 1.0 / 120.0;
        p = p * r + 1.0 / 24.0;
        p = p * r + 1.0 / 6.0;
        p = p * r + 0.5;
        p = p * r + 1.0;
        p = p * r + 1.0;
        s.i = (t.i - m.i + 1022) << 52;              /* 2^(n-1) */
        p = p * s.f * 2.0;
        return x > 709.782712893384 ? (double)INFINITY : p;
    }

    /* Register tile of mm_tile: FA_QV_* rows (the vector axis) by FA_JT_* columns,
       sized to the vector registers (32 x 512-bit with AVX-512, 16 otherwise). Chosen
       by reading gcc's code: some other shapes make it vectorise the column axis and
       shuffle (e.g. double 16 x 8 with AVX-512, 16 x 3 with AVX2 or SSE2). */
    #if defined(FA_QV_F)
    /* set on the command line (experiments) */
    #elif defined(__AVX512F__)
    #define FA_QV_F 32
    #define FA_JT_F 8
    #define FA_QV_D 32
    #define FA_JT_D 5
    #elif defined(__AVX__)
    #define FA_QV_F 16
    #define FA_JT_F 6
    #define FA_QV_D 32
    #define FA_JT_D 2
    #else
    #define FA_QV_F 16
    #define FA_JT_F 3
    #define FA_QV_D 8
    #define FA_JT_D 3
    #endif
    #define FA_TILE_MAX 256
    """
    float fa_expf(float x) noexcept nogil
    double fa_exp(double x) noexcept nogil
    enum:
        FA_QV_F
        FA_JT_F
        FA_QV_D
        FA_JT_D
        FA_TILE_MAX


cdef inline real exp_(real x) noexcept nogil:
    """e^x, vectorisable (see fa_expf / fa_exp above)."""
    if real is float:
        return fa_expf(x)
    else:
        return fa_exp(x)


cdef inline Py_ssize_t round_up(Py_ssize_t n) noexcept nogil:
    return (n + ALIGN - 1) // ALIGN * ALIGN


cdef inline Py_ssize_t key_limit(Py_ssize_t row, Py_ssize_t shift,
                                 Py_ssize_t Lk) noexcept nogil:
    """The number of keys row `row` may see under the causal rule, in [0, Lk]."""
    cdef Py_ssize_t n = row + shift + 1 if shift < Lk else Lk
    if n < 0:
        return 0
    return n if n < Lk else Lk


# ------------------------------------------------------------------ tile primitives

cdef inline void prescale_rows(const real* q, real* qs, Py_ssize_t n,
                               real scale) noexcept nogil:
    """qs[x] = scale * q[x] for x < n."""
    cdef Py_ssize_t x
    for x in range(n):
        qs[x] = q[x] * scale


cdef inline void pack_keys(const real* k, real* kp, Py_ssize_t bc,
                           Py_ssize_t E) noexcept nogil:
    """kp (E, KEY_BLOCK) = k[:bc]^T, zero-padded: the score loop then runs unit-stride."""
    cdef Py_ssize_t c, t
    for t in range(E):
        for c in range(bc):
            kp[t * KEY_BLOCK + c] = k[c * E + t]
        for c in range(bc, KEY_BLOCK):
            kp[t * KEY_BLOCK + c] = 0


cdef inline void score_tile(const real* qs, const real* kp, real* s,
                            Py_ssize_t nrows, Py_ssize_t E) noexcept nogil:
    """s (nrows, KEY_BLOCK) = qs (nrows, E) @ kp (E, KEY_BLOCK)."""
    cdef Py_ssize_t r, t, c
    cdef real a
    cdef real* srow
    cdef const real* krow
    for r in range(nrows):
        srow = s + r * KEY_BLOCK
        for c in range(KEY_BLOCK):
            srow[c] = 0
        for t in range(E):
            a = qs[r * E + t]
            krow = kp + t * KEY_BLOCK
            for c in range(KEY_BLOCK):
                srow[c] = srow[c] + a * krow[c]


cdef inline void block_tile(real* s, Py_ssize_t nrows, Py_ssize_t row0, Py_ssize_t j0,
                            Py_ssize_t bc, Py_ssize_t Lk, Py_ssize_t shift,
                            const unsigned char* mask, Py_ssize_t mask_rs,
                            Py_ssize_t mask_cs, const real* bias, Py_ssize_t bias_rs,
                            Py_ssize_t bias_cs) noexcept nogil:
    """Add the bias and set to -inf every entry of the tile a row may not attend to.

    The tile holds rows row0.. of keys j0..j0+bc; mask and bias point at row row0,
    key 0 of the slice (or are NULL); columns bc.. are padding and become -inf.
    """
    cdef Py_ssize_t r, c, lim
    cdef real* srow
    for r in range(nrows):
        srow = s + r * KEY_BLOCK
        if bias != NULL:
            for c in range(bc):
                srow[c] = srow[c] + bias[r * bias_rs + (j0 + c) * bias_cs]
        if mask != NULL:
            for c in range(bc):
                if not mask[r * mask_rs + (j0 + c) * mask_cs]:
                    srow[c] = -INFINITY
        lim = key_limit(row0 + r, shift, Lk) - j0
        if lim < 0:
            lim = 0
        if lim > bc:
            lim = bc
        for c in range(lim, KEY_BLOCK):
            srow[c] = -INFINITY


cdef inline real row_max(const real* x, Py_ssize_t n) noexcept nogil:
    """The largest entry, -inf for none; NaN entries are skipped here and caught later."""
    cdef Py_ssize_t c
    cdef real m = -INFINITY
    for c in range(n):
        if x[c] > m:
            m = x[c]
    return m


cdef inline double exp_row(real* x, Py_ssize_t n, real m) noexcept nogil:
    """x[c] = exp(x[c] - m) in place; returns the sum (in double).

    ``m == -inf`` (nothing allowed yet) subtracts 0 instead, so -inf entries give 0
    and NaN entries stay NaN and reach the sum.
    """
    cdef Py_ssize_t c
    cdef double total = 0
    if m == -INFINITY:
        m = 0
    for c in range(n):              # vectorised
        x[c] = exp_(x[c] - m)
    for c in range(n):              # in order, in double
        total += x[c]
    return total


# ------------------------------------------------------------------- row kernels

cdef inline void softmax_row(const real* x, real* y, Py_ssize_t n) noexcept nogil:
    """y = softmax(x) over n entries, max-subtracted; all -inf gives zeros (x may be y)."""
    cdef Py_ssize_t c
    cdef real m = row_max(x, n)
    cdef double total
    cdef real inv
    for c in range(n):
        y[c] = x[c]
    total = exp_row(y, n, m)
    if total == 0:
        for c in range(n):
            y[c] = 0
        return
    inv = <real> (1.0 / total)
    for c in range(n):
        y[c] = y[c] * inv


cdef inline void weighted_rows(const real* p, const real* v, real* out,
                               Py_ssize_t nrows, Py_ssize_t Lk,
                               Py_ssize_t Ev) noexcept nogil:
    """out (nrows, Ev) = p (nrows, Lk) @ v (Lk, Ev)."""
    cdef Py_ssize_t r, c, t
    cdef real a
    cdef real* orow
    cdef const real* vrow
    for r in range(nrows):
        orow = out + r * Ev
        for t in range(Ev):
            orow[t] = 0
        for c in range(Lk):
            a = p[r * Lk + c]
            vrow = v + c * Ev
            for t in range(Ev):
                orow[t] = orow[t] + a * vrow[t]


cdef inline Py_ssize_t rows_work_size(Py_ssize_t nrows, Py_ssize_t E,
                                      Py_ssize_t Ev) noexcept nogil:
    """Elements of scratch that score_rows / attend_rows need for nrows query rows."""
    return (round_up(nrows * E) + round_up(E * KEY_BLOCK) + round_up(nrows * KEY_BLOCK)
            + round_up(nrows * Ev) + 4 * round_up(nrows))


cdef inline void score_rows(const real* q, const real* k, real* s, Py_ssize_t nrows,
                            Py_ssize_t row0, Py_ssize_t Lk, Py_ssize_t E, real scale,
                            Py_ssize_t shift, const unsigned char* mask,
                            Py_ssize_t mask_rs, Py_ssize_t mask_cs, const real* bias,
                            Py_ssize_t bias_rs, Py_ssize_t bias_cs, bint softmax,
                            real* work) noexcept nogil:
    """s (nrows, Lk) = scale * q @ k^T + bias, blocked entries -inf; then softmax rows.

    q, s, mask and bias point at row row0 of the slice; work holds
    rows_work_size(nrows, E, 0) elements.
    """
    cdef real* qs = work
    cdef real* kp = qs + round_up(nrows * E)
    cdef real* tile = kp + round_up(E * KEY_BLOCK)
    cdef Py_ssize_t j0, bc, r, c, b
    prescale_rows(q, qs, nrows * E, scale)
    for b in range((Lk + KEY_BLOCK - 1) // KEY_BLOCK):
        j0 = b * KEY_BLOCK
        bc = Lk - j0 if Lk - j0 < KEY_BLOCK else KEY_BLOCK
        pack_keys(k + j0 * E, kp, bc, E)
        score_tile(qs, kp, tile, nrows, E)
        block_tile(tile, nrows, row0, j0, bc, Lk, shift, mask, mask_rs, mask_cs,
                   bias, bias_rs, bias_cs)
        for r in range(nrows):
            for c in range(bc):
                s[r * Lk + j0 + c] = tile[r * KEY_BLOCK + c]
    if softmax:
        for r in range(nrows):
            softmax_row(s + r * Lk, s + r * Lk, Lk)


# ----------------------------------------------------------- the fused forward pass
#
# A work item is up to QUERY_TILE query rows of one slice. Its queries are held
# transposed, qt (E, QUERY_TILE), so that the query rows are the vector axis of every
# loop: the score tile st (KEY_BLOCK, QUERY_TILE) = K_block @ qt, the output
# accumulator ot (Ev, QUERY_TILE) += V_block^T @ st, and the row max, exp, row sum and
# rescaling of the online softmax are plain element-wise loops. K and V are read in
# their own row-major layout (their entries are broadcast), so nothing is packed.

cdef inline bint all_finite(const real* x, Py_ssize_t n) noexcept nogil:
    """No NaN and no inf among x[:n] (x - x is NaN exactly for those)."""
    cdef Py_ssize_t i
    cdef real d
    cdef int flag = 0
    for i in range(n):
        d = x[i] - x[i]
        flag = flag | (d != d)
    return not flag


cdef inline void weigh_values_exactly(const real* v, Py_ssize_t Ev, const real* p,
                                      Py_ssize_t bc, real* o, Py_ssize_t nr) noexcept nogil:
    """o (Ev, QUERY_TILE) = v[:bc]^T @ p (bc, QUERY_TILE) for rows r < nr, skipping every
    zero weight: the path for a value block holding NaN or inf, which must reach only
    the rows that may attend to it (0 * inf would be NaN)."""
    cdef Py_ssize_t c, r, t
    cdef real a
    for t in range(Ev):
        for r in range(nr):
            o[t * QUERY_TILE + r] = 0
    for c in range(bc):
        for r in range(nr):
            a = p[c * QUERY_TILE + r]
            if a != 0:
                for t in range(Ev):
                    o[t * QUERY_TILE + r] = o[t * QUERY_TILE + r] + a * v[c * Ev + t]


cdef inline void mm_tile(const real* a, Py_ssize_t a_js, Py_ssize_t a_ts, Py_ssize_t nj,
                         const real* b, Py_ssize_t nt, real* c, Py_ssize_t nr,
                         bint add) noexcept nogil:
    """c[j, r] (+)= sum_{t < nt} a[j * a_js + t * a_ts] * b[t, r], for j < nj, r < nr.

    b and c have rows of QUERY_TILE elements; nr is a multiple of the register tile's
    row count. The register tile (FA_QV rows x FA_JT columns) lives in a fixed-size
    local array that the compiler keeps in vector registers; the last column tile
    re-reads column nj - 1 in its unused places and does not store them.
    """
    cdef Py_ssize_t QV = FA_QV_F if real is float else FA_QV_D
    cdef Py_ssize_t JT = FA_JT_F if real is float else FA_JT_D
    cdef real acc[FA_TILE_MAX]
    cdef const real* ap[FA_TILE_MAX]
    cdef real* cp[FA_TILE_MAX]
    cdef Py_ssize_t jb, j0, jj, x, rb, r, t, nst
    cdef const real* brow
    cdef real* crow
    cdef real s
    for jb in range((nj + JT - 1) // JT):
        j0 = jb * JT
        nst = nj - j0
        for jj in range(JT):
            x = j0 + jj if jj < nst else nj - 1
            ap[jj] = a + x * a_js
            cp[jj] = c + x * QUERY_TILE
        for rb in range(nr // QV):
            if add:
                for jj in range(JT):
                    crow = cp[jj] + rb * QV
                    for r in range(QV):
                        acc[jj * QV + r] = crow[r]
            else:
                for jj in range(JT):
                    for r in range(QV):
                        acc[jj * QV + r] = 0
            for t in range(nt):
                brow = b + t * QUERY_TILE + rb * QV
                for jj in range(JT):
                    s = ap[jj][t * a_ts]
                    for r in range(QV):
                        acc[jj * QV + r] = acc[jj * QV + r] + s * brow[r]
            for jj in range(JT):
                if jj < nst:
                    crow = cp[jj] + rb * QV
                    for r in range(QV):
                        crow[r] = acc[jj * QV + r]


cdef inline void block_tile_t(real* st, Py_ssize_t nrows, Py_ssize_t row0, Py_ssize_t j0,
                              Py_ssize_t bc, Py_ssize_t Lk, Py_ssize_t shift,
                              const unsigned char* mask, Py_ssize_t mask_rs,
                              Py_ssize_t mask_cs, const real* bias, Py_ssize_t bias_rs,
                              Py_ssize_t bias_cs) noexcept nogil:
    """block_tile for a transposed tile st (KEY_BLOCK, QUERY_TILE): keys j0..j0+bc."""
    cdef Py_ssize_t r, c, lim
    for r in range(nrows):
        if bias != NULL:
            for c in range(bc):
                st[c * QUERY_TILE + r] = (st[c * QUERY_TILE + r]
                                          + bias[r * bias_rs + (j0 + c) * bias_cs])
        if mask != NULL:
            for c in range(bc):
                if not mask[r * mask_rs + (j0 + c) * mask_cs]:
                    st[c * QUERY_TILE + r] = -INFINITY
        lim = key_limit(row0 + r, shift, Lk) - j0
        if lim < 0:
            lim = 0
        for c in range(lim, bc):
            st[c * QUERY_TILE + r] = -INFINITY


cdef inline Py_ssize_t attend_work_size(Py_ssize_t E, Py_ssize_t Ev) noexcept nogil:
    """Elements of scratch attend_rows needs (a multiple of QUERY_TILE)."""
    return (E + KEY_BLOCK + 2 * Ev + 7) * QUERY_TILE      # m, mm, alpha; l, ls in double


cdef inline void attend_rows(const real* q, const real* k, const real* v, real* out,
                             real* lse, Py_ssize_t nrows, Py_ssize_t row0,
                             Py_ssize_t Lk, Py_ssize_t E, Py_ssize_t Ev, real scale,
                             Py_ssize_t shift, const unsigned char* mask,
                             Py_ssize_t mask_rs, Py_ssize_t mask_cs, const real* bias,
                             Py_ssize_t bias_rs, Py_ssize_t bias_cs,
                             real* work) noexcept nogil:
    """Fused attention of nrows <= QUERY_TILE query rows over all keys (online softmax).

    Keys are visited block by block; each row keeps its running max m, running sum l
    (double) and an unnormalised output accumulator, rescaled by exp(m_old - m_new)
    when the max grows. Key blocks past the causal limit of the last row are skipped,
    and the causal rule is applied only to blocks that cross it. q, out, lse, mask and
    bias point at row row0 of the slice (lse may be NULL); work holds
    attend_work_size(E, Ev) elements, aligned to 64 bytes for speed. A row with no
    allowed key gets zeros and lse = -inf. A key whose weight is exactly 0 (blocked,
    or underflowed) never reaches a row, so a NaN or inf in its value row reaches only
    the rows that may attend to it, whatever the blocking of rows and keys.
    """
    cdef Py_ssize_t QB = QUERY_TILE
    cdef Py_ssize_t QV = FA_QV_F if real is float else FA_QV_D
    cdef real* qt = work
    cdef real* st = qt + E * QB
    cdef real* ot = st + KEY_BLOCK * QB
    cdef real* ob = ot + Ev * QB
    cdef real* m = ob + Ev * QB
    cdef real* mm = m + QB
    cdef real* alpha = mm + QB
    cdef double* l = <double*> (alpha + QB)
    cdef double* ls = l + QB
    cdef Py_ssize_t nr = (nrows + QV - 1) // QV * QV
    cdef Py_ssize_t j0, bc, r, c, t, b, key_end, full_end
    cdef Py_ssize_t x_
    cdef real x, m_old, inv

    for r in range(nrows):
        for t in range(E):
            qt[t * QB + r] = q[r * E + t] * scale
    for t in range(E):
        for r in range(nrows, nr):
            qt[t * QB + r] = 0
    # lanes nr.. are never computed: keep them finite for the element-wise loops
    for c in range(KEY_BLOCK):
        for r in range(nr, QB):
            st[c * QB + r] = 0
    for t in range(Ev):
        for r in range(nr, QB):
            ob[t * QB + r] = 0
    for r in range(QB):
        m[r] = -INFINITY
        l[r] = 0
    key_end = key_limit(row0 + nrows - 1, shift, Lk) if nrows > 0 else 0
    full_end = key_limit(row0, shift, Lk)

    for b in range((key_end + KEY_BLOCK - 1) // KEY_BLOCK):
        j0 = b * KEY_BLOCK
        bc = key_end - j0 if key_end - j0 < KEY_BLOCK else KEY_BLOCK
        # st (bc, QB) = K[j0:j0+bc] @ qt: scaled scores, keys by rows
        mm_tile(k + j0 * E, E, 1, bc, qt, E, st, nr, False)
        if mask != NULL or bias != NULL or j0 + bc > full_end:
            block_tile_t(st, nrows, row0, j0, bc, Lk, shift, mask, mask_rs, mask_cs,
                         bias, bias_rs, bias_cs)
        # new running max (NaN scores are skipped here and reach the sums below)
        for r in range(QB):
            mm[r] = m[r]
        for c in range(bc):
            for r in range(QB):
                x = st[c * QB + r]
                mm[r] = x if x > mm[r] else mm[r]
        for r in range(QB):
            m_old = m[r]
            m[r] = mm[r]
            mm[r] = 0 if mm[r] == -INFINITY else mm[r]    # "-inf means 0" as in exp_row
            alpha[r] = exp_(m_old - mm[r])
        # p = exp(s - m), row sums in double
        for c in range(bc):
            for r in range(QB):
                st[c * QB + r] = exp_(st[c * QB + r] - mm[r])
        for r in range(QB):
            ls[r] = 0
        for c in range(bc):
            for r in range(QB):
                ls[r] = ls[r] + <double> st[c * QB + r]
        for r in range(QB):
            l[r] = l[r] * alpha[r] + ls[r]
        # ob (Ev, QB) = V[j0:j0+bc]^T @ st, then ot = alpha * ot + ob: summing block by
        # block keeps the rounding error of long rows at O(KEY_BLOCK + Lk / KEY_BLOCK)
        if all_finite(v + j0 * Ev, bc * Ev):
            mm_tile(v + j0 * Ev, 1, Ev, Ev, st, bc, ob, nr, False)
        else:
            weigh_values_exactly(v + j0 * Ev, Ev, st, bc, ob, nr)
        if b == 0:
            for x_ in range(Ev * QB):
                ot[x_] = ob[x_]
        else:
            # alpha == 0 (the earlier weights underflowed): drop them, as 0 * inf = NaN
            for t in range(Ev):
                for r in range(QB):
                    ot[t * QB + r] = (ot[t * QB + r] * alpha[r] if alpha[r] != 0 else 0) \
                        + ob[t * QB + r]

    for r in range(nrows):
        if l[r] == 0:
            for t in range(Ev):
                out[r * Ev + t] = 0
            if lse != NULL:
                lse[r] = -INFINITY
        else:
            inv = <real> (1.0 / l[r])
            for t in range(Ev):
                out[r * Ev + t] = ot[t * QB + r] * inv
            if lse != NULL:
                lse[r] = <real> (m[r] + log(l[r]))


# ------------------------------------------------- few query rows (decoding), split keys
#
# With one or a few query rows per slice the tiles above would be mostly padding, and
# the work is reading K and V once. Here the vector axis is E: a score is a dot product
# kept in LANES partial sums, and the output accumulates whole V rows. The rows of
# several query slices that share one K/V slice (a grouped-query group) are done
# together, so each K/V row is read once for the whole group. A work item covers a
# range of keys and leaves an unnormalised partial result (acc, m, l) that
# merge_parts combines in a fixed order.

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


cdef inline void attend_few(const real* qs, const real* k, const real* v, real* acc,
                            real* m, double* l, Py_ssize_t G, Py_ssize_t Lq,
                            Py_ssize_t kbeg, Py_ssize_t kend, Py_ssize_t Lk, Py_ssize_t E,
                            Py_ssize_t Ev, Py_ssize_t shift, const unsigned char* mask,
                            const Py_ssize_t* mask_off, Py_ssize_t mask_rs,
                            Py_ssize_t mask_cs, const real* bias,
                            const Py_ssize_t* bias_off, Py_ssize_t bias_rs,
                            Py_ssize_t bias_cs, real* s) noexcept nogil:
    """Partial attention of R = G * Lq query rows over keys kbeg..kend of one K/V slice.

    qs (R, E): the prescaled query rows of G slices that share k (Lk, E) and v (Lk, Ev),
    Lq rows each. Leaves acc (R, Ev) = sum_j exp(s_j - m) v_j, m (R) the max allowed
    score (-inf for none) and l (R) = sum_j exp(s_j - m), with the "-inf means 0" rule
    of exp_row. mask/bias (or NULL) hold, at mask_off[g] / bias_off[g], row 0 of slice
    g's matrix; s is scratch of R * (KEY_BLOCK + Ev) elements.
    """
    cdef Py_ssize_t R = G * Lq
    cdef real* blk = s + R * KEY_BLOCK
    cdef Py_ssize_t j0, bc, r, c, t, g, b, key_end, nb
    cdef real m_new, m_sub, alpha, p
    cdef double total
    cdef real* srow
    cdef real* arow
    cdef const real* krow
    cdef const real* vrow
    for t in range(R * Ev):
        acc[t] = 0
    for r in range(R):
        m[r] = -INFINITY
        l[r] = 0
    key_end = key_limit(Lq - 1, shift, Lk)
    if key_end > kend:
        key_end = kend
    nb = (key_end - kbeg + KEY_BLOCK - 1) // KEY_BLOCK if key_end > kbeg else 0
    for b in range(nb):
        j0 = kbeg + b * KEY_BLOCK
        bc = key_end - j0 if key_end - j0 < KEY_BLOCK else KEY_BLOCK
        for c in range(bc):
            krow = k + (j0 + c) * E
            for r in range(R):
                s[r * KEY_BLOCK + c] = dot_(qs + r * E, krow, E)
        if mask != NULL or bias != NULL or j0 + bc > key_limit(0, shift, Lk):
            for g in range(G):
                block_tile(s + g * Lq * KEY_BLOCK, Lq, 0, j0, bc, Lk, shift,
                           mask + mask_off[g] if mask != NULL else NULL,
                           mask_rs, mask_cs,
                           bias + bias_off[g] if bias != NULL else NULL,
                           bias_rs, bias_cs)
        for r in range(R):
            srow = s + r * KEY_BLOCK
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
                for t in range(Ev):     # alpha == 0: drop them, as 0 * inf = NaN
                    arow[t] = arow[t] * alpha if alpha != 0 else 0
        # this block's P·V on its own, then added (accuracy of long rows); a zero
        # weight is skipped, so a blocked key's NaN or inf value never reaches a row
        for t in range(R * Ev):
            blk[t] = 0
        for c in range(bc):
            vrow = v + (j0 + c) * Ev
            for r in range(R):
                p = s[r * KEY_BLOCK + c]
                if p == 0:
                    continue
                arow = blk + r * Ev
                for t in range(Ev):
                    arow[t] = arow[t] + p * vrow[t]
        for t in range(R * Ev):
            acc[t] = acc[t] + blk[t]


cdef inline void merge_parts(const real* acc, const real* m, const double* l,
                                Py_ssize_t nparts, Py_ssize_t stride, Py_ssize_t R,
                                Py_ssize_t Ev, real* out, real* lse) noexcept nogil:
    """Combine nparts partial results of attend_few, in order, into out (R, Ev), lse (R).

    Part p is at acc + p * stride * Ev, m + p * stride, l + p * stride. With
    M = max_p m_p: out = sum_p exp(m_p - M) acc_p / L and lse = M + log L, where
    L = sum_p exp(m_p - M) l_p; zeros and -inf when L == 0 (no allowed key); NaN
    propagates. lse may be NULL.
    """
    cdef Py_ssize_t r, p, t
    cdef real M, w
    cdef double L, inv
    for r in range(R):
        M = -INFINITY
        for p in range(nparts):
            if m[p * stride + r] > M:
                M = m[p * stride + r]
        if M == -INFINITY:
            M = 0
        L = 0
        for p in range(nparts):
            L = L + l[p * stride + r] * <double> exp_(m[p * stride + r] - M)
        if L == 0:
            for t in range(Ev):
                out[r * Ev + t] = 0
            if lse != NULL:
                lse[r] = -INFINITY
            continue
        inv = 1.0 / L
        for t in range(Ev):
            out[r * Ev + t] = 0
        for p in range(nparts):
            w = <real> (exp_(m[p * stride + r] - M) * inv)
            if w == 0:          # a part with no weight left adds nothing (0 * inf)
                continue
            for t in range(Ev):
                out[r * Ev + t] = out[r * Ev + t] + acc[(p * stride + r) * Ev + t] * w
        if lse != NULL:
            lse[r] = <real> (M + log(L))
