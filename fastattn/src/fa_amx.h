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

#if FA_HAVE_AMX_BF16

#ifdef FA_AMX_EMULATE
/* the eight tiles of this thread, 16 rows of 64 bytes */
static __thread unsigned char fa_emu_tiles[8][16][64];

static void fa_emu_load(int t, const void *base, ptrdiff_t stride) {
    int r;
    for (r = 0; r < 16; r++)
        memcpy(fa_emu_tiles[t][r], (const char *) base + r * stride, 64);
}

static void fa_emu_store(int t, void *base, ptrdiff_t stride) {
    int r;
    for (r = 0; r < 16; r++)
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

#define FA_TILE_LOAD(t, base, stride) fa_emu_load(t, base, stride)
#define FA_TILE_STORE(t, base, stride) fa_emu_store(t, base, stride)
#define FA_TILE_ZERO(t) memset(fa_emu_tiles[t], 0, sizeof fa_emu_tiles[t])
#define FA_TILE_DP(c, a, b) fa_emu_dp(c, a, b)
#define FA_TILE_CONFIG(cfg) ((void) (cfg))
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
#define FA_TILE_CONFIG(cfg)                                                           \
    __asm__ volatile ("ldtilecfg\t%0" :: "m" (*(const unsigned char (*)[64]) (cfg)))
#define FA_TILE_RELEASE() __asm__ volatile ("tilerelease" ::)
#endif

#define FA_AMX_ROW_BYTES (FA_BF16_LANES * 4)   /* a row of st, acc, qp or pp */

/* Configure this thread's tiles: palette 1, all eight 16 rows of 64 bytes. */
static inline void fa_amx_begin(void) {
    unsigned char cfg[64] __attribute__((aligned(64)));
    int t;
    memset(cfg, 0, sizeof cfg);
    cfg[0] = 1;
    for (t = 0; t < 8; t++) {
        cfg[16 + 2 * t] = 64;       /* bytes per row (16-bit, little-endian) */
        cfg[48 + t] = 16;           /* rows */
    }
    FA_TILE_CONFIG(cfg);
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

#endif
#endif
