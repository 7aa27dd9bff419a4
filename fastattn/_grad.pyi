# Type stubs for fastattn.attention_backward (re-exported by fastattn/__init__.py).
from typing import Any, Literal

import numpy as np
from numpy.typing import ArrayLike, NDArray

__all__ = ["attention_backward"]

_Causal = bool | np.bool_ | Literal["top_left", "bottom_right"]
_Int = int | np.integer[Any]
_Window = tuple[_Int | None, _Int | None] | list[_Int | None] | None

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
                       dropout_seed: _Int | None = None,
                       precision: Literal["highest", "bf16"] | None = None,
                       num_threads: int | np.integer[Any] | None = None
                       ) -> tuple[NDArray[Any], ...]: ...
# (dq, dk, dv), and dsinks as a fourth when sinks is given
