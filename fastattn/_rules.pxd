# The rules that turn scale * q.k into the scores a softmax sees, in one place: every
# path (the fused tiles, decoding, the scores pass, the backward, the exact rule for a
# single row) calls `rule_scores`. A new variant of the scores is a new step here.
#
# In this order: the softcap c tanh(s / c), plus the bias, minus slope * |i + d - j|
# (ALiBi), then -inf where the mask, the positions (causal, window) or the lengths
# forbid a key. Dropout (of the weights, after the softmax) is `dropout_weights`.

from libc.math cimport INFINITY

from fastattn._csrc cimport fa_tanh, fastattn_dropout_keep4
from fastattn._gemm cimport real
from fastattn._operands cimport per_slice
from fastattn._plan cimport Plan, key_begin, key_end, offset_of


cdef struct ScoreRows:
    # the query rows a block of scores belongs to, and what rules them
    Py_ssize_t n                    # the slice
    Py_ssize_t i0, nrows            # its query rows i0..i0+nrows
    const unsigned char* mask       # row i0, key 0 of the slice's mask (NULL: none)
    const void* bias                # ... of its bias, in the computation dtype
    const Py_ssize_t* lo            # each row's allowed keys [lo, hi) by position
    const Py_ssize_t* hi            # and length, or NULL: found row by row


cdef inline real tanh_(real x) noexcept nogil:
    """tanh(x), branch-free so that a loop of it vectorises; NaN stays NaN.

    float: a rational minimax approximation on [-7.9988, 7.9988] (x clamped to it;
    beyond, tanh is 1 in float32), a degree-13 odd over a degree-6 even polynomial:
    absolute error below 3e-7, one division and no exp (Eigen's fast tanh). double:
    fa_tanh (src/fa_exp.h), expm1-based, within 2 ulp for every x."""
    cdef real a, x2, num, den
    if real is float:
        a = x if x < <float> 7.99881172180175781 else <float> 7.99881172180175781
        a = a if a > <float> -7.99881172180175781 else <float> -7.99881172180175781
        a = x if x != x else a                  # keep NaN
        x2 = a * a
        num = <float> -2.76076847742355e-16
        num = num * x2 + <float> 2.00018790482477e-13
        num = num * x2 + <float> -8.60467152213735e-11
        num = num * x2 + <float> 5.12229709037114e-08
        num = num * x2 + <float> 1.48572235717979e-05
        num = num * x2 + <float> 6.37261928875436e-04
        num = num * x2 + <float> 4.89352455891786e-03
        den = <float> 1.19825839466702e-06
        den = den * x2 + <float> 1.18534705686654e-04
        den = den * x2 + <float> 2.26843463243900e-03
        den = den * x2 + <float> 4.89352518554385e-03
        return a * num / den
    else:
        return fa_tanh(x)


cdef inline bint rules_every_block(const Plan* p, const ScoreRows* rows) noexcept nogil:
    """Does every block of these rows need rule_scores, not only those a position
    rule crosses?"""
    return (rows.mask != NULL or rows.bias != NULL or p.softcap > 0
            or p.alibi_slopes.data != NULL)


cdef inline void rule_scores(const Plan* p, const ScoreRows* rows, real* s,
                             Py_ssize_t row_step, Py_ssize_t key_step, Py_ssize_t j0,
                             Py_ssize_t keys, bint positions, real* dcap) noexcept nogil:
    """The scores of the rows and of keys j0..j0+keys, s[r * row_step + c * key_step]
    (= scale * q.k), become: softcapped (dcap, if not NULL and laid out as s, receives
    the derivative 1 - tanh^2), plus the bias, minus slope * |i + d - j|, and -inf
    where the mask forbids a key or, with `positions`, where it lies outside the
    row's range. Each term loops with the contiguous axis of s innermost, so that it
    vectorises (the tiles: rows; decoding: keys)."""
    cdef bint by_key = row_step == 1        # the rows are the contiguous axis
    cdef Py_ssize_t nrows = rows.nrows
    if p.softcap > 0:
        if by_key:
            cap_scores(s, key_step, row_step, keys, nrows, <real> p.softcap, dcap)
        else:
            cap_scores(s, row_step, key_step, nrows, keys, <real> p.softcap, dcap)
    if rows.bias != NULL:
        add_bias(p, rows, s, row_step, key_step, j0, keys, by_key)
    if p.alibi_slopes.data != NULL:
        add_alibi(p, rows, s, row_step, key_step, j0, keys, by_key)
    if rows.mask != NULL:
        apply_mask(p, rows, s, row_step, key_step, j0, keys, by_key)
    if positions:
        keep_positions(p, rows, s, row_step, key_step, j0, keys, by_key)


cdef inline void cap_scores(real* s, Py_ssize_t outer_step, Py_ssize_t inner_step,
                            Py_ssize_t outer, Py_ssize_t inner, real cap,
                            real* dcap) noexcept nogil:
    """s = cap * tanh(s / cap) over outer x inner entries (dcap: the derivative)."""
    cdef Py_ssize_t a, b, x
    cdef real t, inv = 1 / cap
    for a in range(outer):
        for b in range(inner):
            x = a * outer_step + b * inner_step
            t = tanh_(s[x] * inv)
            s[x] = cap * t
            if dcap != NULL:
                dcap[x] = 1 - t * t


cdef inline void add_bias(const Plan* p, const ScoreRows* rows, real* s,
                          Py_ssize_t row_step, Py_ssize_t key_step, Py_ssize_t j0,
                          Py_ssize_t keys, bint by_key) noexcept nogil:
    cdef const real* bias = <const real*> rows.bias
    cdef Py_ssize_t b_rs = p.bias.row_stride, b_cs = p.bias.col_stride, r, c
    cdef real* line
    if by_key:
        for c in range(keys):
            line = s + c * key_step
            for r in range(rows.nrows):
                line[r] = line[r] + bias[r * b_rs + (j0 + c) * b_cs]
        return
    for r in range(rows.nrows):
        line = s + r * row_step
        for c in range(keys):
            line[c * key_step] = line[c * key_step] + bias[r * b_rs + (j0 + c) * b_cs]


cdef inline void add_alibi(const Plan* p, const ScoreRows* rows, real* s,
                           Py_ssize_t row_step, Py_ssize_t key_step, Py_ssize_t j0,
                           Py_ssize_t keys, bint by_key) noexcept nogil:
    """minus slope * |i + d - j|: the distance of query row i0 + r (at key position
    i0 + r + d) and key j0 + c is |r + base - c|, base = i0 + d - j0."""
    cdef real slope = <real> per_slice(p, &p.alibi_slopes, rows.n, 0)
    cdef Py_ssize_t r, c, pos
    cdef real base = <real> (rows.i0 + offset_of(p, rows.n) - j0), dist
    cdef real* line
    if by_key:
        for c in range(keys):
            line = s + c * key_step
            for r in range(rows.nrows):
                dist = <real> r + base - <real> c
                line[r] = line[r] - slope * (dist if dist >= 0 else -dist)
        return
    if slope == 0:
        return
    for r in range(rows.nrows):
        line = s + r * row_step
        pos = rows.i0 + r + offset_of(p, rows.n) - j0
        for c in range(keys):
            line[c * key_step] = line[c * key_step] - slope * <real> (
                pos - c if pos >= c else c - pos)


cdef inline void apply_mask(const Plan* p, const ScoreRows* rows, real* s,
                            Py_ssize_t row_step, Py_ssize_t key_step, Py_ssize_t j0,
                            Py_ssize_t keys, bint by_key) noexcept nogil:
    cdef const unsigned char* mask = rows.mask
    cdef Py_ssize_t m_rs = p.mask.row_stride, m_cs = p.mask.col_stride, r, c
    cdef real* line
    if by_key:
        for c in range(keys):
            line = s + c * key_step
            for r in range(rows.nrows):
                line[r] = line[r] if mask[r * m_rs + (j0 + c) * m_cs] else -INFINITY
        return
    for r in range(rows.nrows):
        line = s + r * row_step
        for c in range(keys):
            if not mask[r * m_rs + (j0 + c) * m_cs]:
                line[c * key_step] = -INFINITY


cdef inline void keep_positions(const Plan* p, const ScoreRows* rows, real* s,
                                Py_ssize_t row_step, Py_ssize_t key_step, Py_ssize_t j0,
                                Py_ssize_t keys, bint by_key) noexcept nogil:
    """-inf for the keys outside each row's range by position and length (from
    rows.lo/hi, or key_begin/key_end)."""
    cdef Py_ssize_t r, c, j, lo, hi
    cdef real* line
    if by_key and rows.lo != NULL:
        for c in range(keys):
            line = s + c * key_step
            j = j0 + c
            for r in range(rows.nrows):     # (& not `and`: no branch, it vectorises)
                line[r] = line[r] if (rows.lo[r] <= j) & (j < rows.hi[r]) else -INFINITY
        return
    for r in range(rows.nrows):
        line = s + r * row_step
        lo = key_begin(p, rows.n, rows.i0 + r) - j0
        hi = key_end(p, rows.n, rows.i0 + r) - j0
        lo = 0 if lo < 0 else (lo if lo < keys else keys)
        hi = lo if hi < lo else (hi if hi < keys else keys)
        for c in range(lo):
            line[c * key_step] = -INFINITY
        for c in range(hi, keys):
            line[c * key_step] = -INFINITY


cdef inline void dropout_weights(const Plan* p, Py_ssize_t n, real* s,
                                 Py_ssize_t row_step, Py_ssize_t key_step,
                                 Py_ssize_t nrows, Py_ssize_t i0, Py_ssize_t j0,
                                 Py_ssize_t keys) noexcept nogil:
    """Dropout of the weights s[r * row_step + c * key_step] of query i0 + r and key
    j0 + c of slice n (r < nrows, c < keys; j0 a multiple of 4): each is zeroed or
    scaled by 1 / (1 - dropout_p) as the Philox word of (seed, n, i, j) says
    (src/philox.h)."""
    cdef unsigned char keep[4]
    cdef real kept = <real> (1.0 / (1.0 - p.dropout_p))
    cdef Py_ssize_t r, cb, t, c, x
    for r in range(nrows):
        for cb in range((keys + 3) // 4):
            fastattn_dropout_keep4(p.dropout_seed, p.dropout_slice_base + n, i0 + r,
                                   j0 // 4 + cb, p.dropout_threshold, keep)
            for t in range(4):
                c = cb * 4 + t
                if c < keys:
                    x = r * row_step + c * key_step
                    s[x] = s[x] * kept if keep[t] else 0
