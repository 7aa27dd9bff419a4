/* Software prefetch, for the tiles (fastattn/_tiles.pxd: the next key block, and the
   next tile's query rows) and the decode kernels (fa_dots.h: the rows ahead of each
   stream). */
#ifndef FASTATTN_FA_PREFETCH_H
#define FASTATTN_FA_PREFETCH_H

#include <stddef.h>

/* ask for the cache lines of `rows` rows of `bytes` bytes (row stride `stride` bytes),
   to be read: with `near`, into every cache level; else into the level-2 cache only
   (data read soon, but after what the level-1 cache holds now) */
static inline void fa_prefetch_rows_to(const void *p, ptrdiff_t rows, ptrdiff_t bytes,
                                       ptrdiff_t stride, int near) {
    ptrdiff_t r, x;
    for (r = 0; r < rows; r++)
        for (x = 0; x < bytes; x += 64) {
            if (near)
                __builtin_prefetch((const char *) p + r * stride + x, 0, 3);
            else
                __builtin_prefetch((const char *) p + r * stride + x, 0, 2);
        }
}

/* the same into every cache level (the decode kernels' rows ahead) */
static inline void fa_prefetch_rows(const void *p, ptrdiff_t rows, ptrdiff_t bytes,
                                    ptrdiff_t stride) {
    fa_prefetch_rows_to(p, rows, bytes, stride, 1);
}

#endif
