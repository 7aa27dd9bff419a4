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

cdef extern from *:
    """
    #if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
    #include <cpuid.h>
    /* bit 0: AVX512-BF16, 1: AVX512-FP16, 2: AMX-TILE and AMX-BF16 (CPUID leaf 7),
       3: the OS enables the AMX tile state (XCR0 bits 17 and 18), 4: an AMD CPU,
       5: AMX-INT8 */
    static int fa_cpu_matrix_features(void) {
        unsigned a, b, c, d, x0 = 0, x1 = 0;
        int flags = 0;
        if (__get_cpuid_max(0, 0) < 7)
            return 0;
        __cpuid(0, a, b, c, d);
        if (b == 0x68747541u && d == 0x69746e65u && c == 0x444d4163u)  /* AuthenticAMD */
            flags |= 16;
        __cpuid_count(7, 0, a, b, c, d);
        if (d & (1u << 23)) flags |= 2;
        if ((d & (1u << 24)) && (d & (1u << 22))) flags |= 4;
        if ((d & (1u << 24)) && (d & (1u << 25))) flags |= 32;
        if (a >= 1) {
            unsigned a1, b1, c1, d1;
            __cpuid_count(7, 1, a1, b1, c1, d1);
            if (a1 & (1u << 5)) flags |= 1;
        }
        __cpuid(1, a, b, c, d);
        if (c & (1u << 27)) {                       /* OSXSAVE: xgetbv is allowed */
            __asm__ volatile ("xgetbv" : "=a"(x0), "=d"(x1) : "c"(0));
            if ((x0 & (3u << 17)) == (3u << 17)) flags |= 8;
        }
        return flags;
    }
    #else
    static int fa_cpu_matrix_features(void) { return 0; }
    #endif
    """
    int fa_cpu_matrix_features() noexcept nogil

cdef extern from *:
    """
    #if defined(__linux__) && defined(__x86_64__)
    #include <stdint.h>
    #include <sys/syscall.h>
    #include <unistd.h>
    /* Ask Linux (>= 5.16) for the AMX tile data state of this process:
       arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA), then check the permission
       (ARCH_GET_XCOMP_PERM). 1: granted. */
    static int fa_request_amx(void) {
        uint64_t bits = 0;
        if (syscall(SYS_arch_prctl, 0x1023, 18) != 0)
            return 0;
        if (syscall(SYS_arch_prctl, 0x1022, &bits) != 0)
            return 0;
        return (bits >> 18) & 1;
    }
    #else
    static int fa_request_amx(void) { return 0; }
    #endif
    """
    int fa_request_amx() noexcept nogil

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


def matrix_features():
    """The CPU's bfloat16/float16 instruction sets, read from CPUID (and, for AMX, XCR0):
    ``{"avx512_bf16": bool, "avx512_fp16": bool, "amx_bf16": bool, "amx_int8": bool,
    "amx_os": bool, "amd": bool}`` (``amx_os``: the OS saves the AMX tile state;
    ``amd``: the vendor is AMD)."""
    cdef int flags = fa_cpu_matrix_features()
    return {"avx512_bf16": bool(flags & 1), "avx512_fp16": bool(flags & 2),
            "amx_bf16": bool(flags & 4), "amx_int8": bool(flags & 32),
            "amx_os": bool(flags & 8), "amd": bool(flags & 16)}


def request_amx():
    """Ask the OS for the AMX tile state (Linux: ``arch_prctl(ARCH_REQ_XCOMP_PERM)``,
    once per process; asking again is harmless). True when granted; False elsewhere or
    when refused (the AMX kernels are then not used)."""
    return bool(fa_request_amx())
