# Type stubs for the compiled driver modules fastattn._drivers_<level>: the parallel
# loops, built from _drivers.pxi (forward) and _backward.pxi (attention_backward)
# once per instruction-set level (see fastattn._dispatch). The stubs are identical.
#
# Every array is a flat C-contiguous buffer in the computation dtype (float32 or
# float64, the same for all data arguments of a call); offsets are intp arrays.
import numpy as np
from numpy.typing import NDArray

_Real = NDArray[np.float32] | NDArray[np.float64]
_Offsets = NDArray[np.intp]
_Mask = NDArray[np.uint8]
_Index = NDArray[np.intp]

def attention(q: _Real, k: _Real, v: _Real, out: _Real, lse: _Real, q_off: _Offsets,
              k_off: _Offsets, v_off: _Offsets, Lq: int, Lk: int, E: int, Ev: int,
              scale: float, shift: int, mask: _Mask, mask_off: _Offsets,
              mask_rs: int, mask_cs: int, bias: _Real, bias_off: _Offsets,
              bias_rs: int, bias_cs: int, num_threads: int,
              groups: int = 1) -> None: ...

def scores(q: _Real, k: _Real, out: _Real, q_off: _Offsets, k_off: _Offsets,
           Lq: int, Lk: int, E: int, scale: float, shift: int, mask: _Mask,
           mask_off: _Offsets, mask_rs: int, mask_cs: int, bias: _Real,
           bias_off: _Offsets, bias_rs: int, bias_cs: int, softmax: bool,
           num_threads: int) -> None: ...

def weighted_sum(p: _Real, v: _Real, out: _Real, p_off: _Offsets, v_off: _Offsets,
                 Lq: int, Lk: int, Ev: int, num_threads: int) -> None: ...

def softmax(x: _Real, out: _Real, rows: int, n: int, num_threads: int) -> None: ...

# attention_backward

def row_deltas(grad_out: _Real, out: _Real, delta: _Real, rows: int, Ev: int,
               num_threads: int) -> None: ...

def key_value_grads(q: _Real, k: _Real, v: _Real, grad_out: _Real, lse: _Real,
                    delta: _Real, dk: _Real, dv: _Real, dq_part: _Real,
                    q_off: _Index, users: _Index, starts: _Index, Lq: int, Lk: int,
                    E: int, Ev: int, scale: float, shift: int, mask: _Mask,
                    mask_off: _Index, mask_rs: int, mask_cs: int, bias: _Real,
                    bias_off: _Index, bias_rs: int, bias_cs: int, chunk_blocks: int,
                    n_chunks: int, num_threads: int) -> None: ...

def query_grads(dq_part: _Real, dq: _Real, users: _Index, starts: _Index, Lq: int,
                E: int, n_chunks: int, num_threads: int) -> None: ...
