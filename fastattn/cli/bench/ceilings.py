"""The machine's ceilings, measured with NumPy in the same run as the cases.

Compute: the GFLOP/s of a :data:`GEMM_N` x :data:`GEMM_N` sgemm and dgemm. Memory: the
read bandwidth of a float32 matrix-vector product over a buffer much larger than the L3
cache (:data:`BANDWIDTH_BYTES`). Also the description of the machine a report records.
"""

from __future__ import annotations

import os
import platform
import time
from typing import Callable, List, Optional, Tuple

import numpy as np

import fastattn
from .threads import default_threads, thread_limits

__all__ = ["GEMM_N", "BANDWIDTH_BYTES", "measure_ceilings", "read_probe"]

#: Size of the square matmul that measures the sgemm/dgemm ceiling.
GEMM_N = 2048

#: Bytes read by the bandwidth probe; ``None`` picks 8x the L3 cache (256 MiB to 2 GiB).
BANDWIDTH_BYTES: Optional[int] = None


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


def read_probe(nbytes: Optional[int] = None) -> Tuple[Callable[[], object], int]:
    """The bandwidth probe: a call that reads a buffer once, and the bytes it reads.

    A float32 matrix-vector product (``A @ x``, A of about ``nbytes``, default
    :data:`BANDWIDTH_BYTES` or 8x the L3 cache): BLAS splits it across its threads and
    it reads every byte of A once, as an attention decode step reads K and V once.
    A is written once when it is made, so its pages are real before the first timing.
    """
    nbytes = _bandwidth_bytes() if nbytes is None else int(nbytes)
    cols = 1024
    rows = max(1, nbytes // (4 * cols))
    big = np.ones((rows, cols), np.float32)
    x = np.ones(cols, np.float32)
    y = np.empty(rows, np.float32)
    return (lambda: np.matmul(big, x, out=y)), int(big.nbytes)


def measure_ceilings(threads: Optional[int] = None, *, gemm_n: Optional[int] = None,
                     bandwidth_bytes: Optional[int] = None, repeats: int = 5,
                     torch_module=None) -> dict:
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
    torch_module : module, optional
        The imported ``torch``: then also ``bf16gemm_gflops``, a bfloat16 matmul of
        the same size through PyTorch (oneDNN: AMX or AVX512-BF16 where the CPU has
        them), the ceiling of the bfloat16 rows where it is faster than the sgemm; or
        ``bf16gemm_skipped`` where a small one shows the CPU has no bfloat16 units.

    Returns
    -------
    dict
        ``sgemm_gflops``, ``dgemm_gflops``, ``bandwidth_gbs`` (best of the repeats),
        their per-repeat samples, ``gemm_n`` and ``bandwidth_bytes``.

    Notes
    -----
    The bandwidth probe is :func:`read_probe`'s matrix-vector product.
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
        if torch_module is not None:
            result.update(_bf16_matmul(torch_module, n, repeats, result["sgemm_gflops"]))
        probe, probe_bytes = read_probe(nbytes)
        samples = _repeat(probe, repeats)
        rates = [probe_bytes / t / 1e9 for t in samples]
        result["bandwidth_gbs"] = max(rates)
        result["bandwidth_gbs_samples"] = rates
        result["bandwidth_bytes"] = probe_bytes
        del probe
    return result


#: The size of the bfloat16 matmul that first says whether the full one is worth it
BF16_TRIAL_N = 512

#: Seconds the trial products may take before a CPU counts as having no bfloat16
#: units: oneDNN's first products on a machine with AMX run far below its rate (the
#: threads' tile state and code are set up on the way), so the trial repeats until
#: one product reaches the threshold or this much time has passed
BF16_TRIAL_SECONDS = 0.5


def _bf16_matmul(torch_module, n: int, repeats: int, sgemm_gflops: float) -> dict:
    """``bf16gemm_gflops`` and its samples, a bfloat16 (n, n) matmul through PyTorch;
    or ``bf16gemm_skipped`` (why) where BF16_TRIAL_N products, repeated for
    BF16_TRIAL_SECONDS (at least two), all run below a tenth of the sgemm's rate: a
    CPU without bfloat16 units, where PyTorch multiplies bfloat16 at a fraction of a
    GFLOP/s and the full-size product would take a minute a time. Such a CPU widens
    bfloat16 to float32 (fastattn does), so the sgemm is the ceiling of its bfloat16
    rows."""
    m = BF16_TRIAL_N
    ta = torch_module.randn(m, m, dtype=torch_module.bfloat16)
    torch_module.matmul(ta, ta)
    trial, tries, start = 0.0, 0, time.perf_counter()
    while trial < 0.1 * sgemm_gflops and (
            tries < 2 or time.perf_counter() - start < BF16_TRIAL_SECONDS):
        t0 = time.perf_counter()
        torch_module.matmul(ta, ta)
        trial = max(trial, 2.0 * m ** 3 / (time.perf_counter() - t0) / 1e9)
        tries += 1
    if trial < 0.1 * sgemm_gflops:
        return {"bf16gemm_skipped": f"the best of {tries} {m}x{m} bfloat16 matmuls "
                                    f"ran at {trial:.2f} GFLOP/s, under a tenth of the "
                                    f"sgemm (no bfloat16 units): the sgemm is the "
                                    f"ceiling of the bfloat16 rows"}
    ta = torch_module.randn(n, n, dtype=torch_module.bfloat16)
    tb = torch_module.randn(n, n, dtype=torch_module.bfloat16)
    rates = [2.0 * n ** 3 / t / 1e9
             for t in _repeat(lambda: torch_module.matmul(ta, tb), repeats)]
    return {"bf16gemm_gflops": max(rates), "bf16gemm_gflops_samples": rates}


def _best_ceilings(before: dict, after: dict) -> dict:
    """Ceilings measured before and after the cases: the best of both, all samples.

    On a shared machine a single measurement may catch a busy moment; the machine can
    do at least the best that was seen in the run.
    """
    out = dict(after)
    for key in ("sgemm_gflops", "dgemm_gflops", "bandwidth_gbs", "bf16gemm_gflops"):
        if key not in before or key not in after:
            continue
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


def _machine_info(torch_module) -> dict:
    """What a report records of the machine: platform, CPU, versions, thread pools."""
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
