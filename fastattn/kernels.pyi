# The compiled module fastattn.kernels has no Python-level names: its functions are
# for other Cython code, which cimports their declarations from kernels.pxd and finds
# them at run time through the module's __pyx_capi__ table.

from typing import Any

# name of each specialisation -> a capsule holding its C function pointer
__pyx_capi__: dict[str, Any]
