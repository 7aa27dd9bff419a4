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
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import warnings

from . import _cpu

LEVELS = _cpu.LEVELS


def _select():
    supported = _cpu.supported_levels()
    top = len(supported) - 1
    forced = os.environ.get("FASTATTN_ISA", "").strip().lower()
    if forced:
        if forced not in LEVELS:
            warnings.warn(f"FASTATTN_ISA={forced!r} is not one of {', '.join(LEVELS)}; "
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


#: The driver module in use, its level, and the levels that were built.
drivers, level, built_levels = _select()
supported_levels = _cpu.supported_levels()
