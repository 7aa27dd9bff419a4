"""Timing: interleaved rounds of rotating order, how every figure of the bench is taken.

On a shared machine only ratios measured side by side mean anything: the contenders run
in rounds (A B C, B C A, C A B, ...), so that none always follows the same other, and a
ratio is taken per round.
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Callable, Collection, Dict, Hashable, List, Optional, Sequence

__all__ = ["interleaved", "summary"]

# A pause before each timed sample, so that the worker threads of the library that ran
# before (OpenBLAS, PyTorch's and fastattn's OpenMP pools) have stopped spinning and
# gone to sleep: on a machine with few cores, threads still spinning from one
# contender slow down the next one. The order of the contenders also rotates from
# round to round, so that none always follows the same other.
_SETTLE_S = 0.05

# The pause after a contender whose threads spin longer than that: OpenBLAS's (the
# NumPy baseline, the read probe) wait busy for 2**28 cycles after a call, about 0.1 s
# at 2.5-4 GHz, and a call timed while they still spin on the same cores is slowed
# several times over (docs/performance.md). The first sample of a case pauses as
# long, whatever ran before it.
_SPIN_SETTLE_S = 0.15


def summary(values: Sequence[float]) -> dict:
    return {"median": float(statistics.median(values)), "min": float(min(values)),
            "max": float(max(values))}


def _time_call(fn: Callable[[], object], number: int) -> float:
    t0 = time.perf_counter()
    for _ in range(number):
        fn()
    return (time.perf_counter() - t0) / number


def interleaved(calls: Dict[Hashable, Callable[[], object]], *, max_rounds: int,
                min_rounds: int, time_budget: float, min_sample_time: float,
                setup: Optional[Dict[Hashable, Callable[[], object]]] = None,
                spinning: Collection[Hashable] = ()):
    """Warm up, calibrate and time ``calls`` in interleaved rounds of rotating order.

    A call is repeated within a sample until the sample lasts ``min_sample_time``;
    the number of rounds aims at ``time_budget`` seconds, between the bounds.
    ``setup[name]``, when given, runs (untimed) before each sample of ``name``. A call
    that raises during the warm-up is left out with its error. Each sample follows a
    pause: ``_SPIN_SETTLE_S`` when it is the first or follows one of ``spinning`` (calls
    whose threads go on spinning after they return), else ``_SETTLE_S``.

    Returns ``(samples, outputs, numbers, failed)``: seconds per call of each round,
    the warm-up results, calls per sample, and name -> reason for the left out.
    """
    setup = setup or {}
    outputs, numbers, estimate, failed = {}, {}, {}, {}
    for name in list(calls):
        try:
            if name in setup:
                setup[name]()
            t0 = time.perf_counter()
            outputs[name] = calls[name]()
            t = time.perf_counter() - t0
            if t < 0.25:                      # the first call pays one-off costs
                t = _time_call(calls[name], 1)
        except Exception as exc:              # noqa: BLE001 - report, do not crash
            failed[name] = f"failed: {type(exc).__name__}: {exc}"
            continue
        numbers[name] = max(1, math.ceil(min_sample_time / max(t, 1e-9)))
        estimate[name] = t * numbers[name]
    order = [name for name in calls if name in numbers]
    round_s = sum(estimate.values()) or 1e-9
    rounds = max(1, int(min(max_rounds, max(min_rounds, time_budget // round_s))))
    samples: Dict[Hashable, List[float]] = {name: [] for name in order}
    previous = None
    for r in range(rounds if order else 0):
        for name in order[r % len(order):] + order[:r % len(order)]:
            if name in setup:
                setup[name]()
            pause = (max(_SETTLE_S, _SPIN_SETTLE_S)
                     if previous is None or previous in spinning else _SETTLE_S)
            previous = name
            if pause:
                time.sleep(pause)
                if numbers[name] > 1:
                    # one untimed call first: after the pause the cores may have
                    # clocked down, and a short sample would time the ramp back up
                    # (docs/performance.md)
                    calls[name]()
            samples[name].append(_time_call(calls[name], numbers[name]))
    return samples, outputs, numbers, failed
