# Type stubs for fastattn.explain: why attention divides the scores by sqrt(d_k), from
# random data (loaded on first use as the attribute fastattn.explain).
from collections.abc import Iterable, Mapping
from os import PathLike
from typing import Any

import numpy as np
from numpy.typing import ArrayLike, NDArray

__all__ = ["DIMS", "variance_table", "softmax_table", "explain_table", "softmax_stats",
           "format_table", "plot"]

_Dims = Iterable[int | np.integer[Any]]
_Table = dict[str, NDArray[Any]]

DIMS: tuple[int, ...]
DEFAULT_SAMPLES: int
DEFAULT_KEYS: int
DEFAULT_ROWS: int

def variance_table(dims: _Dims = ..., *, samples: int | np.integer[Any] = ...,
                   seed: int | None = ...) -> _Table: ...
def softmax_stats(scores: ArrayLike) -> _Table: ...
def softmax_table(dims: _Dims = ..., *, keys: int | np.integer[Any] = ...,
                  rows: int | np.integer[Any] = ..., seed: int | None = ...) -> _Table: ...
def explain_table(dims: _Dims = ..., *, samples: int | np.integer[Any] = ...,
                  keys: int | np.integer[Any] = ..., rows: int | np.integer[Any] = ...,
                  seed: int | None = ...) -> _Table: ...
def format_table(table: Mapping[str, ArrayLike]) -> str: ...
def plot(table: Mapping[str, ArrayLike], path: str | PathLike[str], *,
         keys: int | None = ...) -> None: ...
