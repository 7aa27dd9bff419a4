"""fastattn: scaled dot-product attention on multicore CPUs.

Typed Cython kernels with OpenMP loops compute ``softmax(q @ k^T / sqrt(E)) @ v``
under a thin NumPy API; ``fastattn.reference`` holds the plain NumPy baseline.
"""

from . import reference
from ._api import attention, attention_weights, scores, softmax, weighted_sum
from ._grad import attention_backward
from ._config import get_num_threads, set_num_threads, show_config
from ._merge import merge_partials
from ._version import __version__

__all__ = [
    "__version__",
    "attention",
    "attention_backward",
    "attention_weights",
    "get_num_threads",
    "merge_partials",
    "reference",
    "scores",
    "set_num_threads",
    "show_config",
    "softmax",
    "weighted_sum",
]
