# What every parallel driver shares: per-thread scratch and the interrupt check.
#
# Ctrl-C during a long call: between work items, the caller's own thread (OpenMP
# thread 0) looks for pending signals at most every CHECK_SECONDS, taking the GIL for
# that moment only. Once a handler has raised (KeyboardInterrupt), every thread skips
# its remaining items, the parallel region ends, and the driver re-raises the
# exception; the scratch is NumPy-owned, so nothing leaks.

from libc.stdint cimport uintptr_t

from fastattn._openmp cimport omp_get_thread_num

cdef extern from "fa_interrupt.h":
    double fa_seconds() noexcept nogil
    int fa_read_flag(const int* flag) noexcept nogil
    void fa_set_flag(int* flag) noexcept nogil
    unsigned char fa_read_byte(const unsigned char* b) noexcept nogil
    void fa_write_byte(unsigned char* b, unsigned char value) noexcept nogil

cdef extern from "Python.h":
    # declared without an exception value: the exception it sets is raised later, by
    # raise_interrupt(), once the parallel region has ended
    int check_signals "PyErr_CheckSignals" () noexcept

cdef enum:
    SCRATCH_ALIGN = 64      # bytes


cdef struct Interrupt:
    double next_check       # fa_seconds() after which thread 0 looks again
    int stop                # set once a signal handler raised


cdef inline void start_interrupt_checks(Interrupt* it) noexcept nogil:
    it.next_check = fa_seconds() + 0.05
    it.stop = 0


cdef inline bint interrupted(Interrupt* it) noexcept nogil:
    """True once Ctrl-C (or any signal whose handler raises) is pending: the caller
    then skips the rest of its work items. Cheap: one clock read on thread 0."""
    cdef double now
    if fa_read_flag(&it.stop):
        return True
    if omp_get_thread_num() != 0:
        return False
    now = fa_seconds()
    if now < it.next_check:
        return False
    it.next_check = now + 0.05
    with gil:
        if check_signals() != 0:
            fa_set_flag(&it.stop)
    return fa_read_flag(&it.stop) != 0


cdef inline int raise_interrupt() except -1:
    """Propagate the exception that check_signals() left set."""
    return -1


cdef inline void* aligned(void* p) noexcept nogil:
    """p moved up to the next multiple of SCRATCH_ALIGN bytes (the scratch has room)."""
    cdef uintptr_t a = <uintptr_t> p
    return <void*> ((a + SCRATCH_ALIGN - 1) // SCRATCH_ALIGN * SCRATCH_ALIGN)
