# The one place that knows about OpenMP. Every other module cimports from here, so the
# same sources build with or without the compiler's OpenMP flag: without it, the
# functions below are defined to describe a single thread.

cdef extern from *:
    """
    #ifdef _OPENMP
    #include <omp.h>
    #define FASTATTN_HAVE_OPENMP 1
    #else
    #define FASTATTN_HAVE_OPENMP 0
    static inline int omp_get_max_threads(void) { return 1; }
    static inline int omp_get_thread_num(void) { return 0; }
    static inline int omp_get_num_procs(void) { return 1; }
    static inline int omp_in_parallel(void) { return 0; }
    #endif
    """
    const int FASTATTN_HAVE_OPENMP
    int omp_get_max_threads() noexcept nogil
    int omp_get_thread_num() noexcept nogil
    int omp_get_num_procs() noexcept nogil
    int omp_in_parallel() noexcept nogil
