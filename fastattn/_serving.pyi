# Type stubs for fastattn's serving functions (re-exported by fastattn/__init__.py).
from typing import Any, Literal, overload

import numpy as np
from numpy.typing import ArrayLike, NDArray

__all__ = ["attention_paged", "store_kv", "quantize_kv"]

CODE_LIMITS: dict[str, float]

_Int = int | np.integer[Any]
_Window = tuple[_Int | None, _Int | None] | list[_Int | None] | None
_Threads = int | np.integer[Any] | None
# dtype= of quantize_kv: a name, or the NumPy / ml_dtypes type
_Codes = Literal["int8", "float8_e4m3fn", "float8_e5m2"] | Any

@overload
def attention_paged(q: ArrayLike, k_cache: ArrayLike, v_cache: ArrayLike,
                    block_table: ArrayLike, kv_lengths: ArrayLike, *,
                    cu_seqlens_q: ArrayLike | None = None,
                    k_scale: ArrayLike | None = None, v_scale: ArrayLike | None = None,
                    scale: float | None = None, causal: bool = True,
                    window: _Window = None, softcap: float | None = None,
                    alibi_slopes: ArrayLike | None = None, sinks: ArrayLike | None = None,
                    return_lse: Literal[False] = False, out: NDArray[Any] | None = None,
                    num_threads: _Threads = None) -> NDArray[Any]: ...
@overload
def attention_paged(q: ArrayLike, k_cache: ArrayLike, v_cache: ArrayLike,
                    block_table: ArrayLike, kv_lengths: ArrayLike, *,
                    cu_seqlens_q: ArrayLike | None = None,
                    k_scale: ArrayLike | None = None, v_scale: ArrayLike | None = None,
                    scale: float | None = None, causal: bool = True,
                    window: _Window = None, softcap: float | None = None,
                    alibi_slopes: ArrayLike | None = None, sinks: ArrayLike | None = None,
                    return_lse: Literal[True], out: NDArray[Any] | None = None,
                    num_threads: _Threads = None) -> tuple[NDArray[Any], NDArray[Any]]: ...
@overload
def attention_paged(q: ArrayLike, k_cache: ArrayLike, v_cache: ArrayLike,
                    block_table: ArrayLike, kv_lengths: ArrayLike, *,
                    cu_seqlens_q: ArrayLike | None = None,
                    k_scale: ArrayLike | None = None, v_scale: ArrayLike | None = None,
                    scale: float | None = None, causal: bool = True,
                    window: _Window = None, softcap: float | None = None,
                    alibi_slopes: ArrayLike | None = None, sinks: ArrayLike | None = None,
                    return_lse: bool = False, out: NDArray[Any] | None = None,
                    num_threads: _Threads = None
                    ) -> NDArray[Any] | tuple[NDArray[Any], NDArray[Any]]: ...

def quantize_kv(x: ArrayLike, dtype: _Codes = "int8", *,
                axis_scale: Literal["token", "head"] = "token"
                ) -> tuple[NDArray[Any], NDArray[np.float32]]: ...

def store_kv(k_cache: NDArray[Any], v_cache: NDArray[Any], slots: ArrayLike,
             k: ArrayLike, v: ArrayLike, *, k_scale: ArrayLike | None = None,
             v_scale: ArrayLike | None = None) -> None: ...
