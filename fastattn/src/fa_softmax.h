/* The online softmax of a score block of the fused pass, with AVX-512 or AVX2 (the
   avx512 and avx2 levels' modules): st holds bc keys by 64 query lanes (QUERY_TILE),
   the first nr used (nr a multiple of 16). The same steps and the same special cases
   as the portable running_max / block_weights (_softmax.pxd): NaN scores skipped by
   the max and reaching the sums, -inf scores (forbidden keys) giving exactly 0, a row
   with no allowed key yet subtracting 0, the block's row sums in double.

   Two passes over the block where the portable code makes three (max; exp; sum), and
   eight keys' weights added in float32 before the sum in double (fa_block_exp's
   comment). With AVX-512, e^x by vscalefps (fa_exp16: no exponent bits to build, and
   0 below FLT_MIN as in fa_expf; fa_pow2_16, shorter, for the weights that the
   bfloat16 units take rounded to bfloat16: fa_bf16.h); with AVX2, fa_exp8, fa_expf's
   steps, so that the weights, and the maxima, are bit for bit the portable code's.
   The row sums agree with the portable code's to float32 rounding, not bit for bit.
   Each is the same for any number of threads. Elsewhere FA_HAVE_BLOCK_SOFTMAX is 0
   and the portable code runs. */
#ifndef FASTATTN_FA_SOFTMAX_H
#define FASTATTN_FA_SOFTMAX_H

#include <float.h>
#include <math.h>
#include <stddef.h>

#define FA_SOFTMAX_LANES 64         /* query lanes of a score tile: QUERY_TILE */

#if defined(__AVX512F__) && defined(__AVX512DQ__)
#define FA_HAVE_BLOCK_SOFTMAX 1
#include <immintrin.h>

/* e^x for x <= 0 or NaN (a score minus its row's maximum): x = n ln2 + r, n rounded
   to nearest by adding and subtracting 1.5 * 2^23 (one multiply-add and a subtraction),
   Cephes' degree-5 polynomial for e^r (as fa_expf) ending 1 + r (1 + r p) in two
   multiply-adds, times 2^n by vscalefps (no exponent bits to build): within 0.89 ulp of
   e^x over [-87, 0] (1.26 with a rounding instruction and p r^2 + (r + 1)). Below
   FA_EXP_LOW, where e^x is under FLT_MIN (-inf: a key the rules forbid), the result is
   exactly 0, as fa_expf's: x is first clamped there and those lanes are masked out of
   vscalefps, which never makes a subnormal or underflows (on Intel cores either takes
   a microcode assist, some 25 times the cost of the vector: a block with forbidden keys
   or far-below-max scores paid it per vector). NaN stays NaN (vmaxps returns its second
   operand when either is NaN; the unordered compare keeps the lane). */
#define FA_EXP_LOW (-87.33654f)     /* the least float x with e^x >= FLT_MIN */
#define FA_LOG2E 1.44269504088896341f

static inline __m512 fa_exp16(__m512 x) {
    const __m512 shift = _mm512_set1_ps(12582912.0f), low = _mm512_set1_ps(FA_EXP_LOW);
    const __mmask16 normal = _mm512_cmp_ps_mask(x, low, _CMP_NLT_UQ);
    __m512 n, r, p;
    x = _mm512_max_ps(low, x);
    n = _mm512_sub_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(FA_LOG2E), shift),
                      shift);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(_mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f)), r,
                        _mm512_set1_ps(1.0f));
    return _mm512_maskz_scalef_ps(normal, p, n);
}

/* 2^t, which is e^x for t = x log2(e), for the weights rounded to bfloat16 right after
   (the pairs' rounding errs by up to 2^-9 of a weight): 2^t = 2^f 2^floor(t), with
   f = t - floor(t) in [0, 1) by vreduceps, 2^f by a degree-4 polynomial (minimax in
   relative error, 2.96e-6 in float32) and 2^floor(t) by vscalefps: nine instructions
   where fa_exp16 takes fourteen, within 4.7e-6 of e^x for |x| < 30 (the rounding of t
   included). As fa_exp16: t is clamped at -126, where 2^t is FLT_MIN, and the lanes
   below it are 0 (no subnormal, no assist); NaN stays NaN. */
static inline __m512 fa_pow2_16(__m512 t) {
    const __m512 low = _mm512_set1_ps(-126.0f);
    const __mmask16 normal = _mm512_cmp_ps_mask(t, low, _CMP_NLT_UQ);
    __m512 f, p;
    t = _mm512_max_ps(low, t);
    f = _mm512_reduce_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    p = _mm512_fmadd_ps(_mm512_set1_ps(1.3426683843135834e-2f), f,
                        _mm512_set1_ps(5.2242472767829895e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4128019809722900e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9304484128952026e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_maskz_scalef_ps(normal, p, t);
}

/* The largest of x[0..n) as fastattn's row_max (_softmax.pxd) finds it: lane x of 16
   over entries x, x + 16, ... (a NaN entry skipped: vmaxps keeps its second operand),
   the lanes then taken in order, the tail one by one; so the same value, zeros' signs
   included. */
static inline float fa_row_max(const float *x, ptrdiff_t n) {
    ptrdiff_t c, main = n - n % 16;
    float part[16], m = -INFINITY;
    int i;
    if (main) {
        __m512 mx = _mm512_set1_ps(-INFINITY);
        for (c = 0; c < main; c += 16)
            mx = _mm512_max_ps(_mm512_loadu_ps(x + c), mx);
        _mm512_storeu_ps(part, mx);
        for (i = 0; i < 16; i++)
            m = part[i] > m ? part[i] : m;
    }
    for (c = main; c < n; c++)
        m = x[c] > m ? x[c] : m;
    return m;
}

/* The running max of 16 lanes after the block (NaN scores skipped), and m, m_sub and
   alpha of those lanes from it (fa_block_max). */
static inline void fa_lanes_max(__m512 old, __m512 mx, float *m, float *m_sub,
                                float *alpha) {
    __m512 sub = _mm512_mask_blend_ps(
        _mm512_cmp_ps_mask(mx, _mm512_set1_ps(-INFINITY), _CMP_EQ_OQ), mx,
        _mm512_setzero_ps());
    _mm512_storeu_ps(m, mx);
    _mm512_storeu_ps(m_sub, sub);
    _mm512_storeu_ps(alpha, fa_exp16(_mm512_sub_ps(old, sub)));
}

/* Key c's 16 lanes at x, times s where scale is not 1 (stored back), taken into mx. */
static inline __m512 fa_key_max(float *st, ptrdiff_t c, ptrdiff_t x, float scale,
                                __m512 s, __m512 mx) {
    float *p = st + c * FA_SOFTMAX_LANES + x;
    __m512 v = _mm512_loadu_ps(p);
    if (scale != 1.0f) {
        v = _mm512_mul_ps(v, s);
        _mm512_storeu_ps(p, v);
    }
    return _mm512_max_ps(v, mx);
}

/* st *= scale (unless scale is 1: already scaled), then per lane: m = the running max
   over the block (NaN scores skipped: they reach the sums), m_sub = m, or 0 where it
   is -inf (no allowed key yet), alpha = e^(m_old - m_sub), the factor of the earlier
   sums (running_max's steps). Each lane takes its keys in order; a whole tile's four
   groups of 16 lanes go through the keys side by side (four chains of vmaxps, whose
   latency a single chain would wait on). */
static inline void fa_block_max(float *st, ptrdiff_t bc, ptrdiff_t nr, float scale,
                                float *m, float *m_sub, float *alpha) {
    const __m512 s = _mm512_set1_ps(scale);
    ptrdiff_t x, c;
    if (nr == FA_SOFTMAX_LANES) {
        const __m512 o0 = _mm512_loadu_ps(m), o1 = _mm512_loadu_ps(m + 16);
        const __m512 o2 = _mm512_loadu_ps(m + 32), o3 = _mm512_loadu_ps(m + 48);
        __m512 m0 = o0, m1 = o1, m2 = o2, m3 = o3;
        for (c = 0; c < bc; c++) {
            m0 = fa_key_max(st, c, 0, scale, s, m0);
            m1 = fa_key_max(st, c, 16, scale, s, m1);
            m2 = fa_key_max(st, c, 32, scale, s, m2);
            m3 = fa_key_max(st, c, 48, scale, s, m3);
        }
        fa_lanes_max(o0, m0, m, m_sub, alpha);
        fa_lanes_max(o1, m1, m + 16, m_sub + 16, alpha + 16);
        fa_lanes_max(o2, m2, m + 32, m_sub + 32, alpha + 32);
        fa_lanes_max(o3, m3, m + 48, m_sub + 48, alpha + 48);
        return;
    }
    for (x = 0; x < nr; x += 16) {
        __m512 old = _mm512_loadu_ps(m + x), mx = old;
        for (c = 0; c < bc; c++)
            mx = fa_key_max(st, c, x, scale, s, mx);
        fa_lanes_max(old, mx, m + x, m_sub + x, alpha + x);
    }
}

/* e^(st - ms) of key c's 16 lanes, stored back */
static inline __m512 fa_exp_key(float *st, ptrdiff_t c, ptrdiff_t x, __m512 ms) {
    float *p = st + c * FA_SOFTMAX_LANES + x;
    __m512 e = fa_exp16(_mm512_sub_ps(_mm512_loadu_ps(p), ms));
    _mm512_storeu_ps(p, e);
    return e;
}

/* Eight keys' weights of 16 lanes added in float32 as the tree ((e0 + e1) + (e2 + e3))
   + ((e4 + e5) + (e6 + e7)). */
static inline __m512 fa_sum8(const __m512 e[8]) {
    return _mm512_add_ps(
        _mm512_add_ps(_mm512_add_ps(e[0], e[1]), _mm512_add_ps(e[2], e[3])),
        _mm512_add_ps(_mm512_add_ps(e[4], e[5]), _mm512_add_ps(e[6], e[7])));
}

/* e's 16 lanes widened and added to the double sums lo (lanes 0-7) and hi (8-15) */
static inline void fa_widen_add(__m512 e, __m512d *lo, __m512d *hi) {
    *lo = _mm512_add_pd(*lo, _mm512_cvtps_pd(_mm512_castps512_ps256(e)));
    *hi = _mm512_add_pd(*hi, _mm512_cvtps_pd(_mm512_extractf32x8_ps(e, 1)));
}

/* l[0..16) = alpha * l + the block's row sums (lo, hi), in double */
static inline void fa_rescaled_sums(double *l, __m512 alpha, __m512d lo, __m512d hi) {
    _mm512_storeu_pd(l, _mm512_add_pd(_mm512_mul_pd(
        _mm512_loadu_pd(l), _mm512_cvtps_pd(_mm512_castps512_ps256(alpha))), lo));
    _mm512_storeu_pd(l + 8, _mm512_add_pd(_mm512_mul_pd(
        _mm512_loadu_pd(l + 8), _mm512_cvtps_pd(_mm512_extractf32x8_ps(alpha, 1))),
        hi));
}

/* st = e^(st - m_sub) (the block's weights) and the running sums l = alpha * l + the
   block's row sums, summed in double (block_weights' steps). Eight keys' weights are
   first added in float32 as a tree ((e0 + e1) + (e2 + e3)) + ((e4 + e5) + (e6 + e7)),
   then widened and added in double: the float32 additions err by at most 3 * 2^-24
   of the row sum (three roundings, each relative to a part of it), and the widening
   and the double additions, which cost much of the tile's own time outside the
   products when done per key, run once per eight keys (eight rather than four:
   docs/performance.md). */
static inline void fa_block_exp(float *st, ptrdiff_t bc, ptrdiff_t nr,
                                const float *m_sub, const float *alpha, double *l) {
    ptrdiff_t x, c;
    int i;
    for (x = 0; x < nr; x += 16) {
        const __m512 ms = _mm512_loadu_ps(m_sub + x);
        __m512d lo = _mm512_setzero_pd(), hi = _mm512_setzero_pd();
        for (c = 0; c + 8 <= bc; c += 8) {
            __m512 e[8];
            for (i = 0; i < 8; i++)
                e[i] = fa_exp_key(st, c + i, x, ms);
            fa_widen_add(fa_sum8(e), &lo, &hi);
        }
        for (; c < bc; c++)
            fa_widen_add(fa_exp_key(st, c, x, ms), &lo, &hi);
        fa_rescaled_sums(l + x, _mm512_loadu_ps(alpha + x), lo, hi);
    }
}

#elif defined(__AVX2__) && defined(__FMA__)
#define FA_HAVE_BLOCK_SOFTMAX 1
#include <immintrin.h>

/* fa_expf (src/fa_exp.h) of 8 lanes for x <= 0 or NaN, bit for bit as gcc's
   vectorised fa_expf (the same steps, the same multiply-adds fused): x clamped at -88
   (NaN passes), n = x log2(e) rounded by the 1.5 * 2^23 trick, Cephes' polynomial for
   e^r, times 2^n in one product (its two factors in fa_expf matter only below FLT_MIN,
   where both give 0). */
static inline __m256 fa_exp8(__m256 x) {
    const __m256 magic = _mm256_set1_ps(12582912.0f);
    __m256 xc = _mm256_max_ps(_mm256_set1_ps(-88.0f), x);
    __m256 t = _mm256_fmadd_ps(xc, _mm256_set1_ps(1.44269504088896341f), magic);
    __m256 n = _mm256_sub_ps(t, magic), r, p, e;
    __m256i k = _mm256_sub_epi32(_mm256_castps_si256(t), _mm256_castps_si256(magic));
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), xc);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
    e = _mm256_mul_ps(p, _mm256_castsi256_ps(_mm256_slli_epi32(
        _mm256_add_epi32(k, _mm256_set1_epi32(127)), 23)));
    return _mm256_andnot_ps(_mm256_cmp_ps(e, _mm256_set1_ps(FLT_MIN), _CMP_LT_OQ), e);
}

/* row_max (_softmax.pxd) as its portable loop finds it: lanes 0-7 and 8-15 over
   entries x, x + 16, ..., then the 16 lanes in order and the tail one by one. */
static inline float fa_row_max(const float *x, ptrdiff_t n) {
    ptrdiff_t c, main = n - n % 16;
    float part[16], m = -INFINITY;
    int i;
    if (main) {
        __m256 lo = _mm256_set1_ps(-INFINITY), hi = lo;
        for (c = 0; c < main; c += 16) {
            lo = _mm256_max_ps(_mm256_loadu_ps(x + c), lo);
            hi = _mm256_max_ps(_mm256_loadu_ps(x + c + 8), hi);
        }
        _mm256_storeu_ps(part, lo);
        _mm256_storeu_ps(part + 8, hi);
        for (i = 0; i < 16; i++)
            m = part[i] > m ? part[i] : m;
    }
    for (c = main; c < n; c++)
        m = x[c] > m ? x[c] : m;
    return m;
}

/* m, m_sub and alpha of 8 lanes from their old and new running max */
static inline void fa_lanes_max(__m256 old, __m256 mx, float *m, float *m_sub,
                                float *alpha) {
    __m256 sub = _mm256_andnot_ps(
        _mm256_cmp_ps(mx, _mm256_set1_ps(-INFINITY), _CMP_EQ_OQ), mx);
    _mm256_storeu_ps(m, mx);
    _mm256_storeu_ps(m_sub, sub);
    _mm256_storeu_ps(alpha, fa_exp8(_mm256_sub_ps(old, sub)));
}

/* Key c's 8 lanes at x, times s where scale is not 1 (stored back), taken into mx. */
static inline __m256 fa_key_max(float *st, ptrdiff_t c, ptrdiff_t x, float scale,
                                __m256 s, __m256 mx) {
    float *p = st + c * FA_SOFTMAX_LANES + x;
    __m256 v = _mm256_loadu_ps(p);
    if (scale != 1.0f) {
        v = _mm256_mul_ps(v, s);
        _mm256_storeu_ps(p, v);
    }
    return _mm256_max_ps(v, mx);
}

/* running_max's steps (st times scale first unless scale is 1), the same values: each
   lane takes its keys in order, 32 lanes side by side (four chains of vmaxps). */
static inline void fa_block_max(float *st, ptrdiff_t bc, ptrdiff_t nr, float scale,
                                float *m, float *m_sub, float *alpha) {
    const __m256 s = _mm256_set1_ps(scale);
    ptrdiff_t x, c;
    for (x = 0; x + 32 <= nr; x += 32) {
        const __m256 o0 = _mm256_loadu_ps(m + x), o1 = _mm256_loadu_ps(m + x + 8);
        const __m256 o2 = _mm256_loadu_ps(m + x + 16), o3 = _mm256_loadu_ps(m + x + 24);
        __m256 m0 = o0, m1 = o1, m2 = o2, m3 = o3;
        for (c = 0; c < bc; c++) {
            m0 = fa_key_max(st, c, x, scale, s, m0);
            m1 = fa_key_max(st, c, x + 8, scale, s, m1);
            m2 = fa_key_max(st, c, x + 16, scale, s, m2);
            m3 = fa_key_max(st, c, x + 24, scale, s, m3);
        }
        fa_lanes_max(o0, m0, m + x, m_sub + x, alpha + x);
        fa_lanes_max(o1, m1, m + x + 8, m_sub + x + 8, alpha + x + 8);
        fa_lanes_max(o2, m2, m + x + 16, m_sub + x + 16, alpha + x + 16);
        fa_lanes_max(o3, m3, m + x + 24, m_sub + x + 24, alpha + x + 24);
    }
    for (; x < nr; x += 8) {
        __m256 old = _mm256_loadu_ps(m + x), mx = old;
        for (c = 0; c < bc; c++)
            mx = fa_key_max(st, c, x, scale, s, mx);
        fa_lanes_max(old, mx, m + x, m_sub + x, alpha + x);
    }
}

/* e^(st - ms) of key c's 8 lanes at x, stored back */
static inline __m256 fa_exp_key8(float *st, ptrdiff_t c, ptrdiff_t x, __m256 ms) {
    float *p = st + c * FA_SOFTMAX_LANES + x;
    __m256 e = fa_exp8(_mm256_sub_ps(_mm256_loadu_ps(p), ms));
    _mm256_storeu_ps(p, e);
    return e;
}

/* block_weights' steps: st = e^(st - m_sub) (the same values), then per lane the
   block's weights summed and l = alpha * l + that sum, in one pass over the block. As
   with AVX-512, eight keys' weights are first added in float32 as the tree
   ((e0 + e1) + (e2 + e3)) + ((e4 + e5) + (e6 + e7)), then widened and added in double
   (the float32 additions err by at most 3 * 2^-24 of the row sum), the tail key by
   key. */
static inline void fa_block_exp(float *st, ptrdiff_t bc, ptrdiff_t nr,
                                const float *m_sub, const float *alpha, double *l) {
    ptrdiff_t x, c;
    for (x = 0; x < nr; x += 8) {
        const __m256 ms = _mm256_loadu_ps(m_sub + x), a = _mm256_loadu_ps(alpha + x);
        __m256d lo = _mm256_setzero_pd(), hi = _mm256_setzero_pd();
        for (c = 0; c + 8 <= bc; c += 8) {
            __m256 e01 = _mm256_add_ps(fa_exp_key8(st, c, x, ms),
                                       fa_exp_key8(st, c + 1, x, ms));
            __m256 e23 = _mm256_add_ps(fa_exp_key8(st, c + 2, x, ms),
                                       fa_exp_key8(st, c + 3, x, ms));
            __m256 e45 = _mm256_add_ps(fa_exp_key8(st, c + 4, x, ms),
                                       fa_exp_key8(st, c + 5, x, ms));
            __m256 e67 = _mm256_add_ps(fa_exp_key8(st, c + 6, x, ms),
                                       fa_exp_key8(st, c + 7, x, ms));
            __m256 e = _mm256_add_ps(_mm256_add_ps(e01, e23), _mm256_add_ps(e45, e67));
            lo = _mm256_add_pd(lo, _mm256_cvtps_pd(_mm256_castps256_ps128(e)));
            hi = _mm256_add_pd(hi, _mm256_cvtps_pd(_mm256_extractf128_ps(e, 1)));
        }
        for (; c < bc; c++) {
            __m256 e = fa_exp_key8(st, c, x, ms);
            lo = _mm256_add_pd(lo, _mm256_cvtps_pd(_mm256_castps256_ps128(e)));
            hi = _mm256_add_pd(hi, _mm256_cvtps_pd(_mm256_extractf128_ps(e, 1)));
        }
        _mm256_storeu_pd(l + x, _mm256_fmadd_pd(
            _mm256_loadu_pd(l + x), _mm256_cvtps_pd(_mm256_castps256_ps128(a)), lo));
        _mm256_storeu_pd(l + x + 4, _mm256_fmadd_pd(
            _mm256_loadu_pd(l + x + 4), _mm256_cvtps_pd(_mm256_extractf128_ps(a, 1)), hi));
    }
}

#else   /* never called: the portable running_max / block_weights run */

#define FA_HAVE_BLOCK_SOFTMAX 0

static inline float fa_row_max(const float *x, ptrdiff_t n) {
    (void) x; (void) n;
    return 0;
}
static inline void fa_block_max(float *st, ptrdiff_t bc, ptrdiff_t nr, float scale,
                                float *m, float *m_sub, float *alpha) {
    (void) st; (void) bc; (void) nr; (void) scale; (void) m; (void) m_sub; (void) alpha;
}
static inline void fa_block_exp(float *st, ptrdiff_t bc, ptrdiff_t nr,
                                const float *m_sub, const float *alpha, double *l) {
    (void) st; (void) bc; (void) nr; (void) m_sub; (void) alpha; (void) l;
}

#endif
#endif
