"""Threads, show_config, the command line and the build."""

import os
import subprocess
import sys
import threading

import numpy as np
import pytest

import fastattn
from fastattn import _config, _openmp


def test_set_and_get_num_threads():
    default = fastattn.get_num_threads()
    assert default >= 1
    try:
        fastattn.set_num_threads(3)
        assert fastattn.get_num_threads() == (3 if _openmp.openmp_enabled() else 1)
        fastattn.set_num_threads(np.int32(1))
        assert fastattn.get_num_threads() == 1
    finally:
        fastattn.set_num_threads(None)
    assert fastattn.get_num_threads() == default


@pytest.mark.parametrize("bad,exc", [(0, ValueError), (-1, ValueError), (True, TypeError),
                                     (2.0, TypeError), ("2", TypeError)])
def test_set_num_threads_rejects(bad, exc):
    with pytest.raises(exc, match="n must"):
        fastattn.set_num_threads(bad)


def test_default_threads_follow_omp_num_threads(tmp_path):
    code = "import fastattn; print(fastattn.get_num_threads())"
    env = dict(os.environ, OMP_NUM_THREADS="3")
    got = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, check=True, cwd=tmp_path).stdout.strip()
    assert got == ("3" if _openmp.openmp_enabled() else "1")
    env.pop("OMP_NUM_THREADS")
    got = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, check=True, cwd=tmp_path).stdout.strip()
    expect = _config._usable_cores() if _openmp.openmp_enabled() else 1
    assert got == str(expect)


@pytest.mark.parametrize("text,size", [("64m", 64 << 20), ("100", 100 << 10),
                                       (" 2 G ", 2 << 30), ("512b", 512), ("1K", 1024),
                                       ("", None), ("1.5M", None), ("4T", None)])
def test_omp_stacksize_is_read_as_gnu_openmp_reads_it(text, size):
    # the stack size that the thread probe under an address-space limit uses
    assert _openmp._parse_stack_size(text) == size


def test_stack_size_of_openmp_threads_from_the_environment(tmp_path):
    code = "from fastattn import _openmp; print(_openmp.STACK_SIZE)"
    env = {k: v for k, v in os.environ.items() if "STACKSIZE" not in k}
    cases = [({}, 0), ({"OMP_STACKSIZE": "3M"}, 3 << 20),
             ({"OMP_STACKSIZE": "bad", "GOMP_STACKSIZE": "16k"}, 16 << 10)]
    for extra, expect in cases:
        got = subprocess.run([sys.executable, "-c", code], env={**env, **extra},
                             capture_output=True, text=True, check=True,
                             cwd=tmp_path).stdout.strip()
        assert got == str(expect), extra


def test_without_a_memory_limit_thread_counts_are_not_probed():
    resource = pytest.importorskip("resource")
    if any(resource.getrlimit(which)[0] != resource.RLIM_INFINITY
           for which in (resource.RLIMIT_AS, resource.RLIMIT_DATA)):
        pytest.skip("this process has an address-space or data-segment limit")
    got = []

    def run():      # in a new thread: the record of proven threads is per thread
        got.extend([_openmp.startable_threads(1), _openmp.startable_threads(500),
                     _openmp.proven_threads()])

    mine = _openmp.proven_threads()
    t = threading.Thread(target=run)
    t.start()
    t.join()
    # 500 threads are not started to find out: the answer is 500 at once
    assert got == [1, 500, 500 if _openmp.openmp_enabled() else 1]
    assert _openmp.proven_threads() == mine


def test_show_config(capsys):
    fastattn.show_config()
    text = capsys.readouterr().out
    assert fastattn.__version__ in text
    assert "openmp" in text and "threads" in text and "compile_args" in text


@pytest.mark.parametrize("argv", [["-m", "fastattn", "info"]])
def test_command_line_info(argv, tmp_path):
    # run outside the source tree, so the installed package is the one imported
    res = subprocess.run([sys.executable, *argv], capture_output=True, text=True,
                         check=True, cwd=tmp_path)
    assert "fastattn configuration" in res.stdout and fastattn.__version__ in res.stdout


def test_console_script_is_declared():
    from fastattn.cli import main
    assert main(["info"]) == 0


def test_build_has_openmp():
    """A serial build must not pass unnoticed (set FASTATTN_ALLOW_SERIAL=1 to allow one)."""
    if os.environ.get("FASTATTN_ALLOW_SERIAL") == "1":
        pytest.skip("FASTATTN_ALLOW_SERIAL=1: a build without OpenMP is allowed")
    assert _openmp.openmp_enabled(), "fastattn was built without OpenMP"
    assert _config.config()["openmp"] is True
