"""What the OpenMP runtime says, for the thread settings and ``show_config()``."""

from fastattn._openmp cimport (FASTATTN_HAVE_OPENMP, omp_get_max_threads,
                               omp_get_num_procs)


def openmp_enabled():
    """True when the extensions were compiled with OpenMP."""
    return bool(FASTATTN_HAVE_OPENMP)


def max_threads():
    """``omp_get_max_threads()``: honours OMP_NUM_THREADS and threadpoolctl; 1 if serial."""
    return omp_get_max_threads()


def num_procs():
    """``omp_get_num_procs()``: the processors OpenMP sees; 1 if serial."""
    return omp_get_num_procs()
