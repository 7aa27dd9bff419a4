/* The products of bfloat16 attention on AMX tiles (Intel Sapphire Rapids and later):
   a score block S = scale * K Q^T and a value block V^T P, each through tdpbf16ps,
   which multiplies a 16 x 32 bfloat16 tile by a 32 x 16 one (in pairs) and adds the
   result to a 16 x 16 float32 tile.

   The layouts are the fused pass's (keys by query lanes, QUERY_TILE = 64 lanes):

     scores  C = st[j * 64 + r]      (16 keys x 16 query lanes per tile)
             A = k[j * k_rs + e]     key rows read in place, 32 elements per tile row
             B = qp[t * 64 + r]      the query pairs of fa_bf16.h: row t of a tile is
                                     the pairs (q[r, 2t], q[r, 2t + 1]) of 16 lanes
     values  C = acc[c * 64 + r]     (16 value columns x 16 query lanes per tile),
                                     the running output sums, loaded and stored
             A = vt[c * ldv + w]     the value pairs (v[2w, c], v[2w + 1, c]) of
                                     column c: V^T, packed per block
                                     (fa_bf16_pack_values)
             B = pp[w * 64 + r]      the weight pairs (P[2w, r], P[2w + 1, r]),
                                     rounded to bfloat16 per block
                                     (fa_bf16_weight_pairs, straight from the
                                     softmax, or fa_bf16_pack_weights)

   Four accumulator tiles (2 x 2: 32 keys or value columns by 32 lanes), two A and
   two B tiles: all eight tiles are 16 rows of 64 bytes, one configuration
   (fa_amx_begin) for every product. Scores need E % 32 == 0 (a tile row is 32
   elements, read in place: no read past a row); the keys of a block past its last
   whole 16 go through vdpbf16ps (fa_bf16.h). Values need Ev % 16 == 0; the block's
   keys are padded to 32 with zero pairs. Products are exact in float32 and sum in
   float32; the weights P enter the product with V rounded once to bfloat16, as in
   PyTorch's and FlashAttention's bfloat16 kernels (precision="highest": as two
   bfloat16 parts, hi = bf16(P), lo = bf16(P - hi), 16 bits kept), while the row sums
   use them unrounded (the softmax: fa_softmax.h). Every result depends only on the block and the tile, never on the
   thread.

   Linux gives a process the AMX state only when asked (fastattn._cpu.request_amx,
   once); the tile registers are configured per thread and per tile
   (fa_amx_begin / fa_amx_end around a tile's work). The instructions are written as
   inline assembly (the compiler's tile intrinsics lack memory operands); a compiler
   whose assembler does not know them builds without this kernel (setup.py defines
   FA_NO_AMX). With FA_AMX_EMULATE the tile instructions are C functions (for testing
   the layouts on a machine without AMX). */
#ifndef FASTATTN_FA_AMX_H
#define FASTATTN_FA_AMX_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "fa_bf16.h"
#include "fa_dots.h"        /* fa_rows_t */
#include "fa_prefetch.h"
#include "fa_transpose.h"

#if FA_HAVE_AVX512_BF16 && defined(__x86_64__) && !defined(FA_NO_AMX)
#define FA_HAVE_AMX_BF16 1
#else
#define FA_HAVE_AMX_BF16 0
#endif

#if FA_HAVE_AMX_BF16 && defined(FA_AMX_EMULATE)
#define FA_AMX_EMULATED 1
#else
#define FA_AMX_EMULATED 0
#endif

/* The scores of int8 key codes on AMX-INT8 (the decode path: _decode.pxd), exact.

   A query row's elements are floats of few significant bits (a bfloat16 row has 8), so
   the row is an integer vector times one power of two, Q = q 2^-e, whenever its
   nonzero elements span no more than 31 binary orders (the first to the last set bit);
   then q . k = 2^e (Q . k) for codes k, and Q . k is a sum of integer products. Each
   Q splits into bytes, Q = top 2^24 + l2 2^16 + l1 2^8 + l0 (top signed, the others
   not), and tdpbssd / tdpbsud multiply a tile of 16 key rows of 64 codes (read in
   place) by the bytes of up to four query rows at once: the signed high bytes in
   columns 0-3 (row r in column r), the low bytes in columns 4 + 4 l + r, all into one
   16 x 16 int32 tile. The four partial sums of a key and row are exact (at most
   2^22 in magnitude for E = 128), and so is their combination, 2^24 top + 2^16 l2 +
   2^8 l1 + l0, in double; times 2^e and the softmax scale (in double) it is rounded
   once to float32. So each score is the exact dot product, scaled and rounded once:
   never further from the float64 recomputation than the float32 FMA sums are.

   fa_amx_code_limbs packs the R rows of each of `heads` heads (E a multiple of 64, at
   most 128), four rows to a set, head h's set t at lb[h * fa_code_sets(R) + t], and
   returns 0 where a row cannot be packed so (its elements span too many orders, or
   one is inf or NaN): the caller then takes the float32 kernels. */
#define FA_CODE_ROWS 4          /* query rows per set of limbs */
#define FA_CODE_STEPS 2         /* 64-code steps of a key row: E <= 128 */

typedef struct {
    int8_t top[FA_CODE_STEPS][16 * 64];     /* B tiles: the signed high bytes */
    uint8_t low[FA_CODE_STEPS][16 * 64];    /* B tiles: the three low bytes */
    double unit[FA_CODE_ROWS];              /* 2^e times the scale, per row */
} fa_code_limbs_t;

/* sets of limbs for R query rows */
static inline ptrdiff_t fa_code_sets(ptrdiff_t R) {
    return (R + FA_CODE_ROWS - 1) / FA_CODE_ROWS;
}


#if FA_HAVE_AMX_BF16

#ifdef FA_AMX_EMULATE
/* the eight tiles of this thread, up to 16 rows of 64 bytes (fa_emu_rows of them
   configured: a load sets the rest to zero, a store writes those rows only) */
static __thread unsigned char fa_emu_tiles[8][16][64];
static __thread int fa_emu_rows[8];

static void fa_emu_config(const unsigned char *cfg) {
    int t;
    for (t = 0; t < 8; t++)
        fa_emu_rows[t] = cfg[48 + t];
}

static void fa_emu_load(int t, const void *base, ptrdiff_t stride) {
    int r;
    memset(fa_emu_tiles[t], 0, sizeof fa_emu_tiles[t]);
    for (r = 0; r < fa_emu_rows[t]; r++)
        memcpy(fa_emu_tiles[t][r], (const char *) base + r * stride, 64);
}

static void fa_emu_store(int t, void *base, ptrdiff_t stride) {
    int r;
    for (r = 0; r < fa_emu_rows[t]; r++)
        memcpy((char *) base + r * stride, fa_emu_tiles[t][r], 64);
}

static float fa_emu_bf16(const unsigned char *p) {
    uint32_t bits = (uint32_t) (p[0] | (p[1] << 8)) << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* c (16 x 16 float32) += a (16 x 32 bfloat16) . b (16 rows of 16 pairs) */
static void fa_emu_dp(int c, int a, int b) {
    int m, n, t;
    float acc, x;
    for (m = 0; m < 16; m++)
        for (n = 0; n < 16; n++) {
            memcpy(&acc, &fa_emu_tiles[c][m][4 * n], sizeof acc);
            for (t = 0; t < 16; t++)
                acc += fa_emu_bf16(&fa_emu_tiles[a][m][4 * t])
                           * fa_emu_bf16(&fa_emu_tiles[b][t][4 * n])
                       + fa_emu_bf16(&fa_emu_tiles[a][m][4 * t + 2])
                           * fa_emu_bf16(&fa_emu_tiles[b][t][4 * n + 2]);
            x = acc;
            memcpy(&fa_emu_tiles[c][m][4 * n], &x, sizeof x);
        }
}

/* c (16 x 16 int32) += a (16 x 64 signed bytes) . b (16 rows of 16 groups of four
   bytes, signed or not: b_signed) */
static void fa_emu_dp_bytes(int c, int a, int b, int b_signed) {
    int m, n, t;
    int32_t acc;
    unsigned char y;
    for (m = 0; m < 16; m++)
        for (n = 0; n < 16; n++) {
            memcpy(&acc, &fa_emu_tiles[c][m][4 * n], sizeof acc);
            for (t = 0; t < 64; t++) {
                y = fa_emu_tiles[b][t / 4][4 * n + t % 4];
                acc += (int32_t) (int8_t) fa_emu_tiles[a][m][t]
                       * (b_signed ? (int32_t) (int8_t) y : (int32_t) y);
            }
            memcpy(&fa_emu_tiles[c][m][4 * n], &acc, sizeof acc);
        }
}

#define FA_TILE_LOAD(t, base, stride) fa_emu_load(t, base, stride)
#define FA_TILE_STORE(t, base, stride) fa_emu_store(t, base, stride)
#define FA_TILE_ZERO(t) memset(fa_emu_tiles[t], 0, sizeof fa_emu_tiles[t])
#define FA_TILE_DP(c, a, b) fa_emu_dp(c, a, b)
#define FA_TILE_DP_SS(c, a, b) fa_emu_dp_bytes(c, a, b, 1)
#define FA_TILE_DP_SU(c, a, b) fa_emu_dp_bytes(c, a, b, 0)
#define FA_TILE_CONFIG(cfg) fa_emu_config(cfg)
#define FA_TILE_RELEASE() ((void) 0)

#else
/* tdpbf16ps c, a, b: c += a . b (AT&T operand order: b, a, c) */
#define FA_TILE_LOAD(t, base, stride)                                                 \
    __asm__ volatile ("{tileloadd\t(%0,%1,1), %%tmm" #t                               \
                      "|tileloadd\t%%tmm" #t ", [%0+%1*1]}"                           \
                      :: "r" ((const void *) (base)), "r" ((ptrdiff_t) (stride))      \
                      : "memory")
#define FA_TILE_STORE(t, base, stride)                                                \
    __asm__ volatile ("{tilestored\t%%tmm" #t ", (%0,%1,1)"                           \
                      "|tilestored\t[%0+%1*1], %%tmm" #t "}"                          \
                      :: "r" ((void *) (base)), "r" ((ptrdiff_t) (stride))            \
                      : "memory")
#define FA_TILE_ZERO(t) __asm__ volatile ("tilezero\t%%tmm" #t ::)
#define FA_TILE_DP(c, a, b)                                                           \
    __asm__ volatile ("{tdpbf16ps\t%%tmm" #b ", %%tmm" #a ", %%tmm" #c                \
                      "|tdpbf16ps\t%%tmm" #c ", %%tmm" #a ", %%tmm" #b "}" ::)
/* tdpbssd, tdpbsud c, a, b: c += a . b in int32, a's bytes signed, b's signed (ss) or
   not (su) */
#define FA_TILE_DP_SS(c, a, b)                                                        \
    __asm__ volatile ("{tdpbssd\t%%tmm" #b ", %%tmm" #a ", %%tmm" #c                  \
                      "|tdpbssd\t%%tmm" #c ", %%tmm" #a ", %%tmm" #b "}" ::)
#define FA_TILE_DP_SU(c, a, b)                                                        \
    __asm__ volatile ("{tdpbsud\t%%tmm" #b ", %%tmm" #a ", %%tmm" #c                  \
                      "|tdpbsud\t%%tmm" #c ", %%tmm" #a ", %%tmm" #b "}" ::)
#define FA_TILE_CONFIG(cfg)                                                           \
    __asm__ volatile ("ldtilecfg\t%0" :: "m" (*(const unsigned char (*)[64]) (cfg)))
#define FA_TILE_RELEASE() __asm__ volatile ("tilerelease" ::)
#endif

#define FA_AMX_ROW_BYTES (FA_BF16_LANES * 4)   /* a row of st, acc, qp or pp */

/* Configure this thread's tiles: palette 1, all eight of 64 bytes per row, tiles 0-4
   of m rows (m <= 16) and 5-7 of 16. */
static inline void fa_amx_configure(int m) {
    unsigned char cfg[64] __attribute__((aligned(64)));
    int t;
    memset(cfg, 0, sizeof cfg);
    cfg[0] = 1;
    for (t = 0; t < 8; t++) {
        cfg[16 + 2 * t] = 64;       /* bytes per row (16-bit, little-endian) */
        cfg[48 + t] = (unsigned char) (t < 5 ? m : 16);     /* rows */
    }
    FA_TILE_CONFIG(cfg);
}

/* Configure this thread's tiles: all eight 16 rows of 64 bytes. */
static inline void fa_amx_begin(void) {
    fa_amx_configure(16);
}

/* Give the tile state back (the OS then need not save it). */
static inline void fa_amx_end(void) {
    FA_TILE_RELEASE();
}

/* One output block of up to 32 x 32 on the four accumulator tiles:

       C[g] (16 rows x 32 lanes, g < 1 + two) (+)= sum over the steps t of
           A[g, t] . (B[t] (+ B2[t]))

   A[g, t] the tile of 16 rows at a + g * a_group + 64 t bytes (row stride a_stride),
   B[t] the two tiles of 16 pair rows by 16 lanes at b + t * FA_AMX_B_STEP bytes and 64
   bytes on (row stride one row of 64 lanes), B2 likewise at b2 where it is not NULL (a
   second addend, multiplied by the same A tiles); C[g] the two tiles at c + g * 16
   rows of 64 lanes, loaded first where `load`, else zero, and stored at the end. */
#define FA_AMX_B_STEP (16 * FA_AMX_ROW_BYTES)  /* 16 pair rows: 32 of the summed axis */

static inline void fa_amx_block(const char *a, ptrdiff_t a_group, ptrdiff_t a_stride,
                                const char *b, const char *b2, ptrdiff_t steps,
                                float *c, int two, int load) {
    const ptrdiff_t rb = FA_AMX_ROW_BYTES;
    float *c1 = c + 16 * FA_BF16_LANES;
    ptrdiff_t t;
    if (load) {
        FA_TILE_LOAD(0, c, rb);
        FA_TILE_LOAD(1, c + 16, rb);
        if (two) {
            FA_TILE_LOAD(2, c1, rb);
            FA_TILE_LOAD(3, c1 + 16, rb);
        }
    } else {
        FA_TILE_ZERO(0);
        FA_TILE_ZERO(1);
        FA_TILE_ZERO(2);
        FA_TILE_ZERO(3);
    }
    for (t = 0; t < steps; t++) {
        FA_TILE_LOAD(4, a + 64 * t, a_stride);
        FA_TILE_LOAD(6, b + t * FA_AMX_B_STEP, rb);
        FA_TILE_LOAD(7, b + t * FA_AMX_B_STEP + 64, rb);
        FA_TILE_DP(0, 4, 6);
        FA_TILE_DP(1, 4, 7);
        if (two) {
            FA_TILE_LOAD(5, a + a_group + 64 * t, a_stride);
            FA_TILE_DP(2, 5, 6);
            FA_TILE_DP(3, 5, 7);
        }
        if (b2 != NULL) {
            FA_TILE_LOAD(6, b2 + t * FA_AMX_B_STEP, rb);
            FA_TILE_LOAD(7, b2 + t * FA_AMX_B_STEP + 64, rb);
            FA_TILE_DP(0, 4, 6);
            FA_TILE_DP(1, 4, 7);
            if (two) {
                FA_TILE_DP(2, 5, 6);
                FA_TILE_DP(3, 5, 7);
            }
        }
    }
    FA_TILE_STORE(0, c, rb);
    FA_TILE_STORE(1, c + 16, rb);
    if (two) {
        FA_TILE_STORE(2, c1, rb);
        FA_TILE_STORE(3, c1 + 16, rb);
    }
}

/* st[j * 64 + r] (j < bc, r < nr; nr a multiple of 32) = alpha * (key j . query r)
   (alpha 1: the products as they are, scaled later by fa_block_max):
   k (bc keys, row stride k_rs elements) by qp (E / 2 pair rows), E % 32 == 0. */
FA_BF16_TARGET static void fa_amx_scores(const uint16_t *k, ptrdiff_t k_rs,
                                         ptrdiff_t bc, const uint32_t *qp,
                                         ptrdiff_t E, ptrdiff_t nr, float alpha,
                                         float *st) {
    const __m512 a = _mm512_set1_ps(alpha);
    ptrdiff_t j, x, whole;
    int two;
    /* two tile rows of 16 keys (or, past the last 32, one) by 32 lanes at a time */
    for (j = 0; j + 16 <= bc; j += two ? 32 : 16) {
        two = j + 32 <= bc;
        for (x = 0; x < nr; x += 32)
            fa_amx_block((const char *) (k + j * k_rs), 16 * k_rs * 2, k_rs * 2,
                         (const char *) (qp + x), NULL, E / 32,
                         st + j * FA_BF16_LANES + x, two, 0);
    }
    whole = j;
    for (j = 0; j < whole && alpha != 1.0f; j++)
        for (x = 0; x < nr; x += 16)
            _mm512_storeu_ps(st + j * FA_BF16_LANES + x,
                            _mm512_mul_ps(_mm512_loadu_ps(st + j * FA_BF16_LANES + x), a));
    if (whole < bc)
        fa_bf16_scores(k + whole * k_rs, k_rs, bc - whole, qp, E / 2, alpha,
                       st + whole * FA_BF16_LANES);
}

/* acc[c * 64 + r] (c < Ev, r < nr; Ev % 16 == 0, nr a multiple of 32) += the sum over
   the bc keys j of v[j, c] * P[j, r] (first: = instead of +=), with vt from
   fa_bf16_pack_values and the weights P as bfloat16 pairs in pp (fa_bf16_pack_weights
   or fa_bf16_weight_pairs: PyTorch's rounding, the default), or with pl, in two
   bfloat16 parts, hi = bf16(P) in pp and lo = bf16(P - hi) in pl, each multiplied by v:
   the weights keep 16 bits (relative error <= 2^-17) where one bfloat16 keeps 8
   (precision="highest"). The accumulator tiles start from acc, so the block's products
   add to the running sums without a separate pass. */
FA_BF16_TARGET static void fa_amx_pv(const uint32_t *vt, ptrdiff_t bc, ptrdiff_t Ev,
                                     const uint32_t *pp, const uint32_t *pl,
                                     ptrdiff_t nr, float *acc, int first) {
    const ptrdiff_t kc = (bc + 31) / 32 * 32;   /* keys, padded to whole tiles */
    const ptrdiff_t ldv = kc / 2;               /* words per row of vt */
    ptrdiff_t x, c;
    /* two tile rows of 16 columns (or the last one) by 32 lanes at a time */
    for (c = 0; c < Ev; c += 32)
        for (x = 0; x < nr; x += 32)
            fa_amx_block((const char *) (vt + c * ldv), 16 * ldv * 4, ldv * 4,
                         (const char *) (pp + x), pl ? (const char *) (pl + x) : NULL,
                         ldv / 16, acc + c * FA_BF16_LANES + x, c + 16 < Ev, !first);
}

/* a nonzero finite float's magnitude as an integer m times 2^lo, m odd, and the weight
   2^hi of its highest set bit */
static inline uint32_t fa_float_bits(uint32_t u, int *lo, int *hi) {
    uint32_t e = (u >> 23) & 0xff, m = u & 0x7fffff;
    int w = e ? (int) e - 150 : -149;           /* the weight of the mantissa's bit 0 */
    int z;
    if (e)
        m |= 0x800000;
    z = __builtin_ctz(m);
    *lo = w + z;
    *hi = w + 31 - __builtin_clz(m);
    return m >> z;
}

/* one set: R <= 4 rows, q_rs apart */
static int fa_code_limbs_set(const float *q, ptrdiff_t q_rs, ptrdiff_t R, ptrdiff_t E,
                             double scale, fa_code_limbs_t *lb) {
    ptrdiff_t r, t;
    int lo, hi, a, b, l;
    uint32_t u, m;
    int32_t x;
    memset(lb->top, 0, sizeof lb->top);
    memset(lb->low, 0, sizeof lb->low);
    for (r = 0; r < FA_CODE_ROWS; r++)
        lb->unit[r] = 0.0;
    for (r = 0; r < R; r++) {
        lo = 1000;
        hi = -1000;
        for (t = 0; t < E; t++) {
            memcpy(&u, q + r * q_rs + t, sizeof u);
            if ((u & 0x7fffffff) == 0)
                continue;
            if ((u & 0x7f800000) == 0x7f800000)
                return 0;                       /* inf or NaN */
            fa_float_bits(u, &a, &b);
            lo = a < lo ? a : lo;
            hi = b > hi ? b : hi;
        }
        if (hi < lo)
            continue;                           /* a row of zeros */
        if (hi - lo > 30)
            return 0;
        lb->unit[r] = ldexp(scale, lo);
        for (t = 0; t < E; t++) {
            memcpy(&u, q + r * q_rs + t, sizeof u);
            x = 0;
            if (u & 0x7fffffff) {
                m = fa_float_bits(u, &a, &b);
                x = (int32_t) (m << (a - lo));
                x = u >> 31 ? -x : x;
            }
            lb->top[t / 64][(t % 64) / 4 * 64 + r * 4 + t % 4] = (int8_t) (x >> 24);
            for (l = 0; l < 3; l++)
                lb->low[t / 64][(t % 64) / 4 * 64 + (4 + 4 * l + r) * 4 + t % 4] =
                    (uint8_t) (x >> (16 - 8 * l));
        }
    }
    return 1;
}

/* the query rows q (heads x R rows of E) in sets of limbs (see above) */
static int fa_amx_code_limbs(const float *q, ptrdiff_t heads, ptrdiff_t R, ptrdiff_t E,
                             double scale, fa_code_limbs_t *lb) {
    const ptrdiff_t sets = fa_code_sets(R);
    ptrdiff_t h, t, r0;
    for (h = 0; h < heads; h++)
        for (t = 0; t < sets; t++) {
            r0 = t * FA_CODE_ROWS;
            if (!fa_code_limbs_set(q + (h * R + r0) * E, E,
                                   R - r0 < FA_CODE_ROWS ? R - r0 : FA_CODE_ROWS, E,
                                   scale, lb + h * sets + t))
                return 0;
        }
    return 1;
}

/* the 8 words of half h of x */
static inline __m256i fa_half8(__m512 x, int h) {
    return h ? _mm512_extracti64x4_epi64(_mm512_castps_si512(x), 1)
             : _mm512_castsi512_si256(_mm512_castps_si512(x));
}

/* s[r * s_rs + j] for the R rows of lb and keys j < n (n <= 16) from the tile of
   sums c (16 keys x 16 columns, as fa_amx_code_limbs lays them out) */
static inline void fa_code_sums(const int32_t *c, const fa_code_limbs_t *lb,
                                ptrdiff_t R, ptrdiff_t n, float *s, ptrdiff_t s_rs) {
    __m512 m[16];
    __m256 half[2];
    __m512d v;
    ptrdiff_t r;
    int i, h;
    for (i = 0; i < 16; i++)
        m[i] = _mm512_loadu_ps((const float *) (c + 16 * i));
    fa_transpose16(m);
    for (r = 0; r < R; r++) {
        for (h = 0; h < 2; h++) {
            v = _mm512_cvtepi32_pd(fa_half8(m[12 + r], h));
            v = _mm512_fmadd_pd(_mm512_cvtepi32_pd(fa_half8(m[8 + r], h)),
                                _mm512_set1_pd(256.0), v);
            v = _mm512_fmadd_pd(_mm512_cvtepi32_pd(fa_half8(m[4 + r], h)),
                                _mm512_set1_pd(65536.0), v);
            v = _mm512_fmadd_pd(_mm512_cvtepi32_pd(fa_half8(m[r], h)),
                                _mm512_set1_pd(16777216.0), v);
            half[h] = _mm512_cvtpd_ps(_mm512_mul_pd(v, _mm512_set1_pd(lb->unit[r])));
        }
        _mm512_mask_storeu_ps(s + r * s_rs, fa_lanes16(n),
                              _mm512_insertf32x8(_mm512_castps256_ps512(half[0]),
                                                 half[1], 1));
    }
}

/* sum tile c = the key tile a, loaded from the 16 rows at p (stride bytes apart),
   times the query bytes in tiles 4-7 (4, 6: codes 0-63; 5, 7: 64-127), stored at out */
#define FA_CODE_TILE(c, a, p, stride, E, out)                                         \
    do {                                                                              \
        FA_TILE_ZERO(c);                                                              \
        FA_TILE_LOAD(a, p, stride);                                                   \
        FA_TILE_DP_SS(c, a, 4);                                                       \
        FA_TILE_DP_SU(c, a, 6);                                                       \
        if ((E) > 64) {                                                               \
            FA_TILE_LOAD(a, (p) + 64, stride);                                        \
            FA_TILE_DP_SS(c, a, 5);                                                   \
            FA_TILE_DP_SU(c, a, 7);                                                   \
        }                                                                             \
        FA_TILE_STORE(c, out, 64);                                                    \
    } while (0)

/* s (R <= 4 rows, s_rs apart) = the scaled dot products of lb's query rows with key
   rows 0..C of k, their codes at byte offset `off` of each row (E of them, E % 64 == 0,
   E <= 128), 16 keys per tile: read in place where 16 rows lie at one stride (a
   contiguous cache, or a block of a paged one), else copied to buf (16 x E bytes,
   zeros past the last key). With pf > 0, the rows pf ahead (below `limit`) are asked
   for, pf_bytes of each from its start. The caller has configured the tiles
   (fa_amx_begin). */
static void fa_amx_code_scores(fa_rows_t k, ptrdiff_t off, ptrdiff_t C, ptrdiff_t E,
                               const fa_code_limbs_t *lb, ptrdiff_t R, float *s,
                               ptrdiff_t s_rs, int8_t *buf, ptrdiff_t pf,
                               ptrdiff_t pf_bytes, ptrdiff_t limit) {
    int32_t c[2][256] __attribute__((aligned(64)));
    const char *a;
    ptrdiff_t c0, n, stride, i, g;
    int whole;
    FA_TILE_LOAD(4, lb->top[0], 64);
    FA_TILE_LOAD(6, lb->low[0], 64);
    if (E > 64) {
        FA_TILE_LOAD(5, lb->top[1], 64);
        FA_TILE_LOAD(7, lb->low[1], 64);
    }
    for (c0 = 0, g = 0; c0 < C; c0 += 16, g ^= 1) {
        n = C - c0 < 16 ? C - c0 : 16;
        for (i = 0; pf > 0 && i < n && c0 + i + pf < limit; i++)
            fa_prefetch_rows(FA_ROW(k, c0 + i + pf, k.rows != NULL), 1, pf_bytes, 0);
        a = FA_ROW(k, c0, k.rows != NULL) + off;
        stride = k.rows ? (n > 1 ? k.rows[c0 + 1] - k.rows[c0] : 0) : k.stride;
        whole = n == 16 && stride > 0;
        for (i = 2; whole && k.rows && i < 16; i++)
            whole = k.rows[c0 + i] - k.rows[c0] == i * stride;
        if (!whole) {
            for (i = 0; i < 16; i++) {
                if (i < n)
                    memcpy(buf + i * E, FA_ROW(k, c0 + i, k.rows != NULL) + off, E);
                else
                    memset(buf + i * E, 0, E);
            }
            a = (const char *) buf;
            stride = E;
        }
        /* two sum tiles (0, 1) and two key tiles (2, 3) in turn: a tile's next use
           does not wait for the last one's store */
        if (g)
            FA_CODE_TILE(1, 3, a, stride, E, c[1]);
        else
            FA_CODE_TILE(0, 2, a, stride, E, c[0]);
        fa_code_sums(c[g], lb, R, n, s + c0, s_rs);
    }
}

/* fa_amx_code_heads: fa_amx_code_scores for `heads` heads whose parts of a key row lie
   `bytes` apart (a token-major cache; one head: bytes 0) and sets of up to four query
   rows each (R rows per head; head h's set t at lb[h * sets + t], its scores at
   s + (h * R + 4 t) * s_rs): FA_CODE_KEYS keys at a time, each head's and set's pass
   over them in turn while their rows stay in the level-1 cache; the first pass over
   each run of keys asks for the rows ahead (pf rows, pf_bytes each). */
#define FA_CODE_KEYS 32

static void fa_amx_code_heads(fa_rows_t k, ptrdiff_t heads, ptrdiff_t bytes,
                              ptrdiff_t C, ptrdiff_t E, const fa_code_limbs_t *lb,
                              ptrdiff_t R, float *s, ptrdiff_t s_rs, int8_t *buf,
                              ptrdiff_t pf, ptrdiff_t pf_bytes, ptrdiff_t limit) {
    const ptrdiff_t sets = fa_code_sets(R);
    fa_rows_t run;
    ptrdiff_t c0, n, h, t, r0, first;
    for (c0 = 0; c0 < C; c0 += FA_CODE_KEYS) {
        n = C - c0 < FA_CODE_KEYS ? C - c0 : FA_CODE_KEYS;
        run = k;
        if (k.rows)
            run.rows += c0;
        else
            run.base += c0 * k.stride;
        for (h = 0; h < heads; h++)
            for (t = 0; t < sets; t++) {
                first = h == 0 && t == 0;
                r0 = t * FA_CODE_ROWS;
                fa_amx_code_scores(run, h * bytes, n, E, lb + h * sets + t,
                                   R - r0 < FA_CODE_ROWS ? R - r0 : FA_CODE_ROWS,
                                   s + (h * R + r0) * s_rs + c0, s_rs, buf,
                                   first ? pf : 0, pf_bytes, limit - c0);
            }
    }
}

/* The values' product of int8 value codes on AMX-BF16 (the decode path: _decode.pxd),
   for bfloat16 queries with precision=None:

       out (R rows) = w (R x C) . v (C rows of Ev codes, Ev % 64 == 0)

   w the step's weights times each key's scale (float32), rounded once to bfloat16 as
   the bfloat16 path rounds its weights (fa_code_weight_tiles); every code is a
   bfloat16 exactly (at most 8 significant bits), so the tiles' products are exact and
   sum in float32. Per 64 columns, four sum tiles (0-3, R rows of 16 columns) take the
   keys 32 at a time: the weights' tile (4: R rows of 32 keys) times four tiles of
   value pairs (5, 6 in turn: 16 rows of the pairs (v[2i, c], v[2i + 1, c]) of 16
   columns c), which fa_code_value_pairs widens from the codes as it reads them; up
   to FA_VALUE_ROWS rows (a tile's) per pass (fa_code_values_pass). A
   weight nonzero but under 2^-100 in magnitude would leave the tiles (which flush
   subnormal results to zero) with sums that are not those of the float32 kernel: no
   such weight, and every product is a multiple of 2^-107, every sum 0 or normal. */
#define FA_VALUE_KEYS 32            /* keys per weight tile */
#define FA_VALUE_ROWS 16            /* query rows per pass: the rows of a tile */
#define FA_VALUE_COLS 64            /* columns per pass: four sum tiles */
#define FA_WEIGHT_FLOOR 0x1p-100f   /* the smallest nonzero weight the tiles take */
#define FA_PAIR_WORDS (4 * 256)     /* words of a chunk's four tiles of value pairs */

/* bytes of scratch fa_amx_code_values takes for C keys */
static inline ptrdiff_t fa_code_values_bytes(ptrdiff_t C) {
    return (C + FA_VALUE_KEYS - 1) / FA_VALUE_KEYS * 16 * FA_VALUE_KEYS * 2
           + 2 * FA_PAIR_WORDS * 4;
}

/* the weights' tiles: keys t * 32.. of the R rows of w as rows of 32 bfloat16 (tile t
   at wt + t * 16 * 32, keys past C zero); 0 where a weight is nonzero and under
   FA_WEIGHT_FLOOR in magnitude */
FA_BF16_TARGET static int fa_code_weight_tiles(const float *w, ptrdiff_t w_rs,
                                               ptrdiff_t R, ptrdiff_t C, uint16_t *wt) {
    const __m512 least = _mm512_set1_ps(FA_WEIGHT_FLOOR);
    __m512 x[2];
    __mmask16 tiny = 0;
    ptrdiff_t c0, r, n;
    int h;
    for (c0 = 0; c0 < C; c0 += FA_VALUE_KEYS)
        for (r = 0; r < R; r++) {
            for (h = 0; h < 2; h++) {
                n = C - c0 - 16 * h;
                x[h] = _mm512_maskz_loadu_ps(fa_lanes16(n < 0 ? 0 : n),
                                             w + r * w_rs + c0 + 16 * h);
                tiny |= _mm512_cmp_ps_mask(_mm512_abs_ps(x[h]), least, _CMP_LT_OQ)
                        & _mm512_cmp_ps_mask(x[h], _mm512_setzero_ps(), _CMP_NEQ_UQ);
            }
            _mm512_storeu_si512(wt + c0 * 16 + r * FA_VALUE_KEYS,
                                (__m512i) _mm512_cvtne2ps_pbh(x[1], x[0]));
        }
    return tiny == 0;
}

/* 16 codes widened to floats (exactly) */
static inline __m512i fa_code_floats(const char *p) {
    return _mm512_castps_si512(_mm512_cvtepi32_ps(
        _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *) p))));
}

/* the tiles of value pairs of keys c0..c0+n (n <= 32; pairs past n zero), columns
   col.. of each row: tile j's row i holds columns col + 16 j.. as the bfloat16 pairs
   (v[c0 + 2i, c], v[c0 + 2i + 1, c]), each half of a pair the top half of the code's
   float. With pf > 0, each pair of rows asks for the two pf rows ahead (below
   `limit`), pf_bytes of each. */
static inline void fa_code_value_pairs(fa_rows_t v, ptrdiff_t col, ptrdiff_t c0,
                                       ptrdiff_t n, uint32_t *b, ptrdiff_t pf,
                                       ptrdiff_t pf_bytes, ptrdiff_t limit) {
    const __m512i none = _mm512_setzero_si512();
    const char *pa;
    const char *pb;
    __m512i a, x;
    ptrdiff_t i, r;
    int j;
    for (i = 0; i < 16; i++) {
        for (r = c0 + 2 * i + pf; pf > 0 && r < c0 + 2 * i + pf + 2 && r < limit; r++)
            fa_prefetch_rows(FA_ROW(v, r, v.rows != NULL), 1, pf_bytes, 0);
        pa = 2 * i < n ? FA_ROW(v, c0 + 2 * i, v.rows != NULL) + col : NULL;
        pb = 2 * i + 1 < n ? FA_ROW(v, c0 + 2 * i + 1, v.rows != NULL) + col : NULL;
        for (j = 0; j < 4; j++) {
            a = pa ? fa_code_floats(pa + 16 * j) : none;
            x = pb ? fa_code_floats(pb + 16 * j) : none;
            _mm512_storeu_si512(b + j * 256 + i * 16,
                                _mm512_mask_blend_epi16(0xAAAAAAAAu,
                                                        _mm512_srli_epi32(a, 16), x));
        }
    }
}

/* fa_amx_code_values for R <= FA_VALUE_ROWS rows: each chunk's value tiles are
   written while the tiles multiply the chunk before (two sets in turn), so that their
   loads do not wait for the stores; the first pass over the columns asks for the rows
   ahead. Configures the tiles (R rows) and leaves them configured. */
FA_BF16_TARGET static int fa_code_values_pass(const float *w, ptrdiff_t w_rs,
                                              ptrdiff_t R, fa_rows_t v, ptrdiff_t C,
                                              ptrdiff_t Ev, float *out,
                                              ptrdiff_t out_rs, void *scratch,
                                              ptrdiff_t pf, ptrdiff_t pf_bytes,
                                              ptrdiff_t limit) {
    const ptrdiff_t chunks = (C + FA_VALUE_KEYS - 1) / FA_VALUE_KEYS;
    uint16_t *wt = (uint16_t *) scratch;
    uint32_t *pairs = (uint32_t *) (wt + chunks * 16 * FA_VALUE_KEYS);
    uint32_t *b;
    ptrdiff_t col, t, c0;
    if (!fa_code_weight_tiles(w, w_rs, R, C, wt))
        return 0;
    fa_amx_configure((int) R);
    for (col = 0; col < Ev; col += FA_VALUE_COLS) {
        FA_TILE_ZERO(0);
        FA_TILE_ZERO(1);
        FA_TILE_ZERO(2);
        FA_TILE_ZERO(3);
        fa_code_value_pairs(v, col, 0, C < FA_VALUE_KEYS ? C : FA_VALUE_KEYS, pairs,
                            col == 0 ? pf : 0, pf_bytes, limit);
        for (t = 0; t < chunks; t++) {
            c0 = (t + 1) * FA_VALUE_KEYS;
            if (c0 < C)
                fa_code_value_pairs(v, col, c0,
                                    C - c0 < FA_VALUE_KEYS ? C - c0 : FA_VALUE_KEYS,
                                    pairs + ((t + 1) & 1) * FA_PAIR_WORDS,
                                    col == 0 ? pf : 0, pf_bytes, limit);
            b = pairs + (t & 1) * FA_PAIR_WORDS;
            FA_TILE_LOAD(4, wt + t * 16 * FA_VALUE_KEYS, 64);
            FA_TILE_LOAD(5, b, 64);
            FA_TILE_DP(0, 4, 5);
            FA_TILE_LOAD(6, b + 256, 64);
            FA_TILE_DP(1, 4, 6);
            FA_TILE_LOAD(5, b + 512, 64);
            FA_TILE_DP(2, 4, 5);
            FA_TILE_LOAD(6, b + 768, 64);
            FA_TILE_DP(3, 4, 6);
        }
        FA_TILE_STORE(0, out + col, out_rs * 4);
        FA_TILE_STORE(1, out + col + 16, out_rs * 4);
        FA_TILE_STORE(2, out + col + 32, out_rs * 4);
        FA_TILE_STORE(3, out + col + 48, out_rs * 4);
    }
    return 1;
}

/* out (R rows, out_rs apart) = the product above of w (R rows, w_rs apart) and value
   rows 0..C of v (their codes from each row's start), FA_VALUE_ROWS rows per pass;
   0 where a pass meets a weight under FA_WEIGHT_FLOOR (out then holds the earlier
   passes' rows only: the caller takes fa_pv for them all). `scratch`:
   fa_code_values_bytes(C) bytes, 64-aligned. The first pass asks for the rows pf
   ahead (pf > 0, below `limit`), pf_bytes of each. Leaves the tiles configured. */
FA_BF16_TARGET static int fa_amx_code_values(const float *w, ptrdiff_t w_rs,
                                             ptrdiff_t R, fa_rows_t v, ptrdiff_t C,
                                             ptrdiff_t Ev, float *out,
                                             ptrdiff_t out_rs, void *scratch,
                                             ptrdiff_t pf, ptrdiff_t pf_bytes,
                                             ptrdiff_t limit) {
    ptrdiff_t r0, rows;
    for (r0 = 0; r0 < R; r0 += rows) {
        rows = R - r0 < FA_VALUE_ROWS ? R - r0 : FA_VALUE_ROWS;
        if (!fa_code_values_pass(w + r0 * w_rs, w_rs, rows, v, C, Ev, out + r0 * out_rs,
                                 out_rs, scratch, r0 ? 0 : pf, pf_bytes, limit))
            return 0;
    }
    return 1;
}

#else   /* no kernel in this module: never called (fastattn._plan's dot_kernel) */

static inline void fa_amx_begin(void) {}
static inline void fa_amx_end(void) {}
static inline void fa_amx_scores(const uint16_t *k, ptrdiff_t k_rs, ptrdiff_t bc,
                                 const uint32_t *qp, ptrdiff_t E, ptrdiff_t nr,
                                 float alpha, float *st) {
    (void) k; (void) k_rs; (void) bc; (void) qp; (void) E; (void) nr; (void) alpha;
    (void) st;
}
static inline void fa_amx_pv(const uint32_t *vt, ptrdiff_t bc, ptrdiff_t Ev,
                             const uint32_t *pp, const uint32_t *pl, ptrdiff_t nr,
                             float *acc, int first) {
    (void) vt; (void) bc; (void) Ev; (void) pp; (void) pl; (void) nr; (void) acc;
    (void) first;
}
static inline int fa_amx_code_limbs(const float *q, ptrdiff_t heads, ptrdiff_t R,
                                    ptrdiff_t E, double scale, fa_code_limbs_t *lb) {
    (void) q; (void) heads; (void) R; (void) E; (void) scale; (void) lb;
    return 0;
}
static inline void fa_amx_code_scores(fa_rows_t k, ptrdiff_t off, ptrdiff_t C,
                                      ptrdiff_t E, const fa_code_limbs_t *lb,
                                      ptrdiff_t R, float *s, ptrdiff_t s_rs,
                                      int8_t *buf, ptrdiff_t pf, ptrdiff_t pf_bytes,
                                      ptrdiff_t limit) {
    (void) k; (void) off; (void) C; (void) E; (void) lb; (void) R; (void) s;
    (void) s_rs; (void) buf; (void) pf; (void) pf_bytes; (void) limit;
}
static inline void fa_amx_code_heads(fa_rows_t k, ptrdiff_t heads, ptrdiff_t bytes,
                                     ptrdiff_t C, ptrdiff_t E,
                                     const fa_code_limbs_t *lb, ptrdiff_t R, float *s,
                                     ptrdiff_t s_rs, int8_t *buf, ptrdiff_t pf,
                                     ptrdiff_t pf_bytes, ptrdiff_t limit) {
    (void) k; (void) heads; (void) bytes; (void) C; (void) E; (void) lb; (void) R;
    (void) s; (void) s_rs; (void) buf; (void) pf; (void) pf_bytes; (void) limit;
}

static inline ptrdiff_t fa_code_values_bytes(ptrdiff_t C) {
    (void) C;
    return 0;
}
static inline int fa_amx_code_values(const float *w, ptrdiff_t w_rs, ptrdiff_t R,
                                     fa_rows_t v, ptrdiff_t C, ptrdiff_t Ev, float *out,
                                     ptrdiff_t out_rs, void *scratch, ptrdiff_t pf,
                                     ptrdiff_t pf_bytes, ptrdiff_t limit) {
    (void) w; (void) w_rs; (void) R; (void) v; (void) C; (void) Ev;
    (void) out; (void) out_rs; (void) scratch; (void) pf; (void) pf_bytes;
    (void) limit;
    return 0;
}

#endif
#endif
