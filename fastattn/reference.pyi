# Type stubs for fastattn.reference, the plain NumPy baseline.
from typing import Any, Literal, overload

import numpy as np
from numpy.typing import ArrayLike, NDArray

__all__ = ["attention", "scores", "softmax", "weighted_sum", "attention_weights",
           "attention_backward"]

_Causal = bool | np.bool_ | Literal["top_left", "bottom_right"]

@overload
def attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, *,
              mask: ArrayLike | None = None, bias: ArrayLike | None = None,
              causal: _Causal = False, scale: float | None = None,
              enable_gqa: bool = False,
              return_lse: Literal[False] = False) -> NDArray[Any]: ...
@overload
def attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, *,
              mask: ArrayLike | None = None, bias: ArrayLike | None = None,
              causal: _Causal = False, scale: float | None = None,
              enable_gqa: bool = False,
              return_lse: Literal[True]) -> tuple[NDArray[Any], NDArray[Any]]: ...
@overload
def attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, *,
              mask: ArrayLike | None = None, bias: ArrayLike | None = None,
              causal: _Causal = False, scale: float | None = None,
              enable_gqa: bool = False, return_lse: bool = False
              ) -> NDArray[Any] | tuple[NDArray[Any], NDArray[Any]]: ...

def scores(q: ArrayLike, k: ArrayLike, *, mask: ArrayLike | None = None,
           bias: ArrayLike | None = None, causal: _Causal = False,
           scale: float | None = None, enable_gqa: bool = False) -> NDArray[Any]: ...

def attention_weights(q: ArrayLike, k: ArrayLike, *, mask: ArrayLike | None = None,
                      bias: ArrayLike | None = None, causal: _Causal = False,
                      scale: float | None = None,
                      enable_gqa: bool = False) -> NDArray[Any]: ...

def softmax(x: ArrayLike, axis: int | np.integer[Any] = -1) -> NDArray[Any]: ...

def weighted_sum(p: ArrayLike, v: ArrayLike) -> NDArray[Any]: ...

def attention_backward(grad_out: ArrayLike, q: ArrayLike, k: ArrayLike, v: ArrayLike,
                       out: ArrayLike, lse: ArrayLike, *,
                       mask: ArrayLike | None = None, bias: ArrayLike | None = None,
                       causal: _Causal = False, scale: float | None = None,
                       enable_gqa: bool = False
                       ) -> tuple[NDArray[Any], NDArray[Any], NDArray[Any]]: ...
