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

from libc.math cimport INFINITY, exp, expf, log

ctypedef fused real:
    float
    double

cdef enum:
    KEY_BLOCK = 64          # keys per block (the width of a score tile)
    ALIGN = 16              # scratch arrays start on multiples of 16 elements


cdef inline real exp_(real x) noexcept nogil:
    if real is float:
        return expf(x)
    else:
        return exp(x)


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
    cdef real p
    if m == -INFINITY:
        m = 0
    for c in range(n):
        p = exp_(x[c] - m)
        x[c] = p
        total += p
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


cdef inline void attend_rows(const real* q, const real* k, const real* v, real* out,
                             real* lse, Py_ssize_t nrows, Py_ssize_t row0,
                             Py_ssize_t Lk, Py_ssize_t E, Py_ssize_t Ev, real scale,
                             Py_ssize_t shift, const unsigned char* mask,
                             Py_ssize_t mask_rs, Py_ssize_t mask_cs, const real* bias,
                             Py_ssize_t bias_rs, Py_ssize_t bias_cs,
                             real* work) noexcept nogil:
    """Fused attention of nrows query rows over all keys, with the online softmax.

    Keys are visited block by block; each row keeps its running max m, running sum l
    and an unnormalised output accumulator, rescaled by exp(m_old - m_new) when the
    max grows. The Lq x Lk score matrix is never formed. q, out, lse, mask and bias
    point at row row0 of the slice (lse may be NULL); work holds
    rows_work_size(nrows, E, Ev) elements. A row with no allowed key gets zeros and
    lse = -inf. A key whose weight is exactly 0 (blocked, or underflowed) is skipped,
    so a NaN or inf in its value row reaches only the rows that may attend to it,
    whatever the blocking of rows and keys.
    """
    cdef real* qs = work
    cdef real* kp = qs + round_up(nrows * E)
    cdef real* tile = kp + round_up(E * KEY_BLOCK)
    cdef real* acc = tile + round_up(nrows * KEY_BLOCK)
    cdef double* m = <double*> (acc + round_up(nrows * Ev))
    cdef double* l = m + round_up(nrows)
    cdef Py_ssize_t j0, bc, r, c, t, b, x, key_end
    cdef double m_new, alpha, total
    cdef real a, alpha_r, inv
    cdef real* srow
    cdef real* arow
    cdef const real* vrow

    prescale_rows(q, qs, nrows * E, scale)
    for r in range(nrows):
        m[r] = -INFINITY
        l[r] = 0
    for x in range(nrows * Ev):
        acc[x] = 0
    key_end = key_limit(row0 + nrows - 1, shift, Lk) if nrows > 0 else 0

    for b in range((key_end + KEY_BLOCK - 1) // KEY_BLOCK):
        j0 = b * KEY_BLOCK
        bc = key_end - j0 if key_end - j0 < KEY_BLOCK else KEY_BLOCK
        pack_keys(k + j0 * E, kp, bc, E)
        score_tile(qs, kp, tile, nrows, E)
        block_tile(tile, nrows, row0, j0, bc, Lk, shift, mask, mask_rs, mask_cs,
                   bias, bias_rs, bias_cs)
        for r in range(nrows):
            srow = tile + r * KEY_BLOCK
            m_new = row_max(srow, KEY_BLOCK)
            if m[r] > m_new:
                m_new = m[r]
            # exp(m_old - m_new), with the same "-inf means 0" rule as exp_row
            alpha = exp(m[r] - (m_new if m_new != -INFINITY else 0))
            total = exp_row(srow, KEY_BLOCK, <real> m_new)
            l[r] = l[r] * alpha + total
            m[r] = m_new
            arow = acc + r * Ev
            if alpha != 1:
                alpha_r = <real> alpha
                if alpha_r == 0:        # earlier weights all underflowed: drop them
                    for t in range(Ev):     # (0 * inf would be NaN)
                        arow[t] = 0
                else:
                    for t in range(Ev):
                        arow[t] = arow[t] * alpha_r
            for c in range(bc):
                a = srow[c]
                if a == 0:      # a blocked key: its value row (NaN or inf included)
                    continue    # never reaches this row
                vrow = v + (j0 + c) * Ev
                for t in range(Ev):
                    arow[t] = arow[t] + a * vrow[t]

    for r in range(nrows):
        arow = acc + r * Ev
        if l[r] == 0:
            for t in range(Ev):
                out[r * Ev + t] = 0
            if lse != NULL:
                lse[r] = -INFINITY
        else:
            inv = <real> (1.0 / l[r])
            for t in range(Ev):
                out[r * Ev + t] = arow[t] * inv
            if lse != NULL:
                lse[r] = <real> (m[r] + log(l[r]))
