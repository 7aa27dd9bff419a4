# Type stubs for fastattn.torch (the `torch` extra): attention on PyTorch tensors.
# Tensors are typed loosely so that checking these stubs does not need PyTorch's own
# types (mypy would otherwise analyse the whole of torch).
from typing import Any, Literal, overload

import numpy as np
from numpy.typing import ArrayLike

__all__ = ["scaled_dot_product_attention", "attention", "attention_paged", "store_kv",
           "quantize_kv"]

_Tensor = Any
_Causal = bool | np.bool_ | Literal["top_left", "bottom_right"]
_Threads = int | np.integer[Any] | None
_Window = tuple[int | None, int | None] | None
# q_lengths/kv_lengths: an integer tensor, array or sequence of shape (B,)
_Lengths = _Tensor | ArrayLike | None
# dropout_seed: an int in [0, 2**64)
_Seed = int | np.integer[Any] | None

def scaled_dot_product_attention(
        query: _Tensor, key: _Tensor, value: _Tensor, attn_mask: _Tensor | None = None,
        dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
        enable_gqa: bool = False, *, window: _Window = None, softcap: float | None = None,
        alibi_slopes: _Tensor | None = None, sinks: _Tensor | None = None,
        num_threads: _Threads = None) -> _Tensor: ...

@overload
def attention(q: _Tensor, k: _Tensor, v: _Tensor, *, mask: _Tensor | None = None,
              bias: _Tensor | None = None, causal: _Causal = False,
              scale: float | None = None, enable_gqa: bool = False,
              return_lse: Literal[False] = False, window: _Window = None,
              softcap: float | None = None, alibi_slopes: _Tensor | None = None,
              sinks: _Tensor | None = None, q_lengths: _Lengths = None,
              kv_lengths: _Lengths = None, dropout_p: float = 0.0,
              dropout_seed: _Seed = None, precision: str | None = None,
              k_scale: _Tensor | None = None, v_scale: _Tensor | None = None,
              out: _Tensor | None = None, num_threads: _Threads = None) -> _Tensor: ...
@overload
def attention(q: _Tensor, k: _Tensor, v: _Tensor, *, mask: _Tensor | None = None,
              bias: _Tensor | None = None, causal: _Causal = False,
              scale: float | None = None, enable_gqa: bool = False,
              return_lse: Literal[True], window: _Window = None,
              softcap: float | None = None, alibi_slopes: _Tensor | None = None,
              sinks: _Tensor | None = None, q_lengths: _Lengths = None,
              kv_lengths: _Lengths = None, dropout_p: float = 0.0,
              dropout_seed: _Seed = None, precision: str | None = None,
              k_scale: _Tensor | None = None, v_scale: _Tensor | None = None,
              out: _Tensor | None = None,
              num_threads: _Threads = None) -> tuple[_Tensor, _Tensor]: ...
@overload
def attention(q: _Tensor, k: _Tensor, v: _Tensor, *, mask: _Tensor | None = None,
              bias: _Tensor | None = None, causal: _Causal = False,
              scale: float | None = None, enable_gqa: bool = False,
              return_lse: bool = False, window: _Window = None,
              softcap: float | None = None, alibi_slopes: _Tensor | None = None,
              sinks: _Tensor | None = None, q_lengths: _Lengths = None,
              kv_lengths: _Lengths = None, dropout_p: float = 0.0,
              dropout_seed: _Seed = None, precision: str | None = None,
              k_scale: _Tensor | None = None, v_scale: _Tensor | None = None,
              out: _Tensor | None = None,
              num_threads: _Threads = None) -> _Tensor | tuple[_Tensor, _Tensor]: ...

def attention_paged(q: _Tensor, k_cache: _Tensor, v_cache: _Tensor,
                    block_table: _Tensor, kv_lengths: _Tensor, *,
                    cu_seqlens_q: _Tensor | None = None, k_scale: _Tensor | None = None,
                    v_scale: _Tensor | None = None, scale: float | None = None,
                    causal: bool = True, window: _Window = None,
                    softcap: float | None = None, alibi_slopes: _Tensor | None = None,
                    sinks: _Tensor | None = None, return_lse: bool = False,
                    out: _Tensor | None = None, num_threads: _Threads = None) -> Any: ...
def store_kv(k_cache: _Tensor, v_cache: _Tensor, slots: _Tensor, k: _Tensor,
             v: _Tensor, *, k_scale: _Tensor | None = None,
             v_scale: _Tensor | None = None) -> None: ...
def quantize_kv(x: _Tensor, dtype: Any = "int8", *,
                axis_scale: Literal["token", "head"] = "token"
                ) -> tuple[_Tensor, _Tensor]: ...
