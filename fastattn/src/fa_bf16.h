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

#include "fa_transpose.h"

#define FA_BF16_LANES 64            /* query rows of a score tile: QUERY_TILE */

#if defined(__AVX512F__) && defined(__x86_64__) && \
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

static inline void fa_bf16_round_tile(const float *st, ptrdiff_t bc, uint16_t *a) {
    (void) st; (void) bc; (void) a;
}

#endif
#endif
