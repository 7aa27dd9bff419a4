"""``fastattn bench``: time fastattn against the NumPy baseline and PyTorch.

The instrument runs every contender in the same process, with the same number of
threads, on the same arrays, in interleaved rounds (A B C, B C A, C A B, ...: the order
rotates so that no contender always follows the same other). A speed-up is the
ratio ``time of the other / time of fastattn`` taken *per round*; the table reports the
median of those ratios with their min and max, because on a shared machine only ratios
measured side by side mean anything. The same run also measures the machine's
ceilings: sgemm (and dgemm) GFLOP/s of a 2048 x 2048 NumPy matmul and the memory read
bandwidth of a matrix-vector product over a buffer much larger than the L3 cache.

Counting conventions
--------------------
- Forward work is ``2 * B * H * Lq * Lk * (E + Ev)`` flops, i.e. ``4 * B * H * Lq * Lk * E``
  when ``Ev == E``. Under a causal mask only the query-key pairs that may attend are
  counted (``Lq * (Lq + 1) / 2`` of ``Lq * Lk`` for a square causal mask: about half).
- With ``--backward`` the timed work is forward + backward, counted as
  ``(1 + 2.5) x`` the forward flops: the backward pass does five matrix products where
  the forward does two (the FlashAttention-2 convention).
- Decode shapes (one query row) are bound by memory, not arithmetic: their throughput is
  reported as the bytes of K and V read (each key/value head once, also under GQA)
  divided by the time, and compared with the run's measured read bandwidth.
- "% peak" is fastattn's GFLOP/s as a share of the run's sgemm GFLOP/s (dgemm for
  float64 shapes), or its bandwidth as a share of the measured read bandwidth for decode.

Heavy optional packages (torch, matplotlib, tqdm, threadpoolctl) are imported lazily,
inside the functions that need them.

Examples
--------
From the command line::

    fastattn bench --quick
    fastattn bench --threads 2 --json bench.json --plot bench.png
    fastattn bench --backward --only 2048

From Python:

>>> from fastattn import bench
>>> [c.label for c in bench.QUICK_GRID][:2]
['(1,8,512,512,64)', '(4,8,256,256,64)']
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import sys
import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Union

import numpy as np

import fastattn
from . import _validation as _v
from . import reference
from .cli import positive_int

__all__ = ["Case", "GRID", "QUICK_GRID", "CONTENDERS", "Unavailable", "add_arguments",
           "run", "run_benchmarks", "benchmark_report", "geometric_means",
           "measure_ceilings", "thread_limits", "make_inputs", "make_callable",
           "format_report", "write_json", "plot_report", "default_threads"]

#: The contenders, in the order they run within a round.
CONTENDERS = ("fastattn", "numpy", "torch")

#: Backward work counted as this multiple of the forward flops (FlashAttention-2).
BACKWARD_FLOP_FACTOR = 2.5

#: Size of the square matmul that measures the sgemm/dgemm ceiling.
GEMM_N = 2048

#: Bytes read by the bandwidth probe; ``None`` picks 8x the L3 cache (256 MiB to 2 GiB).
BANDWIDTH_BYTES: Optional[int] = None

#: Timing settings of a full run and of ``--quick``.
FULL_SETTINGS = dict(max_rounds=11, min_rounds=3, time_budget=6.0, min_sample_time=0.02)
QUICK_SETTINGS = dict(max_rounds=5, min_rounds=3, time_budget=1.5, min_sample_time=0.01)

# A pause before each timed sample, so that the worker threads of the library that ran
# before (OpenBLAS, PyTorch's and fastattn's OpenMP pools) have stopped spinning and
# gone to sleep: on a machine with few cores, threads still spinning from one
# contender slow down the next one. The order of the contenders also rotates from
# round to round, so that none always follows the same other.
_SETTLE_S = 0.05


# ------------------------------------------------------------------------------ grid

@dataclass(frozen=True)
class Case:
    """One benchmark shape: q (B, H, Lq, E) against k (B, Hkv, Lk, E), v (B, Hkv, Lk, Ev).

    Parameters
    ----------
    B, H, Lq, Lk, E : int
        Batch, query heads, query length, key length and head dimension.
    Hkv : int, optional
        Key/value heads; ``None`` means ``H``. Fewer than ``H`` is grouped-query
        attention (``enable_gqa=True``).
    Ev : int, optional
        Value head dimension; ``None`` means ``E``.
    dtype : str
        ``"float32"`` or ``"float64"``.
    causal : bool or str
        As in :func:`fastattn.attention`.
    quick : bool
        Whether the case belongs to the ``--quick`` grid.
    """

    B: int
    H: int
    Lq: int
    Lk: int
    E: int
    Hkv: Optional[int] = None
    Ev: Optional[int] = None
    dtype: str = "float32"
    causal: Union[bool, str] = False
    quick: bool = False

    @property
    def kv_heads(self) -> int:
        return self.H if self.Hkv is None else self.Hkv

    @property
    def ev(self) -> int:
        return self.E if self.Ev is None else self.Ev

    @property
    def gqa(self) -> bool:
        return self.kv_heads != self.H

    @property
    def decode(self) -> bool:
        """One query row against a key/value cache: a memory-bound shape."""
        return self.Lq == 1

    @property
    def causal_kind(self) -> Optional[str]:
        return _v.parse_causal(self.causal)

    @property
    def label(self) -> str:
        """A short human label, e.g. ``"(1,8,2048,2048,64) causal"``."""
        heads = f"{self.H}:{self.kv_heads}" if self.gqa else f"{self.H}"
        dims = f"{self.E}" if self.Ev is None else f"{self.E}/{self.ev}"
        text = f"({self.B},{heads},{self.Lq},{self.Lk},{dims})"
        tags = []
        if self.decode:
            tags.append("decode")
        if self.gqa:
            tags.append("gqa")
        kind = self.causal_kind
        if kind == "top_left":
            tags.append("causal")
        elif kind == "bottom_right":
            tags.append("causal=bottom_right")
        if self.dtype != "float32":
            tags.append(self.dtype)
        return " ".join([text] + tags)

    @property
    def id(self) -> str:
        """An identifier without spaces, for pytest ids and ``--only``."""
        heads = f"{self.H}h{self.kv_heads}" if self.gqa else f"{self.H}"
        parts = [f"{self.B}x{heads}x{self.Lq}x{self.Lk}x{self.E}", self.dtype]
        if self.Ev is not None:
            parts.insert(1, f"ev{self.ev}")
        kind = self.causal_kind
        if kind:
            parts.append("causal" if kind == "top_left" else "causal_br")
        if self.decode:
            parts.append("decode")
        return "-".join(parts)

    def allowed_pairs(self) -> int:
        """Query-key pairs that may attend, per (batch, head)."""
        kind = self.causal_kind
        if kind is None:
            return self.Lq * self.Lk
        offset = self.Lk - self.Lq if kind == "bottom_right" else 0
        i = np.arange(self.Lq, dtype=np.int64)
        return int(np.clip(i + 1 + offset, 0, self.Lk).sum())

    def flops(self, backward: bool = False) -> float:
        """Floating-point operations of one call (see the module notes)."""
        f = 2.0 * self.B * self.H * self.allowed_pairs() * (self.E + self.ev)
        return f * (1.0 + BACKWARD_FLOP_FACTOR) if backward else f

    def kv_bytes(self) -> int:
        """Bytes of K and V, each key/value head counted once."""
        item = np.dtype(self.dtype).itemsize
        return self.B * self.kv_heads * self.Lk * (self.E + self.ev) * item


#: The full grid: used by ``fastattn bench`` and by ``benchmarks/``.
GRID: List[Case] = [
    Case(1, 8, 512, 512, 64, quick=True),
    Case(1, 8, 2048, 2048, 64),
    Case(1, 12, 1024, 1024, 64),
    Case(4, 8, 256, 256, 64, quick=True),
    Case(16, 12, 128, 128, 64, quick=True),
    Case(1, 8, 4096, 4096, 128),
    Case(1, 8, 2048, 2048, 64, causal=True, quick=True),
    Case(1, 32, 1, 4096, 128, quick=True),
    Case(1, 32, 1, 4096, 128, Hkv=8, causal="bottom_right", quick=True),
    Case(1, 8, 1024, 1024, 64, dtype="float64", quick=True),
]

#: The ``--quick`` subset of :data:`GRID`.
QUICK_GRID: List[Case] = [c for c in GRID if c.quick]


# --------------------------------------------------------------------------- threads

def default_threads() -> int:
    """``fastattn.get_num_threads()``, or the usable cores where it is not available."""
    getter = getattr(fastattn, "get_num_threads", None)
    if getter is not None:
        return int(getter())
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _import_torch():
    """torch, or None when it is not installed (or does not load)."""
    try:
        import torch
        import torch.nn.functional  # noqa: F401
    except Exception:                                   # noqa: BLE001 - any failure
        return None
    return torch


@contextmanager
def thread_limits(threads: int, torch_module=None) -> Iterator[Dict[str, bool]]:
    """Run PyTorch and NumPy's BLAS with ``threads`` threads, then restore.

    fastattn needs no setting (its process-wide default is left alone): every call the
    benchmark times passes ``num_threads=threads``.

    Parameters
    ----------
    threads : int
        The thread count, >= 1.
    torch_module : module, optional
        The imported ``torch``; its intra-op thread count is set when given.

    Yields
    ------
    dict
        Which libraries were limited: ``{"fastattn": bool, "torch": bool, "blas": bool}``
        (``blas`` is False when threadpoolctl is not installed).
    """
    threads = _v.check_num_threads(threads, "threads")
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


# -------------------------------------------------------------------------- ceilings

def _l3_bytes() -> Optional[int]:
    """The L3 cache size from sysfs (Linux), or None."""
    base = "/sys/devices/system/cpu/cpu0/cache"
    try:
        entries = os.listdir(base)
    except OSError:
        return None
    for entry in sorted(entries):
        try:
            with open(os.path.join(base, entry, "level")) as f:
                if f.read().strip() != "3":
                    continue
            with open(os.path.join(base, entry, "size")) as f:
                text = f.read().strip().upper()
        except OSError:
            continue
        units = {"K": 1024, "M": 1024 ** 2, "G": 1024 ** 3}
        try:
            if text[-1] in units:
                return int(text[:-1]) * units[text[-1]]
            return int(text)
        except (ValueError, IndexError):
            return None
    return None


def _bandwidth_bytes() -> int:
    if BANDWIDTH_BYTES is not None:
        return int(BANDWIDTH_BYTES)
    l3 = _l3_bytes() or 32 * 1024 ** 2
    return int(min(max(8 * l3, 256 * 1024 ** 2), 2 * 1024 ** 3))


def measure_ceilings(threads: Optional[int] = None, *, gemm_n: Optional[int] = None,
                     bandwidth_bytes: Optional[int] = None, repeats: int = 5) -> dict:
    """Measure the machine's compute and memory ceilings with NumPy.

    Parameters
    ----------
    threads : int, optional
        Threads for NumPy's BLAS (through threadpoolctl when it is installed); default
        :func:`default_threads`.
    gemm_n : int, optional
        Size of the square matmuls; default :data:`GEMM_N` (2048).
    bandwidth_bytes : int, optional
        Size of the buffer read by the bandwidth probe; default :data:`BANDWIDTH_BYTES`
        or 8x the L3 cache, at least 256 MiB.
    repeats : int
        Timed repetitions of each probe (after one warm-up); the best is reported.

    Returns
    -------
    dict
        ``sgemm_gflops``, ``dgemm_gflops``, ``bandwidth_gbs`` (best of the repeats),
        their per-repeat samples, ``gemm_n`` and ``bandwidth_bytes``.

    Notes
    -----
    The bandwidth probe is a float32 matrix-vector product (``A @ x``, A of
    ``bandwidth_bytes``): BLAS splits it across threads and it reads every byte of A
    once, as an attention decode step reads K and V once.
    """
    threads = default_threads() if threads is None else threads
    n = GEMM_N if gemm_n is None else int(gemm_n)
    nbytes = _bandwidth_bytes() if bandwidth_bytes is None else int(bandwidth_bytes)
    rng = np.random.default_rng(0)
    result = {"gemm_n": n, "bandwidth_bytes": nbytes, "threads": threads}
    with thread_limits(threads):
        for name, dtype in (("sgemm", np.float32), ("dgemm", np.float64)):
            a = rng.standard_normal((n, n)).astype(dtype)
            b = rng.standard_normal((n, n)).astype(dtype)
            c = np.empty((n, n), dtype)
            samples = _repeat(lambda: np.matmul(a, b, out=c), repeats)
            rates = [2.0 * n ** 3 / t / 1e9 for t in samples]
            result[f"{name}_gflops"] = max(rates)
            result[f"{name}_gflops_samples"] = rates
            del a, b, c
        cols = 1024
        rows = max(1, nbytes // (4 * cols))
        big = np.ones((rows, cols), np.float32)            # written once: pages are real
        x = np.ones(cols, np.float32)
        y = np.empty(rows, np.float32)
        samples = _repeat(lambda: np.matmul(big, x, out=y), repeats)
        rates = [big.nbytes / t / 1e9 for t in samples]
        result["bandwidth_gbs"] = max(rates)
        result["bandwidth_gbs_samples"] = rates
        result["bandwidth_bytes"] = int(big.nbytes)
        del big
    return result


def _best_ceilings(before: dict, after: dict) -> dict:
    """Ceilings measured before and after the cases: the best of both, all samples.

    On a shared machine a single measurement may catch a busy moment; the machine can
    do at least the best that was seen in the run.
    """
    out = dict(after)
    for key in ("sgemm_gflops", "dgemm_gflops", "bandwidth_gbs"):
        out[key] = max(before[key], after[key])
        out[key + "_samples"] = before[key + "_samples"] + after[key + "_samples"]
    out["measured"] = "before and after the cases; best of all samples"
    return out


def _repeat(fn: Callable[[], object], repeats: int) -> List[float]:
    fn()
    samples = []
    for _ in range(max(1, repeats)):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return samples


# ------------------------------------------------------------------------ contenders

class Unavailable(Exception):
    """A contender cannot run here (not installed, not built yet); the message says why."""


def make_inputs(case: Case, seed: int = 0) -> Dict[str, np.ndarray]:
    """Random q, k, v (and grad ``do``) of the case's shapes and dtype, C-contiguous."""
    rng = np.random.default_rng(seed)
    dt = np.dtype(case.dtype)

    def randn(*shape):
        return rng.standard_normal(shape, dtype=np.float64).astype(dt)

    return {"q": randn(case.B, case.H, case.Lq, case.E),
            "k": randn(case.B, case.kv_heads, case.Lk, case.E),
            "v": randn(case.B, case.kv_heads, case.Lk, case.ev),
            "do": randn(case.B, case.H, case.Lq, case.ev)}


def make_callable(case: Case, contender: str, arrays: Dict[str, np.ndarray],
                  threads: int, *, backward: bool = False,
                  torch_module=None) -> Callable[[], object]:
    """A zero-argument function that runs one contender once on ``arrays``.

    Parameters
    ----------
    case : Case
    contender : {"fastattn", "numpy", "torch"}
    arrays : dict
        From :func:`make_inputs`; PyTorch shares their memory (``torch.from_numpy``).
    threads : int
        Passed to fastattn as ``num_threads=``; PyTorch and BLAS threads are set by
        :func:`thread_limits`.
    backward : bool
        Time forward + backward instead of forward only.
    torch_module : module, optional
        The imported ``torch``; needed for the ``"torch"`` contender.

    Returns
    -------
    callable
        Its return value is the output (forward) or ``(dq, dk, dv)`` (backward).

    Raises
    ------
    Unavailable
        When the contender cannot run here (PyTorch not installed, a fastattn function
        not built).
    """
    q, k, v, do = arrays["q"], arrays["k"], arrays["v"], arrays["do"]
    causal = case.causal_kind or False
    gqa = case.gqa
    if contender == "fastattn":
        attention = getattr(fastattn, "attention", None)
        if attention is None:
            raise Unavailable("fastattn.attention is not available in this build")
        if not backward:
            return lambda: attention(q, k, v, causal=causal, enable_gqa=gqa,
                                     num_threads=threads)
        attention_backward = getattr(fastattn, "attention_backward", None)
        if attention_backward is None:
            raise Unavailable("fastattn.attention_backward is not available in this "
                              "build; its column is skipped")

        def fastattn_fwd_bwd():
            out, lse = attention(q, k, v, causal=causal, enable_gqa=gqa,
                                 return_lse=True, num_threads=threads)
            return attention_backward(do, q, k, v, out, lse, causal=causal,
                                      enable_gqa=gqa, num_threads=threads)
        return fastattn_fwd_bwd
    if contender == "numpy":
        if not backward:
            return lambda: reference.attention(q, k, v, causal=causal, enable_gqa=gqa)

        def numpy_fwd_bwd():
            out, lse = reference.attention(q, k, v, causal=causal, enable_gqa=gqa,
                                           return_lse=True)
            return reference.attention_backward(do, q, k, v, out, lse, causal=causal,
                                                enable_gqa=gqa)
        return numpy_fwd_bwd
    if contender == "torch":
        torch = torch_module
        if torch is None:
            raise Unavailable("PyTorch is not installed (pip install torch)")
        return _torch_callable(torch, case, q, k, v, do, backward)
    raise ValueError(f"unknown contender {contender!r}; expected one of {CONTENDERS}")


def _torch_callable(torch, case: Case, q, k, v, do, backward: bool):
    sdpa = torch.nn.functional.scaled_dot_product_attention
    kind = case.causal_kind
    kwargs = {}
    if case.gqa:
        kwargs["enable_gqa"] = True
    if kind == "top_left":
        kwargs["is_causal"] = True
    elif kind == "bottom_right":
        allowed = _v.causal_allowed(kind, case.Lq, case.Lk)
        if not allowed.all():                   # decode (Lq = 1) may attend to every key
            kwargs["attn_mask"] = torch.from_numpy(allowed)
    tq, tk, tv = (torch.from_numpy(a) for a in (q, k, v))
    if not backward:
        def torch_fwd():
            with torch.no_grad():
                return sdpa(tq, tk, tv, **kwargs)
        return torch_fwd
    for t in (tq, tk, tv):
        t.requires_grad_(True)
    tdo = torch.from_numpy(do)

    def torch_fwd_bwd():
        out = sdpa(tq, tk, tv, **kwargs)
        return torch.autograd.grad(out, (tq, tk, tv), tdo)
    return torch_fwd_bwd


def _as_numpy_tuple(result) -> tuple:
    items = result if isinstance(result, (tuple, list)) else (result,)
    out = []
    for x in items:
        if hasattr(x, "detach"):
            x = x.detach().numpy()
        out.append(np.asarray(x))
    return tuple(out)


def _max_abs_diff(result, expected) -> Optional[float]:
    got, want = _as_numpy_tuple(result), _as_numpy_tuple(expected)
    if len(got) != len(want) or any(g.shape != w.shape for g, w in zip(got, want)):
        return None
    diffs = [float(np.max(np.abs(g.astype(np.float64) - w.astype(np.float64))))
             if g.size else 0.0 for g, w in zip(got, want)]
    return max(diffs) if diffs else 0.0


# --------------------------------------------------------------------------- running

def _summary(values: Sequence[float]) -> dict:
    return {"median": float(statistics.median(values)), "min": float(min(values)),
            "max": float(max(values))}


def _time_call(fn: Callable[[], object], number: int) -> float:
    t0 = time.perf_counter()
    for _ in range(number):
        fn()
    return (time.perf_counter() - t0) / number


def _bench_case(case: Case, threads: int, *, backward: bool, torch_module, seed: int,
                max_rounds: int, min_rounds: int, time_budget: float,
                min_sample_time: float, ceilings: Optional[dict]) -> dict:
    arrays = make_inputs(case, seed)
    calls: Dict[str, Callable[[], object]] = {}
    skipped: Dict[str, str] = {}
    for name in CONTENDERS:
        try:
            calls[name] = make_callable(case, name, arrays, threads, backward=backward,
                                        torch_module=torch_module)
        except Unavailable as exc:
            skipped[name] = str(exc)

    # warm-up and calibration: `number` calls per sample so a sample lasts at least
    # min_sample_time; a contender that fails here is skipped with its error
    outputs, numbers, estimate = {}, {}, {}
    for name in list(calls):
        try:
            t0 = time.perf_counter()
            outputs[name] = calls[name]()
            t = time.perf_counter() - t0
            if t < 0.25:                      # the first call pays one-off costs
                t = _time_call(calls[name], 1)
        except Exception as exc:              # noqa: BLE001 - report, do not crash
            skipped[name] = f"failed: {type(exc).__name__}: {exc}"
            del calls[name]
            continue
        numbers[name] = max(1, math.ceil(min_sample_time / max(t, 1e-9)))
        estimate[name] = t * numbers[name]
    round_s = sum(estimate.values()) or 1e-9
    rounds = int(min(max_rounds, max(min_rounds, time_budget // round_s)))
    rounds = max(1, rounds)

    samples: Dict[str, List[float]] = {name: [] for name in calls}
    order = list(calls)
    for r in range(rounds):
        for name in order[r % len(order):] + order[:r % len(order)]:
            if _SETTLE_S:
                time.sleep(_SETTLE_S)
            samples[name].append(_time_call(calls[name], numbers[name]))

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

    diffs = {}
    if "numpy" in outputs:
        for name in ("fastattn", "torch"):
            if name in outputs:
                diffs[name] = _max_abs_diff(outputs[name], outputs["numpy"])

    row = {"label": case.label, "id": case.id, "B": case.B, "H": case.H,
           "Hkv": case.kv_heads, "Lq": case.Lq, "Lk": case.Lk, "E": case.E,
           "Ev": case.ev, "dtype": case.dtype, "causal": case.causal_kind or False,
           "gqa": case.gqa, "decode": case.decode, "backward": backward,
           "flops": flops, "kv_bytes": nbytes, "rounds": rounds, "times_ms": times,
           "ratios": ratios, "max_abs_diff_vs_numpy": diffs, "skipped": skipped}
    row.update(_peak(row, ceilings))
    return row


def _peak(row: dict, ceilings: Optional[dict]) -> dict:
    """fastattn's throughput and its share of the run's ceiling."""
    fa = row["times_ms"].get("fastattn")
    out = {"gflops": None, "gbs": None, "pct_of_ceiling": None, "ceiling": None}
    if fa is None:
        return out
    out["gflops"] = fa["gflops"]
    if row["decode"]:
        out["gbs"] = fa["gbs"]
        out["ceiling"] = "bandwidth"
        if ceilings:
            out["pct_of_ceiling"] = 100.0 * fa["gbs"] / ceilings["bandwidth_gbs"]
    else:
        key = "dgemm" if row["dtype"] == "float64" else "sgemm"
        out["ceiling"] = key
        if ceilings:
            out["pct_of_ceiling"] = 100.0 * fa["gflops"] / ceilings[f"{key}_gflops"]
    return out


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
                   ceilings: Optional[dict] = None,
                   max_rounds: int = FULL_SETTINGS["max_rounds"],
                   min_rounds: int = FULL_SETTINGS["min_rounds"],
                   time_budget: float = FULL_SETTINGS["time_budget"],
                   min_sample_time: float = FULL_SETTINGS["min_sample_time"],
                   progress: bool = False, seed: int = 0,
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

    Returns
    -------
    list of dict
        One row per case: the shape, ``flops``, ``kv_bytes``, ``rounds``, ``times_ms``
        (per contender: median/min/max/samples in ms, ``gflops``, ``gbs``), ``ratios``
        (``numpy``/``torch``: median/min/max/per_round of other time / fastattn time,
        or None), ``gflops``, ``gbs``, ``pct_of_ceiling``, ``max_abs_diff_vs_numpy``
        and ``skipped`` (contender -> reason).
    """
    grid = list(GRID if grid is None else grid)
    if backward:
        grid = [c for c in grid if not c.decode]
    threads = default_threads() if threads is None else threads
    threads = _v.check_num_threads(threads, "threads")
    torch_module = _import_torch() if use_torch else None
    bar = _progress or _Progress(len(grid), progress, "fastattn bench")
    rows = []
    try:
        with thread_limits(threads, torch_module):
            for case in grid:
                bar.start(case.label)
                rows.append(_bench_case(
                    case, threads, backward=backward, torch_module=torch_module,
                    seed=seed, max_rounds=max_rounds, min_rounds=min_rounds,
                    time_budget=time_budget, min_sample_time=min_sample_time,
                    ceilings=ceilings))
                bar.advance()
    finally:
        if _progress is None:
            bar.close()
    if not use_torch:
        for row in rows:
            row["skipped"].setdefault("torch", "left out (--no-torch)")
    return rows


def geometric_means(rows: Sequence[dict]) -> Dict[str, Optional[dict]]:
    """Geometric mean of the median speed-ups vs each of numpy and torch."""
    out: Dict[str, Optional[dict]] = {}
    for other in ("numpy", "torch"):
        vals = [r["ratios"][other]["median"] for r in rows if r["ratios"].get(other)]
        vals = [x for x in vals if x > 0 and math.isfinite(x)]
        out[other] = ({"geomean": float(math.exp(sum(map(math.log, vals)) / len(vals))),
                       "shapes": len(vals)} if vals else None)
    return out


def _machine_info(torch_module) -> dict:
    info = {"platform": platform.platform(), "machine": platform.machine(),
            "processor": _cpu_name(), "cpu_count": os.cpu_count(),
            "usable_cores": (len(os.sched_getaffinity(0))
                             if hasattr(os, "sched_getaffinity") else os.cpu_count()),
            "l3_bytes": _l3_bytes(), "python": platform.python_version(),
            "numpy": np.__version__,
            "fastattn": getattr(fastattn, "__version__", None),
            "torch": getattr(torch_module, "__version__", None),
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS")}
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        info["threadpools"] = None
    else:
        keep = ("user_api", "internal_api", "prefix", "version", "num_threads",
                "threading_layer", "architecture")
        info["threadpools"] = [{k: p.get(k) for k in keep} for p in threadpool_info()]
    return info


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def benchmark_report(grid: Optional[Sequence[Case]] = None,
                     threads: Optional[int] = None, *, backward: bool = False,
                     use_torch: bool = True, measure: bool = True,
                     progress: bool = False, seed: int = 0, **settings) -> dict:
    """A whole run: machine info, ceilings, per-case rows and geometric means.

    Parameters
    ----------
    grid, threads, backward, use_torch, progress, seed
        As in :func:`run_benchmarks`.
    measure : bool
        Measure the ceilings (:func:`measure_ceilings`) in the same run, before and
        after the cases; the best of both is kept (a busy moment lowers one of them).
    **settings
        ``max_rounds``, ``min_rounds``, ``time_budget``, ``min_sample_time`` for
        :func:`run_benchmarks`.

    Returns
    -------
    dict
        JSON-ready: ``fastattn_version``, ``created``, ``mode``, ``threads``,
        ``threads_applied``, ``settings``, ``conventions``, ``machine``, ``ceilings``,
        ``results`` and ``geomean``.
    """
    threads = default_threads() if threads is None else threads
    threads = _v.check_num_threads(threads, "threads")
    grid = list(GRID if grid is None else grid)
    n_cases = len([c for c in grid if not (backward and c.decode)])
    torch_module = _import_torch() if use_torch else None
    bar = _Progress(n_cases + (2 if measure else 0), progress, "fastattn bench")
    try:
        with thread_limits(threads, torch_module) as applied:
            ceilings = None
            if measure:
                bar.start("machine ceilings (sgemm, dgemm, bandwidth)")
                before = measure_ceilings(threads)
                bar.advance()
            rows = run_benchmarks(grid, threads, backward=backward,
                                  use_torch=use_torch, seed=seed, _progress=bar,
                                  **settings)
            if measure:
                bar.start("machine ceilings again")
                ceilings = _best_ceilings(before, measure_ceilings(threads))
                bar.advance()
                for row in rows:
                    row.update(_peak(row, ceilings))
    finally:
        bar.close()
    return {
        "fastattn_version": getattr(fastattn, "__version__", None),
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "mode": "forward+backward" if backward else "forward",
        "threads": threads,
        "threads_applied": applied,
        "settings": dict(settings, seed=seed),
        "conventions": {
            "speedup": "median over rounds of (other time / fastattn time); > 1 means "
                       "fastattn is faster",
            "flops": "2*B*H*pairs*(E+Ev), pairs = query-key pairs allowed by the "
                     "causal rule; forward+backward counts 3.5x forward",
            "decode_bandwidth": "bytes of K and V (each kv head once) / time",
            "pct_of_ceiling": "fastattn GFLOP/s / sgemm (dgemm for float64) GFLOP/s, "
                              "or GB/s / read bandwidth for decode, in percent"},
        "machine": _machine_info(torch_module),
        "ceilings": ceilings,
        "results": rows,
        "geomean": geometric_means(rows),
    }


# ---------------------------------------------------------------------------- output

def _fmt_ms(t: Optional[dict]) -> str:
    if t is None:
        return "n/a"
    ms = t["median"]
    return f"{ms:.3g}" if ms < 100 else f"{ms:.0f}"


def _fmt_ratio(r: Optional[dict]) -> str:
    if r is None:
        return "n/a"
    return f"{r['median']:.2f}x [{r['min']:.2f}-{r['max']:.2f}]"


def format_report(report: dict) -> str:
    """The table of a :func:`benchmark_report`, with the ceilings and geometric means."""
    rows = report["results"]
    c = report.get("ceilings")
    lines = [f"fastattn bench: {report['mode']}, {report['threads']} thread(s), "
             f"fastattn {report.get('fastattn_version')}, "
             f"torch {report['machine'].get('torch') or 'not used'}"]
    if c:
        lines.append(
            f"machine ceilings (this run, best seen): sgemm {c['sgemm_gflops']:.1f} GFLOP/s, "
            f"dgemm {c['dgemm_gflops']:.1f} GFLOP/s ({c['gemm_n']}x{c['gemm_n']}), "
            f"read bandwidth {c['bandwidth_gbs']:.1f} GB/s "
            f"({c['bandwidth_bytes'] / 2 ** 20:.0f} MiB buffer)")
    applied = report.get("threads_applied") or {}
    if applied and not applied.get("blas"):
        lines.append("note: threadpoolctl is not installed; NumPy's BLAS threads are "
                     "not limited")
    lines.append("")
    header = ["shape", "dtype", "fastattn ms", "numpy ms", "torch ms", "throughput",
              "% peak", "vs numpy", "vs torch"]
    table = []
    warnings = []
    for r in rows:
        t = r["times_ms"]
        if r["decode"] and r["gbs"] is not None:
            through = f"{r['gbs']:.1f} GB/s"
        elif r["gflops"] is not None:
            through = f"{r['gflops']:.1f} GFLOP/s"
        else:
            through = "n/a"
        pct = "n/a" if r["pct_of_ceiling"] is None else f"{r['pct_of_ceiling']:.0f}%"
        diff = r["max_abs_diff_vs_numpy"].get("fastattn")
        tol = 1e-7 if r["dtype"] == "float64" else 2e-3
        flag = ""
        if diff is not None and not diff <= tol:
            flag = " !"
            warnings.append(f"warning: fastattn differs from the NumPy baseline by "
                            f"{diff:.3g} (max abs) on {r['label']}")
        table.append([r["label"] + flag, r["dtype"], _fmt_ms(t.get("fastattn")),
                      _fmt_ms(t.get("numpy")), _fmt_ms(t.get("torch")), through, pct,
                      _fmt_ratio(r["ratios"].get("numpy")),
                      _fmt_ratio(r["ratios"].get("torch"))])
    widths = [max(len(str(x)) for x in col) for col in zip(header, *table)]
    right = {2, 3, 4, 5, 6}

    def fmt(cells):
        return "  ".join(str(x).rjust(w) if i in right else str(x).ljust(w)
                         for i, (x, w) in enumerate(zip(cells, widths))).rstrip()

    lines.append(fmt(header))
    lines.append("  ".join("-" * w for w in widths))
    lines.extend(fmt(cells) for cells in table)
    lines.append("")
    g = report["geomean"]
    parts = []
    for other, name in (("numpy", "NumPy"), ("torch", "PyTorch")):
        if g.get(other):
            n = g[other]["shapes"]
            parts.append(f"{g[other]['geomean']:.2f}x vs {name} "
                         f"({n} shape{'' if n == 1 else 's'})")
        else:
            parts.append(f"n/a vs {name}")
    lines.append("geometric-mean speed-up of fastattn: " + ", ".join(parts))
    lines.append("speed-up = other time / fastattn time, median of per-round ratios "
                 "[min-max]; > 1 means fastattn is faster. % peak: of the run's sgemm "
                 "(dgemm for float64) GFLOP/s, or of its read bandwidth for decode.")
    if report["mode"] != "forward":
        lines.append("forward+backward flops are counted as 3.5x the forward flops; "
                     "decode shapes are left out.")
    reasons = sorted({f"{name}: {why}" for r in rows
                      for name, why in r["skipped"].items()})
    lines.extend(f"skipped {reason}" for reason in reasons)
    lines.extend(warnings)
    return "\n".join(lines)


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def write_json(report: dict, path: str) -> None:
    """Save a :func:`benchmark_report` as JSON (non-finite numbers become null)."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    with open(path, "w") as f:
        json.dump(_jsonable(report), f, indent=2, allow_nan=False)
        f.write("\n")


def plot_report(report: dict, path: str) -> None:
    """Write a PNG of the speed-ups: one row per shape, bars vs NumPy and vs PyTorch.

    The x axis is logarithmic with a line at 1x; error bars span the min-max of the
    per-round ratios. Needs matplotlib (imported here, not at module import).
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter

    rows = report["results"]
    labels = [r["label"] for r in rows]
    n = len(rows)
    fig = Figure(figsize=(9, 1.2 + 0.55 * max(n, 1)), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    height = 0.38
    series = (("numpy", "vs NumPy baseline", "tab:blue", -height / 2),
              ("torch", "vs PyTorch SDPA", "tab:orange", height / 2))
    y = np.arange(n)
    drawn = False
    for key, name, color, offset in series:
        med = np.array([r["ratios"][key]["median"] if r["ratios"].get(key) else np.nan
                        for r in rows])
        if np.all(np.isnan(med)):
            continue
        lo = np.array([r["ratios"][key]["min"] if r["ratios"].get(key) else np.nan
                       for r in rows])
        hi = np.array([r["ratios"][key]["max"] if r["ratios"].get(key) else np.nan
                       for r in rows])
        err = np.vstack([np.nan_to_num(med - lo), np.nan_to_num(hi - med)])
        g = report["geomean"].get(key)
        if g:
            name += f" (geomean {g['geomean']:.2f}x)"
        # bars grow from the 1x line: right of it fastattn is faster, left slower
        ax.barh(y + offset, np.nan_to_num(med, nan=1.0) - 1.0, left=1.0, height=height,
                color=color, label=name,
                xerr=err, capsize=2, error_kw={"elinewidth": 0.8})
        for yi, m, h in zip(y + offset, med, hi):
            if np.isfinite(m):
                ax.annotate(f"{m:.2f}x", (h if np.isfinite(h) else m, yi), xytext=(4, 0),
                            textcoords="offset points", va="center", fontsize=7)
        drawn = True
    ax.axvline(1.0, color="black", linewidth=1, linestyle="--")
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:g}x"))
    ax.set_yticks(y, labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("speed-up of fastattn (other time / fastattn time; > 1: fastattn "
                  "faster)")
    c = report.get("ceilings") or {}
    extra = (f"; sgemm {c['sgemm_gflops']:.0f} GFLOP/s, {c['bandwidth_gbs']:.0f} GB/s"
             if c else "")
    fig.suptitle(f"fastattn {report.get('fastattn_version')} {report['mode']}, "
                 f"{report['threads']} thread(s){extra}", fontsize=10)
    if drawn:
        ax.legend(loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=2, fontsize=8,
                  frameon=False)
    else:
        ax.text(0.5, 0.5, "no speed-ups to show (fastattn not available)",
                transform=ax.transAxes, ha="center")
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fig.savefig(path, dpi=120)


# ------------------------------------------------------------------------------- CLI

def _positive_float(text: str) -> float:
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
    if not x > 0 or not math.isfinite(x):
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
    return x


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the options of ``fastattn bench`` to ``parser``."""
    parser.description = (
        "Time fastattn.attention against the NumPy baseline (fastattn.reference) and, "
        "when installed, PyTorch's scaled_dot_product_attention: same threads, same "
        "arrays, interleaved rounds, median of per-round speed-ups. Also measures the "
        "machine's sgemm GFLOP/s and memory read bandwidth in the same run.")
    parser.add_argument("--quick", action="store_true",
                        help="a smaller grid and fewer rounds (under a minute)")
    parser.add_argument("--threads", type=positive_int, default=None, metavar="N",
                        help="threads for fastattn, PyTorch and NumPy's BLAS "
                             "(default: fastattn.get_num_threads())")
    parser.add_argument("--backward", action="store_true",
                        help="time forward + backward (attention with return_lse, then "
                             "attention_backward) instead of forward only")
    parser.add_argument("--json", metavar="PATH", default=None,
                        help="save every result (machine, ceilings, times, ratios) as "
                             "JSON")
    parser.add_argument("--plot", metavar="PATH", default=None,
                        help="write a PNG of the speed-ups (needs matplotlib)")
    parser.add_argument("--only", metavar="TEXT", action="append", default=None,
                        help="run only the shapes whose label or id contains TEXT "
                             "(repeatable)")
    parser.add_argument("--rounds", type=positive_int, default=None, metavar="N",
                        help="at most N interleaved rounds per shape (default: 11, "
                             "--quick: 5)")
    parser.add_argument("--time-budget", type=_positive_float, default=None,
                        metavar="SECONDS",
                        help="seconds per shape that the rounds aim at (default: 6, "
                             "--quick: 1.5); slow shapes still run at least 3 rounds")
    parser.add_argument("--no-torch", action="store_true",
                        help="leave PyTorch out even when it is installed")
    parser.add_argument("--no-ceilings", action="store_true",
                        help="skip measuring sgemm and bandwidth (no %% peak column)")
    parser.add_argument("--no-progress", action="store_true",
                        help="no progress bar")
    parser.add_argument("--list", action="store_true",
                        help="print the grid and exit")


def _select(grid: Sequence[Case], only: Optional[Sequence[str]]) -> List[Case]:
    if not only:
        return list(grid)
    return [c for c in grid if any(t in c.label or t in c.id for t in only)]


def run(args: argparse.Namespace) -> int:
    """Run ``fastattn bench`` with parsed ``args``; returns the exit status."""
    grid = _select(QUICK_GRID if args.quick else GRID, args.only)
    if args.list:
        for c in grid:
            print(f"{c.id:40s} {c.label}")
        return 0
    if not grid:
        print(f"fastattn bench: error: no shape matches --only {args.only}; "
              f"see fastattn bench --list", file=sys.stderr)
        return 2
    if args.backward and all(c.decode for c in grid):
        print("fastattn bench: error: --backward leaves out decode shapes and no other "
              "shape is selected", file=sys.stderr)
        return 2
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print("fastattn bench: error: --plot needs matplotlib "
                  "(pip install matplotlib)", file=sys.stderr)
            return 2
    settings = dict(QUICK_SETTINGS if args.quick else FULL_SETTINGS)
    if args.rounds is not None:
        settings["max_rounds"] = args.rounds
        settings["min_rounds"] = min(settings["min_rounds"], args.rounds)
    if args.time_budget is not None:
        settings["time_budget"] = args.time_budget
    if not args.no_torch and _import_torch() is None:
        print("fastattn bench: PyTorch is not installed; its column is skipped",
              file=sys.stderr)
    if args.backward and getattr(fastattn, "attention_backward", None) is None:
        print("fastattn bench: fastattn.attention_backward is not available in this "
              "build; timing the NumPy baseline and PyTorch only", file=sys.stderr)
    if getattr(fastattn, "attention", None) is None:
        print("fastattn bench: fastattn.attention is not available in this build; "
              "timing the NumPy baseline and PyTorch only", file=sys.stderr)

    report = benchmark_report(grid, args.threads, backward=args.backward,
                              use_torch=not args.no_torch,
                              measure=not args.no_ceilings,
                              progress=not args.no_progress, **settings)
    print(format_report(report))
    if args.json:
        write_json(report, args.json)
        print(f"results saved to {args.json}")
    if args.plot:
        plot_report(report, args.plot)
        print(f"plot saved to {args.plot}")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m fastattn.bench``: the same as ``fastattn bench``."""
    parser = argparse.ArgumentParser(prog="fastattn bench")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
