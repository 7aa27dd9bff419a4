/* The products of bfloat16 attention on AVX512-BF16, by one small GEMM
   (fa_bf16_product): the scores S = scale * K Q^T, and the backward's gradient products
   (below). vdpbf16ps multiplies pairs of bfloat16 values and adds both products to a
   float32 lane, so one instruction does the work of two float32 FMAs and K is read as
   it is stored (no widening to float32).

   Layout (the fused pass's score tile, keys by query rows, QUERY_TILE = 64 lanes):
     qp[t * 64 + r]   the pair (q[r, 2t], q[r, 2t + 1]) of query row r, as one 32-bit
                      word (low half: element 2t); rows past the tile are zero
     k[j * k_rs + c]  key j, element c: a pair is two adjacent elements of a key row,
                      loaded as one 32-bit word and broadcast
     st[j * 64 + r]   the scaled score of key j for query row r

   Products of two bfloat16 values are exact in float32 and the sums run in float32, as
   in the float32 path; vdpbf16ps treats subnormal inputs and results as zero.

   Compiled only where the compiler has the instructions and the module targets
   AVX-512 (the avx512 level's driver module); FA_HAVE_AVX512_BF16 says so. The
   functions carry their own target attribute: the module is not built with
   -mavx512bf16, and they are called only when the CPU has it (fastattn._dispatch). */
#ifndef FASTATTN_FA_BF16_H
#define FASTATTN_FA_BF16_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "fa_half.h"
#include "fa_softmax.h"
#include "fa_transpose.h"

#define FA_BF16_LANES 64            /* query rows of a score tile: QUERY_TILE */

/* (with AVX-512DQ, which fa_softmax.h's AVX-512 steps, used here, need) */
#if defined(__AVX512F__) && defined(__AVX512DQ__) && defined(__x86_64__) && \
    ((defined(__clang__) && __clang_major__ >= 9) || \
     (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 10))
#define FA_HAVE_AVX512_BF16 1
#else
#define FA_HAVE_AVX512_BF16 0
#endif

/* qp = the pairs of nrows query rows of E (even) bfloat16 elements (row stride q_rs),
   rows nrows..63 zero. A pair is the 32-bit word its two elements make in memory, so
   where the rows' words are aligned packing is a transpose of 32-bit words. */
static inline void fa_bf16_pack_queries(const uint16_t *q, ptrdiff_t q_rs,
                                        ptrdiff_t nrows, ptrdiff_t E, uint32_t *qp) {
    ptrdiff_t t, r;
    if (q_rs % 2 == 0 && ((uintptr_t) q & 3) == 0) {
        fa_transpose32(q, q_rs / 2, nrows, E / 2, qp, FA_BF16_LANES, FA_BF16_LANES,
                       NULL, 0);
        return;
    }
    for (t = 0; t < E / 2; t++) {
        for (r = 0; r < nrows; r++)
            qp[t * FA_BF16_LANES + r] = (uint32_t) q[r * q_rs + 2 * t]
                                        | ((uint32_t) q[r * q_rs + 2 * t + 1] << 16);
        for (; r < FA_BF16_LANES; r++)
            qp[t * FA_BF16_LANES + r] = 0;
    }
}

/* bp (32, N) = the pairs of rows of x (nrows <= 64 rows of N bfloat16 elements, row
   stride x_rs), rows nrows..63 zero: bp[t * N + n] = (x[2t, n], x[2t + 1, n]); the
   right-hand side of a product over a tile's 64 query lanes. */
static inline void fa_bf16_pair_rows(const uint16_t *x, ptrdiff_t x_rs, ptrdiff_t nrows,
                                     ptrdiff_t N, uint32_t *bp) {
    ptrdiff_t t, n;
    for (t = 0; t < FA_BF16_LANES / 2; t++) {
        uint32_t *row = bp + t * N;
        if (2 * t + 1 < nrows) {
            const uint16_t *r0 = x + 2 * t * x_rs, *r1 = r0 + x_rs;
            for (n = 0; n < N; n++)
                row[n] = (uint32_t) r0[n] | ((uint32_t) r1[n] << 16);
        } else if (2 * t < nrows) {
            const uint16_t *r0 = x + 2 * t * x_rs;
            for (n = 0; n < N; n++)
                row[n] = r0[n];
        } else {
            memset(row, 0, (size_t) N * sizeof *row);
        }
    }
}

/* kt (E, kt_rs) = the transpose of nkeys rows of k (E bfloat16 elements, row stride
   k_rs), columns nkeys..kt_rs - 1 zero: the left-hand side of dQ^T += K^T dS^T. */
static inline void fa_bf16_transpose_keys(const uint16_t *k, ptrdiff_t k_rs,
                                          ptrdiff_t nkeys, ptrdiff_t E, uint16_t *kt,
                                          ptrdiff_t kt_rs) {
    ptrdiff_t c, e;
    for (e = 0; e < E; e++) {
        for (c = 0; c < nkeys; c++)
            kt[e * kt_rs + c] = k[c * k_rs + e];
        for (; c < kt_rs; c++)
            kt[e * kt_rs + c] = 0;
    }
}

#if FA_HAVE_AVX512_BF16
#include <immintrin.h>

#define FA_BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512bf16")))

/* MR rows of c (row stride ldc) and one panel of 64 columns: 4 x MR accumulators of 16
   lanes over K2 pairs, one broadcast pair of a row of a and four vectors of the pairs
   bp (row stride bp_rs words) per step; c = alpha * sum, or c += alpha * sum. */
#define FA_BF16_ROWS(MR)                                                              \
FA_BF16_TARGET static void fa_bf16_rows_##MR(const uint16_t *a, ptrdiff_t a_rs,      \
                                             const uint32_t *bp, ptrdiff_t bp_rs,     \
                                             ptrdiff_t K2, float alpha, float *c,     \
                                             ptrdiff_t ldc, int accumulate) {         \
    __m512 acc[MR][4];                                                                \
    __m512bh b[4];                                                                    \
    uint32_t pair;                                                                    \
    ptrdiff_t t;                                                                      \
    int i, x;                                                                         \
    for (i = 0; i < MR; i++)                                                          \
        for (x = 0; x < 4; x++)                                                       \
            acc[i][x] = _mm512_setzero_ps();                                          \
    for (t = 0; t < K2; t++) {                                                        \
        for (x = 0; x < 4; x++)                                                       \
            b[x] = (__m512bh) _mm512_loadu_si512(bp + t * bp_rs + 16 * x);            \
        for (i = 0; i < MR; i++) {                                                    \
            __m512bh ai;                                                              \
            memcpy(&pair, a + i * a_rs + 2 * t, sizeof pair);                         \
            ai = (__m512bh) _mm512_set1_epi32((int) pair);                            \
            for (x = 0; x < 4; x++)                                                   \
                acc[i][x] = _mm512_dpbf16_ps(acc[i][x], ai, b[x]);                    \
        }                                                                             \
    }                                                                                 \
    for (i = 0; i < MR; i++)                                                          \
        for (x = 0; x < 4; x++) {                                                     \
            float *ci = c + i * ldc + 16 * x;                                         \
            _mm512_storeu_ps(ci, accumulate                                           \
                ? _mm512_fmadd_ps(acc[i][x], _mm512_set1_ps(alpha), _mm512_loadu_ps(ci)) \
                : _mm512_mul_ps(acc[i][x], _mm512_set1_ps(alpha)));                   \
        }                                                                             \
}

FA_BF16_ROWS(6)
FA_BF16_ROWS(4)
FA_BF16_ROWS(2)
FA_BF16_ROWS(1)

/* c (M, N; row stride ldc) = alpha * a . b, or c += that (accumulate): a (M, 2 K2)
   bfloat16 rows (row stride a_rs elements, read a pair at a time), b (2 K2, N) as its
   pairs of rows, bp[t * bp_rs + n] = (b[2t, n], b[2t + 1, n]); N a multiple of 64. */
FA_BF16_TARGET static void fa_bf16_product(const uint16_t *a, ptrdiff_t a_rs,
                                           ptrdiff_t M, const uint32_t *bp,
                                           ptrdiff_t bp_rs, ptrdiff_t K2, ptrdiff_t N,
                                           float alpha, float *c, ptrdiff_t ldc,
                                           int accumulate) {
    ptrdiff_t i, n0;
    for (n0 = 0; n0 < N; n0 += FA_BF16_LANES) {
        const uint32_t *b = bp + n0;
        float *cn = c + n0;
        for (i = 0; i + 6 <= M; i += 6)
            fa_bf16_rows_6(a + i * a_rs, a_rs, b, bp_rs, K2, alpha, cn + i * ldc, ldc,
                           accumulate);
        for (; i + 4 <= M; i += 4)
            fa_bf16_rows_4(a + i * a_rs, a_rs, b, bp_rs, K2, alpha, cn + i * ldc, ldc,
                           accumulate);
        for (; i + 2 <= M; i += 2)
            fa_bf16_rows_2(a + i * a_rs, a_rs, b, bp_rs, K2, alpha, cn + i * ldc, ldc,
                           accumulate);
        for (; i < M; i++)
            fa_bf16_rows_1(a + i * a_rs, a_rs, b, bp_rs, K2, alpha, cn + i * ldc, ldc,
                           accumulate);
    }
}

/* st (bc, 64) = alpha * (bc keys of k, row stride k_rs) . qp, over E2 pairs. */
FA_BF16_TARGET static void fa_bf16_scores(const uint16_t *k, ptrdiff_t k_rs,
                                          ptrdiff_t bc, const uint32_t *qp,
                                          ptrdiff_t E2, float alpha, float *st) {
    fa_bf16_product(k, k_rs, bc, qp, FA_BF16_LANES, E2, FA_BF16_LANES, alpha, st,
                    FA_BF16_LANES, 0);
}

/* vt[c * ldv + w] = the pair (v[2w, c], v[2w + 1, c]) (zero past bc), for c < Ev and
   w < ldv = the block's keys padded to 32, halved (Ev % 16 == 0, bc <= 64): V^T as
   the left operand of the values' product (AMX tiles, fa_bf16_pv). 16 pairs by 32
   columns at a time: rows 2w and 2w + 1 interleaved word by word (vpunpcklwd and
   vpunpckhwd: in each 128-bit lane L the pairs of columns 8L..8L+3, then 8L+4..8L+7),
   the two sets of 16 pair words transposed, each transposed row stored at its column.
   Returns whether every value read is finite (no exponent of all ones, inf or NaN:
   the largest exponent field read is below 0x7f80); if not, vt is not used. */
FA_BF16_TARGET static int fa_bf16_pack_values(const uint16_t *v, ptrdiff_t v_rs,
                                             ptrdiff_t bc, ptrdiff_t Ev, uint32_t *vt) {
    const ptrdiff_t ldv = (bc + 31) / 32 * 16;
    const __m512i ones = _mm512_set1_epi16(0x7F80);
    __m512i top = _mm512_setzero_si512();
    ptrdiff_t w, c, i, m, col;
    __m512 lo4[16], hi4[16];
    for (w = 0; w < ldv; w += 16)
        for (c = 0; c < Ev; c += 32) {
            const ptrdiff_t nc = Ev - c < 32 ? Ev - c : 32;     /* 16 or 32 */
            const __mmask32 cols = nc == 32 ? 0xFFFFFFFFu : 0xFFFFu;
            for (i = 0; i < 16; i++) {
                ptrdiff_t j = 2 * (w + i);
                __m512i lo = _mm512_setzero_si512(), hi = _mm512_setzero_si512();
                if (j < bc)
                    lo = _mm512_maskz_loadu_epi16(cols, v + j * v_rs + c);
                if (j + 1 < bc)
                    hi = _mm512_maskz_loadu_epi16(cols, v + (j + 1) * v_rs + c);
                top = _mm512_max_epu16(top, _mm512_max_epu16(
                    _mm512_and_si512(lo, ones), _mm512_and_si512(hi, ones)));
                lo4[i] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(lo, hi));
                hi4[i] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(lo, hi));
            }
            fa_transpose16(lo4);
            fa_transpose16(hi4);
            for (m = 0; m < 16; m++) {
                col = 8 * (m / 4) + m % 4;
                if (col >= nc)
                    continue;
                _mm512_storeu_ps((float *) (vt + (c + col) * ldv + w), lo4[m]);
                _mm512_storeu_ps((float *) (vt + (c + col + 4) * ldv + w), hi4[m]);
            }
        }
    return _mm512_cmpeq_epi16_mask(top, ones) == 0;
}

/* The 16 pairs of two rows' 16 lanes: h holds row 2w's lanes rounded to bfloat16 in
   its words 0-15 and row 2w + 1's in 16-31 (vcvtne2ps2bf16); word r of the result is
   the pair (row 2w, row 2w + 1) of lane r. */
FA_BF16_TARGET static inline __m512i fa_bf16_pairs16(__m512i h) {
    const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26,
                                           10, 25, 9, 24, 8, 23, 7, 22, 6, 21, 5, 20, 4,
                                           19, 3, 18, 2, 17, 1, 16, 0);
    return _mm512_permutexvar_epi16(pairs, h);
}

/* pp[w * 64 + r] = the pair (P[2w, r], P[2w + 1, r]) of the weights P = st[j * 64 + r]
   (j < bc, r < nr; nr a multiple of 16) rounded to bfloat16 (to nearest even), zero
   for the keys past bc up to a multiple of 32: the right operand of the values'
   product. With pl: pl the same pairs of P - bf16(P) (exact in float32), rounded, the
   low parts of weights kept to 16 bits. */
FA_BF16_TARGET static void fa_bf16_pack_weights(const float *st, ptrdiff_t bc,
                                                ptrdiff_t nr, uint32_t *pp,
                                                uint32_t *pl) {
    const ptrdiff_t kc = (bc + 31) / 32 * 32;
    const __m512 zero = _mm512_setzero_ps();
    ptrdiff_t w, x;
    for (w = 0; w < kc / 2; w++)
        for (x = 0; x < nr; x += 16) {
            __m512 p0 = 2 * w < bc ? _mm512_loadu_ps(st + 2 * w * FA_BF16_LANES + x) : zero;
            __m512 p1 = 2 * w + 1 < bc ? _mm512_loadu_ps(st + (2 * w + 1) * FA_BF16_LANES + x)
                                       : zero;
            __m512i h = (__m512i) _mm512_cvtne2ps_pbh(p1, p0);
            _mm512_storeu_si512(pp + w * FA_BF16_LANES + x, fa_bf16_pairs16(h));
            if (pl) {
                __m512i w0 = _mm512_slli_epi32(_mm512_cvtepu16_epi32(
                                 _mm512_castsi512_si256(h)), 16);
                __m512i w1 = _mm512_slli_epi32(_mm512_cvtepu16_epi32(
                                 _mm512_extracti64x4_epi64(h, 1)), 16);
                __m512i l = (__m512i) _mm512_cvtne2ps_pbh(
                    _mm512_sub_ps(p1, _mm512_castsi512_ps(w1)),
                    _mm512_sub_ps(p0, _mm512_castsi512_ps(w0)));
                _mm512_storeu_si512(pl + w * FA_BF16_LANES + x, fa_bf16_pairs16(l));
            }
        }
}

/* fa_block_max for a positive scale, without storing the scaled scores: each lane's
   max over the block of st as it is, then times scale (rounding keeps the order of the
   products, so that is the max of the scaled scores: the same m, m_sub and alpha),
   four keys side by side (four chains of vmaxps; bc a multiple of 4). st is left
   unscaled, for fa_bf16_weight_pairs to scale as it reads it. */
FA_BF16_TARGET static void fa_block_max_unscaled(const float *st, ptrdiff_t bc,
                                                 ptrdiff_t nr, float scale, float *m,
                                                 float *m_sub, float *alpha) {
    const __m512 s = _mm512_set1_ps(scale);
    ptrdiff_t x, c;
    for (x = 0; x < nr; x += 16) {
        __m512 m0 = _mm512_set1_ps(-INFINITY), m1 = m0, m2 = m0, m3 = m0, old, mx;
        for (c = 0; c < bc; c += 4) {
            const float *p = st + c * FA_BF16_LANES + x;
            m0 = _mm512_max_ps(_mm512_loadu_ps(p), m0);
            m1 = _mm512_max_ps(_mm512_loadu_ps(p + FA_BF16_LANES), m1);
            m2 = _mm512_max_ps(_mm512_loadu_ps(p + 2 * FA_BF16_LANES), m2);
            m3 = _mm512_max_ps(_mm512_loadu_ps(p + 3 * FA_BF16_LANES), m3);
        }
        old = _mm512_loadu_ps(m + x);
        mx = _mm512_max_ps(_mm512_max_ps(m0, m1), _mm512_max_ps(m2, m3));
        mx = _mm512_mul_ps(mx, s);
        fa_lanes_max(old, _mm512_max_ps(mx, old), m + x, m_sub + x, alpha + x);
    }
}

/* The block's weights straight into pp: P = e^(scale * st - m_sub) by fa_pow2_16 (the
   difference by one multiply-add, rounded once), l = alpha * l + the block's row sums
   (summed as fa_block_exp sums them, from P unrounded), and pp[w * 64 + r] the pairs
   (P[2w, r], P[2w + 1, r]) rounded to bfloat16, as fa_bf16_pack_weights packs them.
   st (bc keys, bc a multiple of 32, by nr lanes): the weights never go through memory
   in float32. pp may be st itself: pair row w, at lanes x, is written once score rows
   up to 2w + 1 have been read at those lanes, and no other lanes (the vector loads
   and stores keep their order: the intrinsics' types may alias). With
   fa_block_max_unscaled first (or scale 1 after fa_block_max). */
FA_BF16_TARGET static void fa_bf16_weight_pairs(const float *st, ptrdiff_t bc,
                                                ptrdiff_t nr, float scale,
                                                const float *m_sub, const float *alpha,
                                                double *l, uint32_t *pp) {
    const __m512 s = _mm512_set1_ps(scale), log2e = _mm512_set1_ps(FA_LOG2E);
    ptrdiff_t x, c;
    int i;
    for (x = 0; x < nr; x += 16) {
        const __m512 ms = _mm512_loadu_ps(m_sub + x);
        __m512d lo = _mm512_setzero_pd(), hi = _mm512_setzero_pd();
        for (c = 0; c < bc; c += 8) {
            __m512 e[8];
            for (i = 0; i < 8; i++)
                e[i] = fa_pow2_16(_mm512_mul_ps(_mm512_fmsub_ps(
                    _mm512_loadu_ps(st + (c + i) * FA_BF16_LANES + x), s, ms), log2e));
            for (i = 0; i < 8; i += 2)
                _mm512_storeu_si512(pp + (c + i) / 2 * FA_BF16_LANES + x,
                                    fa_bf16_pairs16((__m512i) _mm512_cvtne2ps_pbh(
                                        e[i + 1], e[i])));
            fa_widen_add(fa_sum8(e), &lo, &hi);
        }
        fa_rescaled_sums(l + x, _mm512_loadu_ps(alpha + x), lo, hi);
    }
}

/* Eight value columns by 32 query lanes of the values' product: acc[c * 64 + r] (+)=
   the sum over the w < K2 pairs of vt[c * ldv + w] . pp[w * 64 + r], summed from zero
   in registers (first: stored, else added; with alpha, the 32 lanes' factors, added
   to acc times alpha where alpha != 0, else to 0: the online softmax's rescale, the
   same roundings as a pass of its own before). */
FA_BF16_TARGET static void fa_bf16_pv_8x32(const uint32_t *vt, ptrdiff_t ldv,
                                           ptrdiff_t K2, const uint32_t *pp, float *acc,
                                           int first, const float *alpha) {
    __m512 sum[8][2], sc[2];
    __mmask16 kept[2];
    ptrdiff_t w;
    int i, x;
    for (i = 0; i < 8; i++)
        for (x = 0; x < 2; x++)
            sum[i][x] = _mm512_setzero_ps();
    for (w = 0; w < K2; w++) {
        __m512bh b0 = (__m512bh) _mm512_loadu_si512(pp + w * FA_BF16_LANES);
        __m512bh b1 = (__m512bh) _mm512_loadu_si512(pp + w * FA_BF16_LANES + 16);
        for (i = 0; i < 8; i++) {
            __m512bh a = (__m512bh) _mm512_set1_epi32((int) vt[i * ldv + w]);
            sum[i][0] = _mm512_dpbf16_ps(sum[i][0], a, b0);
            sum[i][1] = _mm512_dpbf16_ps(sum[i][1], a, b1);
        }
    }
    for (x = 0; x < 2; x++) {
        sc[x] = alpha ? _mm512_loadu_ps(alpha + 16 * x) : _mm512_set1_ps(1.0f);
        kept[x] = _mm512_cmp_ps_mask(sc[x], _mm512_setzero_ps(), _CMP_NEQ_UQ);
    }
    for (i = 0; i < 8; i++)
        for (x = 0; x < 2; x++) {
            float *ci = acc + i * FA_BF16_LANES + 16 * x;
            if (first)
                _mm512_storeu_ps(ci, sum[i][x]);
            else if (alpha)
                _mm512_storeu_ps(ci, _mm512_add_ps(
                    _mm512_maskz_mul_ps(kept[x], _mm512_loadu_ps(ci), sc[x]),
                    sum[i][x]));
            else
                _mm512_storeu_ps(ci, _mm512_add_ps(_mm512_loadu_ps(ci), sum[i][x]));
        }
}

/* The values' product on vdpbf16ps, the same operands as AMX's fa_amx_pv: acc[c * 64 +
   r] (c < Ev, r < nr; Ev % 16 == 0, nr a multiple of 32) += the sum over the bc keys
   j of v[j, c] * P[j, r] (first: =), vt from fa_bf16_pack_values, the weights P
   rounded once to bfloat16 as pairs in pp (fa_bf16_pack_weights or
   fa_bf16_weight_pairs). With alpha (nr lanes' factors; not first), acc is rescaled
   on the way: acc[c * 64 + r] = alpha[r] acc[c * 64 + r] (0 where alpha[r] is 0) +
   the sum, bit for bit as a rescaling pass before the product. */
FA_BF16_TARGET static void fa_bf16_pv(const uint32_t *vt, ptrdiff_t bc, ptrdiff_t Ev,
                                      const uint32_t *pp, ptrdiff_t nr, float *acc,
                                      int first, const float *alpha) {
    const ptrdiff_t ldv = (bc + 31) / 32 * 16;
    ptrdiff_t c, x;
    for (c = 0; c < Ev; c += 8)
        for (x = 0; x < nr; x += 32)
            fa_bf16_pv_8x32(vt + c * ldv, ldv, (bc + 1) / 2, pp + x,
                            acc + c * FA_BF16_LANES + x, first,
                            alpha ? alpha + x : NULL);
}

/* The backward's gradient products with P and dS rounded to bfloat16 (as PyTorch's
   CPU backward rounds them for its bfloat16 products), by fa_bf16_product; a tile is
   (bc, 64): keys by query lanes (fastattn/_tiles_backward.pxd). */

/* a (bc, 64) = the tile st rounded to bfloat16 (vcvtneps2bf16: to nearest even). */
FA_BF16_TARGET static void fa_bf16_round_tile(const float *st, ptrdiff_t bc,
                                              uint16_t *a) {
    ptrdiff_t x;
    for (x = 0; x < bc * FA_BF16_LANES; x += 16)
        _mm256_storeu_si256((__m256i *) (a + x),
                            (__m256i) _mm512_cvtneps_pbh(_mm512_loadu_ps(st + x)));
}

/* d[0..n) = s[0..n) rounded to bfloat16 as fa_narrow_row rounds it (fa_f32_to_bf16:
   to nearest even, a NaN the quiet NaN of its sign, a subnormal rounded like the
   rest), 32 at a time by vcvtne2ps2bf16 where no lane is NaN or subnormal (the
   instruction flushes subnormals and keeps a NaN's payload), else as fa_narrow_row.
   Only where the CPU has AVX512-BF16 (a plan on the bfloat16 units). */
FA_BF16_TARGET static void fa_bf16_narrow_row(const float *s, ptrdiff_t n,
                                              uint16_t *d) {
    /* vfpclassps' classes: quiet NaN, subnormal, signalling NaN */
    const int odd = 0x01 | 0x20 | 0x80;
    ptrdiff_t c;
    for (c = 0; c + 32 <= n; c += 32) {
        __m512 lo = _mm512_loadu_ps(s + c), hi = _mm512_loadu_ps(s + c + 16);
        if (_mm512_fpclass_ps_mask(lo, odd) | _mm512_fpclass_ps_mask(hi, odd))
            fa_narrow_row(s + c, 32, d + c, FA_STORED_BFLOAT16);
        else
            _mm512_storeu_si512(d + c, (__m512i) _mm512_cvtne2ps_pbh(hi, lo));
    }
    fa_narrow_row(s + c, n - c, d + c, FA_STORED_BFLOAT16);
}

#else   /* no kernel in this module: never called (fastattn._plan's dot_kernel) */

static inline void fa_bf16_scores(const uint16_t *k, ptrdiff_t k_rs, ptrdiff_t bc,
                                  const uint32_t *qp, ptrdiff_t E2, float alpha,
                                  float *st) {
    (void) k; (void) k_rs; (void) bc; (void) qp; (void) E2; (void) alpha; (void) st;
}

static inline void fa_bf16_product(const uint16_t *a, ptrdiff_t a_rs, ptrdiff_t M,
                                   const uint32_t *bp, ptrdiff_t bp_rs, ptrdiff_t K2,
                                   ptrdiff_t N, float alpha, float *c, ptrdiff_t ldc,
                                   int accumulate) {
    (void) a; (void) a_rs; (void) M; (void) bp; (void) bp_rs; (void) K2; (void) N;
    (void) alpha; (void) c; (void) ldc; (void) accumulate;
}

static inline int fa_bf16_pack_values(const uint16_t *v, ptrdiff_t v_rs, ptrdiff_t bc,
                                      ptrdiff_t Ev, uint32_t *vt) {
    (void) v; (void) v_rs; (void) bc; (void) Ev; (void) vt;
    return 1;
}

static inline void fa_bf16_pack_weights(const float *st, ptrdiff_t bc, ptrdiff_t nr,
                                        uint32_t *pp, uint32_t *pl) {
    (void) st; (void) bc; (void) nr; (void) pp; (void) pl;
}

static inline void fa_block_max_unscaled(const float *st, ptrdiff_t bc, ptrdiff_t nr,
                                         float scale, float *m, float *m_sub,
                                         float *alpha) {
    (void) st; (void) bc; (void) nr; (void) scale; (void) m; (void) m_sub; (void) alpha;
}

static inline void fa_bf16_weight_pairs(const float *st, ptrdiff_t bc, ptrdiff_t nr,
                                        float scale, const float *m_sub,
                                        const float *alpha, double *l, uint32_t *pp) {
    (void) st; (void) bc; (void) nr; (void) scale; (void) m_sub; (void) alpha; (void) l;
    (void) pp;
}

static inline void fa_bf16_pv(const uint32_t *vt, ptrdiff_t bc, ptrdiff_t Ev,
                              const uint32_t *pp, ptrdiff_t nr, float *acc, int first,
                              const float *alpha) {
    (void) vt; (void) bc; (void) Ev; (void) pp; (void) nr; (void) acc; (void) first;
    (void) alpha;
}

static inline void fa_bf16_round_tile(const float *st, ptrdiff_t bc, uint16_t *a) {
    (void) st; (void) bc; (void) a;
}
static inline void fa_bf16_narrow_row(const float *s, ptrdiff_t n, uint16_t *d) {
    fa_narrow_row(s, n, d, FA_STORED_BFLOAT16);     /* (the same bits) */
}

#endif
#endif
