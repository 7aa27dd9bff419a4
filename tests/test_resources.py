"""Resources: no memory growth over many calls, absurd sizes raise instead of
crashing, and 64-bit index arithmetic in the kernels."""

import os
import pathlib
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import fastattn

from helpers import OUTSIDE_SOURCE

SANITIZED = os.environ.get("FASTATTN_SANITIZED") == "1"     # set by tools/*.sh
CALLS = 10_000
GROWTH_LIMIT = 20 * 2**20        # bytes of RSS growth tolerated over CALLS calls
PACKAGE = pathlib.Path(fastattn.__file__).parent


def _rss() -> int:
    """Resident set size of this process in bytes (Linux); None elsewhere."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return None


def _calls():
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, 33, 16))
    k = rng.standard_normal((2, 65, 16))
    v = rng.standard_normal((2, 65, 8))
    q32, k32, v32 = (a.astype(np.float32) for a in (q, k, v))
    mask = rng.random((33, 65)) < 0.9
    bias = rng.standard_normal((33, 65))
    out = np.empty((2, 33, 8))
    x = rng.standard_normal((8, 100))
    p = fastattn.softmax(rng.standard_normal((2, 33, 65)))

    def bad_call():
        try:
            fastattn.attention(q, k, v[..., :5, :])
        except ValueError:
            pass

    calls = {
        "attention": lambda: fastattn.attention(q, k, v, mask=mask, bias=bias,
                                                causal=True, return_lse=True),
        "attention_f32": lambda: fastattn.attention(q32, k32, v32, num_threads=1),
        "attention_out": lambda: fastattn.attention(q, k, v, out=out),
        "scores": lambda: fastattn.scores(q, k, mask=mask),
        "attention_weights": lambda: fastattn.attention_weights(q32, k32, bias=bias),
        "softmax": lambda: fastattn.softmax(x, axis=0),
        "weighted_sum": lambda: fastattn.weighted_sum(p, v),
        "errors": bad_call,
    }
    if hasattr(fastattn, "attention_backward"):
        o, lse = fastattn.attention(q, k, v, return_lse=True, causal=True)
        g = np.ones_like(o)
        calls["attention_backward"] = lambda: fastattn.attention_backward(
            g, q, k, v, o, lse, causal=True)
    if hasattr(fastattn, "merge_partials"):
        o1, l1 = fastattn.attention(q, k, v, return_lse=True)
        o2, l2 = fastattn.attention(q, k[:, :7], v[:, :7], return_lse=True)
        calls["merge_partials"] = lambda: fastattn.merge_partials([o1, o2], [l1, l2])
    if hasattr(fastattn, "positional_encoding"):
        calls["positional_encoding"] = lambda: fastattn.positional_encoding(50, 16)
    if hasattr(fastattn, "MultiHeadAttention"):
        mha = fastattn.MultiHeadAttention(16, 2, seed=0)
        xs = rng.standard_normal((2, 20, 16)).astype(np.float32)
        calls["MultiHeadAttention"] = lambda: mha(xs, causal=True, need_weights=True)
    return calls


@pytest.mark.skipif(_rss() is None, reason="needs /proc/self/statm")
@pytest.mark.skipif(SANITIZED, reason="AddressSanitizer's quarantine holds freed memory")
@pytest.mark.parametrize("name", list(_calls()))
def test_no_memory_growth_over_many_calls(name):
    # One thread: the buffers are the same on any number, and small calls on several
    # threads are slow on a loaded machine (each waits for its whole team).
    call = _calls()[name]
    try:
        fastattn.set_num_threads(1)
        for _ in range(300):              # warm up: caches, thread pools, allocator
            call()
        before = _rss()
        for _ in range(CALLS):
            call()
        growth = _rss() - before
    finally:
        fastattn.set_num_threads(None)
    assert growth < GROWTH_LIMIT, f"{name}: RSS grew by {growth / 2**20:.1f} MiB"


# ----------------------------------------------------------------- absurd sizes

BIG = 2**40      # elements; every request below needs far more than any address space


def _huge(shape, dtype=np.float64):
    """A read-only broadcast view of the given (huge) shape: no memory behind it."""
    return np.broadcast_to(np.ones((1,) * len(shape), dtype), shape)


@pytest.mark.parametrize("call", [
    lambda: fastattn.attention(np.ones((2, 256)), _huge((BIG, 256)), _huge((BIG, 4))),
    lambda: fastattn.attention(_huge((2**24, 1, 2, 64)), _huge((1, 2**24, 3, 64)),
                               _huge((1, 2**24, 3, 64))),
    lambda: fastattn.attention(np.ones((4, 8)), np.ones((5, 8)), np.ones((5, 2)),
                               mask=_huge((2**20, 2**20, 4, 5), bool)),
    lambda: fastattn.scores(_huge((2**24, 64)), _huge((2**24, 64))),
    lambda: fastattn.attention_weights(_huge((2**24, 64)), _huge((2**24, 64))),
    lambda: fastattn.softmax(_huge((2**20, 2**28))),
    lambda: fastattn.weighted_sum(_huge((2**24, 2**24)), np.ones((2**24, 1))),
    lambda: fastattn.attention(np.empty((2**44, 0)), np.empty((3, 0)), np.empty((3, 1)),
                               scale=1.0),
    lambda: fastattn.attention(np.empty((2**44, 0)), np.empty((3, 0)), np.empty((3, 0)),
                               scale=1.0, return_lse=True),
    lambda: fastattn.attention(np.ones((4, 8)), np.ones((5, 8)), np.ones((5, 2)),
                               out=_huge((4, 2))),
], ids=["Lk", "batch", "mask", "scores", "weights", "softmax", "weighted_sum",
        "out_rows", "lse_rows", "readonly_out"])
def test_absurd_sizes_raise(call):
    with pytest.raises((MemoryError, ValueError)):
        call()


@pytest.mark.parametrize("name", ["positional_encoding", "MultiHeadAttention"])
def test_absurd_sizes_raise_transformer(name):
    if not hasattr(fastattn, name):
        pytest.skip(f"fastattn.{name} does not exist yet")
    with pytest.raises((MemoryError, ValueError)):
        if name == "positional_encoding":
            fastattn.positional_encoding(2**40, 2**12)
        else:
            fastattn.MultiHeadAttention(2**30, 1)


def test_empty_results_with_absurd_row_counts_return_at_once():
    """An empty result needs no work, however many empty rows it has."""
    out = fastattn.attention(np.empty((2**44, 0)), np.empty((3, 0)), np.empty((3, 0)),
                             scale=1.0)
    assert out.shape == (2**44, 0)
    assert fastattn.scores(np.empty((2**44, 0)), np.empty((0, 0)), scale=1.0).shape == (
        2**44, 0)
    assert fastattn.weighted_sum(np.empty((2**44, 0)), np.empty((0, 0))).shape == (2**44, 0)


@pytest.mark.skipif(SANITIZED or not hasattr(os, "fork"),
                    reason="sanitizers need more address space than this test allows")
def test_absurd_num_threads_under_an_address_space_limit():
    """num_threads=10**4 is capped at the usable cores: OpenMP is never asked to
    create thousands of threads (it aborts the process when it cannot)."""
    code = textwrap.dedent("""
        import resource
        import numpy as np, fastattn
        resource.setrlimit(resource.RLIMIT_AS, (3 * 2**30, 3 * 2**30))
        q = np.ones((4000, 1, 2))
        print(fastattn.attention(q, q, q, num_threads=10**4).shape)
    """)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, cwd=OUTSIDE_SOURCE)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "(4000, 1, 2)"


@pytest.mark.skipif(SANITIZED or not os.path.exists("/proc/self/task"),
                    reason="sanitizers need more address space than this test allows")
@pytest.mark.skipif(not fastattn._openmp.openmp_enabled()
                    or fastattn._config._usable_cores() < 2,
                    reason="needs OpenMP and two usable cores")
def test_threads_that_cannot_start_under_an_address_space_limit():
    """Under ulimit -v, a thread of an OpenMP team whose stack does not fit made
    libgomp exit(1) ("Thread creation failed"). fastattn now probes first: the calls
    run on the threads that can start, with one RuntimeWarning, and give the same
    results. OMP_STACKSIZE=1G makes one more thread need 1 GiB of address space, while
    the limit leaves 256 MiB: the outcome does not depend on the machine."""
    code = textwrap.dedent("""
        import os, resource, threading, time, warnings
        import numpy as np, fastattn

        def vm_size():
            with open("/proc/self/status") as f:
                return next(int(line.split()[1]) * 1024 for line in f
                            if line.startswith("VmSize:"))

        def threads(expected):
            # a joined Python thread may take a moment to leave /proc/self/task
            for _ in range(100):
                n = len(os.listdir("/proc/self/task"))
                if n <= expected:
                    break
                time.sleep(0.01)
            return n

        rng = np.random.default_rng(0)
        q, k, v = (rng.standard_normal((4, 300, 32)) for _ in range(3))
        expected = fastattn.attention(q, k, v, num_threads=1)
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        resource.setrlimit(resource.RLIMIT_AS, (vm_size() + 256 * 2**20, hard))
        before = len(os.listdir("/proc/self/task"))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = [fastattn.attention(q, k, v, num_threads=2) for _ in range(3)]
            # another Python thread has its own OpenMP team, so it probes too
            t = threading.Thread(
                target=lambda: got.append(fastattn.attention(q, k, v, num_threads=2)))
            t.start()
            t.join()
        assert threads(before) == before, "a thread of the team was started"
        assert len(got) == 4 and all(np.array_equal(g, expected) for g in got)
        warned = [str(w.message) for w in caught if w.category is RuntimeWarning]
        assert len(warned) == 1 and "only 1 of 2 threads" in warned[0], warned

        # room for the 1 GiB stack: the next call probes again and gets both threads
        resource.setrlimit(resource.RLIMIT_AS, (vm_size() + 3 * 2**30, hard))
        assert np.array_equal(fastattn.attention(q, k, v, num_threads=2), expected)
        assert threads(before + 1) == before + 1, "the team's 2nd thread did not start"
        print("ok")
    """)
    env = dict(os.environ, OMP_STACKSIZE="1G")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, cwd=OUTSIDE_SOURCE, env=env)
    assert res.returncode == 0, (res.returncode, res.stderr)
    assert res.stdout.strip() == "ok"


# ------------------------------------------------------------ 64-bit indexing

# C integer types narrower than Py_ssize_t may only hold thread counts and flags.
_NARROW = re.compile(r"\b(?:unsigned\s+|signed\s+)?(?:int|long|short|int32_t|uint32_t)"
                     r"\s*\*?\s+(\w+)\s*(?=[=,);\n])")
_ALLOWED = re.compile(r"^(n?t|\w*_?threads|tid|thread|causal|"
                      r"ok|status|err|rc|flag\w*|\w*_enabled|dropout_\w+)$")


def test_index_arithmetic_is_64_bit():
    offenders = []
    for path in sorted(PACKAGE.glob("*.pyx")) + sorted(PACKAGE.glob("*.pxd")):
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#")[0]
            if code.lstrip().startswith("union"):   # a float's bit pattern, not a size
                continue
            for name in _NARROW.findall(code):
                if not _ALLOWED.match(name):
                    offenders.append(f"{path.name}:{lineno}: {line.strip()}")
    assert not offenders, ("sizes and indices must be Py_ssize_t:\n" + "\n".join(offenders))


def test_no_negative_index_where_cython_does_not_wrap_it():
    """The modules are compiled with wraparound=False (setup.py): there ``x[-1]`` is
    passed on unwrapped, which NumPy >= 2.5 rejects (and a C array reads before its
    start). Only a module that turns wraparound back on may use negative indices."""
    offenders = []
    for path in sorted(PACKAGE.glob("*.py[xd]")) + sorted(PACKAGE.glob("*.pxi")):
        text = path.read_text()
        if "wraparound=True" in text.split("\n", 1)[0]:
            continue
        for lineno, line in enumerate(text.splitlines(), 1):
            code = line.split("#")[0]
            if re.search(r"[\w\])]\[-\s*\d", code):
                offenders.append(f"{path.name}:{lineno}: {line.strip()}")
    assert not offenders, "\n".join(offenders)


@pytest.mark.skipif(SANITIZED, reason="8 GiB of address space: too much for sanitizers")
def test_a_slice_of_more_than_2_31_elements():
    """Keys of 2**25 + 3 rows x 64 = 2**31 + 192 elements in one slice: every pointer
    offset past 2**31 must be computed in 64 bits. The 8 GiB of keys are zeros from
    calloc, i.e. untouched pages: little real memory is used."""
    Lk = 2**25 + 3
    try:
        k = np.zeros((Lk, 64), np.float32)
    except MemoryError:
        pytest.skip("cannot reserve 8 GiB of address space here")
    k[-1] = 1.0                         # only the last key scores above the others
    v = np.zeros((Lk, 1), np.float32)
    v[-1] = 7.0
    q = np.full((1, 64), 100.0, np.float32)
    out, lse = fastattn.attention(q, k, v, scale=1.0, return_lse=True)
    np.testing.assert_array_equal(out, [[7.0]])
    np.testing.assert_allclose(lse, [6400.0], rtol=1e-6)
