"""Threads, show_config, the command line and the build."""

import os
import subprocess
import sys

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
