# Type stubs for fastattn.dask (the `dask` extra): attention on dask arrays.
from typing import Any, Literal, overload

import numpy as np

__all__ = ["attention"]

# dask.array.Array, or anything dask.array.asarray takes; results are dask arrays
# (typed loosely so that importing these stubs does not need dask's own types)
_Input = Any
_Causal = bool | np.bool_ | Literal["top_left", "bottom_right"]

@overload
def attention(q: _Input, k: _Input, v: _Input, *, mask: _Input | None = None,
              bias: _Input | None = None, causal: _Causal = False,
              scale: float | None = None, enable_gqa: bool = False,
              return_lse: Literal[False] = False) -> Any: ...
@overload
def attention(q: _Input, k: _Input, v: _Input, *, mask: _Input | None = None,
              bias: _Input | None = None, causal: _Causal = False,
              scale: float | None = None, enable_gqa: bool = False,
              return_lse: Literal[True]) -> tuple[Any, Any]: ...
@overload
def attention(q: _Input, k: _Input, v: _Input, *, mask: _Input | None = None,
              bias: _Input | None = None, causal: _Causal = False,
              scale: float | None = None, enable_gqa: bool = False,
              return_lse: bool = False) -> Any: ...
