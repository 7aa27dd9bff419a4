"""The per-call overhead: a tiny call, where the arithmetic is nothing and the rest all.

One (1, 1, 16, 16, 64) float32 call (:data:`OVERHEAD_CASE`: 16 queries, 16 keys, one
head; 0.13 MFLOP) measures what a call costs beyond its arithmetic: argument checks,
dispatch, allocation, starting the threads. Beside it, PyTorch's SDPA on the same
arrays, and a floor: ``numpy.asarray`` of q, k and v plus ``numpy.empty`` of the output,
the least a NumPy function that returns a new array can do.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from .contenders import Unavailable, make_callable, make_inputs
from .grid import Case
from .threads import default_threads
from .timing import interleaved, summary

__all__ = ["OVERHEAD_CASE", "OVERHEAD_SETTINGS", "measure_overhead"]

#: The shape of the probe.
OVERHEAD_CASE = Case(1, 1, 16, 16, 64)

#: Interleaved rounds of the probe; each sample repeats a call for at least this long.
OVERHEAD_SETTINGS = dict(rounds=7, min_sample_time=0.05)

#: The contenders of the probe, in the order they run within a round.
OVERHEAD_CONTENDERS = ("fastattn", "torch", "floor")


def measure_overhead(threads: Optional[int] = None, *, torch_module=None,
                     rounds: Optional[int] = None,
                     min_sample_time: Optional[float] = None, seed: int = 0) -> dict:
    """The per-call time of a tiny call: fastattn, PyTorch SDPA and a NumPy floor.

    Parameters
    ----------
    threads : int, optional
        ``num_threads=`` of the fastattn call (the run's count; the shape has one unit
        of work, so at most one thread computes); PyTorch's count is whatever
        :func:`thread_limits` set. Default :func:`default_threads`.
    torch_module : module, optional
        The imported ``torch``; without it the PyTorch entry is skipped.
    rounds, min_sample_time : optional
        Default :data:`OVERHEAD_SETTINGS`.
    seed : int
        Seed of the random inputs.

    Returns
    -------
    dict
        ``label``, ``threads``, ``rounds``, ``us`` (contender -> median/min/max/samples
        of microseconds per call), ``ratios`` (``torch``: PyTorch time / fastattn time,
        ``floor``: fastattn time / floor time, median/min/max of per-round ratios, or
        None) and ``skipped``.
    """
    threads = default_threads() if threads is None else threads
    rounds = OVERHEAD_SETTINGS["rounds"] if rounds is None else rounds
    if min_sample_time is None:
        min_sample_time = OVERHEAD_SETTINGS["min_sample_time"]
    case = OVERHEAD_CASE
    arrays = make_inputs(case, seed)
    q, k, v = arrays["q"], arrays["k"], arrays["v"]
    out_shape, dtype = (case.B, case.H, case.Lq, case.ev), np.dtype(case.dtype)

    def floor():
        return (np.asarray(q), np.asarray(k), np.asarray(v),
                np.empty(out_shape, dtype))

    calls, skipped = {}, {}
    for name in OVERHEAD_CONTENDERS:
        if name == "floor":
            calls[name] = floor
            continue
        try:
            calls[name] = make_callable(case, name, arrays, threads,
                                        torch_module=torch_module)
        except Unavailable as exc:
            skipped[name] = str(exc)
    samples, _, numbers, failed = interleaved(
        calls, max_rounds=rounds, min_rounds=rounds, time_budget=0.0,
        min_sample_time=min_sample_time)
    skipped.update(failed)
    us = {name: dict({key: x * 1e6 for key, x in summary(s).items()},
                     samples=[x * 1e6 for x in s], number=numbers[name])
          for name, s in samples.items() if s}
    ratios = {"torch": None, "floor": None}
    if "fastattn" in samples:
        fa = samples["fastattn"]
        if "torch" in samples:
            ratios["torch"] = summary(
                [t / f for t, f in zip(samples["torch"], fa)])
        ratios["floor"] = summary(
            [f / b for f, b in zip(fa, samples["floor"])])
    return {"label": case.label, "dtype": case.dtype, "threads": threads,
            "rounds": min((len(s) for s in samples.values()), default=0),
            "us": us, "ratios": ratios, "skipped": skipped}
