"""What the CPU can run: the instruction-set levels of the driver modules.

Compiled with no instruction-set flags, so it loads on any CPU of the target.
"""

cdef extern from *:
    """
    #if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
    /* __builtin_cpu_supports also checks that the OS saves the wide registers. */
    static int fa_cpu_level(void) {
        __builtin_cpu_init();
    #if defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 12
        /* exactly the levels the drivers are compiled for (-march=x86-64-v3 / -v4) */
        if (!__builtin_cpu_supports("x86-64-v3"))
            return 0;
        return __builtin_cpu_supports("x86-64-v4") ? 2 : 1;
    #else
        if (!(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")
              && __builtin_cpu_supports("bmi") && __builtin_cpu_supports("bmi2")))
            return 0;
        if (!(__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
              && __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl")
              && __builtin_cpu_supports("avx512cd")))
            return 1;
        return 2;
    #endif
    }
    #define FA_CPU_X86 1
    #else
    static int fa_cpu_level(void) { return 0; }
    #define FA_CPU_X86 0
    #endif
    """
    int fa_cpu_level() noexcept nogil
    const int FA_CPU_X86

#: The levels, lowest first; a driver module ``_drivers_<level>`` exists for each one
#: that was built.
LEVELS = ("baseline", "avx2", "avx512")


def supported_levels():
    """The levels this CPU (and OS) can run, lowest first.

    ``avx2`` is x86-64-v3 (AVX2, FMA, BMI1/2); ``avx512`` is x86-64-v4 (AVX-512
    F/BW/CD/DQ/VL). Anything but x86 runs ``baseline`` only.
    """
    return LEVELS[:fa_cpu_level() + 1]


def is_x86():
    """True when compiled for x86 with GCC or Clang (levels above baseline may exist)."""
    return bool(FA_CPU_X86)
