/* The scores of bfloat16 attention on AVX512-BF16: S = scale * K Q^T with vdpbf16ps,
   which multiplies pairs of bfloat16 values and adds both products to a float32 lane,
   so one instruction does the work of two float32 FMAs and K is read as it is stored
   (no widening to float32).

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

#if FA_HAVE_AVX512_BF16
#include <immintrin.h>

#define FA_BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512bf16")))

/* MR key rows of the tile: 4 x MR accumulators of 16 lanes, one broadcast pair of K
   and four vectors of qp per step. */
#define FA_BF16_ROWS(MR)                                                              \
FA_BF16_TARGET static void fa_bf16_rows_##MR(const uint16_t *k, ptrdiff_t k_rs,      \
                                             const uint32_t *qp, ptrdiff_t E2,        \
                                             float alpha, float *st) {                \
    __m512 acc[MR][4];                                                                \
    __m512bh b[4];                                                                    \
    uint32_t pair;                                                                    \
    ptrdiff_t t;                                                                      \
    int i, x;                                                                         \
    for (i = 0; i < MR; i++)                                                          \
        for (x = 0; x < 4; x++)                                                       \
            acc[i][x] = _mm512_setzero_ps();                                          \
    for (t = 0; t < E2; t++) {                                                        \
        for (x = 0; x < 4; x++)                                                       \
            b[x] = (__m512bh) _mm512_loadu_si512(qp + t * FA_BF16_LANES + 16 * x);    \
        for (i = 0; i < MR; i++) {                                                    \
            __m512bh a;                                                               \
            memcpy(&pair, k + i * k_rs + 2 * t, sizeof pair);                         \
            a = (__m512bh) _mm512_set1_epi32((int) pair);                             \
            for (x = 0; x < 4; x++)                                                   \
                acc[i][x] = _mm512_dpbf16_ps(acc[i][x], a, b[x]);                     \
        }                                                                             \
    }                                                                                 \
    for (i = 0; i < MR; i++)                                                          \
        for (x = 0; x < 4; x++)                                                       \
            _mm512_storeu_ps(st + i * FA_BF16_LANES + 16 * x,                         \
                             _mm512_mul_ps(acc[i][x], _mm512_set1_ps(alpha)));        \
}

FA_BF16_ROWS(6)
FA_BF16_ROWS(4)
FA_BF16_ROWS(2)
FA_BF16_ROWS(1)

/* st (bc, 64) = alpha * (bc keys of k, row stride k_rs) . qp, over E2 pairs. */
FA_BF16_TARGET static void fa_bf16_scores(const uint16_t *k, ptrdiff_t k_rs,
                                          ptrdiff_t bc, const uint32_t *qp,
                                          ptrdiff_t E2, float alpha, float *st) {
    ptrdiff_t j = 0;
    for (; j + 6 <= bc; j += 6)
        fa_bf16_rows_6(k + j * k_rs, k_rs, qp, E2, alpha, st + j * FA_BF16_LANES);
    for (; j + 4 <= bc; j += 4)
        fa_bf16_rows_4(k + j * k_rs, k_rs, qp, E2, alpha, st + j * FA_BF16_LANES);
    for (; j + 2 <= bc; j += 2)
        fa_bf16_rows_2(k + j * k_rs, k_rs, qp, E2, alpha, st + j * FA_BF16_LANES);
    for (; j < bc; j++)
        fa_bf16_rows_1(k + j * k_rs, k_rs, qp, E2, alpha, st + j * FA_BF16_LANES);
}

#else   /* no kernel in this module: never called (fastattn._plan's dot_kernel) */

static inline void fa_bf16_scores(const uint16_t *k, ptrdiff_t k_rs, ptrdiff_t bc,
                                  const uint32_t *qp, ptrdiff_t E2, float alpha,
                                  float *st) {
    (void) k; (void) k_rs; (void) bc; (void) qp; (void) E2; (void) alpha; (void) st;
}

#endif
#endif
