/* bfloat16 and float16 for the kernels of fastattn: 16-bit storage widened to float32
   (exactly: every bfloat16 and float16 value is a float32 value), with loops simple
   enough to vectorise on any instruction set, or vcvtph2ps where the instruction set
   has it (the avx2 and avx512 levels); no compiler extension (_Float16) needed. And
   the other way: a float32 result rounded once to 16 bits (fa_narrow_row), bit for
   bit as NumPy's and ml_dtypes' astype round it.

   bfloat16 is the top half of a float32. float16 is widened by moving its exponent and
   mantissa into place and multiplying by 2^112, which rebias the exponent and turn
   subnormal halves into normal floats in one step; inf and NaN are then given the
   all-ones exponent back (F. Giesen, "half_to_float_fast5"). */
#ifndef FASTATTN_FA_HALF_H
#define FASTATTN_FA_HALF_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define FA_STORED_BFLOAT16 3    /* the DType codes of fastattn/_plan.pxd */
#define FA_STORED_FLOAT16 4

static inline float fa_bits_to_float(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint32_t fa_float_to_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static inline float fa_bf16_to_f32(uint16_t h) {
    return fa_bits_to_float((uint32_t) h << 16);
}

static inline float fa_f16_to_f32(uint16_t h) {
    float o = fa_bits_to_float(((uint32_t) h & 0x7fffu) << 13) * 5.192296858534828e+33f;
    uint32_t u = fa_float_to_bits(o);
    /* (127 + 16) << 23: the first float past float16's largest finite magnitude */
    u |= (o >= 65536.0f) ? (255u << 23) : 0u;
    u |= ((uint32_t) h & 0x8000u) << 16;
    return fa_bits_to_float(u);
}

#if defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif

/* float16 row of n, widened: by the instruction set where it converts (AVX-512F,
   F16C: vcvtph2ps, 16 or 8 at a time; compilers do not vectorise a loop of _Float16
   casts), by the bit trick above elsewhere and for the tail. */
static inline void fa_widen_f16_row(const uint16_t *s, ptrdiff_t n, float *d) {
    ptrdiff_t c = 0;
#if defined(__AVX512F__)
    for (; c + 16 <= n; c += 16)
        _mm512_storeu_ps(d + c, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *) (s + c))));
#elif defined(__F16C__)
    for (; c + 8 <= n; c += 8)
        _mm256_storeu_ps(d + c, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) (s + c))));
#endif
    for (; c < n; c++)
        d[c] = fa_f16_to_f32(s[c]);
}

/* dst (rows, cols; row stride cols) = src (rows, cols; row stride src_rs elements),
   widened from bfloat16 or float16 (kind: FA_STORED_*). */
static inline void fa_widen_rows(const void *src, int kind, ptrdiff_t src_rs,
                                 ptrdiff_t rows, ptrdiff_t cols, float *dst) {
    const uint16_t *s = (const uint16_t *) src;
    ptrdiff_t r, c;
    if (kind == FA_STORED_BFLOAT16) {
        for (r = 0; r < rows; r++)
            for (c = 0; c < cols; c++)
                dst[r * cols + c] = fa_bf16_to_f32(s[r * src_rs + c]);
    } else {
        for (r = 0; r < rows; r++)
            fa_widen_f16_row(s + r * src_rs, cols, dst + r * cols);
    }
}

/* Whether every bfloat16 word of h[0..n) is zero (either sign) or has a magnitude in
   [2^-safe_exp, 2^safe_exp): subnormals, inf, NaN and larger or smaller magnitudes are
   not. The magnitude a = h & 0x7fff is in range exactly when a - ((127 - safe_exp) << 7),
   taken modulo 2^16, is below (2 safe_exp) << 7 (the mantissa's 7 bits sit below the
   exponent's). With AVX-512 32 words at a time in 16-bit lanes, four vectors per pass
   into four independent masks (one mask would chain every compare to the last), the
   tail by a masked load (no read past h + n). */
#if defined(__AVX512BW__)
static inline __mmask32 fa_bf16_out_of_range(__m512i words, __m512i lo, __m512i span) {
    __m512i a = _mm512_and_si512(words, _mm512_set1_epi16(0x7fff));
    return _mm512_mask_cmpge_epu16_mask(_mm512_test_epi16_mask(a, a),
                                        _mm512_sub_epi16(a, lo), span);
}
#endif

static inline int fa_bf16_words_in_range(const uint16_t *h, ptrdiff_t n,
                                         ptrdiff_t safe_exp) {
    const uint16_t lo = (uint16_t) ((127 - safe_exp) << 7);
    const uint16_t span = (uint16_t) ((2 * safe_exp) << 7);
    ptrdiff_t c = 0;
    int flag = 0;
#if defined(__AVX512BW__)
    const __m512i vlo = _mm512_set1_epi16((short) lo);
    const __m512i vspan = _mm512_set1_epi16((short) span);
    __mmask32 bad = 0, bad1 = 0, bad2 = 0, bad3 = 0;
    for (; c + 128 <= n; c += 128) {
        bad |= fa_bf16_out_of_range(_mm512_loadu_si512(h + c), vlo, vspan);
        bad1 |= fa_bf16_out_of_range(_mm512_loadu_si512(h + c + 32), vlo, vspan);
        bad2 |= fa_bf16_out_of_range(_mm512_loadu_si512(h + c + 64), vlo, vspan);
        bad3 |= fa_bf16_out_of_range(_mm512_loadu_si512(h + c + 96), vlo, vspan);
    }
    for (; c < n; c += 32) {
        __mmask32 here = n - c >= 32 ? (__mmask32) 0xffffffffu
                                     : (__mmask32) ((1u << (n - c)) - 1u);
        bad |= fa_bf16_out_of_range(_mm512_maskz_loadu_epi16(here, h + c), vlo, vspan);
    }
    bad |= bad1 | bad2 | bad3;
    flag = bad != 0;
#endif
    for (; c < n; c++) {
        uint16_t a = h[c] & 0x7fffu;
        flag |= (a != 0) & ((uint16_t) (a - lo) >= span);
    }
    return !flag;
}

/* float32 -> bfloat16, rounded to nearest even, as ml_dtypes (Eigen) rounds it: a NaN
   becomes the quiet NaN of its sign (0x7fc0 or 0xffc0); subnormals round like the rest. */
static inline uint16_t fa_f32_to_bf16(float f) {
    uint32_t u = fa_float_to_bits(f);
    uint16_t nan = (uint16_t) ((u >> 16) & 0x8000u) | 0x7fc0u;
    uint16_t rounded = (uint16_t) ((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    return (u & 0x7fffffffu) > 0x7f800000u ? nan : rounded;
}

/* float32 -> float16, rounded to nearest even, as vcvtps2ph and NumPy round it:
   overflow to inf, subnormal halves where they fall, a NaN kept a quiet NaN with the top
   bits of its payload (F. Giesen, "float_to_half_fast3_rtne", with x86's NaNs). */
static inline uint16_t fa_f32_to_f16(float f) {
    uint32_t u = fa_float_to_bits(f);
    uint32_t sign = (u >> 16) & 0x8000u, a = u & 0x7fffffffu, h;
    if (a >= 0x47800000u)           /* 65536 or more, inf, NaN */
        h = a > 0x7f800000u ? 0x7e00u | ((a >> 13) & 0x3ffu) : 0x7c00u;
    else if (a < 0x38800000u)       /* below 2^-14: a subnormal half (or 2^-14), added
                                       to 0.5 so that the FPU rounds at 2^-24 */
        h = fa_float_to_bits(fa_bits_to_float(a) + 0.5f) - 0x3f000000u;
    else                            /* normal: rebias, round at bit 13 (a carry may
                                       reach inf, which is right) */
        h = (a + 0xc8000fffu + ((a >> 13) & 1u)) >> 13;
    return (uint16_t) (sign | h);
}

/* d[0..n) = s[0..n) rounded to bfloat16 or float16 (kind: FA_STORED_*), to nearest
   even, bit for bit as fa_f32_to_bf16 / fa_f32_to_f16 (float16 by vcvtps2ph where the
   instruction set has it: the same bits). */
static inline void fa_narrow_row(const float *s, ptrdiff_t n, uint16_t *d, int kind) {
    ptrdiff_t c = 0;
    if (kind == FA_STORED_BFLOAT16) {
        for (; c < n; c++)
            d[c] = fa_f32_to_bf16(s[c]);
        return;
    }
#if defined(__AVX512F__)
    for (; c + 16 <= n; c += 16)
        _mm256_storeu_si256((__m256i *) (d + c), _mm512_cvtps_ph(
            _mm512_loadu_ps(s + c), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#elif defined(__F16C__)
    for (; c + 8 <= n; c += 8)
        _mm_storeu_si128((__m128i *) (d + c), _mm256_cvtps_ph(
            _mm256_loadu_ps(s + c), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
    for (; c < n; c++)
        d[c] = fa_f32_to_f16(s[c]);
}

/* One element of a 16-bit operand, widened. */
static inline float fa_widen(const void *src, int kind, ptrdiff_t index) {
    uint16_t h = ((const uint16_t *) src)[index];
    return kind == FA_STORED_BFLOAT16 ? fa_bf16_to_f32(h) : fa_f16_to_f32(h);
}

#endif
