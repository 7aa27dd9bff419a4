"""pytest-benchmark suite over the grid of ``fastattn bench``.

Run with ``pytest benchmarks --benchmark-only`` (not part of the test run). Each shape
is a benchmark group, so fastattn, the NumPy baseline and PyTorch (when installed) sit
side by side in the table; ``--benchmark-only -k 2048`` picks shapes. Add
``--benchmark-json PATH`` to keep the numbers. For ratios measured in interleaved
rounds, use ``fastattn bench`` instead.
"""

import pytest

from fastattn import bench

CONTENDERS = ["fastattn", "numpy", "torch"]


@pytest.fixture(scope="module")
def torch_module():
    return bench._import_torch()


@pytest.mark.parametrize("backward", [False, True], ids=["forward", "backward"])
@pytest.mark.parametrize("contender", CONTENDERS)
@pytest.mark.parametrize("case", bench.GRID, ids=[c.id for c in bench.GRID])
def test_speed(benchmark, case, contender, backward, torch_module):
    if backward and case.decode:
        pytest.skip("forward+backward is not timed for decode shapes")
    if contender == "torch" and torch_module is None:
        pytest.skip("PyTorch is not installed")
    threads = bench.default_threads()
    arrays = bench.make_inputs(case)
    fn = bench.make_callable(case, contender, arrays, threads, backward=backward,
                             torch_module=torch_module)
    benchmark.group = f"{case.label} {'forward+backward' if backward else 'forward'}"
    benchmark.extra_info.update(flops=case.flops(backward), threads=threads)
    with bench.thread_limits(threads, torch_module):
        benchmark.pedantic(fn, warmup_rounds=1, rounds=5 if case.Lq >= 2048 else 10)
