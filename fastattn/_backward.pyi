# Type stubs for the compiled module fastattn._backward: the parallel loops of
# attention_backward. Arrays are flat C-contiguous buffers in the computation dtype
# (float32 or float64); offsets, users and starts are intp arrays.
import numpy as np
from numpy.typing import NDArray

_Real = NDArray[np.float32] | NDArray[np.float64]
_Index = NDArray[np.intp]
_Mask = NDArray[np.uint8]

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
