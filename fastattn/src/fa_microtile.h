/* The register tile of fastattn's micro-GEMM (fastattn/_gemm.pxd), per instruction set
   and dtype: FA_MR_* rows of C (one broadcast scalar of A each) by FA_NR_* columns (the
   vector axis), held in a fixed-size local array that the compiler keeps in vector
   registers. The sizes follow the vector registers of the instruction set the including
   module is compiled for (32 x 512-bit with AVX-512, 16 x 256-bit with AVX2, 16 x 128-bit
   otherwise). Chosen by reading gcc's code: some other shapes make it vectorise the row
   axis and shuffle (e.g. double 16 x 8 with AVX-512, 16 x 3 with AVX2 or SSE2), and
   some are not vectorised at all (float, 6 rows x 16 columns, with AVX2 and gcc 12).
   The float32 forward of (1, 8, 512, 512, 64) on one thread with FASTATTN_ISA=avx2, by
   rows x columns: 6 x 16 62 ms, 4 x 16 12.7, 2 x 32 7.9, 3 x 32 6.0 (the avx512
   level: 3.5 ms). */
#ifndef FASTATTN_FA_MICROTILE_H
#define FASTATTN_FA_MICROTILE_H

#if defined(FA_NR_F)
/* set on the command line (experiments) */
#elif defined(__AVX512F__)
#define FA_NR_F 32
#define FA_MR_F 8
#define FA_NR_D 32
#define FA_MR_D 5
#elif defined(__AVX__)
#define FA_NR_F 32      /* 6 rows x 16 ran scalar through the stack (gcc 12) */
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

#endif
