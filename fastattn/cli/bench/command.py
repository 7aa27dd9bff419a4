"""The ``fastattn bench`` command: its options (:func:`add_arguments`) and :func:`run`."""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from typing import List, Optional, Sequence

import fastattn
from .. import _shown, int_in_range, writable_path
from . import grid as _grid
from . import peers as _peers
from . import runner as _runner
from . import scaling as _scaling
from . import serving as _serving
from .contenders import _import_torch
from .grid import Case
from .report import format_report, plot_report, write_json
from .threads import max_threads

__all__ = ["add_arguments", "run"]


#: The most rounds ``--rounds`` may ask for, and the longest ``--time-budget`` (an
#: hour per shape): beyond them a run would not end in any useful time.
MAX_ROUNDS = 1000
MAX_TIME_BUDGET = 3600.0

#: What ``--plot`` may write (matplotlib's Agg, PDF and SVG backends need nothing more).
PLOT_SUFFIXES = (".png", ".svg", ".pdf")


def _time_budget(text: str) -> float:
    expected = f"a number of seconds > 0 and <= {MAX_TIME_BUDGET:g}"
    try:
        x = float(text)
    except ValueError:
        x = float("nan")
    if not 0 < x <= MAX_TIME_BUDGET:            # also refuses nan and inf
        raise argparse.ArgumentTypeError(f"expected {expected}, got {_shown(text)}")
    return x


def _thread_counts(text: str) -> List[int]:
    """``"2"`` -> [2]; ``"1,2,4"`` -> [1, 2, 4] (sorted, duplicates dropped); each
    count from 1 to :func:`~fastattn.cli.bench.threads.max_threads`."""
    cap = max_threads()
    one = int_in_range(1, cap)
    try:
        counts = [one(part.strip()) for part in text.split(",")]
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"expected thread counts separated by commas, each an integer from 1 to "
            f"{cap}; got {_shown(text)}") from None
    return sorted(set(counts))


def _peer_names(text: str) -> List[str]:
    """``"jax,openvino"`` -> ["openvino", "jax"]: names of
    :data:`~fastattn.cli.bench.peers.PEERS`, separated by commas, in their order,
    duplicates dropped."""
    names = [part.strip() for part in text.split(",")]
    unknown = [n for n in names if n not in _peers.PEERS]
    if unknown or not text.strip():
        raise argparse.ArgumentTypeError(
            f"expected peer names separated by commas, from "
            f"{', '.join(_peers.PEERS)}; got {_shown(text)}")
    return [p for p in _peers.PEERS if p in names]


def _known_texts() -> List[str]:
    """The labels and ids of every case of the grids, in every dtype, and of every
    serving row."""
    texts = []
    for case in list(_grid.GRID) + list(_grid.QUICK_GRID):
        for dtype in _grid.DTYPES:
            c = replace(case, dtype=dtype)
            texts += [c.label, c.id]
    for row in list(_serving.SERVING_GRID) + list(_serving.QUICK_SERVING_GRID):
        texts += [row.label, row.id]
    return texts


def _shape_text(text: str) -> str:
    """A ``--only`` text: not blank, and part of the label or id of some case of the
    grids (in some dtype); whether it is in the selected grid is checked by
    :func:`run`."""
    if not text.strip():
        raise argparse.ArgumentTypeError(
            f"expected part of a shape's label or id (see fastattn bench --list), got "
            f"{_shown(text)}")
    if not any(text in t for t in _known_texts()):
        raise argparse.ArgumentTypeError(
            f"no shape of the grid has {_shown(text)} in its label or id (see "
            f"fastattn bench --list)")
    return text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the options of ``fastattn bench`` to ``parser``."""
    parser.description = (
        "Time fastattn.attention against the NumPy baseline (fastattn.reference) and, "
        "when installed, PyTorch's scaled_dot_product_attention: same threads, same "
        "arrays, interleaved rounds, median of per-round speed-ups. Also measures the "
        "machine's sgemm GFLOP/s and memory read bandwidth in the same run. After the "
        "attention shapes, the serving rows (ids starting with 'serve-'): decoding and "
        "chunked prefill over paged and quantized (int8, float8) key-value caches, "
        "beside the contiguous call and what a caller writes today (gather and "
        "dequantize, then attend); inference only, left out by --backward, --dtype and "
        "several --threads counts.")
    parser.add_argument("--quick", action="store_true",
                        help="a smaller grid and fewer rounds (under a minute)")
    parser.add_argument("--dtype", choices=_grid.DTYPES, default=None,
                        help="run every selected shape in this dtype (PyTorch too); "
                             "bfloat16 needs ml_dtypes; the serving rows, whose dtype "
                             "is their cache's, are left out")
    parser.add_argument("--threads", type=_thread_counts, default=None,
                        metavar="N[,N...]",
                        help="threads for fastattn, PyTorch and NumPy's BLAS "
                             "(default: fastattn.get_num_threads()); several counts, "
                             "e.g. 1,2,4,8,16, give a scaling table per shape instead "
                             "(fastattn and PyTorch at each count; counts above the "
                             "usable cores run, marked oversubscribed; at most "
                             f"{max_threads()})")
    parser.add_argument("--backward", action="store_true",
                        help="time forward + backward (attention with return_lse, then "
                             "attention_backward) instead of forward only")
    parser.add_argument("--json", metavar="PATH", default=None, type=writable_path(),
                        help="save every result (machine, ceilings, times, ratios) as "
                             "JSON (missing folders are created)")
    parser.add_argument("--plot", metavar="PATH", default=None,
                        type=writable_path(PLOT_SUFFIXES),
                        help="write a PNG of the speed-ups (SVG or PDF for a name "
                             "ending in .svg or .pdf; needs matplotlib)")
    parser.add_argument("--only", metavar="TEXT", action="append", default=None,
                        type=_shape_text,
                        help="run only the shapes whose label or id contains TEXT "
                             "(repeatable; see --list; 'serve-' selects the serving "
                             "rows)")
    parser.add_argument("--rounds", type=int_in_range(1, MAX_ROUNDS), default=None,
                        metavar="N",
                        help="at most N interleaved rounds per shape, N from 1 to "
                             f"{MAX_ROUNDS} (default: 11, --quick: 5)")
    parser.add_argument("--time-budget", type=_time_budget, default=None,
                        metavar="SECONDS",
                        help="seconds per shape that the rounds aim at, at most "
                             f"{MAX_TIME_BUDGET:g} (default: 6, --quick: 1.5); slow "
                             "shapes still run at least 3 rounds")
    parser.add_argument("--no-torch", action="store_true",
                        help="leave PyTorch out even when it is installed")
    parser.add_argument("--no-numpy", action="store_true",
                        help="leave the NumPy baseline out (the slowest call of a "
                             "round: shorter rounds keep fastattn and what it is "
                             "compared with closer in time)")
    parser.add_argument("--no-ceilings", action="store_true",
                        help="skip measuring sgemm and bandwidth (no %% peak column)")
    parser.add_argument("--no-overhead", action="store_true",
                        help="skip the per-call overhead row (a (1,1,16,16,64) call "
                             "beside PyTorch and a numpy.empty + numpy.asarray floor)")
    parser.add_argument("--peers", type=_peer_names, default=None,
                        metavar="NAME[,NAME]",
                        help="also time other runtimes' attention operators on the "
                             "same arrays in the same dtype: "
                             f"{', '.join(_peers.PEERS)} (each where installed: "
                             f"{_peers.INSTALL_HINT}); each is checked against the "
                             "float64 reference before it is timed, and then every "
                             "contender runs in a worker process of its own, one "
                             "sample at a time; adds a fastest-peer column and its "
                             "geometric mean")
    parser.add_argument("--torch-op", action="store_true",
                        help="also time the PyTorch operator "
                             "(fastattn.torch.scaled_dot_product_attention, tensors in, "
                             "a tensor out) beside PyTorch's SDPA and the NumPy API, "
                             "on (1,8,128,128,64) and the selected shapes: its "
                             "overhead over the NumPy API (needs PyTorch)")
    parser.add_argument("--no-progress", action="store_true",
                        help="no progress bar")
    parser.add_argument("--list", action="store_true",
                        help="print the grid and exit")


def _have_ml_dtypes() -> bool:
    try:
        import ml_dtypes  # noqa: F401
    except ImportError:
        return False
    return True


def _select(grid: Sequence, only: Optional[Sequence[str]]) -> list:
    """The cases (attention or serving) whose label or id contains a text of
    ``only``; every case without ``only``."""
    if not only:
        return list(grid)
    return [c for c in grid if any(t in c.label or t in c.id for t in only)]


def _serving_left_out(args: argparse.Namespace) -> Optional[str]:
    """Why the serving rows cannot run with these options, or None."""
    if args.backward:
        return "--backward"
    if args.dtype is not None:
        return "--dtype"
    if args.threads and len(args.threads) > 1:
        return "thread scaling (several --threads counts)"
    if not _have_ml_dtypes():
        return "the lack of ml_dtypes (their queries are bfloat16)"
    return None


def run(args: argparse.Namespace) -> int:
    """Run ``fastattn bench`` with parsed ``args``; returns the exit status."""
    grid = _select(_grid.QUICK_GRID if args.quick else _grid.GRID, args.only)
    serving = _select(_serving.QUICK_SERVING_GRID if args.quick
                      else _serving.SERVING_GRID, args.only)
    serving_out = _serving_left_out(args) if serving else None
    if serving_out is not None:
        print(f"fastattn bench: the serving rows (paged and quantized caches: inference, "
              f"bfloat16 queries, their own cache dtypes) are left out by "
              f"{serving_out}", file=sys.stderr)
        if not grid:
            print(f"fastattn bench: error: {serving_out} leaves out the serving rows "
                  f"and no other shape is selected", file=sys.stderr)
            return 2
        serving = []
    if args.dtype is not None:
        grid = _grid.with_dtype(grid, args.dtype)
    if any(c.dtype == "bfloat16" for c in grid) and not _have_ml_dtypes():
        if args.dtype == "bfloat16":
            print("fastattn bench: error: --dtype bfloat16 needs ml_dtypes "
                  "(pip install \"fastattn[bf16]\")", file=sys.stderr)
            return 2
        print("fastattn bench: ml_dtypes is not installed; the bfloat16 shapes are "
              "skipped", file=sys.stderr)
        grid = [c for c in grid if c.dtype != "bfloat16"]
    if args.list:
        for c in list(grid) + list(serving):
            print(f"{c.id:40s} {c.label}")
        return 0
    if not grid and not serving:
        print(f"fastattn bench: error: no shape matches --only {args.only}; "
              f"see fastattn bench --list", file=sys.stderr)
        return 2
    if args.backward and grid and all(c.decode for c in grid):
        print("fastattn bench: error: --backward leaves out decode shapes and no other "
              "shape is selected", file=sys.stderr)
        return 2
    counts = args.threads or []
    scaling = len(counts) > 1
    if args.plot and scaling:
        print("fastattn bench: error: --plot draws a one-count run; give --threads a "
              "single count", file=sys.stderr)
        return 2
    if args.peers is not None and scaling:
        print("fastattn bench: error: --peers times one thread count; give --threads a "
              "single count", file=sys.stderr)
        return 2
    if args.torch_op and (scaling or args.no_torch):
        print("fastattn bench: error: --torch-op times one thread count with PyTorch; "
              "give --threads a single count and leave out --no-torch",
              file=sys.stderr)
        return 2
    if args.torch_op and _import_torch() is None:
        print("fastattn bench: error: --torch-op needs PyTorch (pip install torch)",
              file=sys.stderr)
        return 2
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print("fastattn bench: error: --plot needs matplotlib "
                  "(pip install matplotlib)", file=sys.stderr)
            return 2
    settings = dict(_runner.QUICK_SETTINGS if args.quick else _runner.FULL_SETTINGS)
    if args.rounds is not None:
        settings["max_rounds"] = args.rounds
        settings["min_rounds"] = min(settings["min_rounds"], args.rounds)
    if args.time_budget is not None:
        settings["time_budget"] = args.time_budget
    if not args.no_torch and _import_torch() is None:
        print("fastattn bench: PyTorch is not installed; its column is skipped",
              file=sys.stderr)
    for peer in args.peers or ():
        if not _peers.installed(peer):
            print(f"fastattn bench: {_peers.not_installed(peer)}", file=sys.stderr)
    if args.backward and getattr(fastattn, "attention_backward", None) is None:
        print("fastattn bench: fastattn.attention_backward is not available in this "
              "build; timing the NumPy baseline and PyTorch only", file=sys.stderr)
    if getattr(fastattn, "attention", None) is None:
        print("fastattn bench: fastattn.attention is not available in this build; "
              "timing the NumPy baseline and PyTorch only", file=sys.stderr)

    common = dict(backward=args.backward, use_torch=not args.no_torch,
                  measure=not args.no_ceilings, overhead=not args.no_overhead,
                  progress=not args.no_progress, **settings)
    if scaling:        # the NumPy baseline is not part of a scaling table
        report = _scaling.scaling_report(grid, counts, **common)
    else:
        report = _runner.benchmark_report(grid, counts[0] if counts else None,
                                          use_numpy=not args.no_numpy,
                                          torch_op=args.torch_op, serving=serving,
                                          peers=args.peers, **common)
    print(format_report(report))
    if args.json:
        write_json(report, args.json)
        print(f"results saved to {args.json}")
    if args.plot:
        plot_report(report, args.plot)
        print(f"plot saved to {args.plot}")
    return 0
