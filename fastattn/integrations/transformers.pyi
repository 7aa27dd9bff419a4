# Type stubs for fastattn.integrations.transformers (the `torch` extra). Tensors and
# modules are typed loosely so that checking these stubs does not need PyTorch's or
# transformers' own types.
import logging
from dataclasses import dataclass
from typing import Any

__all__ = ["register", "attention_forward", "build_mask", "MaskDescription",
           "IGNORED_KEYWORDS"]

logger: logging.Logger
IGNORED_KEYWORDS: frozenset[str]

@dataclass(frozen=True, eq=False)
class MaskDescription:
    q_length: int
    kv_length: int
    window: tuple[int, int] | None = None
    key_mask: Any | None = None

def build_mask(*args: Any, **kwargs: Any) -> Any: ...

def attention_forward(module: Any, query: Any, key: Any, value: Any,
                      attention_mask: Any | None, dropout: float = 0.0,
                      scaling: float | None = None, is_causal: bool | None = None,
                      softcap: float | None = None, position_bias: Any | None = None,
                      s_aux: Any | None = None, sliding_window: int | None = None,
                      cu_seq_lens_q: Any | None = None, cu_seq_lens_k: Any | None = None,
                      **kwargs: Any) -> tuple[Any, None]: ...

def register(name: str = "fastattn") -> str: ...
