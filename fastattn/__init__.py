"""fastattn: scaled dot-product attention on multicore CPUs (work in progress)."""
from ._version import __version__
from . import reference
from ._merge import merge_partials

__all__ = ["__version__", "reference", "merge_partials"]
