"""fastattn: scaled dot-product attention on multicore CPUs.

Typed Cython kernels with OpenMP loops compute ``softmax(q @ k^T / sqrt(E)) @ v``
under a thin NumPy API; ``fastattn.reference`` holds the plain NumPy baseline.
"""

import importlib as _importlib
from typing import TYPE_CHECKING

from . import reference
from ._api import attention, attention_weights, scores, softmax, weighted_sum
from ._grad import attention_backward
from ._config import get_num_threads, set_num_threads, show_config
from ._merge import merge_partials
from ._serving import attention_paged, quantize_kv, store_kv
from ._varlen import attention_varlen, attention_varlen_backward
from ._version import __version__
from .transformer import MultiHeadAttention, positional_encoding

__all__ = [
    "MultiHeadAttention",
    "__version__",
    "attention",
    "attention_backward",
    "attention_paged",
    "attention_varlen",
    "attention_varlen_backward",
    "attention_weights",
    "explain",
    "get_num_threads",
    "merge_partials",
    "positional_encoding",
    "quantize_kv",
    "reference",
    "scores",
    "set_num_threads",
    "show_config",
    "softmax",
    "store_kv",
    "weighted_sum",
]

# Submodules loaded on first use (PEP 562), so that `import fastattn` stays light.
_LAZY_SUBMODULES = ("demo", "explain")

if TYPE_CHECKING:
    from . import demo, explain
else:
    # hidden from type checkers, which would otherwise accept any name of the package
    def __getattr__(name):
        if name in _LAZY_SUBMODULES:
            return _importlib.import_module(f"{__name__}.{name}")
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY_SUBMODULES))
