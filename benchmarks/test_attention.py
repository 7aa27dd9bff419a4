"""fastattn vs the NumPy baseline vs PyTorch SDPA over the grid of ``fastattn bench``.

Run with ``pytest benchmarks --benchmark-only`` (``--bench-quick`` for the short grid,
``--bench-threads N``; ``-k forward`` or ``-k backward``). Each shape is one
``benchmark.group``; ``extra_info`` holds the flops (and K/V bytes for decode) so that
GFLOP/s can be read from ``--benchmark-json`` (the flops of a variant case count only
the pairs it allows; ``extra_info`` also names the variants and, for PyTorch, what it
ran: SDPA with a boolean or float mask, or an eager composition for softcap). The interleaved, ratio-based
comparison is ``fastattn bench``; this suite gives pytest-benchmark's statistics and
its history (``--benchmark-autosave``, ``--benchmark-compare``).
"""

import pytest

from fastattn.cli import bench


def _run(benchmark, case, contender, inputs, threads, torch_module, backward):
    if contender == "numpy" and not case.baseline:
        pytest.skip("the NumPy baseline is left out of this shape (it forms the whole "
                    "score matrix: tens of seconds a call)")
    try:
        fn = bench.make_callable(case, contender, inputs, threads, backward=backward,
                                 torch_module=torch_module)
    except bench.Unavailable as exc:
        pytest.skip(str(exc))
    mode = "forward+backward" if backward else "forward"
    benchmark.group = f"{mode} {case.label}"
    benchmark.extra_info.update(
        contender=contender, threads=threads, flops=case.flops(backward),
        kv_bytes=case.kv_bytes(), decode=case.decode, dtype=case.dtype,
        window=case.window, softcap=case.softcap, alibi=case.alibi,
        lengths=case.lengths, ragged=case.ragged_flavour,
        torch_runs=bench.torch_implementation(case) if contender == "torch" else None)
    benchmark(fn)
    stats = benchmark.stats.stats if benchmark.stats is not None else None
    if stats is not None and stats.median > 0:
        benchmark.extra_info["gflops"] = case.flops(backward) / stats.median / 1e9
        if case.decode:
            benchmark.extra_info["gbs"] = case.kv_bytes() / stats.median / 1e9


@pytest.mark.parametrize("contender", bench.CONTENDERS)
def test_forward(benchmark, case, contender, inputs, threads, torch_module):
    _run(benchmark, case, contender, inputs, threads, torch_module, backward=False)


@pytest.mark.backward
@pytest.mark.parametrize("contender", bench.CONTENDERS)
def test_backward(benchmark, case, contender, inputs, threads, torch_module):
    _run(benchmark, case, contender, inputs, threads, torch_module, backward=True)
