/* The decode path's two kernels (fastattn/_tiles.pxd, attend_few), on AVX-512 and on
   AVX2 with FMA and F16C.

   fa_dots: many short dot products of a few query rows with a block of keys,

       s[r * s_rs + c] = sum_t q[r * q_rs + t] * k[c * k_rs + t]    r < R, c < C,

   each summed exactly as fastattn's dot_ (fastattn/_decode.pxd) sums it: 16 partial
   sums (element t into lane t % 16, in order of t, one fused multiply-add each), then
   lanes x + 8 into x, x + 4 into x, and (0 + 2) + (1 + 3). So the result is the same
   bit for bit whichever code runs. On AVX-512 one vector holds a product's 16 partial
   sums and 16 products run at once: four query rows by 4 keys while four rows are left
   (a grouped-query item), then two by 8 keys, then one by 16; the 16 vectors are then
   reduced together by shuffles (45 instructions for 16 sums, where one sum alone takes
   8). On AVX2 two vectors hold them (lanes 0-7 and 8-15) and 4 products run at once:
   four rows by one key, two by two, one by four. Several rows at once load each key
   vector once for all of them, so a grouped-query item loads and widens each key once
   per four query heads rather than once per head (docs/performance.md has the
   measurements).

   fa_pv: the block's weighted sum of the values, each value row streamed once per
   block of columns, the sums in registers.

   Both read K and V in place whether they are float32, bfloat16, float16 or the 8-bit
   codes of a quantized cache (widened in registers, exactly, so the sums are those of
   the widened rows; a code's scale is the caller's to apply, and e4m3 codes come in
   units of FA_E4M3_UNIT, their NaN codes the caller's to find) and prefetch the rows
   ahead. Elsewhere (FA_HAVE_DOTS 0) the caller widens the rows and uses its own loops
   and the micro-GEMM. */
#ifndef FASTATTN_FA_DOTS_H
#define FASTATTN_FA_DOTS_H

#include <stddef.h>
#include <stdint.h>

#include "fa_codes.h"
#include "fa_half.h"
#include "fa_prefetch.h"
#include "fa_transpose.h"     /* fa_lanes8_mask (AVX2) */

/* Where the rows of a stream (keys, values) lie: row c at base + c * stride bytes, or,
   with `rows` set, at rows[c] (the blocks of a paged cache: the caller's table of
   row addresses, which covers every row the kernel reads or asks for ahead). `ahead`
   rows past the one it reads a kernel asks for (0: fa_rows_ahead() of the row's or
   head part's bytes). */
typedef struct {
    const char *base;
    ptrdiff_t stride;
    const char **rows;
    ptrdiff_t ahead;
} fa_rows_t;

#define FA_ROW(r, c, tabbed) ((tabbed) ? (r).rows[c] : (r).base + (c) * (r).stride)

/* Several heads whose parts of each key row lie side by side (a token-major cache):
   their query rows, their scores, and where each head's part of a key row starts. */
typedef struct {
    ptrdiff_t n;        /* heads */
    ptrdiff_t q;        /* floats from one head's query rows to the next's */
    ptrdiff_t s;        /* floats from one head's scores to the next's */
    ptrdiff_t bytes;    /* from one head's part of a key row to the next's */
} fa_heads_t;

/* how far ahead of the rows they read the kernels ask for rows (bytes of row data) */
#ifndef FA_PREFETCH_BYTES
#define FA_PREFETCH_BYTES 3072
#endif

/* call f(..., kind) with kind a constant (0 or FA_STORED_*), so that each storage
   dtype gets its own inlined copy of the loops */
#define FA_WITH_KIND(kind, f, ...)                                                    \
    ((kind) == FA_STORED_BFLOAT16 ? f(__VA_ARGS__, FA_STORED_BFLOAT16)                \
     : (kind) == FA_STORED_FLOAT16 ? f(__VA_ARGS__, FA_STORED_FLOAT16)                \
     : (kind) == FA_STORED_INT8 ? f(__VA_ARGS__, FA_STORED_INT8)                      \
     : (kind) == FA_STORED_E4M3 ? f(__VA_ARGS__, FA_STORED_E4M3)                      \
     : (kind) == FA_STORED_E5M2 ? f(__VA_ARGS__, FA_STORED_E5M2)                      \
     : f(__VA_ARGS__, 0))

/* A block of `keys` keys from key c0 (nc of them real): kr[j] = key j's row from byte
   `off` (keys past nc re-read key nc - 1); with pf > 0, pf_bytes of key c0 + j + pf
   (from byte `off`) asked for where it lies below `limit`. */
static inline __attribute__((always_inline)) void fa_block_keys(
        fa_rows_t k, ptrdiff_t off, ptrdiff_t c0, ptrdiff_t nc, ptrdiff_t pf,
        ptrdiff_t pf_bytes, ptrdiff_t limit, const int keys, const int tabbed,
        const char **kr) {
    int j;
    for (j = 0; j < keys; j++)
        kr[j] = FA_ROW(k, c0 + (j < nc ? j : nc - 1), tabbed) + off;
    for (j = 0; pf && j < keys && j < nc; j++)
        if (c0 + j + pf < limit)
            fa_prefetch_rows(FA_ROW(k, c0 + j + pf, tabbed) + off, 1, pf_bytes, 0);
}

static inline __attribute__((always_inline)) ptrdiff_t fa_element_bytes(int kind) {
    if (kind == FA_STORED_INT8 || kind == FA_STORED_E4M3 || kind == FA_STORED_E5M2)
        return 1;
    return kind == FA_STORED_BFLOAT16 || kind == FA_STORED_FLOAT16 ? 2 : 4;
}

#if defined(__AVX512F__)
#include <immintrin.h>
#define FA_HAVE_DOTS 1
#define FA_VEC 16               /* floats per vector */
#define FA_DOTS_KEYS4 4         /* fa_dots: keys per block of 4, 2 and 1 query rows */
#define FA_DOTS_KEYS2 8
#define FA_DOTS_KEYS1 16
#define FA_PV_VECS4 4           /* fa_pv: vectors of columns per block of 4, 2, 1 rows */
#define FA_PV_VECS2 8
#define FA_PV_VECS1 8
#define FA_PV_RUN_BYTES 0      /* fa_pv: the value rows of all the keys at once */

/* 16 elements of a float32, bfloat16, float16 or 8-bit code stream (kind: 0 or FA_STORED_*, a
   constant where inlined) from element i of p, as float32 (exactly); the masked form
   reads only the lanes of m and gives zeros in the others. Two forms, not one with an
   all-ones mask: gcc 12 folds only an unmasked float32 load into the FMA that uses it
   (one instruction instead of two, and the decode loops are bound by instructions in
   flight per cache line). */
static inline __attribute__((always_inline)) __m512 fa_load16(const void *p,
                                                               ptrdiff_t i, int kind) {
    if (kind == FA_STORED_E4M3)
        return fa_e4m3_units16(_mm_loadu_si128((const __m128i *) ((const uint8_t *) p + i)));
    if (kind == FA_STORED_INT8 || kind == FA_STORED_E5M2)
        return fa_load_codes16(p, i, kind);
    if (kind == FA_STORED_BFLOAT16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
            _mm256_loadu_si256((const __m256i *) ((const uint16_t *) p + i))), 16));
    if (kind == FA_STORED_FLOAT16)
        return _mm512_cvtph_ps(
            _mm256_loadu_si256((const __m256i *) ((const uint16_t *) p + i)));
    return _mm512_loadu_ps((const float *) p + i);
}

static inline __attribute__((always_inline)) __m512 fa_load16_masked(
        const void *p, ptrdiff_t i, int kind, __mmask16 m) {
    if (kind == FA_STORED_E4M3)
        return fa_e4m3_units16(_mm_maskz_loadu_epi8(m, (const uint8_t *) p + i));
    if (kind == FA_STORED_INT8 || kind == FA_STORED_E5M2)
        return fa_load_codes16_masked(p, i, kind, m);
    if (kind == FA_STORED_BFLOAT16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
            _mm256_maskz_loadu_epi16(m, (const uint16_t *) p + i)), 16));
    if (kind == FA_STORED_FLOAT16)
        return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, (const uint16_t *) p + i));
    return _mm512_maskz_loadu_ps(m, (const float *) p + i);
}

/* v[0..15] -> one vector whose lane fa_dots_lane[i] holds the dot_ reduction of v[i] */
static inline __attribute__((always_inline)) __m512 fa_reduce16(__m512 v[16]) {
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
   inlined, so that the 16 partial sums stay in registers), keys c0.. of `kind` read in
   place from byte `off` of their rows; keys past nc re-read key nc - 1 and are not
   stored. With pf > 0, pf_bytes of key c0 + j + pf (from byte `off`) are prefetched
   where it lies below `limit`. */
static inline __attribute__((always_inline)) void fa_dots_block(
        const float *q, ptrdiff_t q_rs, fa_rows_t k, ptrdiff_t off, ptrdiff_t c0,
        ptrdiff_t nc, ptrdiff_t E, float *s, ptrdiff_t s_rs, ptrdiff_t pf,
        ptrdiff_t pf_bytes, ptrdiff_t limit, const int kind, const int rows,
        const int keys, const int tabbed) {
    __m512 acc[16], qv[4], kv;
    const char *kr[16];
    float sums[16];
    ptrdiff_t t, tail = E % 16, main = E - tail;
    __mmask16 last = (__mmask16) ((1u << tail) - 1u);
    int i, j;
    fa_block_keys(k, off, c0, nc, pf, pf_bytes, limit, keys, tabbed, kr);
    for (i = 0; i < 16; i++)
        acc[i] = _mm512_setzero_ps();
    for (t = 0; t < main; t += 16) {
        for (i = 0; i < rows; i++)
            qv[i] = _mm512_loadu_ps(q + i * q_rs + t);
        for (j = 0; j < keys; j++) {
            kv = fa_load16(kr[j], t, kind);
            for (i = 0; i < rows; i++)
                acc[i * keys + j] = _mm512_fmadd_ps(qv[i], kv, acc[i * keys + j]);
        }
    }
    if (tail) {     /* (masked: lanes past E add nothing, as in dot_) */
        for (i = 0; i < rows; i++)
            qv[i] = _mm512_maskz_loadu_ps(last, q + i * q_rs + main);
        for (j = 0; j < keys; j++) {
            kv = fa_load16_masked(kr[j], main, kind, last);
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

/* The decode path's weighted sum of one key block, on AVX-512: rows x (nvec * 16)
   columns (from byte `col` of each value row) of

       out[r * out_rs + e] = sum_c w[r * w_rs + c] * v[c][e]    c < C, in order,

   one fused multiply-add per term from zero (with `add`, from out's values: a sum
   carried on over the next keys is the one chain it would have been), the sums
   in registers while the value rows
   (of `kind`, widened in registers) stream past once (columns past `cols` masked: not
   read, not stored); with pf > 0, pf_bytes of row c + pf are prefetched where
   c + pf < limit. `full` (a constant: cols == 16 * nvec) drops the masks: gcc then
   folds a float32 row's loads into the multiply-adds, where a masked load is an
   instruction of its own and its mask register one more: the one-row loop of a
   multi-head decode is bound by the instructions in flight per cache line, and would
   wait on them. */
static inline __attribute__((always_inline)) void fa_pv_block(
        const float *w, ptrdiff_t w_rs, fa_rows_t v, ptrdiff_t col, ptrdiff_t C,
        ptrdiff_t cols, float *out, ptrdiff_t out_rs, int add, ptrdiff_t pf,
        ptrdiff_t pf_bytes, ptrdiff_t limit, const int kind, const int rows,
        const int nvec, const int full, const int tabbed) {
    __m512 acc[16], x;
    __mmask16 mask[8];
    const char *row;
    ptrdiff_t c;
    int i, j;
    for (j = 0; j < nvec; j++) {
        ptrdiff_t left = cols - 16 * j;
        mask[j] = left >= 16 ? (__mmask16) 0xFFFF
                             : (left > 0 ? (__mmask16) ((1u << left) - 1u) : 0);
    }
    for (i = 0; i < rows; i++)
        for (j = 0; j < nvec; j++)
            acc[i * nvec + j] = add ? _mm512_maskz_loadu_ps(mask[j],
                                                            out + i * out_rs + 16 * j)
                                    : _mm512_setzero_ps();
    for (c = 0; c < C; c++) {
        if (pf && c + pf < limit)
            fa_prefetch_rows(FA_ROW(v, c + pf, tabbed) + col, 1, pf_bytes, 0);
        row = FA_ROW(v, c, tabbed) + col;
        for (j = 0; j < nvec; j++) {
            x = full ? fa_load16(row, 16 * j, kind)
                     : fa_load16_masked(row, 16 * j, kind, mask[j]);
            for (i = 0; i < rows; i++)
                acc[i * nvec + j] = _mm512_fmadd_ps(_mm512_set1_ps(w[i * w_rs + c]), x,
                                                    acc[i * nvec + j]);
        }
    }
    for (i = 0; i < rows; i++)
        for (j = 0; j < nvec; j++)
            _mm512_mask_storeu_ps(out + i * out_rs + 16 * j, mask[j],
                                  acc[i * nvec + j]);
}

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define FA_HAVE_DOTS 1
#define FA_VEC 8                /* floats per vector */
#define FA_DOTS_KEYS4 1         /* fa_dots: keys per block of 4, 2 and 1 query rows */
#define FA_DOTS_KEYS2 2
#define FA_DOTS_KEYS1 4
#define FA_PV_VECS4 2           /* fa_pv: vectors of columns per block of 4, 2, 1 rows */
#define FA_PV_VECS2 4
#define FA_PV_VECS1 8
#ifndef FA_PV_RUN_BYTES
#define FA_PV_RUN_BYTES 16384  /* fa_pv: value rows read per run of keys */
#endif

/* 8 elements of a float32, bfloat16, float16 or 8-bit code stream (kind: 0 or
   FA_STORED_*, a constant where inlined) from element i of p, as float32, exactly
   (e4m3 codes in units of FA_E4M3_UNIT, as fa_e4m3_units16 reads them). */
static inline __attribute__((always_inline)) __m256 fa_load8(const void *p, ptrdiff_t i,
                                                              int kind) {
    if (kind == FA_STORED_E4M3)
        return fa_e4m3_units8(_mm_loadl_epi64((const __m128i *) ((const uint8_t *) p + i)));
    if (kind == FA_STORED_INT8 || kind == FA_STORED_E5M2)
        return fa_codes8(_mm_loadl_epi64((const __m128i *) ((const uint8_t *) p + i)), kind);
    if (kind == FA_STORED_BFLOAT16)
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(
            _mm_loadu_si128((const __m128i *) ((const uint16_t *) p + i))), 16));
    if (kind == FA_STORED_FLOAT16)
        return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) ((const uint16_t *) p + i)));
    return _mm256_loadu_ps((const float *) p + i);
}

/* fa_load8 of the first n elements only (at most 8, none for n <= 0; no byte past
   them is read), the other lanes 0: AVX2 masks only 32-bit elements, so a narrower
   stream's elements are copied out first. */
static inline __attribute__((always_inline)) __m256 fa_load8_part(const void *p,
                                                                   ptrdiff_t i,
                                                                   ptrdiff_t n,
                                                                   int kind) {
    float buf[8] = {0};
    ptrdiff_t eb = fa_element_bytes(kind);
    if (n <= 0)
        return _mm256_setzero_ps();
    if (kind == 0)
        return _mm256_maskload_ps((const float *) p + i, fa_lanes8_mask(n));
    memcpy(buf, (const char *) p + i * eb, (size_t) ((n < 8 ? n : 8) * eb));
    return fa_load8(buf, 0, kind);
}

/* lo[x] + hi[x] for x < 4 (lanes x + 8 into x) summed as dot_ sums its lanes: the dot
   product x lands in lane fa_dots_lane[x] */
static inline __attribute__((always_inline)) __m256 fa_reduce4(const __m256 lo[4],
                                                                const __m256 hi[4]) {
    __m256 v0 = _mm256_add_ps(lo[0], hi[0]), v1 = _mm256_add_ps(lo[1], hi[1]);
    __m256 v2 = _mm256_add_ps(lo[2], hi[2]), v3 = _mm256_add_ps(lo[3], hi[3]);
    /* lanes x + 4 into x: the 128-bit halves of two vectors */
    __m256 a = _mm256_add_ps(_mm256_permute2f128_ps(v0, v1, 0x20),
                             _mm256_permute2f128_ps(v0, v1, 0x31));
    __m256 b = _mm256_add_ps(_mm256_permute2f128_ps(v2, v3, 0x20),
                             _mm256_permute2f128_ps(v2, v3, 0x31));
    /* (0 + 2) + (1 + 3) within each half */
    __m256 e = _mm256_add_ps(_mm256_shuffle_ps(a, b, 0x44), _mm256_shuffle_ps(a, b, 0xEE));
    return _mm256_add_ps(_mm256_shuffle_ps(e, e, 0x88), _mm256_shuffle_ps(e, e, 0xDD));
}

static const int fa_dots_lane[4] = {0, 4, 1, 5};

/* one block: rows x keys dot products (rows * keys == 4, both constants where it is
   inlined: 8 vectors of partial sums in registers), keys c0.. of `kind` read in place
   from byte `off` of their rows; keys past nc re-read key nc - 1 and are not stored.
   With pf > 0, pf_bytes of key c0 + j + pf from byte `off` are prefetched where it
   lies below `limit`. Four rows take their query elements from
   memory with each multiply-add (8 sums, 2 key vectors and 8 query vectors would not
   fit the 16 registers); fewer keep them in registers. */
static inline __attribute__((always_inline)) void fa_dots_block(
        const float *q, ptrdiff_t q_rs, fa_rows_t k, ptrdiff_t off, ptrdiff_t c0,
        ptrdiff_t nc, ptrdiff_t E, float *s, ptrdiff_t s_rs, ptrdiff_t pf,
        ptrdiff_t pf_bytes, ptrdiff_t limit, const int kind, const int rows,
        const int keys, const int tabbed) {
    __m256 lo[4], hi[4], ql[2], qh[2], kl, kh;
    const char *kr[4];
    float sums[8];
    ptrdiff_t t, tail = E % 16, main = E - tail;
    int i, j;
    fa_block_keys(k, off, c0, nc, pf, pf_bytes, limit, keys, tabbed, kr);
    for (i = 0; i < 4; i++) {
        lo[i] = _mm256_setzero_ps();
        hi[i] = _mm256_setzero_ps();
    }
    for (t = 0; t < main; t += 16) {
        if (rows < 4)
            for (i = 0; i < rows; i++) {
                ql[i] = _mm256_loadu_ps(q + i * q_rs + t);
                qh[i] = _mm256_loadu_ps(q + i * q_rs + t + 8);
            }
        for (j = 0; j < keys; j++) {
            kl = fa_load8(kr[j], t, kind);
            kh = fa_load8(kr[j], t + 8, kind);
            for (i = 0; i < rows; i++) {
                lo[i * keys + j] = _mm256_fmadd_ps(
                    rows < 4 ? ql[i] : _mm256_loadu_ps(q + i * q_rs + t), kl,
                    lo[i * keys + j]);
                hi[i * keys + j] = _mm256_fmadd_ps(
                    rows < 4 ? qh[i] : _mm256_loadu_ps(q + i * q_rs + t + 8), kh,
                    hi[i * keys + j]);
            }
        }
    }
    if (tail) {     /* lanes past E keep their sums, as in dot_ */
        __m256i ml = fa_lanes8_mask(tail), mh = fa_lanes8_mask(tail - 8);
        for (j = 0; j < keys; j++) {
            kl = fa_load8_part(kr[j], main, tail, kind);
            kh = fa_load8_part(kr[j], main + 8, tail - 8, kind);
            for (i = 0; i < rows; i++) {
                __m256 x = _mm256_maskload_ps(q + i * q_rs + main, ml);
                __m256 y = _mm256_maskload_ps(q + i * q_rs + main + 8, mh);
                lo[i * keys + j] = _mm256_blendv_ps(
                    lo[i * keys + j], _mm256_fmadd_ps(x, kl, lo[i * keys + j]),
                    _mm256_castsi256_ps(ml));
                hi[i * keys + j] = _mm256_blendv_ps(
                    hi[i * keys + j], _mm256_fmadd_ps(y, kh, hi[i * keys + j]),
                    _mm256_castsi256_ps(mh));
            }
        }
    }
    _mm256_storeu_ps(sums, fa_reduce4(lo, hi));
    for (i = 0; i < rows; i++)
        for (j = 0; j < keys && j < nc; j++)
            s[i * s_rs + j] = sums[fa_dots_lane[i * keys + j]];
}

/* The decode path's weighted sum of one key block, on AVX2: rows x (nvec * 8) columns
   (from byte `col` of each value row) of

       out[r * out_rs + e] = sum_c w[r * w_rs + c] * v[c][e]    c < C, in order,

   one fused multiply-add per term from zero (with `add`, from out's values), as the
   AVX-512 fa_pv_block sums it; the sums in registers while the value
   rows (of `kind`, widened in registers) stream past once (columns past `cols` are not
   read or stored; `full`, a constant, says cols == 8 * nvec); with pf > 0, pf_bytes of
   row c + pf are prefetched where c + pf < limit. */
static inline __attribute__((always_inline)) void fa_pv_block(
        const float *w, ptrdiff_t w_rs, fa_rows_t v, ptrdiff_t col, ptrdiff_t C,
        ptrdiff_t cols, float *out, ptrdiff_t out_rs, int add, ptrdiff_t pf,
        ptrdiff_t pf_bytes, ptrdiff_t limit, const int kind, const int rows,
        const int nvec, const int full, const int tabbed) {
    __m256 acc[8], x;
    __m256i mask[8];
    const char *row;
    ptrdiff_t c;
    int i, j;
    for (j = 0; j < nvec; j++)
        mask[j] = fa_lanes8_mask(cols - 8 * j);
    for (i = 0; i < rows; i++)
        for (j = 0; j < nvec; j++)
            acc[i * nvec + j] = !add ? _mm256_setzero_ps()
                                : full ? _mm256_loadu_ps(out + i * out_rs + 8 * j)
                                : _mm256_maskload_ps(out + i * out_rs + 8 * j, mask[j]);
    for (c = 0; c < C; c++) {
        if (pf && c + pf < limit)
            fa_prefetch_rows(FA_ROW(v, c + pf, tabbed) + col, 1, pf_bytes, 0);
        row = FA_ROW(v, c, tabbed) + col;
        for (j = 0; j < nvec; j++) {
            x = full || cols >= 8 * (j + 1) ? fa_load8(row, 8 * j, kind)
                                           : fa_load8_part(row, 8 * j, cols - 8 * j, kind);
            for (i = 0; i < rows; i++)
                acc[i * nvec + j] = _mm256_fmadd_ps(_mm256_broadcast_ss(w + i * w_rs + c),
                                                    x, acc[i * nvec + j]);
        }
    }
    for (i = 0; i < rows; i++)
        for (j = 0; j < nvec; j++) {
            if (full)
                _mm256_storeu_ps(out + i * out_rs + 8 * j, acc[i * nvec + j]);
            else
                _mm256_maskstore_ps(out + i * out_rs + 8 * j, mask[j], acc[i * nvec + j]);
        }
}
#else
#define FA_HAVE_DOTS 0
#endif

#if FA_HAVE_DOTS

/* Software prefetch: while row c of a stream (keys, values) is read, the cache lines
   of row c + ahead are asked for, ahead = FA_PREFETCH_BYTES of row data; rows past
   the caller's limit (the end of its keys) are not asked for. One prefetch per cache
   line: the loads that feed the sums wait in the CPU's schedulers and the prefetches
   do not, so a line is on its way before a load needs it. The distance, 3 KiB, is a
   compromise (docs/performance.md): on the decode shapes measured, shorter distances
   served caches read from the last-level cache and longer ones those read from
   memory. Build with -DFA_PREFETCH_BYTES=N to try another. */

static inline ptrdiff_t fa_rows_ahead(ptrdiff_t row_bytes) {
    ptrdiff_t rows = row_bytes > 0 ? FA_PREFETCH_BYTES / row_bytes : 0;
    return rows > 0 ? rows : 1;
}

/* the rows ahead a kernel asks for over rows r of row_bytes each: r's own, or the
   default */
static inline ptrdiff_t fa_stream_ahead(fa_rows_t r, ptrdiff_t row_bytes) {
    return r.ahead > 0 ? r.ahead : fa_rows_ahead(row_bytes);
}

/* The bytes of each row ahead that head h of `heads` asks for, its part being
   part_bytes from byte h * heads.bytes (C > 0 rows): part_bytes, or, where neither
   the next head's part nor the next row follows the part, fa_part_bytes (to its last
   line). */
static inline ptrdiff_t fa_heads_ask(fa_rows_t k, fa_heads_t heads, ptrdiff_t h,
                                     ptrdiff_t part_bytes, const int tabbed) {
    ptrdiff_t next = h + 1 < heads.n ? (h + 1) * heads.bytes : k.stride;
    if (h * heads.bytes + part_bytes == next)
        return part_bytes;
    return fa_part_bytes(FA_ROW(k, 0, tabbed) + h * heads.bytes, part_bytes);
}

/* `rows` query rows (a constant) of every head against keys 0..C, `keys` keys at a
   time, each block of keys for every head in turn, so that the keys' rows are read in
   memory order whichever head they belong to; each head's blocks ask for its own
   part (pf_bytes) of the rows pf ahead (pf > 0), to its last line (fa_heads_ask). */
static inline __attribute__((always_inline)) void fa_dots_rows(
        const float *q, ptrdiff_t q_rs, fa_rows_t k, ptrdiff_t C, ptrdiff_t E, float *s,
        ptrdiff_t s_rs, ptrdiff_t pf, ptrdiff_t pf_bytes, ptrdiff_t limit,
        fa_heads_t heads, const int kind, const int rows, const int keys,
        const int tabbed) {
    ptrdiff_t c0, h;
    ptrdiff_t inner = fa_heads_ask(k, heads, 0, pf_bytes, tabbed);
    ptrdiff_t last = fa_heads_ask(k, heads, heads.n - 1, pf_bytes, tabbed);
    for (c0 = 0; c0 < C; c0 += keys)
        for (h = 0; h < heads.n; h++)
            fa_dots_block(q + h * heads.q, q_rs, k, h * heads.bytes, c0, C - c0, E,
                          s + h * heads.s + c0, s_rs, pf,
                          h + 1 < heads.n ? inner : last, limit, kind, rows, keys,
                          tabbed);
}

/* 4 rows x FA_DOTS_KEYS4 keys while four rows are left, then 2 x FA_DOTS_KEYS2, then
   1 x FA_DOTS_KEYS1; the first pass over the keys asks for the rows ahead, each head
   its own part of them where there are several heads side by side (asked for as whole
   token rows by the first head's blocks alone, a burst of a token row's lines per key,
   memory served them slower: docs/performance.md). */
static inline __attribute__((always_inline)) void fa_dots_of_kind(
        const float *q, ptrdiff_t q_rs, ptrdiff_t R, fa_rows_t k, ptrdiff_t C,
        ptrdiff_t E, float *s, ptrdiff_t s_rs, ptrdiff_t limit, fa_heads_t heads,
        const int tabbed, const int kind) {
    ptrdiff_t row_bytes = E * fa_element_bytes(kind);
    ptrdiff_t r0 = 0, pf = fa_stream_ahead(k, row_bytes);
    for (; R - r0 >= 4; r0 += 4, pf = 0)
        fa_dots_rows(q + r0 * q_rs, q_rs, k, C, E, s + r0 * s_rs, s_rs, pf, row_bytes,
                     limit, heads, kind, 4, FA_DOTS_KEYS4, tabbed);
    for (; R - r0 >= 2; r0 += 2, pf = 0)
        fa_dots_rows(q + r0 * q_rs, q_rs, k, C, E, s + r0 * s_rs, s_rs, pf, row_bytes,
                     limit, heads, kind, 2, FA_DOTS_KEYS2, tabbed);
    for (; r0 < R; r0++, pf = 0)
        fa_dots_rows(q + r0 * q_rs, q_rs, k, C, E, s + r0 * s_rs, s_rs, pf, row_bytes,
                     limit, heads, kind, 1, FA_DOTS_KEYS1, tabbed);
}

static inline __attribute__((always_inline)) void fa_dots_flat(
        const float *q, ptrdiff_t q_rs, ptrdiff_t R, fa_rows_t k, ptrdiff_t C,
        ptrdiff_t E, float *s, ptrdiff_t s_rs, ptrdiff_t limit, fa_heads_t heads,
        const int kind) {
    fa_dots_of_kind(q, q_rs, R, k, C, E, s, s_rs, limit, heads, 0, kind);
}

static inline __attribute__((always_inline)) void fa_dots_tabbed(
        const float *q, ptrdiff_t q_rs, ptrdiff_t R, fa_rows_t k, ptrdiff_t C,
        ptrdiff_t E, float *s, ptrdiff_t s_rs, ptrdiff_t limit, fa_heads_t heads,
        const int kind) {
    fa_dots_of_kind(q, q_rs, R, k, C, E, s, s_rs, limit, heads, 1, kind);
}

/* fa_dots for heads.n heads whose parts of a key row lie side by side (a token-major
   cache), head h's R query rows at q + h * heads.q and its scores at s + h * heads.s:
   the same sums as one fa_dots call per head, with the keys' rows read once, in
   memory order (each block of keys for every head in turn), each head asking for its
   part of the rows ahead. */
static inline void fa_dots_heads(const float *q, ptrdiff_t q_rs, ptrdiff_t R,
                                 fa_rows_t k, int kind, ptrdiff_t C, ptrdiff_t E,
                                 float *s, ptrdiff_t s_rs, ptrdiff_t limit,
                                 fa_heads_t heads) {
    if (C <= 0 || heads.n <= 0)
        return;
    if (k.rows)
        FA_WITH_KIND(kind, fa_dots_tabbed, q, q_rs, R, k, C, E, s, s_rs, limit, heads);
    else
        FA_WITH_KIND(kind, fa_dots_flat, q, q_rs, R, k, C, E, s, s_rs, limit, heads);
}

/* s (R, C) as above, the keys k (C rows of E) float32, bfloat16, float16 or codes
   (kind: 0 or FA_STORED_*) read in place, widened in registers. The first pass over
   the keys (rows 0 to 3, 0 and 1, or 0) prefetches the rows fa_stream_ahead() ahead of
   it, below key `limit` (the end of the keys the caller will read). */
static inline void fa_dots(const float *q, ptrdiff_t q_rs, ptrdiff_t R, fa_rows_t k,
                           int kind, ptrdiff_t C, ptrdiff_t E, float *s, ptrdiff_t s_rs,
                           ptrdiff_t limit) {
    fa_heads_t one = {1, 0, 0, 0};
    fa_dots_heads(q, q_rs, R, k, kind, C, E, s, s_rs, limit, one);
}

/* `rows` rows of out, by columns of FA_VEC * nvec, prefetching pf rows ahead (pf > 0):
   with `whole` (a constant), the first column block asks for whole value rows and the
   others find them in the cache, so that memory is read row after row; else each
   column block asks for its own columns. The groups of four rows (a grouped-query
   decode) ask for whole rows; the groups of two rows and of one (a multi-head decode)
   ask per column block: each reads faster that way (docs/performance.md). Where the
   rows do not follow one another (a head's part of token-major rows), the requests
   that reach a row part's end reach its last line (fa_part_bytes). */
static inline __attribute__((always_inline)) void fa_pv_rows(
        const float *w, ptrdiff_t w_rs, fa_rows_t v, ptrdiff_t C, ptrdiff_t Ev,
        float *out, ptrdiff_t out_rs, int add, ptrdiff_t pf, ptrdiff_t limit,
        const int kind, const int rows, const int nvec, const int whole,
        const int tabbed) {
    ptrdiff_t e0, eb = fa_element_bytes(kind), width = FA_VEC * nvec, ahead, bytes;
    for (e0 = 0; e0 < Ev; e0 += width) {
        ahead = whole && e0 ? 0 : pf;
        bytes = (whole ? Ev : (Ev - e0 < width ? Ev - e0 : width)) * eb;
        if (ahead && C > 0 && v.stride != Ev * eb && (whole || e0 + width >= Ev))
            bytes = fa_part_bytes(FA_ROW(v, 0, tabbed) + e0 * eb, bytes);
        if (Ev - e0 >= width)       /* (a constant count of lines without `whole`) */
            fa_pv_block(w, w_rs, v, e0 * eb, C, width, out + e0, out_rs, add, ahead,
                        bytes, limit, kind, rows, nvec, 1, tabbed);
        else
            fa_pv_block(w, w_rs, v, e0 * eb, C, Ev - e0, out + e0, out_rs, add, ahead,
                        bytes, limit, kind, rows, nvec, 0, tabbed);
    }
}

/* fa_pv_of_kind for keys c0..c0+C of v (w's and the limit's columns from c0 too) */
static inline __attribute__((always_inline)) void fa_pv_keys(
        const float *w, ptrdiff_t w_rs, ptrdiff_t R, fa_rows_t v, ptrdiff_t c0,
        ptrdiff_t C, ptrdiff_t Ev, float *out, ptrdiff_t out_rs, int add,
        ptrdiff_t limit, const int tabbed, const int kind) {
    ptrdiff_t r0 = 0, pf = fa_stream_ahead(v, Ev * fa_element_bytes(kind));
    if (tabbed)
        v.rows += c0;
    else
        v.base += c0 * v.stride;
    w += c0;
    limit -= c0;
    for (; R - r0 >= 4; r0 += 4, pf = 0)
        fa_pv_rows(w + r0 * w_rs, w_rs, v, C, Ev, out + r0 * out_rs, out_rs, add, pf,
                   limit, kind, 4, FA_PV_VECS4, 1, tabbed);
    for (; R - r0 >= 2; r0 += 2, pf = 0)
        fa_pv_rows(w + r0 * w_rs, w_rs, v, C, Ev, out + r0 * out_rs, out_rs, add, pf,
                   limit, kind, 2, FA_PV_VECS2, 0, tabbed);
    for (; r0 < R; r0++, pf = 0)
        fa_pv_rows(w + r0 * w_rs, w_rs, v, C, Ev, out + r0 * out_rs, out_rs, add, pf,
                   limit, kind, 1, FA_PV_VECS1, 0, tabbed);
}

/* The keys in runs of FA_PV_RUN_BYTES of value rows (all at once where it is 0), each
   run's rows read once per block of columns while they stay in the L1 cache; a run
   after the first carries the sums on (`add`), so the chains are those of one run.
   `add` is a variable, not a constant: it only chooses how each block's sums start,
   so one copy of the loops per storage kind and address mode serves every run (a
   copy per value of `add` would multiply the module's code and its build). */
static inline __attribute__((always_inline)) void fa_pv_of_kind(
        const float *w, ptrdiff_t w_rs, ptrdiff_t R, fa_rows_t v, ptrdiff_t C,
        ptrdiff_t Ev, float *out, ptrdiff_t out_rs, int add, ptrdiff_t limit,
        const int tabbed, const int kind) {
    ptrdiff_t row_bytes = Ev * fa_element_bytes(kind), c0;
    ptrdiff_t run = FA_PV_RUN_BYTES && row_bytes > 0 ? FA_PV_RUN_BYTES / row_bytes : C;
    run = run < 1 ? 1 : run;
    c0 = 0;
    do {    /* (once where C is 0: without `add`, out's sums are set to zero) */
        fa_pv_keys(w, w_rs, R, v, c0, C - c0 < run ? C - c0 : run, Ev, out, out_rs,
                   add || c0 > 0, limit, tabbed, kind);
        c0 += run;
    } while (c0 < C);
}

static inline __attribute__((always_inline)) void fa_pv_flat(
        const float *w, ptrdiff_t w_rs, ptrdiff_t R, fa_rows_t v, ptrdiff_t C,
        ptrdiff_t Ev, float *out, ptrdiff_t out_rs, int add, ptrdiff_t limit,
        const int kind) {
    fa_pv_of_kind(w, w_rs, R, v, C, Ev, out, out_rs, add, limit, 0, kind);
}

static inline __attribute__((always_inline)) void fa_pv_tabbed(
        const float *w, ptrdiff_t w_rs, ptrdiff_t R, fa_rows_t v, ptrdiff_t C,
        ptrdiff_t Ev, float *out, ptrdiff_t out_rs, int add, ptrdiff_t limit,
        const int kind) {
    fa_pv_of_kind(w, w_rs, R, v, C, Ev, out, out_rs, add, limit, 1, kind);
}

/* out (R, Ev) = w (R, C) . v (C rows of Ev) as fa_pv_block sums it, the values
   float32, bfloat16, float16 or codes (kind: 0 or FA_STORED_*) read in place: 4 rows
   at a time while four rows are left (a grouped-query item: each value vector, loaded
   and widened once, serves four rows rather than two), then 2 or 1 (by 64, 128 and 128
   columns on AVX-512; by 16, 32 and 64 on AVX2). The value rows are read in order once per group of rows: from memory by the
   first group, which prefetches the rows fa_stream_ahead() ahead, below row `limit`;
   from the cache by the others. With `add`, out += w . v, each sum carried on in the
   same chain (the sums of C1 keys then of C2 more are those of C1 + C2 keys at once).
   An inf or NaN in v leaves inf or NaN in out (w is finite), so the caller checks out,
   not v. */
static inline void fa_pv(const float *w, ptrdiff_t w_rs, ptrdiff_t R, fa_rows_t v,
                         int kind, ptrdiff_t C, ptrdiff_t Ev, float *out,
                         ptrdiff_t out_rs, int add, ptrdiff_t limit) {
    if (v.rows)
        FA_WITH_KIND(kind, fa_pv_tabbed, w, w_rs, R, v, C, Ev, out, out_rs, add, limit);
    else
        FA_WITH_KIND(kind, fa_pv_flat, w, w_rs, R, v, C, Ev, out, out_rs, add, limit);
}
#else   /* no kernels in this module: never called (FA_HAVE_DOTS is 0), declared so
           that the callers compile where implicit declarations are errors */

static inline void fa_dots(const float *q, ptrdiff_t q_rs, ptrdiff_t R, fa_rows_t k,
                           int kind, ptrdiff_t C, ptrdiff_t E, float *s, ptrdiff_t s_rs,
                           ptrdiff_t limit) {
    (void) q; (void) q_rs; (void) R; (void) k; (void) kind; (void) C; (void) E;
    (void) s; (void) s_rs; (void) limit;
}

static inline void fa_dots_heads(const float *q, ptrdiff_t q_rs, ptrdiff_t R,
                                 fa_rows_t k, int kind, ptrdiff_t C, ptrdiff_t E,
                                 float *s, ptrdiff_t s_rs, ptrdiff_t limit,
                                 fa_heads_t heads) {
    (void) heads;
    fa_dots(q, q_rs, R, k, kind, C, E, s, s_rs, limit);
}

static inline void fa_pv(const float *w, ptrdiff_t w_rs, ptrdiff_t R, fa_rows_t v,
                         int kind, ptrdiff_t C, ptrdiff_t Ev, float *out,
                         ptrdiff_t out_rs, int add, ptrdiff_t limit) {
    (void) w; (void) w_rs; (void) R; (void) v; (void) kind; (void) C; (void) Ev;
    (void) out; (void) out_rs; (void) add; (void) limit;
}
#endif

#endif
