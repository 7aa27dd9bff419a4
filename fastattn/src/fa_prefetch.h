/* Software prefetch, for the tiles (fastattn/_tiles.pxd: the next key block, and the
   next tile's query rows) and the decode kernels (fa_dots.h: the rows ahead of each
   stream). */
#ifndef FASTATTN_FA_PREFETCH_H
#define FASTATTN_FA_PREFETCH_H

#include <stddef.h>
#include <stdint.h>

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

/* how many bytes from p to ask for (fa_prefetch_rows: the lines at p, p + 64, ...) so
   that the requests reach the last of `bytes` bytes: for the part of a row that the
   next row's part does not follow (a head's part of token-major rows), whose last line
   no other request reaches where p does not start a line (NumPy's arrays are 16-byte
   aligned). Taken once per stream: its rows share p's place in a line. */
static inline ptrdiff_t fa_part_bytes(const void *p, ptrdiff_t bytes) {
    return bytes + (ptrdiff_t) ((uintptr_t) p & 63);
}

/* every cache line of the `bytes` bytes at p, into every cache level */
static inline void fa_prefetch_span(const void *p, ptrdiff_t bytes) {
    fa_prefetch_rows(p, 1, fa_part_bytes(p, bytes), 0);
}

#endif
