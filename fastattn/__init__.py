"""fastattn: scaled dot-product attention on multicore CPUs (work in progress)."""
from ._version import __version__
from . import reference

__all__ = ["__version__", "reference"]
