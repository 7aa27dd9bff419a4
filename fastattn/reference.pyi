# Type stubs for fastattn.reference, the plain NumPy baseline.
from typing import Any, Literal, overload

import numpy as np
from numpy.typing import ArrayLike, NDArray

__all__ = ["attention", "scores", "softmax", "weighted_sum", "attention_weights",
           "attention_backward", "attention_varlen", "attention_varlen_backward",
           "attention_paged", "store_kv", "quantize_kv", "dequantize_kv"]

_Causal = bool | np.bool_ | Literal["top_left", "bottom_right"]
_Int = int | np.integer[Any]
_Window = tuple[_Int | None, _Int | None] | list[_Int | None] | None

@overload
def attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, *,
              mask: ArrayLike | None = None, bias: ArrayLike | None = None,
              causal: _Causal = False, scale: float | None = None,
              enable_gqa: bool = False, window: _Window = None,
              softcap: float | None = None, alibi_slopes: ArrayLike | None = None,
              sinks: ArrayLike | None = None,
              q_lengths: ArrayLike | None = None, kv_lengths: ArrayLike | None = None,
              dropout_p: float = 0.0, dropout_seed: _Int | None = None,
              k_scale: ArrayLike | None = None, v_scale: ArrayLike | None = None,
              return_lse: Literal[False] = False) -> NDArray[Any]: ...
@overload
def attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, *,
              mask: ArrayLike | None = None, bias: ArrayLike | None = None,
              causal: _Causal = False, scale: float | None = None,
              enable_gqa: bool = False, window: _Window = None,
              softcap: float | None = None, alibi_slopes: ArrayLike | None = None,
              sinks: ArrayLike | None = None,
              q_lengths: ArrayLike | None = None, kv_lengths: ArrayLike | None = None,
              dropout_p: float = 0.0, dropout_seed: _Int | None = None,
              k_scale: ArrayLike | None = None, v_scale: ArrayLike | None = None,
              return_lse: Literal[True]) -> tuple[NDArray[Any], NDArray[Any]]: ...
@overload
def attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, *,
              mask: ArrayLike | None = None, bias: ArrayLike | None = None,
              causal: _Causal = False, scale: float | None = None,
              enable_gqa: bool = False, window: _Window = None,
              softcap: float | None = None, alibi_slopes: ArrayLike | None = None,
              sinks: ArrayLike | None = None,
              q_lengths: ArrayLike | None = None, kv_lengths: ArrayLike | None = None,
              dropout_p: float = 0.0, dropout_seed: _Int | None = None,
              k_scale: ArrayLike | None = None, v_scale: ArrayLike | None = None,
              return_lse: bool = False
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

def softmax(x: ArrayLike, axis: int | np.integer[Any] = -1) -> NDArray[Any]: ...

def weighted_sum(p: ArrayLike, v: ArrayLike) -> NDArray[Any]: ...

def attention_backward(grad_out: ArrayLike, q: ArrayLike, k: ArrayLike, v: ArrayLike,
                       out: ArrayLike, lse: ArrayLike, *,
                       mask: ArrayLike | None = None, bias: ArrayLike | None = None,
                       causal: _Causal = False, scale: float | None = None,
                       enable_gqa: bool = False, window: _Window = None,
                       softcap: float | None = None,
                       alibi_slopes: ArrayLike | None = None,
                       sinks: ArrayLike | None = None,
                       q_lengths: ArrayLike | None = None,
                       kv_lengths: ArrayLike | None = None, dropout_p: float = 0.0,
                       dropout_seed: _Int | None = None
                       ) -> tuple[NDArray[Any], ...]: ...  # dq, dk, dv (and dsinks)

@overload
def attention_varlen(q: ArrayLike, k: ArrayLike, v: ArrayLike, cu_seqlens_q: ArrayLike,
                     cu_seqlens_k: ArrayLike, *, causal: _Causal = False,
                     scale: float | None = None, window: _Window = None,
                     softcap: float | None = None, alibi_slopes: ArrayLike | None = None,
                     sinks: ArrayLike | None = None,
                     dropout_p: float = 0.0, dropout_seed: _Int | None = None,
                     return_lse: Literal[False] = False) -> NDArray[Any]: ...
@overload
def attention_varlen(q: ArrayLike, k: ArrayLike, v: ArrayLike, cu_seqlens_q: ArrayLike,
                     cu_seqlens_k: ArrayLike, *, causal: _Causal = False,
                     scale: float | None = None, window: _Window = None,
                     softcap: float | None = None, alibi_slopes: ArrayLike | None = None,
                     sinks: ArrayLike | None = None,
                     dropout_p: float = 0.0, dropout_seed: _Int | None = None,
                     return_lse: Literal[True]) -> tuple[NDArray[Any], NDArray[Any]]: ...
@overload
def attention_varlen(q: ArrayLike, k: ArrayLike, v: ArrayLike, cu_seqlens_q: ArrayLike,
                     cu_seqlens_k: ArrayLike, *, causal: _Causal = False,
                     scale: float | None = None, window: _Window = None,
                     softcap: float | None = None, alibi_slopes: ArrayLike | None = None,
                     sinks: ArrayLike | None = None,
                     dropout_p: float = 0.0, dropout_seed: _Int | None = None,
                     return_lse: bool = False
                     ) -> NDArray[Any] | tuple[NDArray[Any], NDArray[Any]]: ...

def attention_varlen_backward(grad_out: ArrayLike, q: ArrayLike, k: ArrayLike,
                              v: ArrayLike, out: ArrayLike, lse: ArrayLike,
                              cu_seqlens_q: ArrayLike, cu_seqlens_k: ArrayLike, *,
                              causal: _Causal = False, scale: float | None = None,
                              window: _Window = None, softcap: float | None = None,
                              alibi_slopes: ArrayLike | None = None,
                              sinks: ArrayLike | None = None,
                              dropout_p: float = 0.0, dropout_seed: _Int | None = None
                              ) -> tuple[NDArray[Any], ...]: ...  # dq, dk, dv (and dsinks)

def dequantize_kv(codes: ArrayLike, scale: ArrayLike | None = None) -> NDArray[Any]: ...
def quantize_kv(x: ArrayLike, dtype: Any = "int8", *,
                axis_scale: Literal["token", "head"] = "token"
                ) -> tuple[NDArray[Any], NDArray[Any]]: ...
def store_kv(k_cache: NDArray[Any], v_cache: NDArray[Any], slots: ArrayLike,
             k: ArrayLike, v: ArrayLike, *, k_scale: NDArray[Any] | None = None,
             v_scale: NDArray[Any] | None = None) -> None: ...
def attention_paged(q: ArrayLike, k_cache: ArrayLike, v_cache: ArrayLike,
                    block_table: ArrayLike, kv_lengths: ArrayLike, *,
                    cu_seqlens_q: ArrayLike | None = None,
                    k_scale: ArrayLike | None = None, v_scale: ArrayLike | None = None,
                    scale: float | None = None, causal: bool = True,
                    window: _Window = None, softcap: float | None = None,
                    alibi_slopes: ArrayLike | None = None, sinks: ArrayLike | None = None,
                    return_lse: bool = False) -> Any: ...
