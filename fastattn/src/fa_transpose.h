/* Transposes of 32-bit words for the tiles of fastattn's fused pass: the query rows
   into the tile's (E, QUERY_TILE) layout, the accumulator back into output rows, and
   the bfloat16 query pairs of fa_bf16.h (a pair is one 32-bit word).

       dst[c * dst_rs + r] = src[r * src_rs + c] * s(c)    r < rows, c < cols
       dst[c * dst_rs + r] = 0                             rows <= r < dst_cols

   with s(c) = scale[c * scale_step] (scale_step 0: one factor for all), or no product
   at all when scale is NULL (the words are copied as they are). Every product is the
   same float32 multiplication whichever branch runs, so results do not depend on the
   instruction set.

   With AVX-512 (the avx512 level's module) the words move in 16 x 16 blocks through
   registers, with AVX2 in 8 x 8 blocks (masked loads and stores at the edges: nothing
   outside the given rows and columns is read or written); elsewhere a scalar loop.
   The scalar loop writes one word per store, scattered across rows: a 64 x 64 tile
   cost as much as a key block's exponentials. */
#ifndef FASTATTN_FA_TRANSPOSE_H
#define FASTATTN_FA_TRANSPOSE_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__)
#include <immintrin.h>

/* the 16 x 16 transpose of r[0..15] (rows) in registers */
static inline void fa_transpose16(__m512 r[16]) {
    __m512 t[16];
    int i;
    for (i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    for (i = 0; i < 16; i += 4) {
        r[i] = _mm512_shuffle_ps(t[i], t[i + 2], 0x44);
        r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], 0xEE);
        r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
    }
    /* each 128-bit lane now holds a transposed 4 x 4 block: move the lanes */
    for (i = 0; i < 4; i++) {
        t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88);
        t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xDD);
        t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88);
        t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xDD);
    }
    for (i = 0; i < 8; i++) {
        r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
        r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xDD);
    }
}

static inline __mmask16 fa_lanes16(ptrdiff_t n) {
    return n >= 16 ? (__mmask16) 0xFFFF : (__mmask16) ((1u << n) - 1u);
}
#elif defined(__AVX2__)
#include <immintrin.h>

/* the 8 x 8 transpose of r[0..7] (rows) in registers */
static inline void fa_transpose8(__m256 r[8]) {
    __m256 t[8], u[8];
    int i;
    for (i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (i = 0; i < 8; i += 4) {
        u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
        u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
        u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
    }
    /* each 128-bit lane now holds a transposed 4 x 4 block: move the lanes */
    for (i = 0; i < 4; i++) {
        r[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
        r[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
    }
}

/* the lanes below n (n may be <= 0 or >= 8), as a mask of 32-bit lanes (also the
   AVX2 decode kernels' edges: fa_dots.h) */
static inline __attribute__((always_inline)) __m256i fa_lanes8_mask(ptrdiff_t n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int) (n < 0 ? 0 : n > 8 ? 8 : n)),
                              _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
#endif

static inline void fa_transpose32(const void *src_, ptrdiff_t src_rs, ptrdiff_t rows,
                                  ptrdiff_t cols, void *dst_, ptrdiff_t dst_rs,
                                  ptrdiff_t dst_cols, const float *scale,
                                  ptrdiff_t scale_step) {
    const uint32_t *src = (const uint32_t *) src_;
    uint32_t *dst = (uint32_t *) dst_;
#if defined(__AVX512F__)
    ptrdiff_t r0, c0, i, nr, nc;
    __m512 x[16];
    __mmask16 load, store, valid;
    for (r0 = 0; r0 < dst_cols; r0 += 16) {
        nr = rows - r0 < 16 ? (rows - r0 > 0 ? rows - r0 : 0) : 16;
        store = fa_lanes16(dst_cols - r0);
        valid = fa_lanes16(nr);     /* lanes of real rows: the rest stay zero */
        for (c0 = 0; c0 < cols; c0 += 16) {
            nc = cols - c0 < 16 ? cols - c0 : 16;
            load = fa_lanes16(nc);
            for (i = 0; i < 16; i++)
                x[i] = i < nr ? _mm512_maskz_loadu_ps(
                                    load, (const float *) (src + (r0 + i) * src_rs + c0))
                              : _mm512_setzero_ps();
            fa_transpose16(x);
            for (i = 0; i < nc; i++) {
                if (scale != NULL)
                    x[i] = _mm512_mask_mul_ps(
                        x[i], valid, x[i], _mm512_set1_ps(scale[(c0 + i) * scale_step]));
                _mm512_mask_storeu_ps((float *) (dst + (c0 + i) * dst_rs + r0), store,
                                      x[i]);
            }
        }
    }
#elif defined(__AVX2__)
    ptrdiff_t r0, c0, i, nr, nc;
    __m256 x[8];
    __m256i load, store, valid;
    for (r0 = 0; r0 < dst_cols; r0 += 8) {
        nr = rows - r0 < 8 ? (rows - r0 > 0 ? rows - r0 : 0) : 8;
        store = fa_lanes8_mask(dst_cols - r0);
        valid = fa_lanes8_mask(nr);     /* lanes of real rows: the rest stay zero */
        for (c0 = 0; c0 < cols; c0 += 8) {
            nc = cols - c0 < 8 ? cols - c0 : 8;
            if (nr == 8 && nc == 8 && dst_cols - r0 >= 8) {    /* a whole block */
                for (i = 0; i < 8; i++)
                    x[i] = _mm256_loadu_ps((const float *) (src + (r0 + i) * src_rs + c0));
                fa_transpose8(x);
                for (i = 0; i < 8; i++) {
                    if (scale != NULL)
                        x[i] = _mm256_mul_ps(x[i],
                                             _mm256_set1_ps(scale[(c0 + i) * scale_step]));
                    _mm256_storeu_ps((float *) (dst + (c0 + i) * dst_rs + r0), x[i]);
                }
                continue;
            }
            load = fa_lanes8_mask(nc);
            for (i = 0; i < 8; i++)
                x[i] = i < nr ? _mm256_maskload_ps(
                                    (const float *) (src + (r0 + i) * src_rs + c0), load)
                              : _mm256_setzero_ps();
            fa_transpose8(x);
            for (i = 0; i < nc; i++) {
                if (scale != NULL)
                    x[i] = _mm256_blendv_ps(
                        x[i], _mm256_mul_ps(x[i], _mm256_set1_ps(scale[(c0 + i) * scale_step])),
                        _mm256_castsi256_ps(valid));
                _mm256_maskstore_ps((float *) (dst + (c0 + i) * dst_rs + r0), store, x[i]);
            }
        }
    }
#else
    ptrdiff_t r, c;
    float f;
    for (r = 0; r < rows; r++)
        for (c = 0; c < cols; c++) {
            if (scale != NULL) {
                memcpy(&f, src + r * src_rs + c, sizeof f);
                f = f * scale[c * scale_step];
                memcpy(dst + c * dst_rs + r, &f, sizeof f);
            } else {
                dst[c * dst_rs + r] = src[r * src_rs + c];
            }
        }
    for (c = 0; c < cols; c++)
        for (r = rows; r < dst_cols; r++)
            dst[c * dst_rs + r] = 0;
#endif
}

#endif
