"""Every option of ``fastattn bench``, ``explain`` and ``demo`` that takes a value is
checked by argparse itself: a bad value gives argparse's usage error, exit status 2,
naming the option, and no traceback (finding 13: ``--threads 99999999999999999999``
ended in a ctypes/PyTorch traceback after the run had started)."""

import os
import subprocess
import sys

import pytest

import fastattn
from fastattn import cli
from fastattn.cli.bench import command, threads
from fastattn.cli import demo as demo_command, explain as explain_command

HUGE = "99999999999999999999"
CAP = threads.max_threads()

# (subcommand, option, bad value); paths that need tmp_path are below
BAD = [
    # fastattn bench
    *[("bench", "--threads", v) for v in
      (HUGE, str(CAP + 1), "0", "-1", "x", "", "1,,2", "2.5", "1,0", ",", "2," + HUGE)],
    *[("bench", "--rounds", v) for v in
      (HUGE, str(command.MAX_ROUNDS + 1), "0", "-3", "x", "", "1.5")],
    *[("bench", "--time-budget", v) for v in
      ("1e9", HUGE, "0", "-1", "x", "", "nan", "inf", "-inf")],
    *[("bench", "--dtype", v) for v in ("int8", "", "float", "FLOAT32")],
    *[("bench", "--only", v) for v in ("", "  ", "no-such-shape", HUGE)],
    *[("bench", "--json", v) for v in ("", "/proc/no/such.json")],
    *[("bench", "--plot", v) for v in ("", "speed-ups.txt", "speed-ups", "/proc/x.png")],
    # fastattn explain
    *[("explain", "--seed", v) for v in ("-1", "x", "", "1.5")],
    *[("explain", "--samples", v) for v in (HUGE, "1", "0", "-2", "x", "")],
    *[("explain", "--keys", v) for v in (HUGE, "0", "-1", "x", "")],
    *[("explain", "--rows", v) for v in (HUGE, "0", "-1", "x", "")],
    *[("explain", "--max-dk", v) for v in (HUGE, "16384", "0", "-1", "x", "")],
    *[("explain", "--plot", v) for v in ("", "table.jpg", "/proc/x.png")],
    # fastattn demo
    *[("demo", "--sentence", v) for v in ("", "   ")],
    *[("demo", "--embeddings", v) for v in
      ("", ";", "1,x", "1,2;3", "1,nan;1,2;3,4", "inf", ",".join(["1"] * 65))],
    *[("demo", "--seed", v) for v in ("-1", "x", "")],
    *[("demo", "--dim", v) for v in (HUGE, "65", "0", "-1", "x", "")],
    *[("demo", "--decimals", v) for v in (HUGE, "18", "-1", "x", "")],
]


def usage_error(argv, capsys):
    """Run ``fastattn *argv``; it must stop with argparse's usage error. Its stderr."""
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    err = capsys.readouterr().err
    assert info.value.code == 2, err
    assert err.startswith("usage: fastattn "), err
    assert "Traceback" not in err
    return err


@pytest.mark.parametrize("sub,option,value", BAD,
                         ids=[f"{s} {o}={v!r}"[:60] for s, o, v in BAD])
def test_a_bad_value_is_a_usage_error_naming_the_option(sub, option, value, capsys):
    err = usage_error([sub, f"{option}={value}"], capsys)
    assert f"error: argument {option}: " in err


@pytest.mark.parametrize("option", ["--json", "--plot"])
def test_paths_that_cannot_be_written(option, tmp_path, capsys):
    a_file = tmp_path / "a_file"
    a_file.write_text("kept")
    folder = tmp_path / "folder.png"       # a folder, named like a plot
    folder.mkdir()
    for path in (folder, f"{tmp_path}/new/", a_file / "x.png", a_file / "sub" / "x.png"):
        err = usage_error(["bench", option, str(path)], capsys)
        assert f"error: argument {option}: " in err
    assert a_file.read_text() == "kept"
    if os.geteuid() != 0:                 # root writes anywhere: permission bits aside
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        usage_error(["bench", option, str(locked / "x.png")], capsys)


def test_explain_plot_refuses_a_folder(tmp_path, capsys):
    err = usage_error(["explain", "--plot", str(tmp_path)], capsys)
    assert "argument --plot" in err


def test_finding_13_in_a_fresh_process(tmp_path):
    """The exact command of finding 13, as a user runs it."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(fastattn.__file__)))
    env = dict(os.environ, PYTHONPATH=root)
    res = subprocess.run([sys.executable, "-m", "fastattn", "bench", "--threads", HUGE],
                         capture_output=True, text=True, cwd=tmp_path, env=env,
                         timeout=120)
    assert res.returncode == 2, res.stderr
    assert "argument --threads" in res.stderr and "Traceback" not in res.stderr
    assert res.stdout == ""


def parse(module, *argv):
    import argparse
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_good_values_at_the_bounds_are_kept(tmp_path):
    new = tmp_path / "new" / "deeper"
    args = parse(command, "--threads", f"{CAP},1, 1", "--rounds",
                 str(command.MAX_ROUNDS), "--time-budget", str(command.MAX_TIME_BUDGET),
                 "--json", str(new / "run.json"), "--plot", str(tmp_path / "p.SVG"),
                 "--only", "causal", "--only", "float64", "--only", "bfloat16")
    assert args.threads == [1, CAP]
    assert args.rounds == command.MAX_ROUNDS
    assert args.time_budget == command.MAX_TIME_BUDGET
    assert args.json == str(new / "run.json") and not new.exists()   # nothing made yet
    assert args.only == ["causal", "float64", "bfloat16"]
    # an existing file may be replaced; parsing leaves it as it is
    old = tmp_path / "old.json"
    old.write_text("old")
    assert parse(command, "--json", str(old)).json == str(old)
    assert old.read_text() == "old"
    # any dtype of any shape of the grid: --only is checked against them all
    assert parse(command, "--only", "1x8x512x512x64-float16").only

    args = parse(explain_command, "--seed", "0", "--samples", "2", "--max-dk",
                 str(explain_command.MAX_DK), "--keys", str(explain_command.MAX_KEYS))
    assert (args.seed, args.samples, args.max_dk) == (0, 2, explain_command.MAX_DK)
    args = parse(demo_command, "--seed", HUGE, "--dim", str(demo_command.MAX_DIM),
                 "--decimals", "0", "--sentence", " a  b ")
    assert (args.seed, args.dim, args.decimals) == (int(HUGE), demo_command.MAX_DIM, 0)


def test_a_long_bad_value_is_shown_shortened(capsys):
    err = usage_error(["bench", "--rounds", "9" * 5000], capsys)
    assert len(err) < 2000 and "..." in err


def test_the_python_api_refuses_thread_counts_it_cannot_start():
    from fastattn.cli import bench
    for n in (0, CAP + 1, 10 ** 20):
        with pytest.raises(ValueError, match="threads"):
            with bench.thread_limits(n):
                pass
        with pytest.raises(ValueError, match="threads"):
            bench.run_benchmarks([bench.Case(1, 1, 2, 2, 2)], threads=n)


def test_an_only_text_outside_the_selected_grid_is_refused_by_run(capsys, monkeypatch):
    """A text of the full grid that no shape of --quick has: the options are each
    fine, together they select nothing (exit status 2, from run)."""
    from fastattn.cli.bench import grid
    monkeypatch.setattr(grid, "QUICK_GRID", [grid.Case(1, 2, 8, 8, 8)])
    monkeypatch.setattr(grid, "GRID", [grid.Case(1, 2, 8, 8, 8),
                                       grid.Case(1, 2, 16, 16, 8)])
    assert command.run(parse(command, "--quick", "--only", "1x2x16x16x8")) == 2
    assert "no shape matches --only" in capsys.readouterr().err
