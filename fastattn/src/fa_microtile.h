/* The register tile of fastattn's micro-GEMM (fastattn/_gemm.pxd), per instruction set
   and dtype: FA_MR_* rows of C (one broadcast scalar of A each) by FA_NR_* columns (the
   vector axis), held in a fixed-size local array that the compiler keeps in vector
   registers. The sizes follow the vector registers of the instruction set the including
   module is compiled for (32 x 512-bit with AVX-512, 16 x 256-bit with AVX2, 16 x 128-bit
   otherwise). Chosen by reading gcc's code: some other shapes make it vectorise the row
   axis and shuffle (e.g. double 16 x 8 with AVX-512, 16 x 3 with AVX2 or SSE2), and
   some are not vectorised at all (float, 6 rows x 16 columns, with AVX2 and gcc 12).
   The float32 tiles with AVX-512 and with AVX2 are therefore written out below
   (fa_microtile_f32: 8 x 32 and 6 x 16, twelve or sixteen sums in registers), and the
   float64 tile with AVX2 (fa_microtile_f64: 6 x 8, twelve sums). */
#ifndef FASTATTN_FA_MICROTILE_H
#define FASTATTN_FA_MICROTILE_H

#if defined(FA_NR_F)
/* set on the command line (experiments) */
#elif defined(__AVX512F__)
#define FA_NR_F 32
#define FA_MR_F 8
#define FA_NR_D 32
#define FA_MR_D 5
#elif defined(__AVX2__) && defined(__FMA__)
#define FA_NR_F 16      /* written out: fa_microtile_f32 */
#define FA_MR_F 6
#define FA_NR_D 8       /* written out: fa_microtile_f64 */
#define FA_MR_D 6
#elif defined(__AVX__)
#define FA_NR_F 32
#define FA_MR_F 3
#define FA_NR_D 32
#define FA_MR_D 2
#else
#define FA_NR_F 16
#define FA_MR_F 3
#define FA_NR_D 8
#define FA_MR_D 3
#endif
#define FA_MICROTILE_MAX 256    /* FA_MR * FA_NR never exceeds this */

#include <stddef.h>

/* Where a dtype has no tile written out: the same signature, never called (gemm()'s
   portable loop runs; FA_HAVE_MICROTILE_* is 0). */
#define FA_NO_TILE(name, T)                                                            \
static inline void name(const T *const *a, ptrdiff_t a_cs, const T *b, ptrdiff_t b_rs, \
                        ptrdiff_t K, T *const *c, ptrdiff_t j0, ptrdiff_t rows,        \
                        ptrdiff_t mode, const T *c_scale) {                            \
    (void) a; (void) a_cs; (void) b; (void) b_rs; (void) K; (void) c; (void) j0;       \
    (void) rows; (void) mode; (void) c_scale;                                          \
}

/* The AVX2 register tile, written once for float32 and float64: 6 rows x two vectors
   of `lanes` (6 x 16 floats, 6 x 8 doubles), twelve sums, two vectors of B and one
   broadcast of A in the sixteen registers; the loop over t and the three modes of the
   AVX-512 float32 tile below. T is the element, V its vector type, ps/ss the intrinsics'
   suffixes for vectors and scalars (ps/ss for float, pd/sd for double). */
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

/* row i of the tile takes term t: a[i][t] times B's two vectors of row t */
#define FA_AVX2_ROW(i, V, ps, ss)                                                      \
    do {                                                                               \
        const V x = _mm256_broadcast_##ss(a[i] + t * a_cs);                            \
        acc[i][0] = _mm256_fmadd_##ps(x, b0, acc[i][0]);                               \
        acc[i][1] = _mm256_fmadd_##ps(x, b1, acc[i][1]);                               \
    } while (0)

#define FA_AVX2_TILE(name, T, V, ps, ss, lanes)                                        \
static inline void name(const T *const *a, ptrdiff_t a_cs, const T *b, ptrdiff_t b_rs, \
                        ptrdiff_t K, T *const *c, ptrdiff_t j0, ptrdiff_t rows,        \
                        ptrdiff_t mode, const T *c_scale) {                            \
    V acc[6][2];                                                                       \
    ptrdiff_t i, t;                                                                    \
    for (i = 0; i < 6; i++) {                                                          \
        acc[i][0] = mode == 1 ? _mm256_loadu_##ps(c[i] + j0) : _mm256_setzero_##ps();  \
        acc[i][1] = mode == 1 ? _mm256_loadu_##ps(c[i] + j0 + lanes)                   \
                              : _mm256_setzero_##ps();                                 \
    }                                                                                  \
    for (t = 0; t < K; t++) {                                                          \
        const V b0 = _mm256_loadu_##ps(b + t * b_rs);                                  \
        const V b1 = _mm256_loadu_##ps(b + t * b_rs + lanes);                          \
        FA_AVX2_ROW(0, V, ps, ss); FA_AVX2_ROW(1, V, ps, ss);                          \
        FA_AVX2_ROW(2, V, ps, ss); FA_AVX2_ROW(3, V, ps, ss);                          \
        FA_AVX2_ROW(4, V, ps, ss); FA_AVX2_ROW(5, V, ps, ss);                          \
    }                                                                                  \
    for (i = 0; i < 6; i++) {                                                          \
        ptrdiff_t h;                                                                   \
        if (i >= rows)                                                                 \
            break;                                                                     \
        for (h = 0; h < 2; h++) {                                                      \
            V sum = acc[i][h];                                                         \
            if (mode == 2) {   /* C * scale where scale != 0 (else 0), plus the sum */ \
                const V sc = _mm256_loadu_##ps(c_scale + lanes * h);                   \
                const V kept = _mm256_cmp_##ps(sc, _mm256_setzero_##ps(), _CMP_NEQ_UQ); \
                sum = _mm256_add_##ps(                                                 \
                    _mm256_and_##ps(kept, _mm256_mul_##ps(                             \
                        _mm256_loadu_##ps(c[i] + j0 + lanes * h), sc)),                \
                    sum);                                                              \
            }                                                                          \
            _mm256_storeu_##ps(c[i] + j0 + lanes * h, sum);                            \
        }                                                                              \
    }                                                                                  \
}
#endif

/* The float32 register tile with AVX-512, written out: gemm()'s loop over t for one
   8 x 32 tile, acc[i][j] += a[i][t * a_cs] * b[t * b_rs + j] by vfmadd231ps in the
   order of t (as gcc contracts the portable loop: the same bits), the sixteen sums
   in registers from start to end (from the portable loop gcc zeroes and stores them
   through the stack and reloads a row pointer every step; FA_PORTABLE_TILE on the
   command line builds that loop instead, for comparison). Row i of the tile's C
   is c[i] + j0; then, rows below `rows` only: C = acc (mode 0), C = C + acc (1: C
   loaded first, as the sums' start), C = (C * scale where scale != 0, else 0) + acc
   (2: scale = c_scale[0..32)). */
#if defined(__AVX512F__) && FA_MR_F == 8 && FA_NR_F == 32 && !defined(FA_PORTABLE_TILE)
#define FA_HAVE_MICROTILE_F 1
#include <immintrin.h>

#define FA_TILE_ROW(i)                                                                 \
    do {                                                                               \
        __m512 x = _mm512_set1_ps(a[i][t * a_cs]);                                     \
        acc[i][0] = _mm512_fmadd_ps(x, b0, acc[i][0]);                                 \
        acc[i][1] = _mm512_fmadd_ps(x, b1, acc[i][1]);                                 \
    } while (0)

static inline void fa_microtile_f32(const float *const *a, ptrdiff_t a_cs,
                                    const float *b, ptrdiff_t b_rs, ptrdiff_t K,
                                    float *const *c, ptrdiff_t j0, ptrdiff_t rows,
                                    ptrdiff_t mode, const float *c_scale) {
    __m512 acc[8][2];
    ptrdiff_t i, t;
    for (i = 0; i < 8; i++) {
        acc[i][0] = mode == 1 ? _mm512_loadu_ps(c[i] + j0) : _mm512_setzero_ps();
        acc[i][1] = mode == 1 ? _mm512_loadu_ps(c[i] + j0 + 16) : _mm512_setzero_ps();
    }
    for (t = 0; t < K; t++) {
        const __m512 b0 = _mm512_loadu_ps(b + t * b_rs);
        const __m512 b1 = _mm512_loadu_ps(b + t * b_rs + 16);
        FA_TILE_ROW(0); FA_TILE_ROW(1); FA_TILE_ROW(2); FA_TILE_ROW(3);
        FA_TILE_ROW(4); FA_TILE_ROW(5); FA_TILE_ROW(6); FA_TILE_ROW(7);
    }
    for (i = 0; i < 8; i++) {
        ptrdiff_t h;
        if (i >= rows)
            break;
        for (h = 0; h < 2; h++) {
            __m512 sum = acc[i][h];
            if (mode == 2) {
                const __m512 sc = _mm512_loadu_ps(c_scale + 16 * h);
                const __mmask16 kept = _mm512_cmp_ps_mask(sc, _mm512_setzero_ps(),
                                                          _CMP_NEQ_UQ);
                sum = _mm512_add_ps(
                    _mm512_maskz_mul_ps(kept, _mm512_loadu_ps(c[i] + j0 + 16 * h), sc),
                    sum);
            }
            _mm512_storeu_ps(c[i] + j0 + 16 * h, sum);
        }
    }
}
#undef FA_TILE_ROW
#elif defined(__AVX2__) && defined(__FMA__) && FA_MR_F == 6 && FA_NR_F == 16 \
    && !defined(FA_PORTABLE_TILE)
#define FA_HAVE_MICROTILE_F 1
FA_AVX2_TILE(fa_microtile_f32, float, __m256, ps, ss, 8)
#else
#define FA_HAVE_MICROTILE_F 0
FA_NO_TILE(fa_microtile_f32, float)
#endif

/* The float64 tile with AVX2: 6 x 8, the same template with four doubles a vector
   (gcc's code for the portable loop kept its sums on the stack and zeroed them with
   rep stos every tile). */
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__) && FA_MR_D == 6 \
    && FA_NR_D == 8 && !defined(FA_PORTABLE_TILE)
#define FA_HAVE_MICROTILE_D 1
FA_AVX2_TILE(fa_microtile_f64, double, __m256d, pd, sd, 4)
#else
#define FA_HAVE_MICROTILE_D 0
FA_NO_TILE(fa_microtile_f64, double)
#endif

#endif
