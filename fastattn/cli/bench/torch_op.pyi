# Type stubs for fastattn.cli.bench.torch_op: the PyTorch operator beside the NumPy API.
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from .grid import Case

__all__ = ["TORCH_OP_CASE", "TORCH_OP_CONTENDERS", "make_operator_callable",
           "measure_torch_op", "torch_op_cases"]

TORCH_OP_CASE: Case
TORCH_OP_CONTENDERS: tuple[str, ...]

def torch_op_cases(grid: Sequence[Case]) -> list[Case]: ...
# torch_module: the imported torch, or None
def make_operator_callable(case: Case, arrays: Mapping[str, np.ndarray[Any, Any]],
                           threads: int, *, torch_module: Any,
                           backward: bool = ...) -> Callable[[], object]: ...
def measure_torch_op(cases: Sequence[Case] | None = ..., threads: int | None = ..., *,
                     torch_module: Any = ..., backward: bool = ..., seed: int = ...,
                     max_rounds: int = ..., min_rounds: int = ...,
                     time_budget: float = ..., min_sample_time: float = ...,
                     _progress: Any = ...) -> list[dict[str, Any]]: ...
