"""Threads: every contender and every ceiling probe of a run uses the same count.

fastattn gets it as ``num_threads=`` on each call; PyTorch and NumPy's BLAS are set for
the duration of a run by :func:`thread_limits`.
"""

from __future__ import annotations

import os
from contextlib import ExitStack, contextmanager
from typing import Dict, Iterator

import fastattn
from ... import _validation as _v

__all__ = ["MAX_THREADS", "default_threads", "max_threads", "check_threads",
           "thread_limits"]

#: The most threads a run may ask for, unless the process may use more cores: PyTorch
#: and NumPy's BLAS really start that many (fastattn caps a call at the usable cores),
#: and a count far beyond what a machine can start would abort or overflow them
#: (``torch.set_num_threads`` takes a C int).
MAX_THREADS = 1024


def default_threads() -> int:
    """``fastattn.get_num_threads()``, or the usable cores where it is not available."""
    getter = getattr(fastattn, "get_num_threads", None)
    if getter is not None:
        return int(getter())
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def max_threads() -> int:
    """The largest thread count a run accepts: :data:`MAX_THREADS`, or the usable
    cores where there are more."""
    if hasattr(os, "sched_getaffinity"):
        return max(MAX_THREADS, len(os.sched_getaffinity(0)))
    return max(MAX_THREADS, os.cpu_count() or 1)


def check_threads(threads, name: str = "threads") -> int:
    """A thread count for a run: an integer from 1 to :func:`max_threads`."""
    threads = _v.check_num_threads(threads, name)
    if threads > max_threads():
        raise ValueError(f"{name} must be at most {max_threads()} (the most threads a "
                         f"run may start), got {threads}")
    return threads


@contextmanager
def thread_limits(threads: int, torch_module=None) -> Iterator[Dict[str, bool]]:
    """Run PyTorch and NumPy's BLAS with ``threads`` threads, then restore.

    fastattn needs no setting (its process-wide default is left alone): every call the
    benchmark times passes ``num_threads=threads``.

    Parameters
    ----------
    threads : int
        The thread count, from 1 to :func:`max_threads`.
    torch_module : module, optional
        The imported ``torch``; its intra-op thread count is set when given.

    Yields
    ------
    dict
        Which libraries were limited: ``{"fastattn": bool, "torch": bool, "blas": bool}``
        (``blas`` is False when threadpoolctl is not installed).
    """
    threads = check_threads(threads)
    applied = {"fastattn": False, "torch": False, "blas": False}
    with ExitStack() as stack:
        applied["fastattn"] = True          # every fastattn call gets num_threads=
        if torch_module is not None:
            old_torch = torch_module.get_num_threads()
            torch_module.set_num_threads(threads)
            stack.callback(torch_module.set_num_threads, old_torch)
            applied["torch"] = True
        try:
            from threadpoolctl import threadpool_limits
        except ImportError:
            pass
        else:
            stack.enter_context(threadpool_limits(limits=threads, user_api="blas"))
            applied["blas"] = True
        yield applied
