"""The parallel drivers compiled for x86-64-v3 (AVX2 + FMA).

setup.py builds the same source, ``_drivers.pxi``, once per instruction-set level;
``fastattn._dispatch`` imports the best one the CPU runs.
"""

include "_drivers.pxi"
