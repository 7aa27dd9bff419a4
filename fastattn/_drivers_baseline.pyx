"""The parallel drivers compiled for the baseline instruction set of the target (x86-64: SSE2; no extra flags elsewhere).

setup.py builds the same sources, ``_drivers.pxi`` (forward) and ``_backward.pxi``
(backward), once per instruction-set level;
``fastattn._dispatch`` imports the best one the CPU runs.
"""

include "_drivers.pxi"
include "_backward.pxi"
