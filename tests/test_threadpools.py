"""Thread pools: threadpoolctl and OMP_NUM_THREADS are honoured, show_config names the
OpenMP runtime, and fastattn called inside another OpenMP team does not oversubscribe.

Thread counts are observed from outside: the number of OS threads of a fresh process
(/proc/self/task, Linux) before and after a call. OpenMP runtimes keep their worker
threads alive between parallel regions, so a call that ran on n threads leaves n - 1
more threads behind.
"""

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import fastattn
from fastattn import _config, _openmp

from extending_build import consumer  # noqa: F401 (a fixture)
from helpers import assert_close, randn

needs_openmp = pytest.mark.skipif(not _openmp.openmp_enabled(),
                                  reason="fastattn was built without OpenMP")
needs_proc = pytest.mark.skipif(not os.path.isdir("/proc/self/task"),
                                reason="counting threads needs /proc (Linux)")

# A fresh process that reports the OS threads it has before and after one call.
COUNT_THREADS = textwrap.dedent("""
    import json, os, sys
    import numpy as np
    import fastattn

    def threads():
        return len(os.listdir("/proc/self/task"))

    q = np.random.default_rng(0).standard_normal((8, 256, 32))
    before = threads()
    limit = json.loads(sys.argv[1])
    if limit is None:
        fastattn.attention(q, q, q)
        used = fastattn.get_num_threads()
    else:
        from threadpoolctl import threadpool_limits
        with threadpool_limits(limit, user_api="openmp"):
            fastattn.attention(q, q, q)
            used = fastattn.get_num_threads()
    print(json.dumps({"before": before, "after": threads(), "used": used}))
""")


def count_threads(tmp_path, limit=None, **env):
    environ = {key: value for key, value in os.environ.items()
               if key not in ("OMP_NUM_THREADS", "OMP_MAX_ACTIVE_LEVELS", "OMP_NESTED")}
    environ.update(env)
    environ["PYTHONPATH"] = os.pathsep.join(
        [os.path.dirname(os.path.dirname(os.path.abspath(fastattn.__file__)))]
        + ([environ["PYTHONPATH"]] if environ.get("PYTHONPATH") else []))
    res = subprocess.run([sys.executable, "-c", COUNT_THREADS, json.dumps(limit)],
                         env=environ, cwd=tmp_path, capture_output=True, text=True,
                         check=True, timeout=120)
    return json.loads(res.stdout)


def two_or_more():
    if _config._usable_cores() < 2:
        pytest.skip("needs at least two usable cores")


# ------------------------------------------------------------------ threadpoolctl

@needs_openmp
def test_threadpool_limits_sets_the_default(rng):
    threadpoolctl = pytest.importorskip("threadpoolctl")
    default = fastattn.get_num_threads()
    x = randn(rng, (4, 130, 16))
    want = fastattn.attention(x, x, x)
    with threadpoolctl.threadpool_limits(1, user_api="openmp"):
        assert fastattn.get_num_threads() == 1
        np.testing.assert_array_equal(fastattn.attention(x, x, x), want)
    assert fastattn.get_num_threads() == default


@needs_openmp
def test_threadpoolctl_sees_fastattns_runtime():
    threadpoolctl = pytest.importorskip("threadpoolctl")
    libs = [lib for lib in threadpoolctl.threadpool_info() if lib["user_api"] == "openmp"]
    assert libs, "threadpoolctl finds no OpenMP runtime after `import fastattn`"
    with threadpoolctl.threadpool_limits(1, user_api="openmp"):
        assert all(lib["num_threads"] == 1 for lib in threadpoolctl.threadpool_info()
                   if lib["user_api"] == "openmp")


@needs_openmp
@needs_proc
def test_threadpool_limits_caps_the_threads_a_call_starts(tmp_path):
    pytest.importorskip("threadpoolctl")
    two_or_more()
    one = count_threads(tmp_path, limit=1)
    assert one["used"] == 1 and one["after"] == one["before"]
    two = count_threads(tmp_path, limit=2)
    assert two["used"] == 2 and two["after"] == two["before"] + 1


# ---------------------------------------------------------------- OMP_NUM_THREADS

@needs_openmp
@needs_proc
def test_omp_num_threads_caps_the_threads_a_call_starts(tmp_path):
    two_or_more()
    one = count_threads(tmp_path, OMP_NUM_THREADS="1")
    assert one["used"] == 1 and one["after"] == one["before"]
    two = count_threads(tmp_path, OMP_NUM_THREADS="2")
    assert two["used"] == 2 and two["after"] == two["before"] + 1


def test_set_num_threads_wins_over_threadpool_limits():
    threadpoolctl = pytest.importorskip("threadpoolctl")
    try:
        fastattn.set_num_threads(2)
        with threadpoolctl.threadpool_limits(1, user_api="openmp"):
            assert fastattn.get_num_threads() == (2 if _openmp.openmp_enabled() else 1)
    finally:
        fastattn.set_num_threads(None)


# -------------------------------------------------------------------- show_config

@needs_openmp
def test_show_config_names_the_openmp_runtime(capsys):
    runtime = _config.config()["openmp_runtime"]
    assert "omp" in runtime.lower(), runtime          # libgomp, libomp, libiomp, vcomp
    fastattn.show_config()
    assert "openmp_runtime" in capsys.readouterr().out


@needs_openmp
@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="Linux only")
def test_openmp_runtime_without_threadpoolctl(monkeypatch):
    monkeypatch.setitem(sys.modules, "threadpoolctl", None)     # import fails
    found = _config._openmp_runtimes()
    assert found and all("omp" in os.path.basename(path) for path in found)


# -------------------------------------------------- inside another OpenMP program

NESTED = textwrap.dedent("""
    import importlib.util, json, os, sys
    import numpy as np
    import fastattn

    spec = importlib.util.spec_from_file_location("fastattn_consumer", sys.argv[1])
    consumer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(consumer)

    def threads():
        return len(os.listdir("/proc/self/task"))

    q = np.random.default_rng(0).standard_normal((8, 256, 32))
    want = fastattn.reference.attention(q, q, q)
    before = threads()
    seen, errors = [], []

    def call():
        out = fastattn.attention(q, q, q)
        seen.append(threads())
        errors.append(float(np.abs(out - want).max()))

    consumer.call_from_team(call, 2)        # an OpenMP team of 2, each calls fastattn
    print(json.dumps({"before": before, "during": max(seen), "calls": len(seen),
                      "error": max(errors), "threads": fastattn.get_num_threads()}))
""")


@needs_openmp
@needs_proc
def test_no_oversubscription_inside_another_openmp_team(consumer, tmp_path):
    """Called from each thread of someone else's parallel region, fastattn does not
    start a team per caller: nested regions are inactive (OpenMP's default
    max-active-levels of 1), so the process never holds more than the outer team."""
    two_or_more()
    env = {key: value for key, value in os.environ.items()
           if key not in ("OMP_MAX_ACTIVE_LEVELS", "OMP_NESTED")}
    env["OMP_NUM_THREADS"] = "2"
    env["PYTHONPATH"] = os.pathsep.join(
        [os.path.dirname(os.path.dirname(os.path.abspath(fastattn.__file__)))]
        + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    res = subprocess.run([sys.executable, "-c", NESTED, consumer.__file__], env=env,
                         cwd=tmp_path, capture_output=True, text=True, check=True,
                         timeout=120)
    got = json.loads(res.stdout)
    assert got["calls"] == 2 and got["error"] < 1e-12
    # the outer team adds one thread; nested fastattn teams would add one per caller
    assert got["during"] <= got["before"] + 1, got


def test_the_c_level_api_runs_in_the_callers_threads(consumer, rng):
    """The kernels of kernels.pxd are serial: a caller's prange decides the threads."""
    q = randn(rng, (6, 40, 8))
    out = np.empty((6, 40, 8))
    rc = consumer.attention(q.ravel(), q.ravel(), q.ravel(), out.ravel(),
                            np.empty(0), 6, 40, 40, 8, 8, 8 ** -0.5, 0, 3)
    assert (rc == 0).all()
    assert_close(out, fastattn.reference.attention(q, q, q), np.float64)
