/* The scores of the decode path: many short dot products of a few query rows with a
   block of keys,

       s[r * s_rs + c] = sum_t q[r * q_rs + t] * k[c * k_rs + t]    r < R, c < C,

   each summed exactly as fastattn's dot_ (fastattn/_tiles.pxd) sums it: 16 partial sums
   (element t into lane t % 16, in order of t), then lanes x + 8 into x, x + 4 into x,
   and (0 + 2) + (1 + 3). So the result is the same bit for bit whichever code runs.

   With AVX-512 (the avx512 level's module) 16 dot products run at once, a few query
   rows by a few keys (4 x 4, 2 x 8 or 1 x 16), one vector of partial sums each; the
   16 vectors are then reduced together in the order above by shuffles (45 instructions
   for 16 sums, where one sum alone takes 8). Elsewhere: fa_dots_f32 is not defined and
   the caller uses its own loop (FA_HAVE_DOTS says which). */
#ifndef FASTATTN_FA_DOTS_H
#define FASTATTN_FA_DOTS_H

#include <stddef.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#define FA_HAVE_DOTS 1

/* v[0..15] -> one vector whose lane fa_dots_lane[i] holds the dot_ reduction of v[i] */
static inline __m512 fa_reduce16(__m512 v[16]) {
    __m512 a[8], b[4], e[2];
    int i;
    /* lanes x + 8 into x: 256-bit halves of two vectors */
    for (i = 0; i < 8; i++)
        a[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
    /* lanes x + 4 into x: 128-bit quarters of four vectors */
    for (i = 0; i < 4; i++)
        b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xDD));
    /* (0 + 2) + (1 + 3) within each quarter */
    for (i = 0; i < 2; i++)
        e[i] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0xEE));
    return _mm512_add_ps(_mm512_shuffle_ps(e[0], e[1], 0x88),
                         _mm512_shuffle_ps(e[0], e[1], 0xDD));
}

/* the lane of fa_reduce16's result that holds the sum of v[i] */
static const int fa_dots_lane[16] = {0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15};

/* one block: rows x keys dot products (rows * keys == 16, both constants where it is
   inlined, so that the 16 partial sums stay in registers); keys past C re-read key
   C - 1 and are not stored */
static inline __attribute__((always_inline)) void fa_dots_block(
        const float *q, ptrdiff_t q_rs, const float *k, ptrdiff_t k_rs, ptrdiff_t nc,
        ptrdiff_t E, float *s, ptrdiff_t s_rs, const int rows, const int keys) {
    __m512 acc[16], qv[4], kv;
    const float *kr[16];
    float sums[16];
    ptrdiff_t t, tail = E % 16, main = E - tail;
    __mmask16 last = (__mmask16) ((1u << tail) - 1u);
    int i, j;
    for (j = 0; j < keys; j++)
        kr[j] = k + (j < nc ? j : nc - 1) * k_rs;
    for (i = 0; i < 16; i++)
        acc[i] = _mm512_setzero_ps();
    for (t = 0; t < main; t += 16) {
        for (i = 0; i < rows; i++)
            qv[i] = _mm512_loadu_ps(q + i * q_rs + t);
        for (j = 0; j < keys; j++) {
            kv = _mm512_loadu_ps(kr[j] + t);
            for (i = 0; i < rows; i++)
                acc[i * keys + j] = _mm512_fmadd_ps(qv[i], kv, acc[i * keys + j]);
        }
    }
    if (tail) {     /* (masked: lanes past E add nothing, as in dot_) */
        for (i = 0; i < rows; i++)
            qv[i] = _mm512_maskz_loadu_ps(last, q + i * q_rs + main);
        for (j = 0; j < keys; j++) {
            kv = _mm512_maskz_loadu_ps(last, kr[j] + main);
            for (i = 0; i < rows; i++)
                acc[i * keys + j] = _mm512_mask3_fmadd_ps(qv[i], kv, acc[i * keys + j],
                                                          last);
        }
    }
    _mm512_storeu_ps(sums, fa_reduce16(acc));
    for (i = 0; i < rows; i++)
        for (j = 0; j < keys && j < nc; j++)
            s[i * s_rs + j] = sums[fa_dots_lane[i * keys + j]];
}

static inline void fa_dots_f32(const float *q, ptrdiff_t q_rs, ptrdiff_t R,
                               const float *k, ptrdiff_t k_rs, ptrdiff_t C, ptrdiff_t E,
                               float *s, ptrdiff_t s_rs) {
    ptrdiff_t r0 = 0, c0;
    if (C <= 0)
        return;
    for (; R - r0 >= 4; r0 += 4)            /* 4 rows x 4 keys */
        for (c0 = 0; c0 < C; c0 += 4)
            fa_dots_block(q + r0 * q_rs, q_rs, k + c0 * k_rs, k_rs, C - c0, E,
                          s + r0 * s_rs + c0, s_rs, 4, 4);
    for (; R - r0 >= 2; r0 += 2)            /* 2 rows x 8 keys */
        for (c0 = 0; c0 < C; c0 += 8)
            fa_dots_block(q + r0 * q_rs, q_rs, k + c0 * k_rs, k_rs, C - c0, E,
                          s + r0 * s_rs + c0, s_rs, 2, 8);
    for (; r0 < R; r0++)                    /* 1 row x 16 keys */
        for (c0 = 0; c0 < C; c0 += 16)
            fa_dots_block(q + r0 * q_rs, q_rs, k + c0 * k_rs, k_rs, C - c0, E,
                          s + r0 * s_rs + c0, s_rs, 1, 16);
}
#else
#define FA_HAVE_DOTS 0
#endif

#endif
