"""The report of a run: the table, JSON and the plot of the speed-ups."""

from __future__ import annotations

import json
import math
import os
from typing import Dict, List, Optional, Tuple

import numpy as np

__all__ = ["format_report", "format_scaling", "format_overhead", "format_torch_op",
           "format_serving", "format_peers", "write_json", "plot_report"]


def _throughput_and_peak(r: dict) -> Tuple[str, str]:
    """A row's throughput (GB/s for decoding, else GFLOP/s) and its share of the
    ceiling (with the same rounds' range against the read probe), as printed."""
    if r["decode"] and r["gbs"] is not None:
        through = f"{r['gbs']:.1f} GB/s"
    elif r["gflops"] is not None:
        through = f"{r['gflops']:.1f} GFLOP/s"
    else:
        through = "n/a"
    pct = "n/a" if r["pct_of_ceiling"] is None else f"{r['pct_of_ceiling']:.0f}%"
    same = r.get("pct_of_bandwidth_same_rounds")
    if same:
        pct += f" [{same['min']:.0f}-{same['max']:.0f}]"
    return through, pct


def _fmt_ms(t: Optional[dict]) -> str:
    if t is None:
        return "n/a"
    ms = t["median"]
    return f"{ms:.3g}" if ms < 100 else f"{ms:.0f}"


def _fmt_range(r: Optional[dict], unit: str = "", digits: int = 2) -> str:
    if r is None:
        return "n/a"
    return (f"{r['median']:.{digits}f}{unit} "
            f"[{r['min']:.{digits}f}-{r['max']:.{digits}f}]")


def _fmt_ratio(r: Optional[dict]) -> str:
    return _fmt_range(r, "x")


def _align(header, table, right) -> list:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *table)]

    def fmt(cells):
        return "  ".join(str(x).rjust(w) if i in right else str(x).ljust(w)
                         for i, (x, w) in enumerate(zip(cells, widths))).rstrip()

    return [fmt(header), "  ".join("-" * w for w in widths)] + [fmt(c) for c in table]


def format_overhead(overheads) -> List[str]:
    """The table of :func:`measure_overhead` results (a dict, or a list of them, one
    per thread count); no lines for None or an empty list."""
    if isinstance(overheads, dict):
        overheads = [overheads]
    overheads = [o for o in overheads or () if o]
    if not overheads:
        return []
    first = overheads[0]
    lines = [f"per-call overhead, {first['label']} {first['dtype']}: microseconds per "
             f"call, median [min-max] of {first['rounds']} interleaved rounds"]
    header = ["threads", "fastattn us", "PyTorch SDPA us", "vs torch",
              "floor us (numpy.asarray q,k,v + numpy.empty out)"]
    table = [[str(o["threads"]), _fmt_range(o["us"].get("fastattn"), "", 1),
              _fmt_range(o["us"].get("torch"), "", 1),
              _fmt_ratio(o["ratios"].get("torch")),
              _fmt_range(o["us"].get("floor"), "", 2)] for o in overheads]
    return lines + _align(header, table, set())


def format_torch_op(section: Optional[dict]) -> List[str]:
    """The table of the ``--torch-op`` section (``report["torch_op"]``); no lines for
    None."""
    if not section or not section.get("rows"):
        return []
    rows = section["rows"]
    lines = [f"PyTorch operator (fastattn.torch.scaled_dot_product_attention, tensors "
             f"in, a tensor out), {section['mode']}, {section['threads']} thread(s): "
             f"beside the NumPy API on the same memory and PyTorch's SDPA"]
    header = ["shape", "dtype", "NumPy API ms", "operator ms", "torch ms",
              "operator/NumPy API", "overhead us", "vs torch"]
    table = [[r["label"], r["dtype"], _fmt_ms(r["times_ms"].get("numpy_api")),
              _fmt_ms(r["times_ms"].get("operator")),
              _fmt_ms(r["times_ms"].get("torch")),
              _fmt_ratio(r["ratios"]["overhead"]),
              _fmt_range(r["overhead_us"], "", 1),
              _fmt_ratio(r["ratios"]["vs_torch"])] for r in rows]
    lines.extend(_align(header, table, {2, 3, 4}))
    lines.append("operator/NumPy API: operator time / fastattn.attention time on "
                 "pre-made arrays; overhead us: their difference; vs torch: PyTorch "
                 "time / operator time; median of per-round values [min-max].")
    if any(r["operator_runs"] != "fastattn.torch.scaled_dot_product_attention"
           for r in rows):
        lines.append("causal=bottom_right rows run fastattn.torch.attention (the same "
                     "operator with the NumPy API's keywords).")
    reasons = sorted({f"skipped in the operator table, {name}: {why}" for r in rows
                      for name, why in r["skipped"].items()})
    return lines + reasons


# which rows a PyTorch implementation serves, in words, for the notes under the table
_TORCH_ROWS = (("window", lambda r: r.get("window") is not None),
               ("ragged", lambda r: r.get("ragged") is not None),
               ("alibi", lambda r: r.get("alibi")),
               ("sinks", lambda r: r.get("sinks")),
               ("softcap", lambda r: r.get("softcap") is not None),
               ("causal=bottom_right", lambda r: r.get("causal") == "bottom_right"))


def _torch_notes(rows) -> List[str]:
    """One line per way PyTorch ran other than plain SDPA, naming the kinds of rows."""
    kinds: Dict[str, List[str]] = {}
    for r in rows:
        how = r.get("torch_runs")
        if not how or how == "SDPA" or "torch" not in r["times_ms"]:
            continue
        tags = [name for name, test in _TORCH_ROWS if test(r)]
        for tag in tags[:1] or ["other"]:
            if tag not in kinds.setdefault(how, []):
                kinds[how].append(tag)
    return [f"PyTorch column of the {', '.join(tags)} rows: {how}"
            + (" (for ragged rows: the padded batch with the key-padding mask)"
               if "ragged" in tags and "boolean" in how else "")
            for how, tags in kinds.items()]


def _format_counterparts(rows) -> List[str]:
    """The table of variant rows against their counterpart (fastattn on both)."""
    pairs = [r for r in rows if r.get("counterpart")]
    if not pairs:
        return []
    header = ["variant", "counterpart", "variant ms", "counterpart ms",
              "speed-up (counterpart/variant)", "cost (variant/counterpart)"]
    table = [[r["label"], r["counterpart"]["label"],
              _fmt_ms(r["times_ms"].get("fastattn")),
              _fmt_ms(r["times_ms"].get("counterpart")),
              _fmt_ratio(r["counterpart"]["speedup"]),
              _fmt_ratio(r["counterpart"]["cost"])] for r in pairs]
    return (["variants against their counterpart: fastattn on both, in the same "
             "rounds (median of per-round ratios [min-max])"]
            + _align(header, table, {2, 3}) + [""])


def _tolerance(dtype: str, scale: Optional[float]) -> float:
    """The largest difference from another result that is not flagged: the dtype's
    tolerance per unit of the largest value (gradients of long rows exceed 1)."""
    tol = {"float64": 1e-7, "bfloat16": 3e-2, "float16": 5e-3}.get(dtype, 2e-3)
    return tol * max(1.0, scale or 0.0)


def format_serving(rows, split: bool = False):
    """The table of the serving rows (``report["serving"]``, from
    :func:`~fastattn.cli.bench.serving.run_serving`), its notes, the skipped
    contenders and the warnings: a list of lines (none for None or an empty list), or
    with ``split`` a pair (the table and its notes, the skipped and warnings)."""
    if not rows:
        return ([], []) if split else []
    lines = ["serving: paged and quantized key-value caches, bfloat16 queries "
             "(fastattn.attention_paged, or the contiguous call of a contiguous row)"]
    header = ["row", "fastattn ms", "contiguous ms", "paged/contiguous",
              "NumPy today ms", "vs NumPy today", "PyTorch today ms",
              "vs PyTorch today", "throughput", "% read bw", "max diff"]
    table, warnings = [], []
    for r in rows:
        t = r["times_ms"]
        through, pct = _throughput_and_peak(r)
        tol = _tolerance("bfloat16", r.get("max_abs_reference"))
        flag = ""
        for name, diff in sorted(r["max_abs_diff_vs_reference"].items()):
            if diff is None or not diff <= tol:
                flag = " !"
                warnings.append(f"warning: the {name} contender differs from the "
                                f"reference by {diff if diff is None else f'{diff:.3g}'} "
                                f"(max abs) on {r['label']}")
        diff = r["max_abs_diff_vs_reference"].get("fastattn")
        table.append([r["label"] + flag, _fmt_ms(t.get("fastattn")),
                      _fmt_ms(t.get("contiguous")),
                      _fmt_ratio(r["paged_over_contiguous"]),
                      _fmt_ms(t.get("numpy")), _fmt_ratio(r["speedup"].get("numpy")),
                      _fmt_ms(t.get("torch")), _fmt_ratio(r["speedup"].get("torch")),
                      through, pct, "n/a" if diff is None else f"{diff:.2g}"])
    lines.extend(_align(header, table, {1, 2, 4, 6, 8, 9, 10}))
    lines.append(
        "contiguous: fastattn on the same data laid out contiguously, its tokens and "
        "heads in the order of the blocks (fastattn.attention for one sequence, "
        "attention_varlen for a batch), in the same rounds; heads first: blocks stored "
        "(num_blocks, Hkv, block_size, E); "
        "paged/contiguous: fastattn's time over it. NumPy today: gather the tokens from "
        "the blocks (numpy.take) and dequantize to bfloat16 (float32(code) * scale), "
        "then the contiguous fastattn call; PyTorch today: index_select, the same "
        "dequantization, then SDPA (enable_gqa) per sequence; each timed per step, the "
        "gather and dequantization included; vs: their time over fastattn's (median "
        "of per-round ratios [min-max]). throughput: for decoding, the bytes of the "
        "cache read (each kv head once: 1 byte per code plus 4-byte scales per token "
        "and head of K and of V, or 2 bytes per bfloat16 element) over the time; "
        "% read bw: per round against the read probe in the same rounds. max diff: "
        "fastattn's largest absolute difference from fastattn.reference.attention_paged "
        "(float64 on the dequantized values) on every sequence, the query heads of the "
        "first and last kv head, and the first, middle and last query of a prefill "
        "sequence (every contender's in the JSON).")
    reasons = sorted({f"skipped in the serving table, {name}: {why}" for r in rows
                      for name, why in r["skipped"].items()})
    return (lines, reasons + warnings) if split else lines + reasons + warnings


def format_report(report: dict) -> str:
    """The table of a :func:`benchmark_report`, with the ceilings and geometric means
    (or, for a :func:`scaling_report`, its per-shape scaling tables)."""
    if "scaling" in report:
        return format_scaling(report)
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
            f"({c['bandwidth_bytes'] / 2 ** 20:.0f} MiB buffer)"
            + (f", bf16 matmul (PyTorch) {c['bf16gemm_gflops']:.1f} GFLOP/s"
               if "bf16gemm_gflops" in c else "")
            + (f"; bf16 matmul not timed: {c['bf16gemm_skipped']}"
               if "bf16gemm_skipped" in c else ""))
    timing = report.get("timing") or {}
    if timing.get("isolation") == "process":
        lines.append(f"timing of the attention rows: {timing['text']}; peers: "
                     f"{', '.join(timing['peers']) or 'none'}")
    applied = report.get("threads_applied") or {}
    if applied and not applied.get("blas"):
        lines.append("note: threadpoolctl is not installed; NumPy's BLAS threads are "
                     "not limited")
    lines.append("")
    tail: List[str] = []          # skipped contenders and warnings: last
    if rows:
        table, tail = _format_rows(report, rows)
        lines.extend(table)
    if report.get("serving"):
        if rows:
            lines.append("")
        serving, serving_tail = format_serving(report["serving"], split=True)
        lines.extend(serving)
        tail += serving_tail
    if report.get("overhead"):
        lines.append("")
        lines.extend(format_overhead(report["overhead"]))
    if report.get("torch_op"):
        lines.append("")
        lines.extend(format_torch_op(report["torch_op"]))
    return "\n".join(lines + tail)


def _format_rows(report: dict, rows) -> Tuple[List[str], List[str]]:
    """The table of the attention rows and its notes; the skipped contenders and the
    warnings."""
    lines = []
    with_peers = any("peers" in r for r in rows)
    header = ["shape", "dtype", "kernel", "fastattn ms", "numpy ms", "torch ms",
              "throughput", "% peak", "vs numpy", "vs torch"]
    if with_peers:
        header.append("fastest peer (peer/fastattn)")
    table = []
    warnings = []
    for r in rows:
        t = r["times_ms"]
        through, pct = _throughput_and_peak(r)
        tol = _tolerance(r["dtype"], r.get("max_abs_fastattn"))
        flag = ""
        for other, diff in (("the NumPy baseline", r["max_abs_diff_vs_numpy"].get(
                                "fastattn")),
                            ("PyTorch", r.get("max_abs_diff_fastattn_vs_torch"))):
            if diff is not None and not diff <= tol:
                flag = " !"
                warnings.append(f"warning: fastattn differs from {other} by "
                                f"{diff:.3g} (max abs) on {r['label']}")
        table.append([r["label"] + flag, r["dtype"], r.get("kernel") or "n/a",
                      _fmt_ms(t.get("fastattn")),
                      _fmt_ms(t.get("numpy")), _fmt_ms(t.get("torch")), through, pct,
                      _fmt_ratio(r["ratios"].get("numpy")),
                      _fmt_ratio(r["ratios"].get("torch"))]
                     + ([_fmt_fastest(r.get("fastest_peer"))] if with_peers else []))
    lines.extend(_align(header, table, {3, 4, 5, 6, 7}))
    lines.append("")
    lines.extend(_format_counterparts(rows))
    if with_peers:
        peer_lines, peer_tail = format_peers(rows)
        lines.extend(peer_lines + [""])
        warnings.extend(peer_tail)
    g = report["geomean"]
    parts = []
    others = (("numpy", "NumPy"), ("torch", "PyTorch"))
    if with_peers:
        others += (("fastest_peer", "the fastest peer"),)
    for other, name in others:
        if g.get(other):
            n = g[other]["shapes"]
            parts.append(f"{g[other]['geomean']:.2f}x vs {name} "
                         f"({n} shape{'' if n == 1 else 's'})")
        else:
            parts.append(f"n/a vs {name}")
    lines.append("geometric-mean speed-up of fastattn: " + ", ".join(parts))
    lines.append("speed-up = other time / fastattn time, median of per-round ratios "
                 "[min-max]; > 1 means fastattn is faster. % peak: of the run's sgemm "
                 "(dgemm for float64, PyTorch's bf16 matmul for bfloat16 where it is "
                 "faster than the sgemm) GFLOP/s, or "
                 "for decode of the read bandwidth: the median [min-max] of per-round "
                 "ratios to the read probe (a float32 matrix-vector product over the "
                 "buffer above) timed in the same rounds. kernel: what computes fastattn's "
                 "products (amx_bf16: AMX tiles, avx512_bf16: vdpbf16ps, fma: the "
                 "float32 micro-GEMM, decode: the decoding path; after a +: the "
                 "backward's gradient products).")
    if report["mode"] != "forward":
        lines.append("forward+backward flops are counted as 3.5x the forward flops; "
                     "decode shapes are left out.")
    if any(r.get("window") is not None or r.get("ragged") for r in rows):
        lines.append("flops count only the query-key pairs the causal rule and the "
                     "window allow, over each sequence's real rows"
                     + (" (the padded rows of the padding-mask flavour are waste, not "
                        "work: the three ragged flavours count the same flops)."
                        if any(r.get("ragged") for r in rows) else "."))
    lines.extend(_torch_notes(rows))
    reasons = sorted({f"{name}: {why}" for r in rows
                      for name, why in r["skipped"].items()})
    return lines, [f"skipped {reason}" for reason in reasons] + warnings


def _fmt_fastest(best: Optional[dict]) -> str:
    if not best:
        return "n/a"
    return f"{best['name']} {_fmt_ratio(best['ratio'])}"


def _peer_cell(entry: dict, times: Optional[dict]) -> str:
    """A peer's cell: its time, or what kept it from being timed."""
    status = entry.get("status")
    if status == "timed" and times is not None:
        return _fmt_ms(times)
    if status == "wrong":
        err = entry.get("max_abs_diff")
        return "wrong (max err " + ("n/a" if err is None else f"{err:.2g}") + ")"
    if status == "n/a":
        return f"n/a ({entry.get('reason')})"
    return status or "n/a"


def format_peers(rows) -> Tuple[List[str], List[str]]:
    """The table of the peers (rows timed with ``--peers``): each peer's time or
    status per row, and what each ran; and the lines for the reasons of the failed
    and not installed."""
    rows = [r for r in rows if "peers" in r]
    names = []
    for r in rows:
        names += [n for n in r["peers"] if n not in names]
    if not rows or not names:
        return [], []
    header = ["shape", "dtype", "fastattn ms"] + [f"{n} ms" for n in names] + [
        "vs fastest peer"]
    table = []
    for r in rows:
        t = r["times_ms"]
        table.append([r["label"], r["dtype"], _fmt_ms(t.get("fastattn"))]
                     + [_peer_cell(r["peers"][n], t.get(n)) if n in r["peers"]
                        else "n/a" for n in names]
                     + [_fmt_fastest(r.get("fastest_peer"))])
    lines = ["peers: each checked against the float64 reference (fastattn.reference on "
             "the same inputs) before it is timed; wrong: outside the tolerance, not "
             "timed; n/a (why): a case or dtype the peer is not run on"]
    lines.extend(_align(header, table, set(range(2, 3 + len(names)))))
    lines.append("vs fastest peer: the peer with the smallest median time, its time / "
                 "fastattn time, median of per-round ratios [min-max]; > 1 means "
                 "fastattn is faster.")
    runs: Dict[str, List[str]] = {}
    for r in rows:
        for n, e in r["peers"].items():
            if e.get("runs") and e["runs"] not in runs.setdefault(n, []):
                runs[n].append(e["runs"])
    for n in names:
        for how in runs.get(n, []):
            lines.append(f"{n}: {how}")
    tail = sorted({f"{n}: {e['status']} on {r['label']} {r['dtype']}: {e['reason']}"
                   for r in rows for n, e in r["peers"].items()
                   if e.get("status") == "failed"})
    missing = sorted({f"{n}: not installed ({e['reason']})"
                      for r in rows for n, e in r["peers"].items()
                      if e.get("status") == "not installed"})
    return lines, missing + tail


def format_scaling(report: dict) -> str:
    """The per-shape tables of a :func:`scaling_report`."""
    counts = report["threads"]
    cores = report["usable_cores"]
    lines = [f"fastattn bench: {report['mode']}, thread scaling over "
             f"{', '.join(map(str, counts))} threads ({cores} usable cores), "
             f"fastattn {report.get('fastattn_version')}, "
             f"torch {report['machine'].get('torch') or 'not used'}"]
    over = [n for n in counts if n > cores]
    if over:
        lines.append(f"oversubscribed (*): {', '.join(map(str, over))} threads on "
                     f"{cores} usable cores; PyTorch runs that many threads, fastattn "
                     f"caps a call at the usable cores (the 'ran' column)")
    header = ["threads", "ran fa/torch", "fastattn ms", "GFLOP/s", "% sgemm",
              "efficiency", "torch ms", "torch GFLOP/s", "torch eff.", "vs torch"]
    warnings = set()
    for row in report["scaling"]:
        lines.append("")
        lines.append(f"{row['label']} {row['dtype']}: {row['flops'] / 1e9:.3g} GFLOP, "
                     f"{row['rounds']} round(s)")
        table = []
        for e in row["counts"]:
            fa, to = e["fastattn"], e["torch"]
            mark = "*" if e["oversubscribed"] else ""
            table.append([
                f"{e['threads']}{mark}",
                f"{e['fastattn_threads']}/{e['torch_threads'] if to else '-'}",
                _fmt_ms(fa), "n/a" if fa is None else f"{fa['gflops']:.1f}",
                "n/a" if e["pct_of_sgemm"] is None else f"{e['pct_of_sgemm']:.0f}%",
                _fmt_range(fa["efficiency"] if fa else None),
                _fmt_ms(to), "n/a" if to is None else f"{to['gflops']:.1f}",
                "n/a" if to is None or to["efficiency"] is None
                else f"{to['efficiency']['median']:.2f}",
                _fmt_ratio(e["vs_torch"])])
        lines.extend(_align(header, table, {1, 2, 3, 4, 6, 7, 8}))
        warnings.update(f"skipped {name}: {why}" for name, why in row["skipped"].items())
    lines.append("")
    base = sorted({r["base_threads"] for r in report["scaling"]})
    lines.append(f"efficiency = t({'/'.join(map(str, base)) or 1}) x "
                 f"{'/'.join(map(str, base)) or 1} / (n x t(n)), median of per-round "
                 f"ratios [min-max]; vs torch = PyTorch time / fastattn time at the same "
                 f"count; % sgemm: of the best sgemm GFLOP/s measured at that count or "
                 f"fewer threads.")
    ceilings = report.get("ceilings") or {}
    if ceilings:
        lines.append("sgemm GFLOP/s by threads: " + ", ".join(
            f"{n}: {c['sgemm_gflops']:.1f}" for n, c in ceilings.items()))
    overhead = list((report.get("overhead") or {}).values())
    if overhead:
        lines.append("")
        lines.extend(format_overhead(overhead))
    lines.extend(sorted(warnings))
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
