/* The decode path's two kernels for float8 codes on the bfloat16 units (AVX512-BF16,
   with AVX512-VBMI's byte lookups): e4m3fn and e5m2 key and value codes against
   bfloat16 queries, where vdpbf16ps issues as often as a float32 FMA (AMD Zen 4 and
   5) and so does twice its work.

   Every float8 code is a bfloat16 value exactly (4 and 3 significant bits, their
   subnormals normal in bfloat16), so 64 codes are widened to bfloat16 words by two
   byte lookups (the words' low and high bytes, vpermi2b over the 128-entry tables of
   the codes' magnitudes, fa_pair_tables), the sign, and two unpacks, in place of the
   four widenings to float32 of fa_dots.h; a NaN or inf code widens to a NaN or an inf.
   (int8 codes keep fa_dots.h: their widening to float32 takes two instructions per 16,
   and the pairs gained nothing there: docs/performance.md.)

   fa_pair_dots: the scores of R query rows against a block of keys,

       s[r * s_rs + c] = f[r] * sum_t qp[r][t] * code(k[c][t])

   qp: the query rows as bfloat16 words, each divided by a power of two so that its
   largest element lies in [1, 2) (fa_pair_queries; f[r] multiplies it back, times the
   softmax scale). The products are exact in float32 and the sums run in float32, as
   fa_dots sums them but in another order: 16 lanes of pairs of elements per product.
   The lookups give a 64-element chunk's words in the order of vpunpck[lh]bw (in
   128-bit lane L, elements 16L..16L+7 in the first vector, 16L+8..16L+15 in the
   second), so fa_pair_queries writes each chunk of a query row in that order.

   fa_pair_pv: the block's weighted sum of the values,

       out[r * out_rs + e] (+)= sum_c bf16(w[r * w_rs + c]) * code(v[c][e])

   the weights rounded once to bfloat16 (fa_pair_weights, precision=None), two keys'
   codes interleaved by one vpermi2b into pairs (v[c][e], v[c + 1][e]) in the order of
   the columns, each pair of keys one vdpbf16ps per 16 columns and row. vdpbf16ps
   treats subnormal inputs and results as zero: fa_pair_weights refuses a block with a
   nonzero weight below 2^-100 or one of 2^127 or more (or not finite), and the caller
   then takes fa_pv, so no product or sum it keeps is near the subnormal range. The
   codes' scales are in the weights (the caller's w), as for fa_pv.

   Compiled into the avx512 level's driver module where the compiler has the
   instructions (FA_HAVE_PAIRS); the functions carry their own target attribute and
   are called only where the CPU has AVX512-BF16 and AVX512-VBMI (fa_pairs_usable). */
#ifndef FASTATTN_FA_PAIRS_H
#define FASTATTN_FA_PAIRS_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "fa_codes.h"
#include "fa_dots.h"
#include "fa_prefetch.h"

/* (clang 17 is the first to know "avx512bf16" in __builtin_cpu_supports) */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__x86_64__) && \
    ((defined(__clang__) && __clang_major__ >= 17) || \
     (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 10))
#define FA_HAVE_PAIRS 1
#else
#define FA_HAVE_PAIRS 0
#endif

#define FA_PAIR_CHUNK 64        /* elements of a query row per lookup of its codes */

/* the query rows' words fa_pair_queries writes: E rounded up to whole chunks */
static inline ptrdiff_t fa_pair_row_words(ptrdiff_t E) {
    return (E + FA_PAIR_CHUNK - 1) / FA_PAIR_CHUNK * FA_PAIR_CHUNK;
}

#if FA_HAVE_PAIRS
#include <immintrin.h>

#define FA_PAIRS_TARGET \
    __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,avx512vbmi")))

/* The bfloat16 words of the codes of magnitude 0..127 of each kind, as two byte tables
   (low bytes, high bytes: [kind][0][code], [kind][1][code]), kinds FA_STORED_E4M3 and
   FA_STORED_E5M2 in that order; a code's sign is its top bit. Written once when the
   module is loaded, with whether the CPU runs these kernels. */
static uint8_t fa_pair_bytes[2][2][128];
static int fa_pairs_cpu;

/* vpermi2b's indices that interleave the codes of two value rows (the first table row
   c, the second row c + 1) for fa_pair_widen, columns 32 * half.. (fa_pair_mix[half]):
   its words come out in order of the columns, each the pair (row c, row c + 1). Byte n
   = 16 L + 8 h + i goes to word 8 L + i of fa_pair_widen's output h, which is to hold
   column 32 * half + 16 h + 4 L + i / 2 of row c + i % 2. */
static uint8_t fa_pair_mix[2][64];

static void fa_pair_tables_init(void) __attribute__((constructor));
static void fa_pair_tables_init(void) {
    int kind, b;
    __builtin_cpu_init();           /* (constructors may run before libgcc's) */
    fa_pairs_cpu = __builtin_cpu_supports("avx512bf16")
                   && __builtin_cpu_supports("avx512vbmi")
                   && __builtin_cpu_supports("avx512bw")
                   && __builtin_cpu_supports("avx512dq");
    for (b = 0; b < 128; b++) {
        int half = b / 64, n = b % 64, lane = n / 16, h = (n / 8) % 2, i = n % 8;
        fa_pair_mix[half][n] = (uint8_t) (32 * half + 16 * h + 4 * lane + i / 2
                                          + 64 * (i % 2));
    }
    for (kind = FA_STORED_E4M3; kind <= FA_STORED_E5M2; kind++)
        for (b = 0; b < 128; b++) {
            float f = fa_widen_code(&(uint8_t){(uint8_t) b}, kind, 0);
            uint32_t u;
            memcpy(&u, &f, sizeof u);   /* exact: the low 16 bits are zero, or NaN */
            if (isnan(f))
                u = 0x7FC00000u;
            fa_pair_bytes[kind - FA_STORED_E4M3][0][b] = (uint8_t) (u >> 16);
            fa_pair_bytes[kind - FA_STORED_E4M3][1][b] = (uint8_t) (u >> 24);
        }
}

/* Whether this CPU runs these kernels. */
static inline int fa_pairs_usable(void) {
    return fa_pairs_cpu;
}

/* One kind's tables in registers: lo[0..1] the low bytes of magnitudes 0-63 and
   64-127, hi[0..1] the high bytes. */
typedef struct {
    __m512i lo[2], hi[2];
} fa_pair_tables_t;

FA_PAIRS_TARGET static inline fa_pair_tables_t fa_pair_tables(int kind) {
    const uint8_t (*t)[128] = fa_pair_bytes[kind - FA_STORED_E4M3];
    fa_pair_tables_t tab;
    tab.lo[0] = _mm512_loadu_si512(t[0]);
    tab.lo[1] = _mm512_loadu_si512(t[0] + 64);
    tab.hi[0] = _mm512_loadu_si512(t[1]);
    tab.hi[1] = _mm512_loadu_si512(t[1] + 64);
    return tab;
}

/* 64 codes x -> their bfloat16 words: in 128-bit lane L, *a those of bytes
   16L..16L+7, *b those of bytes 16L+8..16L+15 (vpunpck[lh]bw). The bytes of the
   magnitude's word by one lookup each (vpermi2b reads an index's low seven bits), then
   the sign bit or'ed into the high byte (vpternlogd: hi | (x & 0x80)). */
FA_PAIRS_TARGET static inline __attribute__((always_inline)) void fa_pair_widen(
        __m512i x, const fa_pair_tables_t *tab, __m512i *a, __m512i *b) {
    __m512i lo = _mm512_permutex2var_epi8(tab->lo[0], x, tab->lo[1]);
    __m512i hi = _mm512_permutex2var_epi8(tab->hi[0], x, tab->hi[1]);
    hi = _mm512_ternarylogic_epi32(hi, x, _mm512_set1_epi8((char) 0x80), 0xF8);
    *a = _mm512_unpacklo_epi8(lo, hi);
    *b = _mm512_unpackhi_epi8(lo, hi);
}

/* qp (R rows of fa_pair_row_words(E) words) = the float32 query rows q (R x E, row
   stride q_rs; bfloat16 values) divided by a power of two each, so that a row's
   largest magnitude lies in [1, 2), as bfloat16 words in fa_pair_widen's order (each
   chunk of 64: in each 128-bit lane L, elements 16 L..16 L+7 of the chunk, then
   16 L+8..16 L+15 in the chunk's second 32 words), zero past E; f[r] = that power of
   two times `scale`. Returns 0 (qp, f unusable) where a row cannot be written so
   exactly: an element not finite or not a bfloat16 value, nonzero elements 2^100 or
   more apart (vdpbf16ps would flush the smallest), or a factor outside
   [2^-100, 2^100). */
FA_PAIRS_TARGET static inline int fa_pair_queries(const float *q, ptrdiff_t q_rs,
                                                  ptrdiff_t R, ptrdiff_t E, double scale,
                                                  uint16_t *qp, float *f) {
    /* word i of a chunk's half (32 words) <- element 16 (i / 8) + i % 8 of its 64, the
       second half's 8 elements later */
    static const uint16_t order[32] = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21,
                                       22, 23, 32, 33, 34, 35, 36, 37, 38, 39, 48, 49,
                                       50, 51, 52, 53, 54, 55};
    const __m512i first = _mm512_loadu_si512(order);
    const __m512i second = _mm512_add_epi16(first, _mm512_set1_epi16(8));
    ptrdiff_t W = fa_pair_row_words(E), r, t, i;
    for (r = 0; r < R; r++) {
        const float *row = q + r * q_rs;
        __m512 big = _mm512_setzero_ps(), small = _mm512_set1_ps(INFINITY);
        __mmask16 bad = 0;
        float top, least;
        int e = 0;
        double factor;
        for (t = 0; t < E; t += 16) {
            __mmask16 m = E - t >= 16 ? (__mmask16) 0xFFFF
                                      : (__mmask16) ((1u << (E - t)) - 1u);
            __m512 x = _mm512_abs_ps(_mm512_maskz_loadu_ps(m, row + t));
            /* not finite, or bits below a bfloat16's */
            bad |= _mm512_cmp_ps_mask(x, _mm512_set1_ps(3.4e38f), _CMP_NLE_UQ)
                   | _mm512_test_epi32_mask(_mm512_castps_si512(x),
                                            _mm512_set1_epi32(0xFFFF));
            big = _mm512_max_ps(big, x);
            small = _mm512_mask_min_ps(small, _mm512_cmp_ps_mask(
                x, _mm512_setzero_ps(), _CMP_NEQ_OQ), small, x);
        }
        top = _mm512_reduce_max_ps(big);
        least = _mm512_reduce_min_ps(small);
        if (bad)
            return 0;
        if (top > 0.0f) {
            frexpf(top, &e);
            e -= 1;                         /* top = m * 2^e, m in [1, 2) */
            if ((double) top / least >= 0x1p100)
                return 0;
        }
        factor = ldexp(scale, e);
        if (!(factor >= 0x1p-100 && factor < 0x1p100))
            return 0;
        f[r] = (float) factor;
        for (t = 0; t < W; t += FA_PAIR_CHUNK) {
            __m512i words[2];       /* elements t..t+31, t+32..t+63, in order */
            for (i = 0; i < 2; i++) {
                ptrdiff_t at = t + 32 * i, left = E - at;
                __mmask16 m0 = left >= 16 ? (__mmask16) 0xFFFF : left > 0
                               ? (__mmask16) ((1u << left) - 1u) : 0;
                __mmask16 m1 = left >= 32 ? (__mmask16) 0xFFFF : left > 16
                               ? (__mmask16) ((1u << (left - 16)) - 1u) : 0;
                /* times 2^-e (exact), the top 16 bits of each float */
                __m512 a = _mm512_scalef_ps(_mm512_maskz_loadu_ps(m0, row + at),
                                            _mm512_set1_ps((float) -e));
                __m512 b = _mm512_scalef_ps(_mm512_maskz_loadu_ps(m1, row + at + 16),
                                            _mm512_set1_ps((float) -e));
                __m256i wa = _mm512_cvtepi32_epi16(
                    _mm512_srli_epi32(_mm512_castps_si512(a), 16));
                __m256i wb = _mm512_cvtepi32_epi16(
                    _mm512_srli_epi32(_mm512_castps_si512(b), 16));
                words[i] = _mm512_inserti64x4(_mm512_castsi256_si512(wa), wb, 1);
            }
            _mm512_storeu_si512(qp + r * W + t,
                                _mm512_permutex2var_epi16(words[0], first, words[1]));
            _mm512_storeu_si512(qp + r * W + t + 32,
                                _mm512_permutex2var_epi16(words[0], second, words[1]));
        }
    }
    return 1;
}

/* s[i * s_rs + j] = f[i] * the sum fa_reduce16 left in lane fa_dots_lane[i * keys + j]
   of `sums`, for i < rows, j < keys and j < nc (rows * keys == 16, constants where
   inlined): the lanes put in order of rows by one permutation, times the rows'
   factors, then each row's keys stored at once (masked: the lanes of the other rows
   are not written). */
FA_PAIRS_TARGET static inline __attribute__((always_inline)) void fa_pair_store(
        __m512 sums, const float *f, float *s, ptrdiff_t s_rs, ptrdiff_t nc,
        const int rows, const int keys) {
    const __m512i row_of = _mm512_srli_epi32(     /* lane l holds row l / keys */
        _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
        keys == 4 ? 2 : keys == 8 ? 3 : 4);
    __m512 factors = _mm512_maskz_loadu_ps((__mmask16) ((1u << rows) - 1u), f);
    __m512 by_rows = _mm512_permutexvar_ps(_mm512_loadu_si512(fa_dots_lane), sums);
    __m512 x = _mm512_mul_ps(by_rows, _mm512_permutexvar_ps(row_of, factors));
    __mmask16 row_keys = (__mmask16) ((1u << (nc < keys ? nc : keys)) - 1u);
    int i;
    for (i = 0; i < rows; i++)
        _mm512_mask_storeu_ps(s + i * s_rs - i * keys,
                              (__mmask16) (row_keys << (i * keys)), x);
}

/* One block: rows x keys scores (rows * keys == 16, constants where inlined, the 16
   sums in registers), the keys' codes (tab: their kind's tables) from byte `off` of
   rows c0.. (keys past nc re-read key nc - 1 and are not stored); with pf > 0,
   pf_bytes of key c0 + j + pf (from byte `off`) are asked for where it lies below
   `limit`. As fa_dots_block, the lanes reduced by fa_reduce16. */
FA_PAIRS_TARGET static inline __attribute__((always_inline)) void fa_pair_dots_block(
        const uint16_t *qp, ptrdiff_t W, fa_rows_t k, ptrdiff_t off, ptrdiff_t c0,
        ptrdiff_t nc, ptrdiff_t E, const float *f, float *s, ptrdiff_t s_rs,
        ptrdiff_t pf, ptrdiff_t pf_bytes, ptrdiff_t limit, const fa_pair_tables_t *tab,
        const int rows, const int keys, const int tabbed) {
    __m512 acc[16];
    __m512i a, b;
    const char *kr[16];
    ptrdiff_t t;
    int i, j;
    fa_block_keys(k, off, c0, nc, pf, pf_bytes, limit, keys, tabbed, kr);
    for (i = 0; i < 16; i++)
        acc[i] = _mm512_setzero_ps();
    for (t = 0; t < E; t += FA_PAIR_CHUNK) {
        __mmask64 m = E - t >= FA_PAIR_CHUNK ? ~(__mmask64) 0
                                             : ((__mmask64) 1 << (E - t)) - 1;
        for (j = 0; j < keys; j++) {
            __m512i x = E - t >= FA_PAIR_CHUNK ? _mm512_loadu_si512(kr[j] + t)
                                               : _mm512_maskz_loadu_epi8(m, kr[j] + t);
            fa_pair_widen(x, tab, &a, &b);
            for (i = 0; i < rows; i++) {
                const uint16_t *qr = qp + i * W + t;
                /* the query words read from the level-1 cache by each product rather
                   than held in registers: the 16 sums, the tables and the codes use
                   them (held, they would push the sums out to memory) */
                __asm__("" : "+r"(qr));
                acc[i * keys + j] = _mm512_dpbf16_ps(
                    acc[i * keys + j], (__m512bh) a, (__m512bh) _mm512_loadu_si512(qr));
                acc[i * keys + j] = _mm512_dpbf16_ps(
                    acc[i * keys + j], (__m512bh) b,
                    (__m512bh) _mm512_loadu_si512(qr + 32));
            }
        }
    }
    fa_pair_store(fa_reduce16(acc), f, s, s_rs, nc, rows, keys);
}

/* fa_dots_rows' loop for the pairs: each block of keys for every head in turn, each
   head asking for its part of the rows ahead (fa_heads_ask) */
FA_PAIRS_TARGET static inline __attribute__((always_inline)) void fa_pair_dots_rows(
        const uint16_t *qp, ptrdiff_t W, fa_rows_t k, ptrdiff_t C, ptrdiff_t E,
        const float *f, float *s, ptrdiff_t s_rs, ptrdiff_t pf, ptrdiff_t pf_bytes,
        ptrdiff_t limit, fa_heads_t heads, const fa_pair_tables_t *tab, const int rows,
        const int keys, const int tabbed) {
    ptrdiff_t c0, h;
    ptrdiff_t inner = fa_heads_ask(k, heads, 0, pf_bytes, tabbed);
    ptrdiff_t last = fa_heads_ask(k, heads, heads.n - 1, pf_bytes, tabbed);
    for (c0 = 0; c0 < C; c0 += keys)
        for (h = 0; h < heads.n; h++)
            fa_pair_dots_block(qp + h * heads.q, W, k, h * heads.bytes, c0, C - c0, E,
                               f + h * heads.q / W, s + h * heads.s + c0, s_rs, pf,
                               h + 1 < heads.n ? inner : last, limit, tab, rows, keys,
                               tabbed);
}

FA_PAIRS_TARGET static inline __attribute__((always_inline)) void fa_pair_dots_at(
        const uint16_t *qp, ptrdiff_t R, fa_rows_t k, ptrdiff_t C, ptrdiff_t E,
        const float *f, float *s, ptrdiff_t s_rs, ptrdiff_t limit, fa_heads_t heads,
        int kind, const int tabbed) {
    const fa_pair_tables_t tab = fa_pair_tables(kind);
    ptrdiff_t W = fa_pair_row_words(E);
    ptrdiff_t row_bytes = E;    /* each head asks for its own part (fa_dots_of_kind) */
    ptrdiff_t r0 = 0, pf = fa_stream_ahead(k, row_bytes);
    for (; R - r0 >= 4; r0 += 4, pf = 0)
        fa_pair_dots_rows(qp + r0 * W, W, k, C, E, f + r0, s + r0 * s_rs, s_rs, pf,
                          row_bytes, limit, heads, &tab, 4, 4, tabbed);
    for (; R - r0 >= 2; r0 += 2, pf = 0)
        fa_pair_dots_rows(qp + r0 * W, W, k, C, E, f + r0, s + r0 * s_rs, s_rs, pf,
                          row_bytes, limit, heads, &tab, 2, 8, tabbed);
    for (; r0 < R; r0++, pf = 0)
        fa_pair_dots_rows(qp + r0 * W, W, k, C, E, f + r0, s + r0 * s_rs, s_rs, pf,
                          row_bytes, limit, heads, &tab, 1, 16, tabbed);
}

/* s (R, C) as above for heads.n heads whose parts of each key row lie side by side
   (one head: heads.n == 1), head h's query words at qp + h * heads.q, its factors at
   f + h * heads.q / W and its scores at s + h * heads.s; the keys (C rows of E codes
   of kind FA_STORED_E4M3 or FA_STORED_E5M2) read in place, in memory order, the rows
   ahead asked for below key `limit`. */
FA_PAIRS_TARGET static void fa_pair_dots(const uint16_t *qp, ptrdiff_t R, fa_rows_t k,
                                         int kind, ptrdiff_t C, ptrdiff_t E,
                                         const float *f, float *s, ptrdiff_t s_rs,
                                         ptrdiff_t limit, fa_heads_t heads) {
    if (C <= 0 || heads.n <= 0)
        return;
    if (k.rows)     /* one inlined copy of the loops per address mode */
        fa_pair_dots_at(qp, R, k, C, E, f, s, s_rs, limit, heads, kind, 1);
    else
        fa_pair_dots_at(qp, R, k, C, E, f, s, s_rs, limit, heads, kind, 0);
}

/* wp (R rows of (C + 1) / 2 words, row stride wp_rs) = the weights w (R x C, row
   stride w_rs) rounded once to bfloat16, as pairs (w[r][2i], w[r][2i + 1]) (the last
   one of an odd C with a zero). Returns 0 (wp unusable) where a weight is not finite,
   is 2^127 or more, or is nonzero and below 2^-100. */
FA_PAIRS_TARGET static inline int fa_pair_weights(const float *w, ptrdiff_t w_rs,
                                                  ptrdiff_t R, ptrdiff_t C, uint32_t *wp,
                                                  ptrdiff_t wp_rs) {
    const __m512 tiny = _mm512_set1_ps(0x1p-100f), huge = _mm512_set1_ps(0x1p127f);
    __mmask16 bad = 0;
    ptrdiff_t r, c;
    for (r = 0; r < R; r++)
        for (c = 0; c < C; c += 16) {
            __mmask16 m = C - c >= 16 ? (__mmask16) 0xFFFF
                                      : (__mmask16) ((1u << (C - c)) - 1u);
            __m512 x = _mm512_abs_ps(_mm512_maskz_loadu_ps(m, w + r * w_rs + c));
            /* (not x < 2^127: inf and NaN too) */
            bad |= _mm512_cmp_ps_mask(x, huge, _CMP_NLT_UQ)
                   | (_mm512_cmp_ps_mask(x, tiny, _CMP_LT_OQ)
                      & _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_NEQ_OQ));
            _mm256_storeu_si256((__m256i *) (wp + r * wp_rs + c / 2),
                                (__m256i) _mm512_cvtneps_pbh(
                                    _mm512_maskz_loadu_ps(m, w + r * w_rs + c)));
        }
    return bad == 0;
}

/* One block of rows x 64 columns (from byte `col` of each value row; columns past
   `cols` not read, not stored): the weights' pairs wp (row stride wp_rs words) times
   the pairs of value rows c, c + 1 for c < C (an odd C's last row paired with itself,
   its weight's partner zero), the sums in registers, from zero or (add) from out's
   values; with pf > 0, pf_bytes of row c + pf asked for where c + pf < limit. */
FA_PAIRS_TARGET static inline __attribute__((always_inline)) void fa_pair_pv_block(
        const uint32_t *wp, ptrdiff_t wp_rs, fa_rows_t v, ptrdiff_t col, ptrdiff_t C,
        ptrdiff_t cols, float *out, ptrdiff_t out_rs, int add, ptrdiff_t pf,
        ptrdiff_t pf_bytes, ptrdiff_t limit, const fa_pair_tables_t *tab,
        const __m512i *mix, const int rows, const int tabbed) {
    __m512 acc[4][4];
    __m512i y, a[4];
    __mmask16 mask[4];
    __mmask64 bytes = cols >= 64 ? ~(__mmask64) 0 : ((__mmask64) 1 << cols) - 1;
    ptrdiff_t c;
    int i, x;
    for (x = 0; x < 4; x++) {
        ptrdiff_t left = cols - 16 * x;
        mask[x] = left >= 16 ? (__mmask16) 0xFFFF
                             : (left > 0 ? (__mmask16) ((1u << left) - 1u) : 0);
    }
    for (i = 0; i < rows; i++)
        for (x = 0; x < 4; x++)
            acc[i][x] = add ? _mm512_maskz_loadu_ps(mask[x], out + i * out_rs + 16 * x)
                            : _mm512_setzero_ps();
    for (c = 0; c < C; c += 2) {
        const char *r0 = FA_ROW(v, c, tabbed) + col;
        const char *r1 = c + 1 < C ? FA_ROW(v, c + 1, tabbed) + col : r0;
        __m512i x0 = _mm512_maskz_loadu_epi8(bytes, r0);
        __m512i x1 = _mm512_maskz_loadu_epi8(bytes, r1);
        if (pf && c + pf < limit) {
            fa_prefetch_rows(FA_ROW(v, c + pf, tabbed) + col, 1, pf_bytes, 0);
            if (c + 1 + pf < limit)
                fa_prefetch_rows(FA_ROW(v, c + 1 + pf, tabbed) + col, 1, pf_bytes, 0);
        }
        y = _mm512_permutex2var_epi8(x0, mix[0], x1);
        fa_pair_widen(y, tab, &a[0], &a[1]);
        y = _mm512_permutex2var_epi8(x0, mix[1], x1);
        fa_pair_widen(y, tab, &a[2], &a[3]);
        for (i = 0; i < rows; i++) {
            __m512bh wv = (__m512bh) _mm512_set1_epi32((int) wp[i * wp_rs + c / 2]);
            for (x = 0; x < 4; x++)
                acc[i][x] = _mm512_dpbf16_ps(acc[i][x], (__m512bh) a[x], wv);
        }
    }
    for (i = 0; i < rows; i++)
        for (x = 0; x < 4; x++)
            _mm512_mask_storeu_ps(out + i * out_rs + 16 * x, mask[x], acc[i][x]);
}

FA_PAIRS_TARGET static inline __attribute__((always_inline)) void fa_pair_pv_at(
        const uint32_t *wp, ptrdiff_t wp_rs, ptrdiff_t R, fa_rows_t v, ptrdiff_t C,
        ptrdiff_t Ev, float *out, ptrdiff_t out_rs, int add, ptrdiff_t limit,
        int kind, const int tabbed) {
    const fa_pair_tables_t tab = fa_pair_tables(kind);
    const __m512i mix[2] = {_mm512_loadu_si512(fa_pair_mix[0]),
                            _mm512_loadu_si512(fa_pair_mix[1])};
    ptrdiff_t r0 = 0, e0, pf = fa_stream_ahead(v, Ev);
    ptrdiff_t bytes = v.stride != Ev && C > 0       /* (a head's part of token rows) */
                      ? fa_part_bytes(FA_ROW(v, 0, tabbed), Ev) : Ev;
    for (; r0 < R; r0 += 4, pf = 0)
        for (e0 = 0; e0 < Ev; e0 += 64) {
            ptrdiff_t ahead = e0 ? 0 : pf;      /* whole rows, by the first columns */
            ptrdiff_t cols = Ev - e0 < 64 ? Ev - e0 : 64;
            const uint32_t *w = wp + r0 * wp_rs;
            float *o = out + r0 * out_rs + e0;
            if (R - r0 >= 4)
                fa_pair_pv_block(w, wp_rs, v, e0, C, cols, o, out_rs, add, ahead, bytes,
                                 limit, &tab, mix, 4, tabbed);
            else if (R - r0 == 3)
                fa_pair_pv_block(w, wp_rs, v, e0, C, cols, o, out_rs, add, ahead, bytes,
                                 limit, &tab, mix, 3, tabbed);
            else if (R - r0 == 2)
                fa_pair_pv_block(w, wp_rs, v, e0, C, cols, o, out_rs, add, ahead, bytes,
                                 limit, &tab, mix, 2, tabbed);
            else
                fa_pair_pv_block(w, wp_rs, v, e0, C, cols, o, out_rs, add, ahead, bytes,
                                 limit, &tab, mix, 1, tabbed);
        }
}

/* out (R, Ev) (+)= the weights' pairs wp (fa_pair_weights) times value rows 0..C of v
   (codes of kind FA_STORED_E4M3 or FA_STORED_E5M2, read in place), 4 rows by 64 columns
   at a time, each value row read once per group of 4 rows (from memory by the first,
   which asks for the rows ahead below row `limit`). With `add`, each sum carries on
   from out's value. */
FA_PAIRS_TARGET static void fa_pair_pv(const uint32_t *wp, ptrdiff_t wp_rs, ptrdiff_t R,
                                       fa_rows_t v, int kind, ptrdiff_t C, ptrdiff_t Ev,
                                       float *out, ptrdiff_t out_rs, int add,
                                       ptrdiff_t limit) {
    if (v.rows)     /* one inlined copy of the loops per address mode */
        fa_pair_pv_at(wp, wp_rs, R, v, C, Ev, out, out_rs, add, limit, kind, 1);
    else
        fa_pair_pv_at(wp, wp_rs, R, v, C, Ev, out, out_rs, add, limit, kind, 0);
}

#else   /* no kernels in this module (FA_HAVE_PAIRS 0): never called */

static inline int fa_pairs_usable(void) { return 0; }

static inline int fa_pair_queries(const float *q, ptrdiff_t q_rs, ptrdiff_t R,
                                  ptrdiff_t E, double scale, uint16_t *qp, float *f) {
    (void) q; (void) q_rs; (void) R; (void) E; (void) scale; (void) qp; (void) f;
    return 0;
}

static inline void fa_pair_dots(const uint16_t *qp, ptrdiff_t R, fa_rows_t k, int kind,
                                ptrdiff_t C, ptrdiff_t E, const float *f, float *s,
                                ptrdiff_t s_rs, ptrdiff_t limit, fa_heads_t heads) {
    (void) qp; (void) R; (void) k; (void) kind; (void) C; (void) E; (void) f; (void) s;
    (void) s_rs; (void) limit; (void) heads;
}

static inline int fa_pair_weights(const float *w, ptrdiff_t w_rs, ptrdiff_t R,
                                  ptrdiff_t C, uint32_t *wp, ptrdiff_t wp_rs) {
    (void) w; (void) w_rs; (void) R; (void) C; (void) wp; (void) wp_rs;
    return 0;
}

static inline void fa_pair_pv(const uint32_t *wp, ptrdiff_t wp_rs, ptrdiff_t R,
                              fa_rows_t v, int kind, ptrdiff_t C, ptrdiff_t Ev,
                              float *out, ptrdiff_t out_rs, int add, ptrdiff_t limit) {
    (void) wp; (void) wp_rs; (void) R; (void) v; (void) kind; (void) C; (void) Ev;
    (void) out; (void) out_rs; (void) add; (void) limit;
}
#endif

#endif
