"""Memory reused across calls: the drivers' scratch and a call's intermediates.

Each calling Python thread keeps its own buffers, one per (dtype, slot). A call runs
its drivers to the end before it returns, so a calling thread's buffer is never
shared; a slot names what one call holds at the same time as the others (the
drivers' per-thread ``"work"`` areas, followed by the partial results of a forward
whose keys are split, the float32 ``"result"`` a 16-bit call of the other functions
(weights, weighted sums, softmax) then rounds, the
backward's partial dQ ``"dq_part"`` and, for 16-bit gradients, the per-thread
``"dq_tile"`` of its final sums). A buffer grows when a call needs more
and is kept up to ``KEEP_BYTES``, or for the drivers' per-thread areas up to
``KEEP_BYTES_PER_THREAD`` times the call's threads where that is more (a team of 16
threads needs more than 4 MiB for a decoding call); a larger request gets a buffer of
its own that is freed with the call. Small and middle-sized calls then allocate
nothing but their results, and the pages they write are not mapped anew on every
call (fresh buffers of a few MiB cost a page fault per 4 KiB).

A buffer from here must not outlive the call that asked for it: what a call returns
is always a new array.

A call can start inside another on the same thread: a Python signal handler runs
between the drivers' work items (where they look for Ctrl-C) and may call fastattn.
The functions that use scratch are wrapped in :func:`owns_scratch`, which counts the
calls under way on the thread; an inner call gets buffers of its own, never the outer
call's.
"""

from __future__ import annotations

import functools
import threading

import numpy as np

__all__ = ["scratch", "owns_scratch", "kept", "KEEP_BYTES", "KEEP_BYTES_PER_THREAD"]

#: Scratch up to this size stays allocated between calls (per thread, dtype and slot).
KEEP_BYTES = 4 << 20

#: ... or up to this size per thread of the call's team, where that is more.
KEEP_BYTES_PER_THREAD = 1 << 20


class _Thread(threading.local):
    depth = 0               # calls under way on this thread (owns_scratch)
    buffers = None          # {(dtype, slot): the kept buffer}


_local = _Thread()


def owns_scratch(func):
    """Mark ``func`` as a call that uses the thread's scratch: a call made while it
    runs on the same thread (from a signal handler) gets buffers of its own."""
    @functools.wraps(func)
    def call(*args, **kwargs):
        _local.depth += 1
        try:
            return func(*args, **kwargs)
        finally:
            _local.depth -= 1
    return call


def kept(nbytes: int, threads: int = 1) -> bool:
    """Is a request of ``nbytes`` bytes, for a call on ``threads`` threads, small
    enough to be served from the thread's kept buffers (rather than by a buffer of its
    own, new pages on every call)?"""
    return nbytes <= max(KEEP_BYTES, KEEP_BYTES_PER_THREAD * threads)


def scratch(elements: int, dtype, slot: str = "work", threads: int = 1) -> np.ndarray:
    """A 1-D array of at least ``elements`` elements of ``dtype`` (contents undefined),
    the calling thread's buffer for ``slot`` (a fresh one inside a nested call);
    ``threads``: the team that shares it (see :func:`kept`)."""
    dtype = np.dtype(dtype)
    if not kept(elements * dtype.itemsize, threads) or _local.depth > 1:
        return np.empty(elements, dtype)
    buffers = _local.buffers
    if buffers is None:
        buffers = _local.buffers = {}
    buf = buffers.get((dtype, slot))
    if buf is None or buf.size < elements:
        buf = buffers[dtype, slot] = np.empty(max(elements, 1024), dtype)
    return buf
