# Type stubs for fastattn.cli.bench.contenders: fastattn, the NumPy baseline, PyTorch.
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
from numpy.typing import NDArray

from .grid import Case

__all__ = ["CONTENDERS", "Unavailable", "make_inputs", "make_callable",
           "alibi_slopes", "torch_implementation", "fastattn_kernel"]

CONTENDERS: tuple[str, ...]

class Unavailable(Exception): ...

def make_inputs(case: Case, seed: int = ...) -> dict[str, NDArray[Any]]: ...

# torch_module: the imported torch, or None
def make_callable(case: Case, contender: str, arrays: Mapping[str, NDArray[Any]],
                  threads: int, *, backward: bool = ...,
                  torch_module: Any = ...) -> Callable[[], object]: ...

def alibi_slopes(H: int) -> NDArray[np.float64]: ...
def torch_implementation(case: Case) -> str: ...
def fastattn_kernel(case: Case, arrays: Mapping[str, NDArray[Any]],
                    backward: bool = ...) -> str: ...
def real_rows(case: Case, x: NDArray[Any]) -> NDArray[Any]: ...
