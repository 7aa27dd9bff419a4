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

#define FA_TILE_ROW(i)                                                          \
    do {                                                                        \
        __m512 x = _mm512_set1_ps(a[i][t * a_cs]);                              \
        acc[i][0] = _mm512_fmadd_ps(x, b0, acc[i][0]);                          \
        acc[i][1] = _mm512_fmadd_ps(x, b1, acc[i][1]);                          \
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
/* The same with AVX2: a 6 x 16 tile, twelve sums, two vectors of B and one broadcast
   of A in the sixteen registers. */
#define FA_HAVE_MICROTILE_F 1
#include <immintrin.h>

#define FA_TILE_ROW(i)                                                          \
    do {                                                                        \
        __m256 x = _mm256_broadcast_ss(a[i] + t * a_cs);                        \
        acc[i][0] = _mm256_fmadd_ps(x, b0, acc[i][0]);                          \
        acc[i][1] = _mm256_fmadd_ps(x, b1, acc[i][1]);                          \
    } while (0)

static inline void fa_microtile_f32(const float *const *a, ptrdiff_t a_cs,
                                    const float *b, ptrdiff_t b_rs, ptrdiff_t K,
                                    float *const *c, ptrdiff_t j0, ptrdiff_t rows,
                                    ptrdiff_t mode, const float *c_scale) {
    __m256 acc[6][2];
    ptrdiff_t i, t;
    for (i = 0; i < 6; i++) {
        acc[i][0] = mode == 1 ? _mm256_loadu_ps(c[i] + j0) : _mm256_setzero_ps();
        acc[i][1] = mode == 1 ? _mm256_loadu_ps(c[i] + j0 + 8) : _mm256_setzero_ps();
    }
    for (t = 0; t < K; t++) {
        const __m256 b0 = _mm256_loadu_ps(b + t * b_rs);
        const __m256 b1 = _mm256_loadu_ps(b + t * b_rs + 8);
        FA_TILE_ROW(0); FA_TILE_ROW(1); FA_TILE_ROW(2);
        FA_TILE_ROW(3); FA_TILE_ROW(4); FA_TILE_ROW(5);
    }
    for (i = 0; i < 6; i++) {
        ptrdiff_t h;
        if (i >= rows)
            break;
        for (h = 0; h < 2; h++) {
            __m256 sum = acc[i][h];
            if (mode == 2) {
                const __m256 sc = _mm256_loadu_ps(c_scale + 8 * h);
                const __m256 kept = _mm256_cmp_ps(sc, _mm256_setzero_ps(), _CMP_NEQ_UQ);
                sum = _mm256_add_ps(
                    _mm256_and_ps(kept, _mm256_mul_ps(_mm256_loadu_ps(c[i] + j0 + 8 * h),
                                                      sc)),
                    sum);
            }
            _mm256_storeu_ps(c[i] + j0 + 8 * h, sum);
        }
    }
}
#undef FA_TILE_ROW
#else
#define FA_HAVE_MICROTILE_F 0
static inline void fa_microtile_f32(const float *const *a, ptrdiff_t a_cs,
                                    const float *b, ptrdiff_t b_rs, ptrdiff_t K,
                                    float *const *c, ptrdiff_t j0, ptrdiff_t rows,
                                    ptrdiff_t mode, const float *c_scale) {
    (void) a; (void) a_cs; (void) b; (void) b_rs; (void) K; (void) c; (void) j0;
    (void) rows; (void) mode; (void) c_scale;   /* never called: gemm()'s loop runs */
}
#endif

/* The float64 register tile with AVX2, written out: 6 x 8, twelve sums of four doubles,
   two vectors of B and one broadcast of A in the sixteen registers, as the float32
   tile above (gcc's own code for the portable loop kept the sums through the stack and
   zeroed them with rep stos every tile). The same sums in the same order, the same
   modes. */
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__) && FA_MR_D == 6 \
    && FA_NR_D == 8 && !defined(FA_PORTABLE_TILE)
#define FA_HAVE_MICROTILE_D 1
#include <immintrin.h>

#define FA_TILE_ROW(i)                                                          \
    do {                                                                        \
        __m256d x = _mm256_broadcast_sd(a[i] + t * a_cs);                       \
        acc[i][0] = _mm256_fmadd_pd(x, b0, acc[i][0]);                          \
        acc[i][1] = _mm256_fmadd_pd(x, b1, acc[i][1]);                          \
    } while (0)

static inline void fa_microtile_f64(const double *const *a, ptrdiff_t a_cs,
                                    const double *b, ptrdiff_t b_rs, ptrdiff_t K,
                                    double *const *c, ptrdiff_t j0, ptrdiff_t rows,
                                    ptrdiff_t mode, const double *c_scale) {
    __m256d acc[6][2];
    ptrdiff_t i, t;
    for (i = 0; i < 6; i++) {
        acc[i][0] = mode == 1 ? _mm256_loadu_pd(c[i] + j0) : _mm256_setzero_pd();
        acc[i][1] = mode == 1 ? _mm256_loadu_pd(c[i] + j0 + 4) : _mm256_setzero_pd();
    }
    for (t = 0; t < K; t++) {
        const __m256d b0 = _mm256_loadu_pd(b + t * b_rs);
        const __m256d b1 = _mm256_loadu_pd(b + t * b_rs + 4);
        FA_TILE_ROW(0); FA_TILE_ROW(1); FA_TILE_ROW(2);
        FA_TILE_ROW(3); FA_TILE_ROW(4); FA_TILE_ROW(5);
    }
    for (i = 0; i < 6; i++) {
        ptrdiff_t h;
        if (i >= rows)
            break;
        for (h = 0; h < 2; h++) {
            __m256d sum = acc[i][h];
            if (mode == 2) {
                const __m256d sc = _mm256_loadu_pd(c_scale + 4 * h);
                const __m256d kept = _mm256_cmp_pd(sc, _mm256_setzero_pd(), _CMP_NEQ_UQ);
                sum = _mm256_add_pd(
                    _mm256_and_pd(kept, _mm256_mul_pd(_mm256_loadu_pd(c[i] + j0 + 4 * h),
                                                      sc)),
                    sum);
            }
            _mm256_storeu_pd(c[i] + j0 + 4 * h, sum);
        }
    }
}
#undef FA_TILE_ROW
#else
#define FA_HAVE_MICROTILE_D 0
static inline void fa_microtile_f64(const double *const *a, ptrdiff_t a_cs,
                                    const double *b, ptrdiff_t b_rs, ptrdiff_t K,
                                    double *const *c, ptrdiff_t j0, ptrdiff_t rows,
                                    ptrdiff_t mode, const double *c_scale) {
    (void) a; (void) a_cs; (void) b; (void) b_rs; (void) K; (void) c; (void) j0;
    (void) rows; (void) mode; (void) c_scale;   /* never called: gemm()'s loop runs */
}
#endif

#endif
