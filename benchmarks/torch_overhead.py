"""The cost of the PyTorch binding: time and memory of the operator over the NumPy API.

1. Time: ``fastattn.torch.scaled_dot_product_attention`` on CPU tensors against
   ``fastattn.attention`` on the same memory as pre-made NumPy arrays, and PyTorch's
   own ``scaled_dot_product_attention``, ``--threads`` threads for all, in interleaved
   rounds whose order rotates (the instrument of ``fastattn bench --torch-op``):
   the per-round ratio operator / NumPy API and the difference in microseconds. Also
   with autograd recording (inputs that require a gradient: the custom operator's
   dispatcher and autograd formula), forward only.
2. Memory: the bytes each call allocates (``tracemalloc``: NumPy's allocations, which
   is where the kernels' output goes) and whether the kernels read the tensors' own
   memory and wrote the result tensor's (data pointers): no hidden copies.

    python benchmarks/torch_overhead.py --threads 2 --shape 1 8 128 128 64

The model end to end (prefill, decode, a training step) is
``benchmarks/transformers_llama.py``. On a shared machine only ratios measured side by
side mean anything.
"""

import argparse
import tracemalloc


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", type=int, nargs=5, default=[1, 8, 128, 128, 64],
                   metavar=("B", "H", "LQ", "LK", "E"))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=31)
    p.add_argument("--time-budget", type=float, default=20.0,
                   help="seconds the rounds of one table aim at")
    return p.parse_args(argv)


def fmt(s, unit="", digits=3):
    return f"{s['median']:.{digits}f}{unit} [{s['min']:.{digits}f}-{s['max']:.{digits}f}]"


def timing(args, torch, case):
    import fastattn.torch as ft
    from fastattn.cli import bench
    from fastattn.cli.bench import timing as _timing

    settings = dict(max_rounds=args.rounds, min_rounds=args.rounds,
                    time_budget=args.time_budget, min_sample_time=0.02)
    with bench.thread_limits(args.threads, torch):
        row = bench.measure_torch_op([case], args.threads, torch_module=torch,
                                     **settings)[0]
        # the dispatcher's path: the same forward call, on inputs that require a grad
        arrays = bench.make_inputs(case)
        calls = {"numpy_api": bench.make_callable(case, "fastattn", arrays, args.threads)}
        tq, tk, tv = (torch.from_numpy(arrays[n]).requires_grad_() for n in "qkv")
        calls["operator_autograd"] = lambda: ft.scaled_dot_product_attention(
            tq, tk, tv, num_threads=args.threads)
        samples = _timing.interleaved(calls, **settings)[0]
    t = row["times_ms"]
    print(f"shape {case.label} float32, {args.threads} threads, {row['rounds']} "
          f"interleaved rounds: median [min-max]")
    for name in ("numpy_api", "operator", "torch"):
        print(f"  {name:20s} {t[name]['median'] * 1e3:9.1f} us")
    print(f"  operator / NumPy API:          {fmt(row['ratios']['overhead'], 'x')}")
    print(f"  operator - NumPy API:          {fmt(row['overhead_us'], ' us', 1)}")
    print(f"  PyTorch SDPA / operator:       {fmt(row['ratios']['vs_torch'], 'x')}")
    ratio = [a / b for a, b in zip(samples["operator_autograd"], samples["numpy_api"])]
    print(f"  with autograd recording (the custom operator's dispatcher), operator / "
          f"NumPy API: {fmt(_timing.summary(ratio), 'x')}")


def allocations(torch, case, threads):
    import fastattn
    import fastattn.torch as ft
    from fastattn.cli import bench

    arrays = bench.make_inputs(case)
    q, k, v = arrays["q"], arrays["k"], arrays["v"]
    tq, tk, tv = (torch.from_numpy(a) for a in (q, k, v))
    calls = {"NumPy API": lambda: fastattn.attention(q, k, v, num_threads=threads),
             "operator": lambda: ft.scaled_dot_product_attention(
                 tq, tk, tv, num_threads=threads)}
    out_bytes = case.B * case.H * case.Lq * case.ev * 4
    print(f"allocations per call (tracemalloc; the output is {out_bytes} bytes):")
    for name, call in calls.items():
        call()
        tracemalloc.start()
        call()
        size, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        print(f"  {name:10s} peak {peak:9d} bytes, still held {size:6d} bytes")
    seen = []
    real = ft._np_attention

    def spy(*a, **kw):
        result = real(*a, **kw)
        seen.append((a, result))
        return result
    ft._np_attention = spy
    try:
        out = ft.scaled_dot_product_attention(tq, tk, tv, num_threads=threads)
    finally:
        ft._np_attention = real
    (aq, ak, av), result = seen[-1]
    reads = all(a.__array_interface__["data"][0] == t.data_ptr()
                for a, t in ((aq, tq), (ak, tk), (av, tv)))
    writes = result.__array_interface__["data"][0] == out.data_ptr()
    print(f"  the kernels read the tensors in place: {reads}; the result tensor is "
          f"the kernels' output buffer: {writes}")


def main(argv=None):
    args = parse_args(argv)
    import torch

    import fastattn
    from fastattn.cli.bench import Case

    fastattn.set_num_threads(args.threads)
    case = Case(*args.shape)
    timing(args, torch, case)
    allocations(torch, case, args.threads)


if __name__ == "__main__":
    main()
