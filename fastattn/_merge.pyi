# Type stubs for fastattn.merge_partials (re-exported by fastattn/__init__.py).
from collections.abc import Iterable
from typing import Any

from numpy.typing import ArrayLike, NDArray

__all__ = ["merge_partials"]

def merge_partials(outs: Iterable[ArrayLike],
                   lses: Iterable[ArrayLike]) -> tuple[NDArray[Any], NDArray[Any]]: ...
