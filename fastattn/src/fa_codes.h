/* 8-bit codes of quantized key-value caches, widened to float32 for the kernels of
   fastattn: int8 codes, and the float8 formats e4m3fn (no inf; S.1111.111 is NaN) and
   e5m2 (float16's top byte). Every code is a float32 value exactly; a kernel's value is
   float(code) * scale, the scale one float32 per row (1 without one).

   e5m2 is the top byte of a float16. e4m3fn moves into a float16 the same way with
   its exponent three bits wider: (code & 0x7f) << 7 as float16 bits is the code's
   value times 2^-8 (subnormals included), so it is scaled back by 2^8 (exact). */
#ifndef FASTATTN_FA_CODES_H
#define FASTATTN_FA_CODES_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "fa_half.h"

#define FA_STORED_INT8 5        /* the DType codes of fastattn/_plan.pxd */
#define FA_STORED_E4M3 6
#define FA_STORED_E5M2 7

/* the unit the decode kernels read e4m3 codes in (see fa_e4m3_units16) */
#define FA_E4M3_UNIT (1.0f / 256.0f)

static inline float fa_e5m2_to_f32(uint8_t b) {
    return fa_f16_to_f32((uint16_t) ((uint16_t) b << 8));
}

static inline float fa_e4m3_to_f32(uint8_t b) {
    uint16_t h = (uint16_t) (((b & 0x80u) << 8) | ((b & 0x7fu) << 7));
    return (b & 0x7fu) == 0x7fu ? NAN : fa_f16_to_f32(h) * 256.0f;
}

/* One code (kind: FA_STORED_INT8, _E4M3 or _E5M2), widened. */
static inline float fa_widen_code(const void *src, int kind, ptrdiff_t index) {
    uint8_t b = ((const uint8_t *) src)[index];
    if (kind == FA_STORED_INT8)
        return (float) (int8_t) b;
    return kind == FA_STORED_E4M3 ? fa_e4m3_to_f32(b) : fa_e5m2_to_f32(b);
}

#if defined(__AVX512F__)
#include <immintrin.h>

/* 16 codes of `kind` (a constant where inlined) from src, as float32, exactly; the
   masked form reads only the lanes of m and gives zeros in the others. */
static inline __attribute__((always_inline)) __m512 fa_codes16(__m128i x, int kind) {
    if (kind == FA_STORED_INT8)
        return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(x));
    if (kind == FA_STORED_E5M2)
        return _mm512_cvtph_ps(_mm256_slli_epi16(_mm256_cvtepu8_epi16(x), 8));
    {
        __m256i w = _mm256_cvtepu8_epi16(x);
        __m256i mag = _mm256_and_si256(w, _mm256_set1_epi16(0x7f));
        __m256i h = _mm256_or_si256(
            _mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x80)), 8),
            _mm256_slli_epi16(mag, 7));
        __m512 f = _mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(256.0f));
        __mmask16 nan = _mm256_cmpeq_epi16_mask(mag, _mm256_set1_epi16(0x7f));
        return _mm512_mask_mov_ps(f, nan, _mm512_set1_ps(NAN));
    }
}

/* The decode kernels' e4m3: the code's value times 2^-8 (FA_E4M3_UNIT), exactly,
   from its bits moved into a float16 (the sign to bit 15, the rest shifted by 7: the
   byte sign-extended to 16 bits and shifted left by 7, which puts the sign in bits 15
   and 14, bit 14 then cleared), in three instructions where the exact form takes
   nine. The NaN codes come out finite: the caller checks for them (fa_e4m3_nan) and
   multiplies by 2^8. */
static inline __attribute__((always_inline)) __m512 fa_e4m3_units16(__m128i x) {
    __m256i h = _mm256_slli_epi16(_mm256_cvtepi8_epi16(x), 7);
    return _mm512_cvtph_ps(_mm256_andnot_si256(_mm256_set1_epi16(0x4000), h));
}

static inline __attribute__((always_inline)) __m512 fa_load_codes16(const void *p,
                                                                     ptrdiff_t i,
                                                                     int kind) {
    return fa_codes16(_mm_loadu_si128((const __m128i *) ((const uint8_t *) p + i)), kind);
}

static inline __attribute__((always_inline)) __m512 fa_load_codes16_masked(
        const void *p, ptrdiff_t i, int kind, __mmask16 m) {
    return fa_codes16(_mm_maskz_loadu_epi8(m, (const uint8_t *) p + i), kind);
}
#define FA_CODES_LANES 16
#define fa_codes_vec(p, i, kind) fa_load_codes16(p, i, kind)
#define fa_store_scaled(d, x, sc) _mm512_storeu_ps(d, _mm512_mul_ps(x, _mm512_set1_ps(sc)))
#elif defined(__AVX2__) && defined(__F16C__)
#include <immintrin.h>

/* fa_codes16 and fa_e4m3_units16 for the 8 codes in the low half of x, on AVX2 */
static inline __attribute__((always_inline)) __m256 fa_codes8(__m128i x, int kind) {
    if (kind == FA_STORED_INT8)
        return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(x));
    if (kind == FA_STORED_E5M2)
        return _mm256_cvtph_ps(_mm_slli_epi16(_mm_cvtepu8_epi16(x), 8));
    {
        __m128i w = _mm_cvtepu8_epi16(x);
        __m128i mag = _mm_and_si128(w, _mm_set1_epi16(0x7f));
        __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x80)), 8),
                                 _mm_slli_epi16(mag, 7));
        __m256 f = _mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(256.0f));
        __m256i nan = _mm256_cvtepi16_epi32(_mm_cmpeq_epi16(mag, _mm_set1_epi16(0x7f)));
        return _mm256_blendv_ps(f, _mm256_set1_ps(NAN), _mm256_castsi256_ps(nan));
    }
}

static inline __attribute__((always_inline)) __m256 fa_e4m3_units8(__m128i x) {
    __m128i h = _mm_slli_epi16(_mm_cvtepi8_epi16(x), 7);
    return _mm256_cvtph_ps(_mm_andnot_si128(_mm_set1_epi16(0x4000), h));
}
#define FA_CODES_LANES 8
#define fa_codes_vec(p, i, kind)                                                      \
    fa_codes8(_mm_loadl_epi64((const __m128i *) ((const uint8_t *) (p) + (i))), kind)
#define fa_store_scaled(d, x, sc) _mm256_storeu_ps(d, _mm256_mul_ps(x, _mm256_set1_ps(sc)))
#endif

/* Whether any of n e4m3 codes at p is a NaN (S.1111.111): 64 codes per compare
   with AVX-512BW, 32 with AVX2, else eight per 64-bit word (a byte's low seven bits
   plus one carry into its top bit only when they are all ones), the rest one by one. */
static inline int fa_e4m3_nan(const void *p, ptrdiff_t n) {
    const uint8_t *b = (const uint8_t *) p;
    ptrdiff_t i = 0;
    uint64_t found = 0;
#if defined(__AVX512BW__)
    const __m512i low7 = _mm512_set1_epi8(0x7f);
    for (; i < n; i += 64) {
        __mmask64 m = n - i >= 64 ? ~(__mmask64) 0 : ((__mmask64) 1 << (n - i)) - 1;
        __m512i x = _mm512_and_si512(_mm512_maskz_loadu_epi8(m, b + i), low7);
        found |= _mm512_mask_cmpeq_epi8_mask(m, x, low7);
    }
#elif defined(__AVX2__) && defined(__F16C__)   /* (immintrin.h included above) */
    const __m256i low7 = _mm256_set1_epi8(0x7f);
    __m256i hits = _mm256_setzero_si256();
    for (; i + 32 <= n; i += 32)
        hits = _mm256_or_si256(hits, _mm256_cmpeq_epi8(_mm256_and_si256(
            _mm256_loadu_si256((const __m256i *) (b + i)), low7), low7));
    found = (uint64_t) (uint32_t) _mm256_movemask_epi8(hits);
#endif
#if !defined(__AVX512BW__)
    for (; i + 8 <= n; i += 8) {
        uint64_t w;
        memcpy(&w, b + i, sizeof w);
        found |= ((w & 0x7f7f7f7f7f7f7f7fULL) + 0x0101010101010101ULL)
                 & 0x8080808080808080ULL;
    }
    for (; i < n; i++)
        found |= (b[i] & 0x7fu) == 0x7fu;
#endif
    return found != 0;
}

/* dst (rows, cols; row stride cols) = the codes of src (rows, cols; row stride src_rb
   bytes) times their row's scale (scale[r * scale_rs], or 1 with scale NULL). */
static inline void fa_widen_codes(const void *src, int kind, ptrdiff_t src_rb,
                                  ptrdiff_t rows, ptrdiff_t cols, const float *scale,
                                  ptrdiff_t scale_rs, float *dst) {
    ptrdiff_t r, c;
    for (r = 0; r < rows; r++) {
        const uint8_t *s = (const uint8_t *) src + r * src_rb;
        float sc = scale ? scale[r * scale_rs] : 1.0f, *d = dst + r * cols;
        c = 0;
#if defined(FA_CODES_LANES)
        for (; c + FA_CODES_LANES <= cols; c += FA_CODES_LANES)
            fa_store_scaled(d + c,
                            kind == FA_STORED_INT8 ? fa_codes_vec(s, c, FA_STORED_INT8)
                            : kind == FA_STORED_E4M3 ? fa_codes_vec(s, c, FA_STORED_E4M3)
                            : fa_codes_vec(s, c, FA_STORED_E5M2), sc);
#endif
        for (; c < cols; c++)
            d[c] = fa_widen_code(s, kind, c) * sc;
    }
}

#endif
