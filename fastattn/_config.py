"""Thread settings and build information."""

from __future__ import annotations

import os
import platform
import sys
import warnings

from . import _cpu, _dispatch, _openmp
from ._validation import check_num_threads
from ._version import __version__

try:
    from . import _build_config
except ImportError:         # built by something other than setup.py's build_ext
    _build_config = None

_num_threads = None         # set_num_threads() value; None means the default
_parallel_used = False      # this process has run a call on more than one thread
_forked_serial = False      # forked from a process that had: run every call serial
_warned_shortfall = False   # the RuntimeWarning about threads that cannot start: once
# OpenMP read OMP_NUM_THREADS when it was loaded (with this package): so does fastattn
_OMP_NUM_THREADS_SET = bool(os.environ.get("OMP_NUM_THREADS"))


def _after_fork_in_child() -> None:
    # GNU libgomp's thread pool does not survive fork(): a parallel region in a child
    # of a process that already ran one waits forever for threads that no longer
    # exist. Such a child runs every call on one thread instead.
    global _forked_serial
    _forked_serial = _forked_serial or _parallel_used


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def set_num_threads(n) -> None:
    """Set the number of threads fastattn uses, for the whole process.

    Parameters
    ----------
    n : int or None
        An integer >= 1 (Python or NumPy); ``None`` restores the default
        (see :func:`get_num_threads`).

    Notes
    -----
    The setting is process-wide: every Python thread sees it. A call's own
    ``num_threads=`` argument overrides it for that call only. Without OpenMP every
    call runs on one thread whatever is set here.
    """
    global _num_threads
    _num_threads = None if n is None else check_num_threads(n, "n")


def get_num_threads() -> int:
    """The number of threads a call uses when it is not given ``num_threads``.

    The value of :func:`set_num_threads` if one was set; otherwise ``OMP_NUM_THREADS``
    when it was set as fastattn was imported (OpenMP reads it then; more precisely,
    OpenMP's ``omp_get_max_threads()``, which also follows
    ``threadpoolctl.threadpool_limits(..., user_api="openmp")``); otherwise the number
    of cores this process may run on. Always 1 without OpenMP, and 1 in a
    process created by ``fork()`` from one that had already run fastattn on several
    threads (OpenMP's thread pool does not survive ``fork``).
    """
    return _default_threads(_usable_cores())


def _default_threads(cores: int) -> int:
    """get_num_threads() on a process that may run on ``cores`` cores."""
    if not _openmp.openmp_enabled() or _forked_serial:
        return 1
    if _num_threads is not None:
        return _num_threads
    omp = _openmp.max_threads()
    if _OMP_NUM_THREADS_SET:
        return max(1, omp)
    return max(1, min(omp, cores))


def resolve_num_threads(num_threads=None) -> int:
    """The threads a call runs on, from its ``num_threads`` argument.

    None means :func:`get_num_threads`; an explicit count is checked. Either is capped
    at the cores this process may run on: more threads cannot speed up the kernels,
    and an absurd count would make OpenMP abort the process when it cannot create
    them. Under an address-space limit (``ulimit -v``) it is also capped at the
    threads that can be started (see ``_openmp.startable_threads``), with a
    RuntimeWarning the first time. The caps never change :func:`get_num_threads`.
    """
    global _parallel_used
    if num_threads is not None:
        num_threads = check_num_threads(num_threads)
    if not _openmp.openmp_enabled() or _forked_serial:
        return 1
    cores = _usable_cores()
    n = _default_threads(cores) if num_threads is None else num_threads
    if n > 1:
        n = min(n, cores)
        started = _openmp.startable_threads(n)    # n at once unless ulimit -v stops it
        if started < n:
            _warn_shortfall(n, started)
            n = started
        if n > 1:
            _parallel_used = True
    return n


def _limit_text(which) -> str:
    import resource
    soft = resource.getrlimit(which)[0]
    return "unlimited" if soft == resource.RLIM_INFINITY else _size_text(soft)


def _size_text(nbytes) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= size:
            return f"{nbytes / size:.4g} {unit}"
    return f"{nbytes} B"


def _warn_shortfall(requested, started) -> None:
    """Say once per process that a call runs on fewer threads than it asked for,
    because OpenMP could not have created them (it would have ended the process)."""
    global _warned_shortfall
    if _warned_shortfall:
        return
    _warned_shortfall = True
    import resource
    info = _openmp.last_shortfall or {}
    stack = info.get("stack_size") or 0
    stack = (f"{_size_text(stack)} stacks (OMP_STACKSIZE)" if stack
             else "stacks of the default size (RLIMIT_STACK)")
    reason = os.strerror(info["error"]) if info.get("error") else "unknown error"
    message = (
        f"fastattn: only {started} of {requested} threads could be started ({reason}, "
        f"with {stack}, under RLIMIT_AS = "
        f"{_limit_text(resource.RLIMIT_AS)}, RLIMIT_DATA = "
        f"{_limit_text(resource.RLIMIT_DATA)}): running on {started} rather than "
        "letting OpenMP end the process. Raise the limit (ulimit -v), set a smaller "
        "OMP_STACKSIZE (or ulimit -s) before starting Python, or use fewer threads; "
        "see docs/robustness.md. This warning is given once.")
    warnings.warn(message, RuntimeWarning, stacklevel=_caller_stacklevel())


def _caller_stacklevel() -> int:
    """The stacklevel of the first frame outside the fastattn package."""
    package = os.path.dirname(os.path.abspath(__file__))
    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.dirname(
            os.path.abspath(frame.f_code.co_filename)) == package:
        frame, level = frame.f_back, level + 1
    return level


def _openmp_runtimes() -> list:
    """The OpenMP runtime libraries loaded in this process, as readable strings.

    threadpoolctl's ``threadpool_info()`` when it is installed (it also gives the
    runtime's version and thread count); otherwise the shared libraries named like an
    OpenMP runtime in /proc/self/maps (Linux). Empty when neither can tell.
    """
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        threadpool_info = None
    if threadpool_info is not None:
        return [" ".join(str(part) for part in (
                    lib.get("prefix"), lib.get("version"),
                    f"({lib.get('num_threads')} threads)", lib.get("filepath"))
                    if part is not None)
                for lib in threadpool_info() if lib.get("user_api") == "openmp"]
    found = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split()[-1]
                name = os.path.basename(path)
                if name.startswith(("libgomp", "libomp", "libiomp", "vcomp")) \
                        and path not in found:
                    found.append(path)
    except OSError:
        pass
    return found


def _reduced_precision(level: str) -> dict:
    """How bfloat16 and float16 are computed at this level, and what the CPU offers."""
    feats = _cpu.matrix_features()
    fma = f"float32 FMA micro-GEMM ({level})"
    widen = "widened by F16C (vcvtph2ps)" if level != "baseline" else "widened in software"
    have = [name for name in ("avx512_bf16", "avx512_fp16", "amx_bf16", "amx_int8")
            if feats[name]]
    if _dispatch.amx:
        bf16 = ("read in place; scores and values' products on AMX tiles (q, k: E a "
                "multiple of 32; v: Ev a multiple of 16), the weights rounded once to "
                "bfloat16 for the values' product (precision='highest': two bfloat16 "
                f"parts); otherwise the {fma}")
    elif _dispatch.bf16_dot:
        bf16 = ("read in place; scores by AVX512-BF16 dot products (vdpbf16ps), "
                "and the values' product too with the weights rounded once to "
                "bfloat16 (v bfloat16, Ev a multiple of 16; precision='highest': "
                f"values widened per block and the {fma}); the backward's products "
                "on vdpbf16ps too (E, Ev multiples of 64: P and dS rounded to "
                "bfloat16 for the gradient products)")
    else:
        bf16 = f"read in place, widened per block (a shift); {fma}"
    codes = ("quantized caches: read in place, 8-bit codes widened to float32 in "
             "registers")
    if _dispatch.amx:
        codes += ("; a decoding step's int8 key codes' scores against 16-bit queries "
                  "on AMX-INT8 tiles (exact), and bfloat16 queries' weights times int8 "
                  "value codes on AMX-BF16 tiles (5 or more query rows per key head)")
    if _dispatch.bf16_dot and getattr(_dispatch.drivers, "FLOAT8_PAIRS", False):
        codes += ("; a decoding step's float8 codes against bfloat16 queries widened "
                  "exactly to bfloat16 by byte lookups (AVX512-VBMI) and multiplied "
                  "by vdpbf16ps, the weights rounded once to bfloat16 for the "
                  "values' product (precision='highest': the values' product in "
                  "float32)")
    return {
        "bfloat16": bf16,
        "float16": f"read in place, {widen} per block; {fma}",
        "kv_codes": codes,
        "cpu_16bit": ", ".join(have) or "none",
        "amx": _dispatch.amx_status,
        "precision": ("None (default): bfloat16 weights rounded once for the values' "
                      "product on the bfloat16 units; 'highest': kept to 16 bits or "
                      "more; " + ("'bf16': float32 inputs rounded to bfloat16 copies "
                                  "and computed on AMX tiles" if _dispatch.amx else
                                  "'bf16' computes as None (no AMX kernel in use)")),
    }


def config() -> dict:
    """The facts :func:`show_config` prints, as a dictionary."""
    info = {
        "version": __version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "machine": platform.machine(),
        "openmp": _openmp.openmp_enabled(),
        "openmp_runtime": "; ".join(_openmp_runtimes()) or "none found",
        "threads": get_num_threads(),
        "usable_cores": _usable_cores(),
        "isa": _dispatch.level,
        "isa_built": ", ".join(_dispatch.built_levels),
        "isa_supported": ", ".join(_dispatch.supported_levels),
        **_reduced_precision(_dispatch.level),
    }
    if _build_config is not None:
        info.update(compiler=_build_config.COMPILER,
                    compile_args=" ".join(_build_config.COMPILE_ARGS),
                    link_args=" ".join(_build_config.LINK_ARGS))
        isa_flags = getattr(_build_config, "ISA_FLAGS", {}).get(_dispatch.level)
        if isa_flags is not None:
            info["isa_flags"] = " ".join(isa_flags) or "(none)"
    return info


def show_config() -> None:
    """Print the version, OpenMP on/off, threads, compiler and build flags.

    ``isa`` is the instruction-set level of the drivers in use (the best of
    ``isa_built`` that the CPU supports, or lower when ``FASTATTN_ISA`` says so).
    """
    info = config()
    if not info["openmp"]:
        info["openmp"] = "False  (built WITHOUT OpenMP: every call runs on one thread)"
    width = max(len(key) for key in info)
    print("fastattn configuration")
    for key, value in info.items():
        print(f"  {key:<{width}}  {value}")
