/*
 * fastattn/src/philox.h -- the dropout generator of fastattn: Philox4x32-10.
 *
 * Portable C99 (stdint.h only; also valid C++), every function static inline, no
 * Python. The kernels include it; fastattn/_philox.py is the same generator in NumPy
 * and the tests check one against the other and both against Random123's published
 * known-answer vectors.
 *
 * Philox4x32-10 (Salmon, Moraes, Dror, Shaw, "Parallel random numbers: as easy as
 * 1, 2, 3", SC 2011; as in Random123): ten rounds of
 *
 *     (c0, c1, c2, c3) -> (hi(M1*c2) ^ c1 ^ k0, lo(M1*c2), hi(M0*c0) ^ c3 ^ k1, lo(M0*c0))
 *
 * with the key (k0, k1) bumped by (W0, W1) before every round but the first.
 *
 * Dropout is a pure function of (seed, slice, i, j): slice is the C-order flat index of
 * the (Lq, Lk) weight matrix in the output's batch (b * Hq + h for varlen), i the query
 * row and j the key column in it:
 *
 *     key       = (seed mod 2^32, seed div 2^32)            0 <= seed < 2^64
 *     counter   = (j div 4, i, slice mod 2^32, slice div 2^32)
 *     u         = word (j mod 4) of Philox4x32-10(counter, key)
 *     threshold = floor(dropout_p * 2^32)                    0 <= dropout_p < 1
 *     kept      = u >= threshold; a kept weight is scaled by 1 / (1 - dropout_p)
 *
 * One generator call decides four neighbouring keys: fastattn_dropout_keep4.
 */
#ifndef FASTATTN_PHILOX_H
#define FASTATTN_PHILOX_H

#include <stdint.h>

#if defined(_MSC_VER) && !defined(__cplusplus)
#define FASTATTN_PHILOX_INLINE static __inline
#else
#define FASTATTN_PHILOX_INLINE static inline
#endif

#define FASTATTN_PHILOX_M0 UINT32_C(0xD2511F53)
#define FASTATTN_PHILOX_M1 UINT32_C(0xCD9E8D57)
#define FASTATTN_PHILOX_W0 UINT32_C(0x9E3779B9)
#define FASTATTN_PHILOX_W1 UINT32_C(0xBB67AE85)

/* out = Philox4x32-10(ctr, key). out may alias ctr. */
FASTATTN_PHILOX_INLINE void fastattn_philox4x32_10(const uint32_t ctr[4],
                                                   const uint32_t key[2],
                                                   uint32_t out[4])
{
    uint32_t c0 = ctr[0], c1 = ctr[1], c2 = ctr[2], c3 = ctr[3];
    uint32_t k0 = key[0], k1 = key[1];
    int r;
    for (r = 0; r < 10; r++) {
        uint64_t p0, p1;
        if (r) {
            k0 += FASTATTN_PHILOX_W0;
            k1 += FASTATTN_PHILOX_W1;
        }
        p0 = (uint64_t)FASTATTN_PHILOX_M0 * c0;
        p1 = (uint64_t)FASTATTN_PHILOX_M1 * c2;
        c0 = (uint32_t)(p1 >> 32) ^ c1 ^ k0;
        c1 = (uint32_t)p1;
        c2 = (uint32_t)(p0 >> 32) ^ c3 ^ k1;
        c3 = (uint32_t)p0;
    }
    out[0] = c0; out[1] = c1; out[2] = c2; out[3] = c3;
}

/* floor(dropout_p * 2^32) for 0 <= dropout_p < 1: a word u is kept iff u >= it. */
FASTATTN_PHILOX_INLINE uint32_t fastattn_dropout_threshold(double dropout_p)
{
    /* dropout_p * 2^32 is exact in double and below 2^32; the conversion truncates */
    return (uint32_t)(dropout_p * 4294967296.0);
}

/* The four words that decide keys j = 4*jblock .. 4*jblock + 3 of row i of a slice. */
FASTATTN_PHILOX_INLINE void fastattn_dropout_words(uint64_t seed, uint64_t slice,
                                                   uint32_t i, uint32_t jblock,
                                                   uint32_t words[4])
{
    uint32_t ctr[4], key[2];
    ctr[0] = jblock;
    ctr[1] = i;
    ctr[2] = (uint32_t)slice;
    ctr[3] = (uint32_t)(slice >> 32);
    key[0] = (uint32_t)seed;
    key[1] = (uint32_t)(seed >> 32);
    fastattn_philox4x32_10(ctr, key, words);
}

/* keep[t] = 1 if weight (i, 4*jblock + t) of the slice is kept, else 0 (t = 0..3). */
FASTATTN_PHILOX_INLINE void fastattn_dropout_keep4(uint64_t seed, uint64_t slice,
                                                   uint32_t i, uint32_t jblock,
                                                   uint32_t threshold,
                                                   unsigned char keep[4])
{
    uint32_t w[4];
    int t;
    fastattn_dropout_words(seed, slice, i, jblock, w);
    for (t = 0; t < 4; t++)
        keep[t] = (unsigned char)(w[t] >= threshold);
}

/* 1 if weight (i, j) of the slice is kept, else 0: one element (four cost the same). */
FASTATTN_PHILOX_INLINE int fastattn_dropout_keep(uint64_t seed, uint64_t slice,
                                                 uint32_t i, uint32_t j,
                                                 uint32_t threshold)
{
    uint32_t w[4];
    fastattn_dropout_words(seed, slice, i, j >> 2, w);
    return w[j & 3u] >= threshold;
}

#endif /* FASTATTN_PHILOX_H */
