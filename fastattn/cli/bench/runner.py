"""Running the cases: calibration, interleaved rounds, per-round ratios, a whole run.

Every contender of a case runs in the same process, with the same threads, on the same
arrays, in interleaved rounds whose order rotates (A B C, B C A, C A B, ...); a
speed-up is taken per round, as ``time of the other / time of fastattn``. With peers
(``run_benchmarks(..., peers=[...])``, ``fastattn bench --peers``) each contender runs
instead in a worker process of its own, the workers taking turns one sample at a time
in the same rotating rounds (:class:`~fastattn.cli.bench.peers.WorkerPool`).
"""

from __future__ import annotations

import datetime
import math
import sys
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import fastattn
from . import ceilings as _ceilings
from . import grid as _grid
from . import overhead as _overhead
from . import peers as _peers
from . import serving as _serving
from . import torch_op as _torch_op
from .contenders import (CONTENDERS, Unavailable, _import_torch, _max_abs,
                         _max_abs_diff, fastattn_kernel, make_callable, make_inputs,
                         torch_implementation)
from .grid import Case
from .threads import check_threads, default_threads, thread_limits
from .timing import interleaved as _interleaved, summary as _summary

__all__ = ["FULL_SETTINGS", "QUICK_SETTINGS", "run_benchmarks", "geometric_means",
           "benchmark_report"]

#: Timing settings of a full run and of ``--quick``.
FULL_SETTINGS = dict(max_rounds=11, min_rounds=3, time_budget=6.0, min_sample_time=0.02)
QUICK_SETTINGS = dict(max_rounds=5, min_rounds=3, time_budget=1.5, min_sample_time=0.01)

def _bench_case(case: Case, threads: int, *, backward: bool, torch_module, seed: int,
                max_rounds: int, min_rounds: int, time_budget: float,
                min_sample_time: float, ceilings: Optional[dict],
                use_numpy: bool = True,
                read_probe: Optional[Tuple[Callable[[], object], int]] = None,
                pool: Optional[_peers.WorkerPool] = None) -> dict:
    arrays = make_inputs(case, seed)
    skipped: Dict[str, str] = {}
    names = []
    for name in CONTENDERS:
        if name == "numpy" and not use_numpy:
            skipped[name] = "left out (--no-numpy)"
            continue
        if name == "numpy" and not case.baseline:
            skipped[name] = ("left out of the largest shapes (it forms the whole score "
                             "matrix: tens of seconds a call)")
            continue
        names.append(name)
    twin = case.counterpart()
    timing = dict(max_rounds=max_rounds, min_rounds=min_rounds, time_budget=time_budget,
                  min_sample_time=min_sample_time)
    isolated: Optional[dict] = None
    if pool is None:
        probe_bytes = read_probe[1] if read_probe is not None else None
        calls: Dict[str, Callable[[], object]] = {}
        for name in names:
            try:
                calls[name] = make_callable(case, name, arrays, threads,
                                            backward=backward,
                                            torch_module=torch_module)
            except Unavailable as exc:
                skipped[name] = str(exc)

        # a decode case: the bandwidth probe too, in the same rounds (the read
        # bandwidth of this shared machine moves from minute to minute)
        if case.decode and read_probe is not None and "fastattn" in calls:
            calls["read"] = read_probe[0]

        # a variant case: fastattn on its counterpart too, in the same rounds
        if twin is not None and "fastattn" in calls:
            calls["counterpart"] = make_callable(twin, "fastattn", arrays, threads,
                                                 backward=backward)

        samples, outputs, numbers, failed = _interleaved(
            calls, spinning=("numpy", "read"), **timing)
        skipped.update(failed)
    else:
        # every contender in its own worker process (fastattn, numpy, torch, the
        # probe, the counterpart, each peer), one sample at a time
        if torch_module is None and "torch" in names:
            names.remove("torch")
            skipped["torch"] = "PyTorch is not installed (pip install torch)"
        if case.decode and pool.read_probe:
            names.append("read")
        if twin is not None:
            names.append("counterpart")
        isolated = pool.time_case(case, names, backward=backward, seed=seed,
                                  arrays=arrays, **timing)
        samples, outputs = isolated["samples"], isolated["outputs"]
        numbers = isolated["numbers"]
        skipped.update(isolated["skipped"])
        probe_bytes = isolated["probe_bytes"]
        if "fastattn" not in samples:
            for name in ("read", "counterpart"):
                samples.pop(name, None)
    rounds = min((len(s) for s in samples.values()), default=0)

    flops = case.flops(backward)
    nbytes = case.kv_bytes()
    times = {}
    for name, s in samples.items():
        summary = _summary(s)
        med = summary["median"]
        times[name] = dict(
            {key: val * 1e3 for key, val in summary.items()},
            samples=[x * 1e3 for x in s], number=numbers[name],
            gflops=flops / med / 1e9, gbs=nbytes / med / 1e9)

    ratios: Dict[str, Optional[dict]] = {}
    for other in ("numpy", "torch"):
        if "fastattn" in samples and other in samples:
            per_round = [o / f for o, f in zip(samples[other], samples["fastattn"])]
            ratios[other] = dict(_summary(per_round), per_round=per_round)
        else:
            ratios[other] = None

    bandwidth = None
    if "read" in samples and "fastattn" in samples:
        # fastattn's GB/s over the probe's in each round, in percent
        per_round = [100.0 * (nbytes / f) / (probe_bytes / r)
                     for r, f in zip(samples["read"], samples["fastattn"])]
        bandwidth = dict(_summary(per_round), per_round=per_round,
                         probe_bytes=probe_bytes)

    counterpart = None
    if "counterpart" in samples and "fastattn" in samples:
        pairs = list(zip(samples["counterpart"], samples["fastattn"]))
        counterpart = {"label": twin.label, "id": twin.id,
                       "speedup": dict(_summary([c / f for c, f in pairs]),
                                       per_round=[c / f for c, f in pairs]),
                       "cost": _summary([f / c for c, f in pairs])}

    diffs = {}
    if "numpy" in outputs:
        for name in ("fastattn", "torch"):
            if name in outputs:
                diffs[name] = _max_abs_diff(outputs[name], outputs["numpy"], case)
    diff_torch = None
    if "fastattn" in outputs and "torch" in outputs:
        diff_torch = _max_abs_diff(outputs["fastattn"], outputs["torch"], case)

    row = {"label": case.label, "id": case.id, "B": case.B, "H": case.H,
           "Hkv": case.kv_heads, "Lq": case.Lq, "Lk": case.Lk, "E": case.E,
           "Ev": case.ev, "dtype": case.dtype, "causal": case.causal_kind or False,
           "gqa": case.gqa, "decode": case.decode, "backward": backward,
           "window": list(case.window) if case.window is not None else None,
           "softcap": case.softcap, "alibi": case.alibi, "sinks": case.sinks,
           "lengths": list(case.lengths) if case.lengths is not None else None,
           "ragged": case.ragged_flavour, "torch_runs": torch_implementation(case),
           "kernel": fastattn_kernel(case, arrays, backward),
           "flops": flops, "kv_bytes": nbytes, "rounds": rounds, "times_ms": times,
           "ratios": ratios, "max_abs_diff_vs_numpy": diffs,
           "max_abs_diff_fastattn_vs_torch": diff_torch,
           "max_abs_fastattn": (_max_abs(outputs["fastattn"], case)
                                if "fastattn" in outputs else None),
           "counterpart": counterpart, "pct_of_bandwidth_same_rounds": bandwidth,
           "skipped": skipped}
    if isolated is not None:
        row.update(_peer_columns(isolated, samples))
    row.update(_peak(row, ceilings))
    return row


def _peer_columns(isolated: dict, samples: dict) -> dict:
    """The peers of a row timed in worker processes: each peer's status and its
    per-round ratio to fastattn, the fastest peer, and every contender's difference
    from the float64 reference."""
    peers = {}
    for name, entry in isolated["peers"].items():
        entry = dict(entry, ratio=None)
        if name in samples and "fastattn" in samples:
            per_round = [p / f for p, f in zip(samples[name], samples["fastattn"])]
            entry["ratio"] = dict(_summary(per_round), per_round=per_round)
        peers[name] = entry
    timed = {n: samples[n] for n in peers if n in samples}
    return {"peers": peers,
            "fastest_peer": _peers.fastest_peer(timed, samples.get("fastattn", [])),
            "max_abs_diff_vs_float64": isolated["max_abs_diff_vs_float64"]}


def _peak(row: dict, ceilings: Optional[dict]) -> dict:
    """fastattn's throughput and its share of the run's ceiling: for a decode row, the
    median over rounds of its GB/s over the read probe's in the same round when the
    probe ran in its rounds, else of the run's best read bandwidth."""
    fa = row["times_ms"].get("fastattn")
    out = {"gflops": None, "gbs": None, "pct_of_ceiling": None, "ceiling": None}
    if fa is None:
        return out
    out["gflops"] = fa["gflops"]
    if row["decode"]:
        out["gbs"] = fa["gbs"]
        same_rounds = row.get("pct_of_bandwidth_same_rounds")
        if same_rounds:
            out["ceiling"] = "read probe, same rounds"
            out["pct_of_ceiling"] = same_rounds["median"]
        else:
            out["ceiling"] = "bandwidth"
            if ceilings:
                out["pct_of_ceiling"] = 100.0 * fa["gbs"] / ceilings["bandwidth_gbs"]
    else:
        key = "dgemm" if row["dtype"] == "float64" else "sgemm"
        # bfloat16: PyTorch's bf16 matmul where it is the faster (a CPU with
        # bfloat16 units); without them it is no ceiling (a fraction of a GFLOP/s on
        # CPUs with AVX2 only) and both widen to float32, whose ceiling is the sgemm
        if (row["dtype"] == "bfloat16" and ceilings and "bf16gemm_gflops" in ceilings
                and ceilings["bf16gemm_gflops"] >= ceilings["sgemm_gflops"]):
            key = "bf16gemm"
        out["ceiling"] = key
        if ceilings:
            out["pct_of_ceiling"] = 100.0 * fa["gflops"] / ceilings[f"{key}_gflops"]
    return out


def report_head(backward: bool, threads, settings: dict, seed) -> dict:
    """The first entries of a run's report: the version, the time, the mode, the
    thread count(s) and the settings (with the seed)."""
    return {
        "fastattn_version": getattr(fastattn, "__version__", None),
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "mode": "forward+backward" if backward else "forward",
        "threads": threads,
        "settings": dict(settings, seed=seed),
    }


class _Progress:
    """tqdm when it is installed, else a one-line progress report on stderr."""

    def __init__(self, total: int, enabled: bool, desc: str):
        self.total, self.enabled, self.desc, self.done = total, enabled, desc, 0
        self.bar = None
        if enabled:
            try:
                from tqdm.auto import tqdm
            except ImportError:
                pass
            else:
                self.bar = tqdm(total=total, desc=desc, unit="step", file=sys.stderr,
                                dynamic_ncols=True)

    def start(self, what: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.set_postfix_str(what, refresh=True)
        else:
            line = f"{self.desc} [{self.done + 1}/{self.total}] {what}"
            if sys.stderr.isatty():
                sys.stderr.write("\r" + line + "\033[K")      # redraw the same line
            else:
                sys.stderr.write(line + "\n")
            sys.stderr.flush()

    def advance(self) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.enabled and sys.stderr.isatty():
            sys.stderr.write("\n")
            sys.stderr.flush()


def run_benchmarks(grid: Optional[Sequence[Case]] = None, threads: Optional[int] = None,
                   *, backward: bool = False, use_torch: bool = True,
                   use_numpy: bool = True, ceilings: Optional[dict] = None,
                   max_rounds: int = FULL_SETTINGS["max_rounds"],
                   min_rounds: int = FULL_SETTINGS["min_rounds"],
                   time_budget: float = FULL_SETTINGS["time_budget"],
                   min_sample_time: float = FULL_SETTINGS["min_sample_time"],
                   progress: bool = False, seed: int = 0, read_probe: bool = False,
                   peers: Optional[Sequence[str]] = None,
                   _progress: Optional[_Progress] = None) -> List[dict]:
    """Time fastattn, the NumPy baseline and PyTorch over ``grid``.

    Parameters
    ----------
    grid : sequence of Case, optional
        Default :data:`GRID`. With ``backward=True``, decode cases are left out.
    threads : int, optional
        Threads for every contender; default :func:`default_threads`.
    backward : bool
        Time forward + backward (``attention(..., return_lse=True)`` then
        ``attention_backward``; PyTorch autograd through SDPA).
    use_torch : bool
        Include PyTorch when it is installed.
    use_numpy : bool
        Include the NumPy baseline (the slowest call of a round: leaving it out makes
        the rounds short, so that fastattn and what it is compared with run closer in
        time).
    ceilings : dict, optional
        From :func:`measure_ceilings`; gives each row its ``pct_of_ceiling``.
    max_rounds, min_rounds : int
        Bounds on the interleaved rounds per case.
    time_budget : float
        Seconds per case the rounds aim at (between the two bounds).
    min_sample_time : float
        A short call is repeated within a sample until the sample lasts this long.
    progress : bool
        Show a progress bar on stderr.
    seed : int
        Seed of the random inputs.
    read_probe : bool
        Time the bandwidth probe (:func:`fastattn.cli.bench.ceilings.read_probe`) in
        the rounds of each decode case: ``pct_of_bandwidth_same_rounds`` (per-round
        percentages, their median/min/max) and ``pct_of_ceiling`` from it.
    peers : sequence of str, optional
        Time these peers too (names of :data:`~fastattn.cli.bench.peers.PEERS`; an
        empty sequence: none), and then every contender in a worker process of its
        own, one sample at a time (:class:`~fastattn.cli.bench.peers.WorkerPool`).
        None (the default): every contender in this process.

    Returns
    -------
    list of dict
        One row per case: the shape and its variants, ``flops``, ``kv_bytes``,
        ``rounds``, ``times_ms`` (per contender: median/min/max/samples in ms,
        ``gflops``, ``gbs``; ``counterpart`` for fastattn on
        :meth:`Case.counterpart`), ``ratios`` (``numpy``/``torch``:
        median/min/max/per_round of other time / fastattn time, or None), ``gflops``,
        ``gbs``, ``pct_of_ceiling``, ``max_abs_diff_vs_numpy``,
        ``max_abs_diff_fastattn_vs_torch``, ``max_abs_fastattn`` (the largest
        magnitude in fastattn's result: the scale of those differences), ``torch_runs``
        (what PyTorch ran),
        ``counterpart`` (None, or its ``label``, ``id``, ``speedup`` = counterpart
        time / variant time and ``cost`` = its inverse, median/min/max of per-round
        values), ``pct_of_bandwidth_same_rounds`` (None, or as above) and ``skipped``
        (contender -> reason). With ``peers``, also ``isolation`` (``"process"``),
        ``peers`` (peer -> ``status``, ``reason``, ``max_abs_diff``, ``tolerance``,
        ``runs``, ``ratio``: median/min/max/per_round of peer time / fastattn time, or
        None), ``fastest_peer`` (None, or ``name``, ``median_ms``, ``ratio``) and
        ``max_abs_diff_vs_float64`` (contender -> its largest difference from the
        float64 reference on the sampled rows); ``times_ms`` holds the timed peers.
    """
    grid = list(_grid.GRID if grid is None else grid)
    if backward:
        grid = [c for c in grid if not c.decode]
    threads = default_threads() if threads is None else threads
    threads = check_threads(threads)
    torch_module = _import_torch() if use_torch else None
    bar = _progress or _Progress(len(grid), progress, "fastattn bench")
    rows = []
    decode = read_probe and any(c.decode for c in grid)
    probe = _ceilings.read_probe() if decode and peers is None else None
    pool = None
    if peers is not None:
        pool = _peers.WorkerPool(threads, list(peers), read_probe=read_probe,
                                 probe_bytes=_ceilings._bandwidth_bytes() if decode
                                 else None)
    try:
        with thread_limits(threads, torch_module):
            for case in grid:
                bar.start(case.label)
                row = _bench_case(
                    case, threads, backward=backward, torch_module=torch_module,
                    seed=seed, max_rounds=max_rounds, min_rounds=min_rounds,
                    time_budget=time_budget, min_sample_time=min_sample_time,
                    ceilings=ceilings, use_numpy=use_numpy, read_probe=probe,
                    pool=pool)
                if pool is not None:
                    row["isolation"] = "process"
                rows.append(row)
                bar.advance()
    finally:
        del probe
        if pool is not None:
            pool.close()
        if _progress is None:
            bar.close()
    if not use_torch:
        for row in rows:
            row["skipped"]["torch"] = "left out (--no-torch)"
    return rows


def geometric_means(rows: Sequence[dict]) -> Dict[str, Optional[dict]]:
    """Geometric mean of the median speed-ups vs each of numpy and torch; with peers
    (rows with a ``peers`` entry), also vs each row's fastest peer
    (``"fastest_peer"``) and vs each peer (:func:`~fastattn.cli.bench.peers.
    peer_geomeans`)."""
    out: Dict[str, Optional[dict]] = {}
    for other in ("numpy", "torch"):
        vals = [r["ratios"][other]["median"] for r in rows if r["ratios"].get(other)]
        vals = [x for x in vals if x > 0 and math.isfinite(x)]
        out[other] = ({"geomean": float(math.exp(sum(map(math.log, vals)) / len(vals))),
                       "shapes": len(vals)} if vals else None)
    if any("peers" in r for r in rows):
        out.update(_peers.peer_geomeans(rows))
    return out


def benchmark_report(grid: Optional[Sequence[Case]] = None,
                     threads: Optional[int] = None, *, backward: bool = False,
                     use_torch: bool = True, use_numpy: bool = True,
                     measure: bool = True, overhead: bool = True,
                     torch_op: bool = False, progress: bool = False, seed: int = 0,
                     serving: Sequence[_serving.ServingCase] = (),
                     peers: Optional[Sequence[str]] = None,
                     **settings) -> dict:
    """A whole run: machine info, ceilings, per-case rows and geometric means.

    Parameters
    ----------
    grid, threads, backward, use_torch, use_numpy, progress, seed, peers
        As in :func:`run_benchmarks`.
    measure : bool
        Measure the ceilings (:func:`measure_ceilings`) in the same run, before and
        after the cases; the best of both is kept (a busy moment lowers one of them).
        Also times the read probe in the rounds of each decode case (``read_probe``
        of :func:`run_benchmarks`): a decode row's ``pct_of_ceiling`` comes from it.
    overhead : bool
        Measure the per-call overhead of a tiny call at the run's thread count
        (:func:`measure_overhead`), after the cases.
    torch_op : bool
        Also time the PyTorch operator (``fastattn.torch``) beside the NumPy API and
        PyTorch's SDPA, on :data:`~fastattn.cli.bench.torch_op.TORCH_OP_CASE` and the
        cases of ``grid`` it takes (:func:`~fastattn.cli.bench.measure_torch_op`),
        after the cases; needs PyTorch (``use_torch``).
    serving : sequence of ServingCase
        Serving rows to time after the cases
        (:func:`~fastattn.cli.bench.serving.run_serving`: paged and quantized caches;
        ``fastattn bench`` passes :data:`~fastattn.cli.bench.serving.SERVING_GRID`);
        none by default. Inference only: refused with ``backward``.
    **settings
        ``max_rounds``, ``min_rounds``, ``time_budget``, ``min_sample_time`` for
        :func:`run_benchmarks`.

    Returns
    -------
    dict
        JSON-ready: ``fastattn_version``, ``created``, ``mode``, ``threads``,
        ``threads_applied``, ``settings``, ``conventions``, ``machine``, ``ceilings``,
        ``results``, ``geomean``, ``overhead`` (None when not measured),
        ``torch_op`` (None, or ``{"threads", "mode", "rows"}``), ``serving`` (None,
        or the rows of :func:`~fastattn.cli.bench.serving.run_serving`) and ``timing``
        (how the attention rows were timed: ``isolation``, ``"process"`` with peers
        else ``"none"``, ``peers``, ``rounds`` (the fewest and most of a row) and
        ``text``, in words).
    """
    threads = default_threads() if threads is None else threads
    threads = check_threads(threads)
    grid = list(_grid.GRID if grid is None else grid)
    serving = list(serving)
    if serving and backward:
        raise ValueError("the serving rows are inference only: no backward")
    n_cases = len([c for c in grid if not (backward and c.decode)])
    torch_module = _import_torch() if use_torch else None
    if torch_op and torch_module is None:
        raise ValueError("torch_op needs PyTorch (installed, and use_torch=True)")
    op_cases = _torch_op.torch_op_cases(grid) if torch_op else []
    if backward:
        op_cases = [c for c in op_cases if not c.decode]
    bar = _Progress(n_cases + (2 if measure else 0) + (1 if overhead else 0)
                    + len(op_cases) + len(serving), progress, "fastattn bench")
    tiny = op_rows = serving_rows = None
    try:
        with thread_limits(threads, torch_module) as applied:
            ceilings = None
            if measure:
                bar.start("machine ceilings (sgemm, dgemm, bandwidth)")
                before = _ceilings.measure_ceilings(threads, torch_module=torch_module)
                bar.advance()
            rows = run_benchmarks(grid, threads, backward=backward,
                                  use_torch=use_torch, use_numpy=use_numpy,
                                  seed=seed, read_probe=measure, peers=peers,
                                  _progress=bar, **settings)
            if serving:
                serving_rows = _serving.run_serving(
                    serving, threads, torch_module=torch_module, use_numpy=use_numpy,
                    use_torch=use_torch, seed=seed, read_probe=measure, _progress=bar,
                    **settings)
            if measure:
                bar.start("machine ceilings again")
                ceilings = _ceilings._best_ceilings(
                    before, _ceilings.measure_ceilings(threads,
                                                       torch_module=torch_module))
                bar.advance()
                for row in rows:
                    row.update(_peak(row, ceilings))
                for row in serving_rows or ():
                    row.update(_serving.serving_peak(row, ceilings))
            if overhead:
                bar.start(f"per-call overhead {_overhead.OVERHEAD_CASE.label}")
                tiny = _overhead.measure_overhead(threads, torch_module=torch_module,
                                                  seed=seed)
                bar.advance()
            if torch_op:
                op_rows = _torch_op.measure_torch_op(
                    op_cases, threads, torch_module=torch_module, backward=backward,
                    seed=seed, _progress=bar, **settings)
    finally:
        bar.close()
    return {
        **report_head(backward, threads, settings, seed),
        "threads_applied": applied,
        "conventions": {
            "speedup": "median over rounds of (other time / fastattn time); > 1 means "
                       "fastattn is faster",
            "flops": "2*H*pairs*(E+Ev), pairs = query-key pairs allowed by the "
                     "causal rule and the window, over the real rows of each batch "
                     "entry; forward+backward counts 3.5x forward",
            "decode_bandwidth": "bytes of K and V (each kv head once) / time",
            "pct_of_ceiling": "fastattn GFLOP/s / sgemm (dgemm for float64, "
                              "PyTorch's bf16 matmul for bfloat16 where it is faster "
                              "than the sgemm) GFLOP/s; for "
                              "decode, the median over rounds of fastattn GB/s / the "
                              "read probe's GB/s in the same round (the run's best "
                              "read bandwidth when the probe did not run); in percent",
            "serving_bytes": "serving decode rows: the bytes of the cache read, each kv "
                             "head once: codes or bfloat16 values of K and V, and for "
                             "a quantized cache its float32 scales (4 bytes per token "
                             "and head, each of K and V)"},
        "machine": _ceilings._machine_info(torch_module),
        "ceilings": ceilings,
        "results": rows,
        "geomean": geometric_means(rows),
        "overhead": tiny,
        "torch_op": None if op_rows is None else {
            "threads": threads, "mode": "forward+backward" if backward else "forward",
            "rows": op_rows},
        "serving": serving_rows,
        "timing": _timing(rows, peers),
    }


def _timing(rows: Sequence[dict], peers: Optional[Sequence[str]]) -> dict:
    """How the attention rows were timed, for the report."""
    counts = [r["rounds"] for r in rows if r["rounds"]]
    lo, hi = (min(counts), max(counts)) if counts else (0, 0)
    rounds = f"{lo}" if lo == hi else f"{lo}-{hi}"
    if peers is None:
        text = (f"every contender in this process, interleaved in rotating order, "
                f"{rounds} rounds")
    else:
        text = (f"each contender in its own process (spawned workers), alternating "
                f"one sample at a time in rotating order, {rounds} rounds")
    return {"isolation": "none" if peers is None else "process",
            "peers": None if peers is None else list(peers), "rounds": [lo, hi],
            "text": text}
