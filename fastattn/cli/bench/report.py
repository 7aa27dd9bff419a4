"""The report of a run: the table, JSON and the plot of the speed-ups."""

from __future__ import annotations

import json
import math
import os
from typing import Optional

import numpy as np

__all__ = ["format_report", "write_json", "plot_report"]


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
