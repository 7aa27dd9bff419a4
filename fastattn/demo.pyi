# Type stubs for fastattn.demo: the worked example "The cat sat", step by step (loaded
# on first use as the attribute fastattn.demo).
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
from numpy.typing import ArrayLike, NDArray

__all__ = ["WORDS", "EMBEDDINGS", "worked_example", "format_matrix", "format_steps"]

WORDS: tuple[str, ...]
EMBEDDINGS: NDArray[np.float64]

def worked_example(words: Iterable[str] = ..., embeddings: ArrayLike | None = ..., *,
                   w_q: ArrayLike | None = ..., w_k: ArrayLike | None = ...,
                   w_v: ArrayLike | None = ...) -> dict[str, NDArray[np.float64]]: ...
def format_matrix(title: str, a: ArrayLike, rows: Iterable[object] | None = ...,
                  cols: Iterable[object] | None = ..., *, decimals: int = ...) -> str: ...
def format_steps(steps: Mapping[str, NDArray[Any]], words: Sequence[str], *,
                 decimals: int = ...) -> str: ...
