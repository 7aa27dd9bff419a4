# Type stub of the compiled driver modules fastattn._drivers_<level>: the path choice
# and the parallel loops, built from _drivers.pxi (forward) and _backward.pxi
# (backward) once per instruction-set level (see fastattn._dispatch). Each
# _drivers_<level>.pyi is a link to this file.
#
# Every driver takes an AttentionPlan (fastattn._plan.make_plan); the arrays it takes
# besides are C-contiguous, in the plan's computation dtype (float32 or float64).
from typing import Any

import numpy as np
from numpy.typing import NDArray

from fastattn._plan import AttentionPlan

_Real = NDArray[np.float32] | NDArray[np.float64]
_Index = NDArray[np.intp]

HAS_AVX512_BF16: bool
HAS_AMX_BF16: bool
FLOAT8_PAIRS: bool
AMX_EMULATED: bool
PATH_CONSTANTS: dict[str, int]

def forward_path(plan: AttentionPlan) -> tuple[Any, ...]: ...
def decode_heads_per_item(plan: AttentionPlan, num_threads: int) -> int: ...
def attention(plan: AttentionPlan, num_threads: int) -> None: ...
def scores(plan: AttentionPlan, softmax: bool, num_threads: int) -> None: ...
def weighted_sum(plan: AttentionPlan, num_threads: int) -> None: ...
def softmax(x: _Real, out: _Real, rows: int, n: int, num_threads: int) -> None: ...
def narrow(src: NDArray[np.float32], dst: NDArray[Any], num_threads: int,
           units: bool = ...) -> None: ...
def quantize_codes(x: _Real, codes: NDArray[np.uint8], scale: NDArray[np.float32],
                   name: str, num_threads: int) -> bool: ...

# attention_backward

def backward_chunks(Lk: int, n_kv: int) -> tuple[int, int]: ...
def backward_kernel(plan: AttentionPlan, grad_dtype: Any) -> str: ...
def forward_kernel(plan: AttentionPlan) -> str: ...
def backward(plan: AttentionPlan, grad_out: _Real, out: _Real, dq: _Real, dk: _Real,
             dv: _Real, kv_users: _Index, kv_starts: _Index, q_users: _Index,
             q_starts: _Index, num_threads: int) -> None: ...
