/* A clock and a shared flag for the drivers' interrupt checks (fastattn/_parallel.pxd),
   and shared bytes for what a work item learns of its slice. */
#ifndef FASTATTN_FA_INTERRUPT_H
#define FASTATTN_FA_INTERRUPT_H

#ifdef _OPENMP
#include <omp.h>
static inline double fa_seconds(void) { return omp_get_wtime(); }
#else
#include <time.h>
static inline double fa_seconds(void) { return (double)clock() / CLOCKS_PER_SEC; }
#endif

/* The flag is written by one thread and read by the others between work items. */
static inline int fa_read_flag(const int *flag) { return *(const volatile int *)flag; }
static inline void fa_set_flag(int *flag) { *(volatile int *)flag = 1; }

/* A byte that any thread may write and others read, each writer writing the same
   value (a result that depends on the data only: fastattn/_tiles.pxd's
   tile_units_safe). */
static inline unsigned char fa_read_byte(const unsigned char *b) {
    return *(const volatile unsigned char *)b;
}
static inline void fa_write_byte(unsigned char *b, unsigned char value) {
    *(volatile unsigned char *)b = value;
}

#endif
