"""Pick, at import, the driver module built for the best instruction set the CPU runs.

setup.py compiles the parallel drivers (``_drivers.pxi``) once per level:
``_drivers_baseline`` (no instruction-set flags), ``_drivers_avx2`` (x86-64-v3) and
``_drivers_avx512`` (x86-64-v4, 512-bit vectors); only ``baseline`` on other
architectures and compilers. The CPU's features are read with
``__builtin_cpu_supports`` (``fastattn._cpu``), so a higher level is never loaded on a
CPU that would stop with "Illegal instruction".

The environment variable ``FASTATTN_ISA`` (``baseline``, ``avx2`` or ``avx512``) caps
the level, e.g. to run the test suite on the baseline code:
``FASTATTN_ISA=baseline python -m pytest tests``. A level above what the CPU supports
is not used (a warning says so).

Inside the avx512 module, bfloat16 scores can run on the CPU's AVX512-BF16 dot
products (``vdpbf16ps``, src/fa_bf16.h): ``bf16_dot``. It is used by default on AMD
CPUs, where ``vdpbf16ps`` issues as often as a float32 FMA and so does twice its work.
On Intel CPUs it issues half as often, which gains nothing over the FMAs, so it is not
used there unless ``FASTATTN_ISA=avx512_bf16`` asks for it; any other
``FASTATTN_ISA`` value turns it off. (docs/performance.md has the measurements.)

Where the CPU has AMX-BF16 and AMX-INT8 (Intel Sapphire Rapids and later), the OS
enables its tile state and grants it to this process (``_cpu.request_amx``), bfloat16
scores and values' products run on AMX tiles (src/fa_amx.h), and so do a decoding
step's scores of 16-bit queries against int8 key codes and its product of bfloat16
queries' weights with int8 value codes: ``amx``. It is on by default
there; ``FASTATTN_ISA=amx`` asks for it (with a warning where it cannot be had), and
any other ``FASTATTN_ISA`` value turns it off (``avx512_bf16``: the vdpbf16ps kernel
instead).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import warnings

from . import _cpu

LEVELS = _cpu.LEVELS


def _requested() -> str:
    """FASTATTN_ISA as given ("" when unset)."""
    return os.environ.get("FASTATTN_ISA", "").strip().lower()


def _select():
    supported = _cpu.supported_levels()
    top = len(supported) - 1
    forced = _requested()
    if forced in KERNEL_LEVELS:
        forced = "avx512"
    if forced:
        if forced not in LEVELS:
            warnings.warn(f"FASTATTN_ISA={forced!r} is not one of "
                          f"{', '.join(LEVELS + KERNEL_LEVELS)}; "
                          "ignored", RuntimeWarning, stacklevel=3)
        elif LEVELS.index(forced) > top:
            warnings.warn(f"FASTATTN_ISA={forced!r}: this CPU supports only up to "
                          f"{supported[-1]!r}; using that", RuntimeWarning, stacklevel=3)
        else:
            top = LEVELS.index(forced)
    # Found, not imported: the module of a level the CPU lacks must never be loaded
    # (even its initialisation code may use the wider instructions).
    built = [level for level in LEVELS
             if importlib.util.find_spec(f"{__package__}._drivers_{level}") is not None]
    for level in reversed(LEVELS[:top + 1]):
        if level in built:
            return importlib.import_module(f"._drivers_{level}", __package__), level, built
    raise ImportError("fastattn: no driver module could be imported (was the package "
                      "built? `pip install .` or `python setup.py build_ext --inplace`)")


def amx_choice(forced: str, feats: dict, has_kernel: bool, emulated: bool,
               request) -> tuple[bool, str]:
    """Whether bfloat16 products run on AMX tiles, and why (for ``show_config``).

    ``forced``: FASTATTN_ISA; ``feats``: ``_cpu.matrix_features()``; ``has_kernel``:
    the driver module in use has the AMX kernels (``emulated``: as C functions, a
    test build); ``request``: asks the OS for the tile state, True when granted
    (called only when everything else allows AMX)."""
    if not has_kernel:
        why = ("not used: this build has no AMX kernel (the avx512 drivers are not in "
               "use, or the assembler lacks the tile instructions)")
        usable = False
    elif emulated:
        why = "emulated (a test build: C functions stand in for the tile instructions)"
        usable = forced == "amx"
    elif not (feats["amx_bf16"] and feats["amx_int8"] and feats["avx512_bf16"]):
        why, usable = "not used: the CPU lacks AMX-BF16 or AMX-INT8", False
    elif not feats["amx_os"]:
        why, usable = "not used: the OS does not enable the AMX tile state", False
    elif forced not in ("", "amx"):
        why, usable = f"not used: FASTATTN_ISA={forced!r}", False
    elif not request():
        why, usable = ("not used: the OS refused this process the AMX tile state "
                       "(arch_prctl ARCH_REQ_XCOMP_PERM)"), False
    else:
        why, usable = ("used: bfloat16 scores and values' products on AMX tiles "
                       "(tdpbf16ps), and a decoding step's int8 key codes' scores "
                       "(tdpbssd, tdpbsud) and int8 values' product (tdpbf16ps)"), True
    if emulated and not usable:
        why += " (not used: FASTATTN_ISA=amx turns it on)"
    if forced == "amx" and not usable:
        warnings.warn(f"FASTATTN_ISA='amx': AMX is {why}; using the float32 "
                      "micro-GEMM", RuntimeWarning, stacklevel=3)
    return usable, why


def _amx() -> tuple[bool, str]:
    has = level == "avx512" and getattr(drivers, "HAS_AMX_BF16", False)
    return amx_choice(_requested(), _cpu.matrix_features(), has,
                      has and getattr(drivers, "AMX_EMULATED", False), _cpu.request_amx)


def _bf16_dot() -> bool:
    """Whether bfloat16 scores use AVX512-BF16 (see the module's docstring)."""
    forced = _requested()
    feats = _cpu.matrix_features()
    usable = (level == "avx512" and feats["avx512_bf16"]
              and getattr(drivers, "HAS_AVX512_BF16", False))
    if forced == "avx512_bf16":
        if not usable:
            warnings.warn("FASTATTN_ISA='avx512_bf16': this CPU or build has no "
                          "AVX512-BF16 kernel; using the float32 micro-GEMM",
                          RuntimeWarning, stacklevel=3)
        return usable
    return usable and not forced and feats["amd"]


#: FASTATTN_ISA values that name a kernel inside a level's module rather than a level.
KERNEL_LEVELS = ("avx512_bf16", "amx")

#: The driver module in use, its level, and the levels that were built.
drivers, level, built_levels = _select()
supported_levels = _cpu.supported_levels()
#: bfloat16 scores by AVX512-BF16 dot products (fastattn._plan's dot_kernel).
bf16_dot = _bf16_dot()
#: bfloat16 products on AMX tiles (fastattn._plan's dot_kernel), and why or why not.
amx, amx_status = _amx()
