# Type stub of fastattn._plan (compiled): the description of one attention call.
from typing import Any

from typing_extensions import disjoint_base

import numpy as np
from numpy.typing import NDArray

SIZES: dict[str, int]
# the cdef functions other Cython modules cimport (dtype_code), as capsules
__pyx_capi__: dict[str, Any]

@disjoint_base
class AttentionPlan:
    @property
    def n_slices(self) -> int: ...
    @property
    def batch_shape(self) -> tuple[int, ...]: ...
    @property
    def sizes(self) -> tuple[int, int, int, int]: ...
    @property
    def groups(self) -> int: ...
    @property
    def dtype(self) -> np.dtype[Any]: ...
    @property
    def dot_kernel(self) -> str: ...
    @property
    def amx_codes(self) -> bool: ...
    @property
    def amx_values(self) -> bool: ...
    @property
    def pair_codes(self) -> bool: ...
    @property
    def pair_values(self) -> bool: ...
    @property
    def positions(self) -> tuple[int, int | None, int | None]: ...
    @property
    def bottom_right(self) -> bool: ...
    @property
    def softcap(self) -> float | None: ...
    def operand(self, name: str) -> tuple[int, tuple[int, ...], int, int] | None: ...

def make_plan(batch: tuple[int, ...], Lq: int, Lk: int, E: int, Ev: int, scale: float,
              dtype: Any, *, q: NDArray[Any] | None = ..., k: NDArray[Any] | None = ...,
              v: NDArray[Any] | None = ..., out: NDArray[Any] | None = ...,
              lse: NDArray[Any] | None = ..., mask: NDArray[Any] | None = ...,
              bias: NDArray[Any] | None = ..., k_scale: NDArray[Any] | None = ...,
              v_scale: NDArray[Any] | None = ..., groups: int = ...,
              causal: str | None = ..., query_offset: int | None = ...,
              window: tuple[int | None, int | None] = ...,
              softcap: float | None = ..., alibi_slopes: NDArray[Any] | None = ...,
              sinks: NDArray[Any] | None = ...,
              q_lengths: NDArray[Any] | None = ...,
              kv_lengths: NDArray[Any] | None = ..., dropout_p: float = ...,
              dropout_seed: int | None = ...,
              dropout_slice_base: int = ...,
              bf16_dot: bool = ..., amx: bool = ...,
              round_weights: bool = ...) -> AttentionPlan: ...

def packed_plan(q: NDArray[Any], k: NDArray[Any], v: NDArray[Any], out: NDArray[Any],
                lse: NDArray[Any] | None, cu_seqlens_q: NDArray[Any],
                cu_seqlens_k: NDArray[Any], scale: float, dtype: Any, *,
                k_scale: NDArray[Any] | None = ..., v_scale: NDArray[Any] | None = ...,
                groups: int = ..., causal: str | None = ...,
                window: tuple[int | None, int | None] = ..., softcap: float | None = ...,
                alibi_slopes: NDArray[Any] | None = ..., sinks: NDArray[Any] | None = ...,
                dropout_p: float = ..., dropout_seed: int | None = ...,
                bf16_dot: bool = ..., amx: bool = ...,
                round_weights: bool = ...) -> AttentionPlan: ...
def paged_plan(q: NDArray[Any], k_cache: NDArray[Any], v_cache: NDArray[Any],
               block_table: NDArray[Any], kv_lengths: NDArray[Any], out: NDArray[Any],
               lse: NDArray[Any] | None, cu_seqlens_q: NDArray[Any] | None,
               scale: float, dtype: Any, *, k_scale: NDArray[Any] | None = ...,
               v_scale: NDArray[Any] | None = ..., groups: int = ..., causal: bool = ...,
               window: tuple[int | None, int | None] = ..., softcap: float | None = ...,
               alibi_slopes: NDArray[Any] | None = ..., sinks: NDArray[Any] | None = ...,
               bf16_dot: bool = ..., amx: bool = ...,
               round_weights: bool = ...) -> AttentionPlan: ...
def plain_packed_plan(q: Any, k: Any, v: Any, cu_seqlens_q: Any, cu_seqlens_k: Any,
                      causal: Any, scale: Any, sinks: Any, bf16_dot: bool = ...,
                      amx: bool = ..., window: Any = ..., softcap: Any = ...
                      ) -> tuple[AttentionPlan, NDArray[Any]] | None: ...
def plain_paged_plan(q: Any, k_cache: Any, v_cache: Any, block_table: Any,
                     kv_lengths: Any, k_scale: Any, v_scale: Any, causal: Any,
                     scale: Any, sinks: Any, bf16_dot: bool = ..., amx: bool = ...,
                     window: Any = ..., softcap: Any = ..., cu_seqlens_q: Any = ...
                     ) -> tuple[AttentionPlan, NDArray[Any]] | None: ...
def plain_plan(q: Any, k: Any, v: Any, causal: Any, scale: Any, enable_gqa: Any,
               bf16_dot: bool = ..., amx: bool = ..., lse: Any = ...,
               sinks: Any = ..., round_weights: bool = ..., window: Any = ...,
               softcap: Any = ..., kv_lengths: Any = ..., k_scale: Any = ...,
               v_scale: Any = ...
               ) -> tuple[AttentionPlan, NDArray[Any] | None] | None: ...
