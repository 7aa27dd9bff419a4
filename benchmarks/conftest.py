"""Options and fixtures of the pytest-benchmark suite (``pytest benchmarks --benchmark-only``).

The suite is not part of the test run (pytest's ``testpaths`` is ``tests``). It times
the grid of :mod:`fastattn.cli.bench` with pytest-benchmark, one group per shape so that
fastattn, the NumPy baseline and PyTorch sit side by side.
"""

import pytest

from fastattn.cli import bench


def pytest_addoption(parser):
    group = parser.getgroup("fastattn", "fastattn benchmark suite")
    group.addoption("--bench-quick", action="store_true",
                    help="only the shapes of `fastattn bench --quick`")
    group.addoption("--bench-threads", type=int, default=None, metavar="N",
                    help="threads for every contender (default: "
                         "fastattn.get_num_threads())")


def _parametrized_by_marker(metafunc, name):
    for marker in metafunc.definition.iter_markers("parametrize"):
        names = marker.args[0] if marker.args else marker.kwargs.get("argnames", "")
        if isinstance(names, str):
            names = [n.strip() for n in names.split(",")]
        if name in names:
            return True
    return False


def pytest_generate_tests(metafunc):
    """Parametrise ``case`` over the grid (``--bench-quick``: the quick grid)."""
    if "case" in metafunc.fixturenames and not _parametrized_by_marker(metafunc, "case"):
        grid = [c for c in bench.GRID if c.quick] \
            if metafunc.config.getoption("--bench-quick") else bench.GRID
        if metafunc.definition.get_closest_marker("backward"):
            grid = [c for c in grid if not c.decode]   # decode is inference only
        metafunc.parametrize("case", grid, ids=[c.id for c in grid])


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "backward: forward + backward timings (decode shapes left out)")


@pytest.fixture(scope="session")
def torch_module():
    return bench._import_torch()


@pytest.fixture(scope="session")
def threads(request, torch_module):
    """The thread count; PyTorch and NumPy's BLAS are limited to it for the session."""
    n = request.config.getoption("--bench-threads") or bench.default_threads()
    with bench.thread_limits(n, torch_module):
        yield n


_inputs_cache = {}


@pytest.fixture
def inputs(case):
    """The case's arrays, shared by the contenders of one shape (one shape kept)."""
    if case not in _inputs_cache:
        _inputs_cache.clear()
        _inputs_cache[case] = bench.make_inputs(case)
    return _inputs_cache[case]
