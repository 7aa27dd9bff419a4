# Type stubs for fastattn's public functions (re-exported by fastattn/__init__.py).
from typing import Any, Literal, overload

import numpy as np
from numpy.typing import ArrayLike, NDArray

__all__ = ["attention", "scores", "softmax", "weighted_sum", "attention_weights"]

# causal=: False, True (numpy.bool_ too), "top_left" or "bottom_right"
_Causal = bool | np.bool_ | Literal["top_left", "bottom_right"]
# num_threads=: None (the default), or an int >= 1 (Python or NumPy)
_Threads = int | np.integer[Any] | None
_Int = int | np.integer[Any]
# window=: (left, right), each an int >= 0 or None (unbounded)
_Window = tuple[_Int | None, _Int | None] | list[_Int | None] | None
# precision=: None (the default), "highest" or "bf16" (README "bfloat16 and float16")
_Precision = Literal["highest", "bf16"] | None

@overload
def attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, *,
              mask: ArrayLike | None = None, bias: ArrayLike | None = None,
              causal: _Causal = False, scale: float | None = None,
              enable_gqa: bool = False, window: _Window = None,
              softcap: float | None = None, alibi_slopes: ArrayLike | None = None,
              sinks: ArrayLike | None = None,
              q_lengths: ArrayLike | None = None, kv_lengths: ArrayLike | None = None,
              dropout_p: float = 0.0, dropout_seed: _Int | None = None,
              precision: _Precision = None,
              k_scale: ArrayLike | None = None, v_scale: ArrayLike | None = None,
              return_lse: Literal[False] = False,
              out: NDArray[Any] | None = None,
              num_threads: _Threads = None) -> NDArray[Any]: ...
@overload
def attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, *,
              mask: ArrayLike | None = None, bias: ArrayLike | None = None,
              causal: _Causal = False, scale: float | None = None,
              enable_gqa: bool = False, window: _Window = None,
              softcap: float | None = None, alibi_slopes: ArrayLike | None = None,
              sinks: ArrayLike | None = None,
              q_lengths: ArrayLike | None = None, kv_lengths: ArrayLike | None = None,
              dropout_p: float = 0.0, dropout_seed: _Int | None = None,
              precision: _Precision = None,
              k_scale: ArrayLike | None = None, v_scale: ArrayLike | None = None,
              return_lse: Literal[True],
              out: NDArray[Any] | None = None,
              num_threads: _Threads = None) -> tuple[NDArray[Any], NDArray[Any]]: ...
@overload
def attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, *,
              mask: ArrayLike | None = None, bias: ArrayLike | None = None,
              causal: _Causal = False, scale: float | None = None,
              enable_gqa: bool = False, window: _Window = None,
              softcap: float | None = None, alibi_slopes: ArrayLike | None = None,
              sinks: ArrayLike | None = None,
              q_lengths: ArrayLike | None = None, kv_lengths: ArrayLike | None = None,
              dropout_p: float = 0.0, dropout_seed: _Int | None = None,
              precision: _Precision = None,
              k_scale: ArrayLike | None = None, v_scale: ArrayLike | None = None,
              return_lse: bool = False,
              out: NDArray[Any] | None = None, num_threads: _Threads = None
              ) -> NDArray[Any] | tuple[NDArray[Any], NDArray[Any]]: ...

def scores(q: ArrayLike, k: ArrayLike, *, mask: ArrayLike | None = None,
           bias: ArrayLike | None = None, causal: _Causal = False,
           scale: float | None = None, enable_gqa: bool = False,
           window: _Window = None, softcap: float | None = None,
           alibi_slopes: ArrayLike | None = None, sinks: ArrayLike | None = None,
           q_lengths: ArrayLike | None = None,
           kv_lengths: ArrayLike | None = None) -> NDArray[Any]: ...

def attention_weights(q: ArrayLike, k: ArrayLike, *, mask: ArrayLike | None = None,
                      bias: ArrayLike | None = None, causal: _Causal = False,
                      scale: float | None = None, enable_gqa: bool = False,
                      window: _Window = None, softcap: float | None = None,
                      alibi_slopes: ArrayLike | None = None,
                      sinks: ArrayLike | None = None,
                      q_lengths: ArrayLike | None = None,
                      kv_lengths: ArrayLike | None = None) -> NDArray[Any]: ...

def softmax(x: ArrayLike, axis: int | np.integer[Any] = -1, *,
            out: NDArray[Any] | None = None) -> NDArray[Any]: ...

def weighted_sum(p: ArrayLike, v: ArrayLike, *,
                 out: NDArray[Any] | None = None) -> NDArray[Any]: ...
