"""The cost of running fastattn on Dask: a LocalCluster against one plain call.

Times ``fastattn.dask.attention`` with the key axis (Lk) cut in ``--chunks`` pieces on a
``dask.distributed.LocalCluster`` of ``--workers`` processes with one thread each
(fastattn running one thread inside each), against a plain ``fastattn.attention`` call
with as many threads as there are workers, on the same machine. The runs alternate,
``--repeat`` times each, after one warm-up of each; on a shared machine compare the
best runs as well as the medians (the load average before each pair is recorded).

The inputs are generated on the workers and kept there (``persist``), as they would be
in a pipeline; a Dask run is ``compute()`` of the output, including the merge of the
partial results and the transfer of the output back to this process. Besides wall time
the script records the CPU seconds of every process involved (this one, which also
runs the scheduler, and the workers): the engine's overhead in CPU time, which other
load on the machine disturbs less than wall time.

    python benchmarks/dask_overhead.py --shape 1 16 8192 8192 64 --chunks 4 --repeat 3 \\
        --json dask_overhead.json --plot dask_overhead.png
"""

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", type=int, nargs=5, default=[1, 16, 8192, 8192, 64],
                   metavar=("B", "H", "LQ", "LK", "E"))
    p.add_argument("--chunks", type=int, default=4, help="pieces along Lk")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--json", help="write the timings here")
    p.add_argument("--plot", help="write a bar chart here (needs matplotlib)")
    p.add_argument("--replot", metavar="JSON",
                   help="only draw --plot from the timings saved in JSON")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if args.replot:
        with open(args.replot) as f:
            plot(json.load(f), args.plot)
        return 0
    os.environ["OMP_NUM_THREADS"] = "1"          # for the worker processes
    import dask.array as da
    from distributed import Client, LocalCluster, wait

    import fastattn
    import fastattn.dask

    B, H, Lq, Lk, E = args.shape
    dtype = np.dtype(args.dtype)
    threads = args.workers
    kchunk = -(-Lk // args.chunks)

    with LocalCluster(n_workers=args.workers, threads_per_worker=1, processes=True,
                      host="127.0.0.1", dashboard_address=None,
                      silence_logs=40) as cluster, Client(cluster) as client:
        rs = da.random.default_rng(0)
        q = rs.standard_normal((B, H, Lq, E), dtype=dtype, chunks=(B, H, Lq, E))
        k = rs.standard_normal((B, H, Lk, E), dtype=dtype, chunks=(B, H, kchunk, E))
        v = rs.standard_normal((B, H, Lk, E), dtype=dtype, chunks=(B, H, kchunk, E))
        q, k, v = client.persist([q, k, v])
        wait([q, k, v])
        qn, kn, vn = client.compute([q, k, v], sync=True)     # the same data, locally
        worker_threads = set(client.run(lambda: fastattn.get_num_threads()).values())

        out = fastattn.dask.attention(q, k, v)
        tasks = len(out.__dask_graph__()) - sum(len(x.__dask_graph__()) for x in (q, k, v))

        def workers_cpu():
            return sum(client.run(time.process_time).values())

        def run_dask():
            c, w, t = time.process_time(), workers_cpu(), time.perf_counter()
            res = out.compute()
            t = time.perf_counter() - t
            return t, res, workers_cpu() - w + time.process_time() - c

        def run_plain():
            c, t = time.process_time(), time.perf_counter()
            res = fastattn.attention(qn, kn, vn, num_threads=threads)
            return time.perf_counter() - t, res, time.process_time() - c

        _, a, _ = run_dask()                                   # warm-up and check
        _, b, _ = run_plain()
        err = float(np.max(np.abs(a.astype(np.float64) - b)))
        del a, b
        times = {"dask": [], "plain": []}
        cpu = {"dask": [], "plain": []}        # CPU seconds of every process involved
        load = []                      # 1-minute load average before each pair of runs
        for _ in range(args.repeat):
            load.append(os.getloadavg()[0] if hasattr(os, "getloadavg") else None)
            for name, run in (("dask", run_dask), ("plain", run_plain)):
                t, _, c = run()
                times[name].append(t)
                cpu[name].append(c)

    flop = 4.0 * B * H * Lq * Lk * E
    summary = {
        "shape": [B, H, Lq, Lk, E], "dtype": str(dtype), "lk_chunks": args.chunks,
        "workers": args.workers, "threads_per_worker": 1,
        "fastattn_threads_in_workers": sorted(worker_threads),
        "plain_threads": threads, "graph_tasks": tasks, "max_abs_diff": err,
        "times_s": times, "cpu_s": cpu, "load_average": load,
        "median_s": {n: statistics.median(t) for n, t in times.items()},
        "min_s": {n: min(t) for n, t in times.items()},
    }
    summary["ratio_dask_over_plain"] = summary["median_s"]["dask"] / summary["median_s"]["plain"]
    med = summary["median_s"]
    print(f"shape {tuple(args.shape)} {dtype}, Lk in {args.chunks} chunks, "
          f"{args.workers} worker processes x 1 thread (fastattn threads there: "
          f"{sorted(worker_threads)}); {tasks} tasks; max |dask - plain| = {err:.2e}")
    for name, label in (("plain", f"fastattn.attention, {threads} threads"),
                        ("dask", f"fastattn.dask on LocalCluster ({args.workers} procs)")):
        ts = ", ".join(f"{t:.2f}" for t in times[name])
        cs = ", ".join(f"{c:.2f}" for c in cpu[name])
        print(f"  {label:<44} median {med[name]:7.2f} s  ({flop / med[name] / 1e9:5.1f} "
              f"GFLOP/s)  runs: {ts}  CPU s: {cs}")
    print(f"  dask / plain = {summary['ratio_dask_over_plain']:.3f} (medians), "
          f"{summary['min_s']['dask'] / summary['min_s']['plain']:.3f} (best runs); "
          f"load average before each pair: {load}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)
    if args.plot:
        plot(summary, args.plot)
    return 0


def plot(summary, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [f"fastattn.attention\n{summary['plain_threads']} threads",
             f"fastattn.dask, Lk in {summary['lk_chunks']}\n"
             f"{summary['workers']} procs x 1 thread"]
    fig, axes = plt.subplots(1, 2, figsize=(8.5, 3.6))
    for ax, field, label in ((axes[0], "times_s", "wall time (s)"),
                             (axes[1], "cpu_s", "CPU time, all processes (s)")):
        runs = [summary[field]["plain"], summary[field]["dask"]]
        med = [float(np.median(r)) for r in runs]
        bars = ax.bar(names, med, color=["#4c72b0", "#dd8452"], alpha=0.85)
        for x, r in enumerate(runs):
            ax.plot([x + 0.25] * len(r), r, "k.", label="runs" if x == 0 else None)
        ax.bar_label(bars, [f"median {m:.1f}" for m in med], label_type="center",
                     color="white")
        ax.set_ylabel(label)
        ax.set_ylim(0, max(max(r) for r in runs) * 1.15)
        ax.set_title(f"dask / plain = {med[1] / med[0]:.2f}", fontsize=10)
        ax.legend(loc="lower right", fontsize=8)
    load = [x for x in summary.get("load_average", []) if x is not None]
    note = f", load average {min(load):.1f}-{max(load):.1f}" if load else ""
    fig.suptitle(f"{tuple(summary['shape'])} {summary['dtype']}, same machine{note}",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
