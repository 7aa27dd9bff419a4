"""The parallel drivers compiled for x86-64-v4 (AVX-512) with 512-bit vectors preferred.

setup.py builds the same source, ``_drivers.pxi``, once per instruction-set level;
``fastattn._dispatch`` imports the best one the CPU runs.
"""

include "_drivers.pxi"
