# Type stubs for fastattn.attention_varlen and its backward (re-exported by
# fastattn/__init__.py).
from typing import Any, Literal, overload

import numpy as np
from numpy.typing import ArrayLike, NDArray

__all__ = ["attention_varlen", "attention_varlen_backward"]

_Causal = bool | np.bool_ | Literal["top_left", "bottom_right"]
_Int = int | np.integer[Any]
_Window = tuple[_Int | None, _Int | None] | list[_Int | None] | None
_Threads = int | np.integer[Any] | None

@overload
def attention_varlen(q: ArrayLike, k: ArrayLike, v: ArrayLike, cu_seqlens_q: ArrayLike,
                     cu_seqlens_k: ArrayLike, *, causal: _Causal = False,
                     scale: float | None = None, window: _Window = None,
                     softcap: float | None = None, alibi_slopes: ArrayLike | None = None,
                     sinks: ArrayLike | None = None,
                     dropout_p: float = 0.0, dropout_seed: _Int | None = None,
                     k_scale: ArrayLike | None = None, v_scale: ArrayLike | None = None,
                     return_lse: Literal[False] = False, out: NDArray[Any] | None = None,
                     num_threads: _Threads = None) -> NDArray[Any]: ...
@overload
def attention_varlen(q: ArrayLike, k: ArrayLike, v: ArrayLike, cu_seqlens_q: ArrayLike,
                     cu_seqlens_k: ArrayLike, *, causal: _Causal = False,
                     scale: float | None = None, window: _Window = None,
                     softcap: float | None = None, alibi_slopes: ArrayLike | None = None,
                     sinks: ArrayLike | None = None,
                     dropout_p: float = 0.0, dropout_seed: _Int | None = None,
                     k_scale: ArrayLike | None = None, v_scale: ArrayLike | None = None,
                     return_lse: Literal[True], out: NDArray[Any] | None = None,
                     num_threads: _Threads = None
                     ) -> tuple[NDArray[Any], NDArray[Any]]: ...
@overload
def attention_varlen(q: ArrayLike, k: ArrayLike, v: ArrayLike, cu_seqlens_q: ArrayLike,
                     cu_seqlens_k: ArrayLike, *, causal: _Causal = False,
                     scale: float | None = None, window: _Window = None,
                     softcap: float | None = None, alibi_slopes: ArrayLike | None = None,
                     sinks: ArrayLike | None = None,
                     dropout_p: float = 0.0, dropout_seed: _Int | None = None,
                     k_scale: ArrayLike | None = None, v_scale: ArrayLike | None = None,
                     return_lse: bool = False, out: NDArray[Any] | None = None,
                     num_threads: _Threads = None
                     ) -> NDArray[Any] | tuple[NDArray[Any], NDArray[Any]]: ...

def attention_varlen_backward(grad_out: ArrayLike, q: ArrayLike, k: ArrayLike,
                              v: ArrayLike, out: ArrayLike, lse: ArrayLike,
                              cu_seqlens_q: ArrayLike, cu_seqlens_k: ArrayLike, *,
                              causal: _Causal = False, scale: float | None = None,
                              window: _Window = None, softcap: float | None = None,
                              alibi_slopes: ArrayLike | None = None,
                              sinks: ArrayLike | None = None,
                              dropout_p: float = 0.0, dropout_seed: _Int | None = None,
                              num_threads: _Threads = None
                              ) -> tuple[NDArray[Any], ...]: ...  # dq, dk, dv (and dsinks)
