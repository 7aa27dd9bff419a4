"""Python threads, OpenMP settings and fork: the rules of docs/robustness.md."""

import json
import os
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

import fastattn
from fastattn import _config, _openmp

from helpers import OUTSIDE_SOURCE

N_THREADS = 8
openmp_only = pytest.mark.skipif(not _openmp.openmp_enabled(),
                                 reason="built without OpenMP")


def _inputs(seed):
    """Different shapes, dtypes, masks and options for each Python thread (float16:
    the float32 intermediates in each thread's kept scratch)."""
    rng = np.random.default_rng(seed)
    dtype = [np.float32, np.float64, np.float16, np.float32][seed % 4]
    Lq, Lk = 20 + 13 * seed, 150 - 9 * seed
    q = rng.standard_normal((2, 2, Lq, 16)).astype(dtype)
    k = rng.standard_normal((2, 1, Lk, 16)).astype(dtype)
    v = rng.standard_normal((2, 1, Lk, 8)).astype(dtype)
    kw = dict(mask=rng.random((Lq, Lk)) < 0.8, causal=[False, True, "bottom_right"][seed % 3],
              enable_gqa=True)
    return (q, k, v), kw


def _work(args, kw, num_threads):
    out, lse = fastattn.attention(*args, return_lse=True, num_threads=num_threads, **kw)
    results = [out, lse]
    if hasattr(fastattn, "attention_backward"):
        grad = np.ones_like(out)
        results += fastattn.attention_backward(grad, *args, out, lse,
                                               num_threads=num_threads, **kw)
    return results


def test_concurrent_calls_give_the_single_threaded_results():
    cases = [_inputs(seed) for seed in range(N_THREADS)]
    expected = [_work(args, kw, 1) for args, kw in cases]
    got = [None] * N_THREADS
    errors = []
    barrier = threading.Barrier(N_THREADS)

    def run(i):
        try:
            barrier.wait()
            for rep in range(5):
                got[i] = _work(*cases[i], [None, 1, 2, 3][(i + rep) % 4])
                for a, b in zip(got[i], expected[i]):
                    np.testing.assert_array_equal(a, b)
        except Exception as exc:            # noqa: BLE001 - reported below
            errors.append((i, exc))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(N_THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert all(g is not None for g in got)


def _long_call(fn_name):
    """Arguments of a call of at least ~0.15 s on one thread, found by doubling."""
    rng = np.random.default_rng(0)
    Lk = 256
    while True:
        q = rng.standard_normal((1, 512, 64))
        k = rng.standard_normal((1, Lk, 64))
        v = rng.standard_normal((1, Lk, 64))
        if fn_name == "attention":
            call = lambda: fastattn.attention(q, k, v, num_threads=1)  # noqa: E731
        else:
            out, lse = fastattn.attention(q, k, v, return_lse=True)
            call = lambda: fastattn.attention_backward(  # noqa: E731
                np.ones_like(out), q, k, v, out, lse, num_threads=1)
        t0 = time.perf_counter()
        call()
        if time.perf_counter() - t0 > 0.15 or Lk >= 2**17:
            return call
        Lk *= 2


@pytest.mark.parametrize("fn_name", ["attention", "attention_backward"])
def test_the_gil_is_released(fn_name):
    """Another Python thread keeps running while a long call computes."""
    if not hasattr(fastattn, fn_name):
        pytest.skip(f"fastattn.{fn_name} does not exist yet")
    call = _long_call(fn_name)

    def count(seconds):
        n, end = 0, time.perf_counter() + seconds
        while time.perf_counter() < end:
            n += 1
        return n

    rate = count(0.1) / 0.1                   # Python loop iterations per second, alone
    started, done = threading.Event(), threading.Event()
    took = []

    def worker():
        started.set()
        t0 = time.perf_counter()
        call()
        took.append(time.perf_counter() - t0)
        done.set()

    t = threading.Thread(target=worker)
    t.start()
    started.wait()
    n = 0
    while not done.is_set():
        n += 1
    t.join()
    # With the GIL held the counter would only move before and after the kernels.
    assert n > 0.2 * rate * took[0], (n, rate, took)


@openmp_only
def test_num_threads_is_per_call_and_set_num_threads_is_process_wide():
    default = fastattn.get_num_threads()
    seen, errors = [], []
    stop = threading.Event()
    (q, k, v), kw = _inputs(1)

    def per_call():
        try:
            while not stop.is_set():
                fastattn.attention(q, k, v, num_threads=1, **kw)
        except Exception as exc:            # noqa: BLE001
            errors.append(exc)

    def observer():
        for _ in range(200):
            seen.append(fastattn.get_num_threads())

    a = threading.Thread(target=per_call)
    a.start()
    b = threading.Thread(target=observer)
    b.start()
    b.join()
    stop.set()
    a.join()
    assert not errors and set(seen) == {default}    # num_threads= changed nothing

    got = []
    try:
        fastattn.set_num_threads(1)
        t = threading.Thread(target=lambda: got.append(fastattn.get_num_threads()))
        t.start()
        t.join()
    finally:
        fastattn.set_num_threads(None)
    assert got == [1]                               # set_num_threads: every thread
    assert fastattn.get_num_threads() == default


@openmp_only
def test_thread_counts_are_capped_at_the_usable_cores():
    cores = _config._usable_cores()
    assert _config.resolve_num_threads(10**9) == cores
    assert _config.resolve_num_threads(np.uint64(2**64 - 1)) == cores
    try:
        fastattn.set_num_threads(10**6)
        assert fastattn.get_num_threads() == 10**6      # the setting is kept as given
        assert _config.resolve_num_threads(None) == cores
    finally:
        fastattn.set_num_threads(None)
    (q, k, v), kw = _inputs(2)
    np.testing.assert_array_equal(fastattn.attention(q, k, v, num_threads=10**6, **kw),
                                  fastattn.attention(q, k, v, num_threads=1, **kw))


@openmp_only
def test_inside_a_threadpoolctl_openmp_limit():
    threadpoolctl = pytest.importorskip("threadpoolctl")
    (q, k, v), kw = _inputs(3)
    want = fastattn.attention(q, k, v, **kw)
    default = fastattn.get_num_threads()
    other = []
    with threadpoolctl.threadpool_limits(limits=1, user_api="openmp"):
        assert fastattn.get_num_threads() == 1
        np.testing.assert_array_equal(fastattn.attention(q, k, v, **kw), want)
        # OpenMP's setting belongs to the thread that made it
        t = threading.Thread(target=lambda: other.append(fastattn.get_num_threads()))
        t.start()
        t.join()
        try:
            fastattn.set_num_threads(2)              # set_num_threads wins over it
            assert fastattn.get_num_threads() == 2
        finally:
            fastattn.set_num_threads(None)
    assert other == [default]
    assert fastattn.get_num_threads() == default


def _run_python(code, env=None, timeout=120):
    env = dict(os.environ, **(env or {}))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env,
                          capture_output=True, text=True, timeout=timeout,
                          cwd=OUTSIDE_SOURCE)


@openmp_only
def test_openmp_environment_settings_do_not_change_results(tmp_path):
    code = """
        import numpy as np, fastattn
        rng = np.random.default_rng(5)
        q, k, v = (rng.standard_normal((3, 130, 16)) for _ in range(3))
        out = fastattn.attention(q, k, v, causal=True)
        print(out.tobytes().hex()[:4000], fastattn.get_num_threads())
    """
    base = _run_python(code)
    assert base.returncode == 0, base.stderr
    for env in ({"OMP_NUM_THREADS": "1"}, {"OMP_THREAD_LIMIT": "1"},
                {"OMP_DYNAMIC": "TRUE", "OMP_NUM_THREADS": "4"},
                {"OMP_PROC_BIND": "TRUE", "OMP_WAIT_POLICY": "PASSIVE"},
                # small thread stacks, the workaround docs/robustness.md gives for
                # ulimit -v: the kernels need only a few KiB of stack
                {"OMP_STACKSIZE": "256K", "OMP_NUM_THREADS": "2"}):
        res = _run_python(code, env)
        assert res.returncode == 0, (env, res.stderr)
        assert res.stdout.split()[0] == base.stdout.split()[0], env


@openmp_only
@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork() here")
def test_fork_after_parallel_calls_does_not_hang():
    """GNU OpenMP's thread pool does not survive fork(): a child of a process that
    already ran parallel calls runs serial instead of waiting forever."""
    code = """
        import multiprocessing as mp, numpy as np, fastattn
        q = np.random.default_rng(0).standard_normal((4, 200, 32))
        want = fastattn.attention(q, q, q, num_threads=2)
        def child(_):
            out = fastattn.attention(q, q, q, num_threads=2)
            return fastattn.get_num_threads(), bool((out == want).all())
        with mp.get_context("fork").Pool(2) as pool:
            print(pool.map(child, range(4)))
    """
    res = _run_python(code, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == str([(1, True)] * 4)


TEAM_PROBE = """
import json, os, numpy as np, fastattn
from fastattn import _config
_config._usable_cores = lambda: 4       # a team of 4, whatever the cores here
rng = np.random.default_rng(0)
def arrays(*shape):
    return [rng.standard_normal(shape).astype(np.float32) for _ in range(3)]
many = arrays(2, 4, 256, 32)            # 32 tiles: a team of 4
few = arrays(1, 3, 64, 32)              # 3 tiles: 3 would do
one = arrays(1, 1, 64, 32)              # 1 tile: no team
def tasks():
    return sorted(os.listdir("/proc/self/task"))
fastattn.attention(*many, num_threads=4)
before = tasks()
for _ in range(3):
    fastattn.attention(*few, num_threads=4)
    fastattn.attention(*one, num_threads=4)
    out, lse = fastattn.attention(*few, return_lse=True, num_threads=4)
    fastattn.attention_backward(out, *few, out, lse, num_threads=4)
    fastattn.attention(few[0][:, :, :1], *few[1:], num_threads=4)      # decoding
    fastattn.set_num_threads(4)
    fastattn.weighted_sum(fastattn.attention_weights(few[0], few[1]), few[2])
    fastattn.set_num_threads(None)
    fastattn.attention(*many, num_threads=4)
print(json.dumps({"before": before, "after": tasks()}))
"""


@openmp_only
@pytest.mark.skipif(not os.path.isdir("/proc/self/task"),
                    reason="needs /proc/self/task")
def test_calls_with_fewer_items_than_threads_keep_the_openmp_threads():
    """Every parallel region of a call runs on the call's whole team (or alone, for one
    work item), so that OpenMP's pool keeps its threads from call to call: libgomp
    ends the threads a smaller team leaves out and starts new ones for the next larger
    team. The same threads (by their ids) before and after calls of 1, 3 and 32 items
    on 4 threads: forward, backward, decoding, weights and weighted sums."""
    res = subprocess.run([sys.executable, "-c", TEAM_PROBE], capture_output=True,
                         text=True, cwd=OUTSIDE_SOURCE, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    got = json.loads(res.stdout)
    assert got["after"] == got["before"]
