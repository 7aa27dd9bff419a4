"""Scratch memory for the drivers, reused across calls.

Each calling Python thread keeps its own buffer per dtype (a call runs its drivers to
the end before it returns, so one buffer per calling thread is never shared), grown
when a call needs more and kept up to ``KEEP_BYTES``; a larger request gets a buffer
of its own that is freed with the call. Small calls then allocate nothing.
"""

from __future__ import annotations

import threading

import numpy as np

__all__ = ["scratch", "KEEP_BYTES"]

#: Scratch up to this size stays allocated between calls (per thread and dtype).
KEEP_BYTES = 4 << 20

_local = threading.local()


def scratch(elements: int, dtype) -> np.ndarray:
    """A 1-D array of at least ``elements`` elements of ``dtype`` (contents undefined)."""
    dtype = np.dtype(dtype)
    if elements * dtype.itemsize > KEEP_BYTES:
        return np.empty(elements, dtype)
    kept = getattr(_local, "buffers", None)
    if kept is None:
        kept = _local.buffers = {}
    buf = kept.get(dtype)
    if buf is None or buf.size < elements:
        buf = kept[dtype] = np.empty(max(elements, 1024), dtype)
    return buf
