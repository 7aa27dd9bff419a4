"""What the OpenMP runtime says, for the thread settings and ``show_config()``; and
whether the threads of a team can be created at all (under an address-space limit)."""

import os
import re

from fastattn._openmp cimport (FASTATTN_HAVE_OPENMP, omp_get_max_threads,
                               omp_get_num_procs)

cdef extern from *:
    """
    /* GNU OpenMP (libgomp) ends the process with exit(1) ("libgomp: Thread creation
       failed") when pthread_create fails for a thread of a team; LLVM's libomp aborts
       likewise. Under RLIMIT_AS (ulimit -v) or RLIMIT_DATA each thread's stack
       (OMP_STACKSIZE, or the pthread default, which glibc takes from RLIMIT_STACK:
       8 MiB) counts against the limit. So before a calling thread's first team of
       n_threads, startable_threads() starts n_threads - 1 threads with that stack
       size, all alive at once, and joins them: only as many as could be created are
       asked of the runtime. glibc keeps the stacks of joined threads in its stack
       cache, and the runtime's threads then reuse them. Teams are per calling thread
       (each thread that opens a parallel region gets its own pool of workers), hence
       a thread-local record. */
    #if defined(_OPENMP) && !defined(_WIN32)
    #include <errno.h>
    #include <pthread.h>
    #include <stdlib.h>
    #include <sys/resource.h>
    #define FASTATTN_CAN_PROBE 1

    typedef struct {
        pthread_mutex_t lock;
        pthread_cond_t cond;
        int flag_open;
    } fa_gate;

    static void *fa_wait_at_gate(void *arg) {
        fa_gate *gate = (fa_gate *)arg;
        pthread_mutex_lock(&gate->lock);
        while (!gate->flag_open)
            pthread_cond_wait(&gate->cond, &gate->lock);
        pthread_mutex_unlock(&gate->lock);
        return NULL;
    }

    /* Start n_threads - 1 threads of the given stack size (0: the pthread default),
       all alive together, then join them. Returns how many threads, the caller
       included, could exist at once (n_threads when all started); *err is
       pthread_create's error, or 0. */
    static int fa_probe_threads(int n_threads, size_t stack_size, int *err) {
        fa_gate gate = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0};
        pthread_attr_t attr;
        pthread_t *ids;
        int started_threads = 0, i, rc;
        *err = 0;
        if (n_threads <= 1)
            return 1;
        ids = (pthread_t *)malloc((size_t)(n_threads - 1) * sizeof(pthread_t));
        if (ids == NULL) {
            *err = ENOMEM;
            return 1;
        }
        pthread_attr_init(&attr);
        if (stack_size > 0)      /* as libgomp: a size it rejects leaves the default */
            pthread_attr_setstacksize(&attr, stack_size);
        for (i = 0; i < n_threads - 1; i++) {
            rc = pthread_create(&ids[i], &attr, fa_wait_at_gate, &gate);
            if (rc != 0) {
                *err = rc;
                break;
            }
            started_threads++;
        }
        pthread_mutex_lock(&gate.lock);
        gate.flag_open = 1;
        pthread_cond_broadcast(&gate.cond);
        pthread_mutex_unlock(&gate.lock);
        for (i = 0; i < started_threads; i++)
            pthread_join(ids[i], NULL);
        pthread_attr_destroy(&attr);
        free(ids);
        return started_threads + 1;
    }

    /* Is the address space or the data segment limited (ulimit -v, ulimit -d)? */
    static int fa_memory_limited(void) {
        struct rlimit lim;
        if (getrlimit(RLIMIT_AS, &lim) == 0 && lim.rlim_cur != RLIM_INFINITY)
            return 1;
        if (getrlimit(RLIMIT_DATA, &lim) == 0 && lim.rlim_cur != RLIM_INFINITY)
            return 1;
        return 0;
    }

    /* The largest team the calling thread has started or proven it can start. */
    static __thread int fa_proven_threads = 1;
    #else
    #define FASTATTN_CAN_PROBE 0
    static int fa_probe_threads(int n_threads, size_t stack_size, int *err) {
        (void)stack_size; *err = 0; return n_threads;
    }
    static int fa_memory_limited(void) { return 0; }
    static int fa_proven_threads = 1;
    #endif
    """
    const int FASTATTN_CAN_PROBE
    int fa_proven_threads
    int fa_probe_threads(int n_threads, size_t stack_size, int *err) noexcept nogil
    int fa_memory_limited() noexcept nogil


def openmp_enabled():
    """True when the extensions were compiled with OpenMP."""
    return bool(FASTATTN_HAVE_OPENMP)


def max_threads():
    """``omp_get_max_threads()``: honours OMP_NUM_THREADS and threadpoolctl; 1 if serial."""
    return omp_get_max_threads()


def num_procs():
    """``omp_get_num_procs()``: the processors OpenMP sees; 1 if serial."""
    return omp_get_num_procs()


def _parse_stack_size(text):
    """Bytes of an ``OMP_STACKSIZE`` value as GNU OpenMP reads it (a number with an
    optional B, K, M or G suffix; K when there is none), or None if it is invalid."""
    match = re.fullmatch(r"\s*(\d+)\s*([bkmg]?)\s*", text, re.IGNORECASE)
    if match is None:
        return None
    shift = {"b": 0, "": 10, "k": 10, "m": 20, "g": 30}[match[2].lower()]
    return int(match[1]) << shift


def _runtime_stack_size():
    """The stack size OpenMP gives its threads: OMP_STACKSIZE, else GOMP_STACKSIZE (the
    first valid one, as libgomp reads them), else 0 for the pthread default. Read once,
    at import, when the runtime reads them too: a later change does not reach it."""
    for name in ("OMP_STACKSIZE", "GOMP_STACKSIZE"):
        value = os.environ.get(name)
        if value is not None:
            size = _parse_stack_size(value)
            if size is not None:
                return size
    return 0


STACK_SIZE = _runtime_stack_size()
last_shortfall = None       # what the last probe that fell short found, as a dict


def startable_threads(int n_threads):
    """How many threads, up to ``n_threads``, a parallel region of the calling thread
    may use.

    ``n_threads`` whenever this thread has already used or proven that many (the
    cheap, usual answer), or when no address-space or data-segment limit is set.
    Otherwise starts ``n_threads - 1`` threads with OpenMP's stack size, all at once,
    and joins them: the answer is how many could exist together, the caller included.
    When that is fewer, ``last_shortfall`` says what happened. Always ``n_threads``
    without OpenMP or pthreads.
    """
    global last_shortfall, fa_proven_threads
    cdef int started_threads, err = 0
    cdef size_t stack_size = STACK_SIZE
    if n_threads <= fa_proven_threads or not FASTATTN_CAN_PROBE:
        return n_threads
    if not fa_memory_limited():
        fa_proven_threads = n_threads
        return n_threads
    with nogil:
        started_threads = fa_probe_threads(n_threads, stack_size, &err)
    if started_threads >= n_threads:
        fa_proven_threads = n_threads
        return n_threads
    fa_proven_threads = max(fa_proven_threads, started_threads)
    last_shortfall = {"requested": n_threads, "started": started_threads, "error": err,
                      "stack_size": stack_size}
    return started_threads


def proven_threads():
    """The largest team the calling thread has started or proven it can start."""
    return fa_proven_threads
