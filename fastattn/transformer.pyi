# Type stubs for fastattn.transformer (positional_encoding and MultiHeadAttention are
# re-exported by fastattn/__init__.py).
from collections.abc import Mapping
from typing import Any

import numpy as np
from numpy.typing import ArrayLike, DTypeLike, NDArray

__all__ = ["positional_encoding", "MultiHeadAttention"]

def positional_encoding(length: int, d_model: int, *, base: float = ...,
                        dtype: DTypeLike = ...) -> NDArray[Any]: ...

class MultiHeadAttention:
    embed_dim: int
    num_heads: int
    head_dim: int
    kdim: int
    vdim: int
    w_q: NDArray[Any]
    w_k: NDArray[Any]
    w_v: NDArray[Any]
    w_o: NDArray[Any]
    b_q: NDArray[Any] | None
    b_k: NDArray[Any] | None
    b_v: NDArray[Any] | None
    b_o: NDArray[Any] | None
    def __init__(self, embed_dim: int, num_heads: int, *, kdim: int | None = ...,
                 vdim: int | None = ..., bias: bool = ..., dtype: DTypeLike = ...,
                 seed: int | None = ...) -> None: ...
    @property
    def bias(self) -> bool: ...
    @property
    def dtype(self) -> np.dtype[Any]: ...
    def __call__(self, query: ArrayLike, key: ArrayLike | None = ...,
                 value: ArrayLike | None = ..., *, mask: ArrayLike | None = ...,
                 causal: bool | str = ..., need_weights: bool = ...,
                 window: tuple[int | None, int | None] | None = ...,
                 softcap: float | None = ..., alibi_slopes: ArrayLike | None = ...,
                 sinks: ArrayLike | None = ...,
                 q_lengths: ArrayLike | None = ..., kv_lengths: ArrayLike | None = ...,
                 dropout_p: float = ..., dropout_seed: int | None = ...) -> Any: ...
    def state_dict(self) -> dict[str, NDArray[Any]]: ...
    @classmethod
    def from_state_dict(cls, state: Mapping[str, ArrayLike], num_heads: int, *,
                        dtype: DTypeLike | None = ...) -> MultiHeadAttention: ...
