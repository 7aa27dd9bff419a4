# Type stubs for the compiled module fastattn._drivers: the parallel loops.
#
# Every array is a flat C-contiguous buffer in the computation dtype (float32 or
# float64, the same for all data arguments of a call); offsets are intp arrays.
from typing import Any

import numpy as np
from numpy.typing import NDArray

_Real = NDArray[np.float32] | NDArray[np.float64]
_Offsets = NDArray[np.intp]
_Mask = NDArray[np.uint8]

def attention(q: _Real, k: _Real, v: _Real, out: _Real, lse: _Real, q_off: _Offsets,
              k_off: _Offsets, v_off: _Offsets, Lq: int, Lk: int, E: int, Ev: int,
              scale: float, shift: int, mask: _Mask, mask_off: _Offsets,
              mask_rs: int, mask_cs: int, bias: _Real, bias_off: _Offsets,
              bias_rs: int, bias_cs: int, num_threads: int) -> None: ...

def scores(q: _Real, k: _Real, out: _Real, q_off: _Offsets, k_off: _Offsets,
           Lq: int, Lk: int, E: int, scale: float, shift: int, mask: _Mask,
           mask_off: _Offsets, mask_rs: int, mask_cs: int, bias: _Real,
           bias_off: _Offsets, bias_rs: int, bias_cs: int, softmax: bool,
           num_threads: int) -> None: ...

def weighted_sum(p: _Real, v: _Real, out: _Real, p_off: _Offsets, v_off: _Offsets,
                 Lq: int, Lk: int, Ev: int, num_threads: int) -> None: ...

def softmax(x: _Real, out: _Real, rows: int, n: int, num_threads: int) -> None: ...
