"""Thread scaling: each shape timed at several thread counts, beside PyTorch at each.

``fastattn bench --threads 1,2,4,8,16`` runs this instead of the one-count table. For
every shape, fastattn (``num_threads=n``) and PyTorch (``torch.set_num_threads(n)`` in
the same process, set before each of its samples) run at every count ``n``, all in the
same interleaved rounds of rotating order, so that the ratios between counts are taken
side by side like the ratios between contenders. Per count the table gives the time,
GFLOP/s, the share of the same count's sgemm, the parallel efficiency
``t(n0) * n0 / (n * t(n))`` (``n0`` the smallest count, normally 1) and the speed-up
over PyTorch, each ratio as the median of its per-round values with their min and max.

A count above the cores this process may use runs too, and is marked *oversubscribed*:
PyTorch then runs that many threads on fewer cores, while fastattn caps a call at the
usable cores (see :func:`fastattn.get_num_threads`); the table says which count each
library ran.
"""

from __future__ import annotations

import os
from typing import Dict, List, Optional, Sequence

from ... import _config
from . import ceilings as _ceilings
from . import grid as _grid
from . import overhead as _overhead
from .contenders import Unavailable, _import_torch, make_callable, make_inputs
from .grid import Case
from .runner import _Progress, report_head
from .threads import check_threads, thread_limits
from .timing import interleaved, summary

__all__ = ["usable_cores", "run_scaling", "scaling_report"]


def usable_cores() -> int:
    """The cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _fastattn_threads(n: int) -> int:
    """The threads a fastattn call given ``num_threads=n`` runs on (capped at the
    usable cores; 1 without OpenMP)."""
    return int(_config.resolve_num_threads(n))


def _scaling_case(case: Case, counts: Sequence[int], *, backward: bool, torch_module,
                  seed: int, max_rounds: int, min_rounds: int, time_budget: float,
                  min_sample_time: float, ceilings: Optional[Dict[int, dict]]) -> dict:
    arrays = make_inputs(case, seed)
    calls, setup, skipped = {}, {}, {}
    for n in counts:
        for name in ("fastattn", "torch"):
            try:
                calls[(name, n)] = make_callable(case, name, arrays, n,
                                                 backward=backward,
                                                 torch_module=torch_module)
            except Unavailable as exc:
                skipped[name] = str(exc)
                continue
            if name == "torch":
                setup[(name, n)] = (lambda k=n: torch_module.set_num_threads(k))
    samples, _, numbers, failed = interleaved(
        calls, max_rounds=max_rounds, min_rounds=min_rounds, time_budget=time_budget,
        min_sample_time=min_sample_time, setup=setup)
    for (name, n), why in failed.items():
        skipped[f"{name} at {n} threads"] = why
    flops = case.flops(backward)
    cores = usable_cores()
    base = counts[0]
    per_count = []
    for n in counts:
        entry = {"threads": n, "oversubscribed": n > cores,
                 "fastattn_threads": _fastattn_threads(n), "torch_threads": n}
        for name in ("fastattn", "torch"):
            s = samples.get((name, n))
            if not s:
                entry[name] = None
                continue
            t = summary(s)
            b = samples.get((name, base))
            entry[name] = dict(
                {key: val * 1e3 for key, val in t.items()},
                samples=[x * 1e3 for x in s], number=numbers[(name, n)],
                gflops=flops / t["median"] / 1e9,
                efficiency=(summary([tb * base / (n * tn) for tb, tn in zip(b, s)])
                            if b else None))
        fa, to = samples.get(("fastattn", n)), samples.get(("torch", n))
        entry["vs_torch"] = (summary([t / f for t, f in zip(to, fa)])
                             if fa and to else None)
        # the ceiling at n threads: the best sgemm seen at n threads or fewer (more
        # threads than cores do not make the machine smaller, only BLAS slower)
        seen = [c["sgemm_gflops"] for m, c in (ceilings or {}).items() if m <= n]
        entry["sgemm_gflops"] = max(seen) if seen else None
        entry["pct_of_sgemm"] = (100.0 * entry["fastattn"]["gflops"] / max(seen)
                                 if seen and entry["fastattn"] else None)
        per_count.append(entry)
    return {"label": case.label, "id": case.id, "dtype": case.dtype, "flops": flops,
            "backward": backward, "base_threads": base, "usable_cores": cores,
            "rounds": min((len(s) for s in samples.values()), default=0),
            "counts": per_count, "skipped": skipped}


def _check_counts(counts: Sequence[int]) -> List[int]:
    out = sorted({check_threads(n) for n in counts})
    if not out:
        raise ValueError("threads: give at least one thread count")
    return out


def run_scaling(grid: Optional[Sequence[Case]] = None,
                counts: Sequence[int] = (1, 2, 4, 8, 16), *, backward: bool = False,
                use_torch: bool = True, ceilings: Optional[Dict[int, dict]] = None,
                max_rounds: int = 11, min_rounds: int = 3, time_budget: float = 6.0,
                min_sample_time: float = 0.02, progress: bool = False, seed: int = 0,
                _progress: Optional[_Progress] = None) -> List[dict]:
    """Time fastattn and PyTorch over ``grid`` at every thread count of ``counts``.

    Parameters
    ----------
    grid : sequence of Case, optional
        Default :data:`GRID`; with ``backward=True`` decode cases are left out.
    counts : sequence of int
        Thread counts (sorted, duplicates dropped); any count >= 1, also above the
        usable cores (marked oversubscribed).
    backward, use_torch, max_rounds, min_rounds, time_budget, min_sample_time, progress,
    seed
        As in :func:`run_benchmarks`; ``time_budget`` is per shape, for all counts.
    ceilings : dict, optional
        Thread count -> :func:`measure_ceilings` at that count; gives ``pct_of_sgemm``,
        of the best sgemm measured at that count or fewer threads.

    Returns
    -------
    list of dict
        One per case: ``label``, ``id``, ``flops``, ``base_threads`` (the smallest
        count, the base of the efficiency), ``usable_cores``, ``rounds``, ``skipped``
        and ``counts``: per count ``threads``, ``oversubscribed``,
        ``fastattn_threads`` (what a fastattn call ran on), ``torch_threads``,
        ``fastattn`` and ``torch`` (median/min/max/samples ms, ``gflops``,
        ``efficiency`` median/min/max, or None), ``vs_torch`` (PyTorch time / fastattn
        time, median/min/max, or None), ``sgemm_gflops`` and ``pct_of_sgemm``.
    """
    counts = _check_counts(counts)
    grid = list(_grid.GRID if grid is None else grid)
    if backward:
        grid = [c for c in grid if not c.decode]
    torch_module = _import_torch() if use_torch else None
    bar = _progress or _Progress(len(grid), progress, "fastattn bench")
    rows = []
    try:
        # restores PyTorch's and BLAS's thread counts afterwards
        with thread_limits(counts[-1], torch_module):
            for case in grid:
                bar.start(f"{case.label} at {','.join(map(str, counts))} threads")
                rows.append(_scaling_case(
                    case, counts, backward=backward, torch_module=torch_module,
                    seed=seed, max_rounds=max_rounds, min_rounds=min_rounds,
                    time_budget=time_budget, min_sample_time=min_sample_time,
                    ceilings=ceilings))
                bar.advance()
    finally:
        if _progress is None:
            bar.close()
    if not use_torch:
        for row in rows:
            row["skipped"]["torch"] = "left out (--no-torch)"
    return rows


def scaling_report(grid: Optional[Sequence[Case]] = None,
                   counts: Sequence[int] = (1, 2, 4, 8, 16), *, backward: bool = False,
                   use_torch: bool = True, measure: bool = True, overhead: bool = True,
                   progress: bool = False, seed: int = 0, **settings) -> dict:
    """A whole scaling run: machine, ceilings and overhead per count, per-case rows.

    Parameters
    ----------
    grid, counts, backward, use_torch, progress, seed, **settings
        As in :func:`run_scaling`.
    measure : bool
        Measure the ceilings (:func:`measure_ceilings`) at every count, before the
        cases.
    overhead : bool
        Measure the per-call overhead (:func:`measure_overhead`) at every count.

    Returns
    -------
    dict
        JSON-ready: ``fastattn_version``, ``created``, ``mode``, ``threads`` (the
        counts), ``usable_cores``, ``settings``, ``conventions``, ``machine``,
        ``ceilings`` and ``overhead`` (keyed by the count as a string, or None),
        and ``scaling`` (the rows of :func:`run_scaling`).
    """
    counts = _check_counts(counts)
    grid = list(_grid.GRID if grid is None else grid)
    n_cases = len([c for c in grid if not (backward and c.decode)])
    torch_module = _import_torch() if use_torch else None
    steps = n_cases + len(counts) * ((1 if measure else 0) + (1 if overhead else 0))
    bar = _Progress(steps, progress, "fastattn bench")
    ceilings: Optional[Dict[int, dict]] = {} if measure else None
    tiny: Optional[Dict[int, dict]] = {} if overhead else None
    try:
        for n in counts:
            with thread_limits(n, torch_module):
                if ceilings is not None:
                    bar.start(f"machine ceilings at {n} threads")
                    ceilings[n] = _ceilings.measure_ceilings(n)
                    bar.advance()
                if tiny is not None:
                    bar.start(f"per-call overhead at {n} threads")
                    tiny[n] = _overhead.measure_overhead(n, torch_module=torch_module,
                                                         seed=seed)
                    bar.advance()
        rows = run_scaling(grid, counts, backward=backward, use_torch=use_torch,
                           ceilings=ceilings, seed=seed, _progress=bar, **settings)
    finally:
        bar.close()
    return {
        **report_head(backward, counts, settings, seed),
        "usable_cores": usable_cores(),
        "conventions": {
            "efficiency": "median over rounds of t(n0) * n0 / (n * t(n)), n0 the "
                          "smallest count; 1 is perfect scaling",
            "speedup": "median over rounds of (PyTorch time / fastattn time) at the "
                       "same count; > 1 means fastattn is faster",
            "oversubscribed": "a count above the usable cores: PyTorch runs that many "
                              "threads, fastattn caps a call at the usable cores",
            "flops": "as in a one-count run"},
        "machine": _ceilings._machine_info(torch_module),
        "ceilings": (None if ceilings is None
                     else {str(n): c for n, c in ceilings.items()}),
        "overhead": None if tiny is None else {str(n): o for n, o in tiny.items()},
        "scaling": rows,
    }
