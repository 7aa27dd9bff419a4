"""The parallel drivers compiled for x86-64-v4 (AVX-512) with 512-bit vectors preferred.

setup.py builds the same sources, ``_drivers.pxi`` (forward) and ``_backward.pxi``
(backward), once per instruction-set level;
``fastattn._dispatch`` imports the best one the CPU runs.
"""

include "_drivers.pxi"
include "_backward.pxi"
