# Type stubs for fastattn.dask (the `dask` extra): attention on dask arrays.
from typing import Any, Literal, overload

import numpy as np

__all__ = ["attention"]

# dask.array.Array, or anything dask.array.asarray takes; results are dask arrays
# (typed loosely so that importing these stubs does not need dask's own types)
_Input = Any
_Causal = bool | np.bool_ | Literal["top_left", "bottom_right"]
_Int = int | np.integer[Any]
# window=: (left, right), each an int >= 0 or None (unbounded)
_Window = tuple[_Int | None, _Int | None] | list[_Int | None] | None

@overload
def attention(q: _Input, k: _Input, v: _Input, *, mask: _Input | None = None,
              bias: _Input | None = None, causal: _Causal = False,
              scale: float | None = None, enable_gqa: bool = False,
              window: _Window = None, softcap: float | None = None,
              alibi_slopes: _Input | None = None, sinks: _Input | None = None,
              q_lengths: _Input | None = None, kv_lengths: _Input | None = None,
              dropout_p: float = 0.0,
              dropout_seed: _Int | None = None,
              return_lse: Literal[False] = False) -> Any: ...
@overload
def attention(q: _Input, k: _Input, v: _Input, *, mask: _Input | None = None,
              bias: _Input | None = None, causal: _Causal = False,
              scale: float | None = None, enable_gqa: bool = False,
              window: _Window = None, softcap: float | None = None,
              alibi_slopes: _Input | None = None, sinks: _Input | None = None,
              q_lengths: _Input | None = None, kv_lengths: _Input | None = None,
              dropout_p: float = 0.0,
              dropout_seed: _Int | None = None,
              return_lse: Literal[True]) -> tuple[Any, Any]: ...
@overload
def attention(q: _Input, k: _Input, v: _Input, *, mask: _Input | None = None,
              bias: _Input | None = None, causal: _Causal = False,
              scale: float | None = None, enable_gqa: bool = False,
              window: _Window = None, softcap: float | None = None,
              alibi_slopes: _Input | None = None, sinks: _Input | None = None,
              q_lengths: _Input | None = None, kv_lengths: _Input | None = None,
              dropout_p: float = 0.0,
              dropout_seed: _Int | None = None,
              return_lse: bool = False) -> Any: ...
