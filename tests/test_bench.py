"""The benchmark instrument (``fastattn bench``): structure only, never timings.

Every test runs tiny shapes for one or two rounds with tiny ceiling probes, so the
whole file takes seconds; no test asserts that anything is faster than anything else.
"""

import argparse
import importlib
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

import fastattn
from fastattn import bench, cli, reference



def _importable(name):
    try:
        importlib.import_module(name)
    except ImportError:
        return False
    return True


# PyTorch is left out under the sanitizer build (tools/sanitize.sh): a C++ exception
# thrown inside its native code stops a process that has ASan preloaded
SANITIZED = bool(os.environ.get("FASTATTN_SANITIZED"))
HAS_TORCH = not SANITIZED and bench._import_torch() is not None


@pytest.fixture(autouse=True)
def _no_torch_under_the_sanitizer(monkeypatch):
    if SANITIZED:
        monkeypatch.setattr(bench, "_import_torch", lambda: None)
HAS_MPL = _importable("matplotlib")

TINY = [
    bench.Case(1, 2, 9, 11, 8),
    bench.Case(2, 2, 8, 24, 8, causal=True),
    bench.Case(1, 4, 1, 70, 8, Hkv=2, causal="bottom_right"),
    bench.Case(2, 2, 16, 16, 8, causal=True, dtype="float64"),
]
FAST = dict(max_rounds=2, min_rounds=1, time_budget=0.01, min_sample_time=0.0)


@pytest.fixture(autouse=True)
def tiny_settings(monkeypatch):
    """Tiny grids, tiny ceiling probes and no pause between contenders."""
    monkeypatch.setattr(bench, "_SETTLE_S", 0.0)
    monkeypatch.setattr(bench, "GEMM_N", 64)
    monkeypatch.setattr(bench, "BANDWIDTH_BYTES", 1 << 20)
    monkeypatch.setattr(bench, "QUICK_GRID", TINY)
    monkeypatch.setattr(bench, "QUICK_SETTINGS", FAST)
    monkeypatch.setattr(bench, "FULL_SETTINGS", FAST)


def parse(*argv):
    parser = argparse.ArgumentParser(prog="fastattn bench")
    bench.add_arguments(parser)
    return parser.parse_args(list(argv))


def positive_finite(x):
    return isinstance(x, float) and math.isfinite(x) and x > 0


# ------------------------------------------------------------------------------ grid

def test_grid_holds_the_required_shapes():
    shapes = {(c.B, c.H, c.kv_heads, c.Lq, c.Lk, c.E, c.dtype, c.causal_kind)
              for c in bench.GRID}
    f32 = "float32"
    for want in [(1, 8, 8, 512, 512, 64, f32, None),
                 (1, 8, 8, 2048, 2048, 64, f32, None),
                 (1, 12, 12, 1024, 1024, 64, f32, None),
                 (4, 8, 8, 256, 256, 64, f32, None),
                 (16, 12, 12, 128, 128, 64, f32, None),
                 (1, 8, 8, 4096, 4096, 128, f32, None),
                 (1, 8, 8, 2048, 2048, 64, f32, "top_left"),
                 (1, 32, 32, 1, 4096, 128, f32, None),
                 (1, 32, 8, 1, 4096, 128, f32, "bottom_right"),
                 (1, 8, 8, 1024, 1024, 64, "float64", None)]:
        assert want in shapes


def test_quick_grid_is_a_smaller_subset():
    quick = [c for c in bench.GRID if c.quick]      # what QUICK_GRID is built from
    assert quick and len(quick) < len(bench.GRID)
    assert len({c.id for c in bench.GRID}) == len(bench.GRID)   # ids are unique


def test_flop_and_byte_counts():
    c = bench.Case(1, 8, 512, 512, 64)
    assert c.flops() == 4 * 8 * 512 * 512 * 64
    assert c.flops(backward=True) == 3.5 * c.flops()
    causal = bench.Case(1, 8, 512, 512, 64, causal=True)
    assert causal.flops() == pytest.approx(c.flops() / 2, rel=1e-2)
    # bottom-right decode may attend to every key; GQA reads each kv head once
    gqa = bench.Case(1, 32, 1, 4096, 128, Hkv=8, causal="bottom_right")
    assert gqa.flops() == 4 * 32 * 4096 * 128
    assert gqa.kv_bytes() == 2 * 8 * 4096 * 128 * 4
    assert gqa.decode and gqa.gqa and not c.decode
    assert bench.Case(1, 1, 4, 4, 2, causal=True).allowed_pairs() == 1 + 2 + 3 + 4
    assert bench.Case(1, 1, 2, 5, 2, causal="bottom_right").allowed_pairs() == 4 + 5


# --------------------------------------------------------------------------- Python

def check_rows(rows, grid, *, with_torch):
    assert [r["id"] for r in rows] == [c.id for c in grid]
    for r in rows:
        assert r["rounds"] >= 1
        for name in ("fastattn", "numpy") + (("torch",) if with_torch else ()):
            t = r["times_ms"][name]
            assert len(t["samples"]) == r["rounds"]
            assert all(positive_finite(x) for x in (t["median"], t["min"], t["max"]))
        for other in ("numpy",) + (("torch",) if with_torch else ()):
            ratio = r["ratios"][other]
            assert all(positive_finite(ratio[k]) for k in ("median", "min", "max"))
            assert len(ratio["per_round"]) == r["rounds"]
        assert positive_finite(r["gflops"])
        for t in r["times_ms"].values():
            assert 0 < t["min"] <= t["median"] <= t["max"]
        # the instrument checks that the contenders agree (against NumPy)
        tol = 1e-10 if r["dtype"] == "float64" else 1e-4
        assert r["max_abs_diff_vs_numpy"]["fastattn"] < tol


def test_run_benchmarks_rows():
    rows = bench.run_benchmarks(TINY, threads=1, use_torch=HAS_TORCH, **FAST)
    check_rows(rows, TINY, with_torch=HAS_TORCH)
    decode = [r for r in rows if r["decode"]]
    assert decode and all(positive_finite(r["gbs"]) for r in decode)
    g = bench.geometric_means(rows)["numpy"]
    ratios = [r["ratios"]["numpy"]["median"] for r in rows]
    assert g["shapes"] == len(TINY)
    assert g["geomean"] == pytest.approx(math.exp(np.mean(np.log(ratios))))


def test_report_with_ceilings_and_no_torch():
    report = bench.benchmark_report(TINY[:2], threads=1, use_torch=False, **FAST)
    c = report["ceilings"]
    for key in ("sgemm_gflops", "dgemm_gflops", "bandwidth_gbs"):
        assert positive_finite(c[key])
    for r in report["results"]:
        assert r["ratios"]["torch"] is None and "torch" in r["skipped"]
        assert positive_finite(r["pct_of_ceiling"])
    assert report["geomean"]["torch"] is None
    text = bench.format_report(report)
    assert "n/a vs PyTorch" in text and "sgemm" in text


def test_backward_rows():
    grid = TINY[:2] + [TINY[2]]                     # the decode case is left out
    rows = bench.run_benchmarks(grid, threads=1, backward=True, use_torch=HAS_TORCH,
                                **FAST)
    check_rows(rows, TINY[:2], with_torch=HAS_TORCH)
    assert all(r["backward"] for r in rows)


def test_backward_without_fastattn_backward(monkeypatch, capsys):
    monkeypatch.delattr(fastattn, "attention_backward", raising=False)
    rows = bench.run_benchmarks(TINY[:1], threads=1, backward=True, use_torch=False,
                                **FAST)
    (r,) = rows
    assert "fastattn" not in r["times_ms"] and "numpy" in r["times_ms"]
    assert "attention_backward" in r["skipped"]["fastattn"]
    assert r["ratios"] == {"numpy": None, "torch": None}
    assert bench.run(parse("--quick", "--backward", "--no-torch", "--no-progress",
                           "--no-ceilings", "--only", TINY[0].id)) == 0
    out, err = capsys.readouterr()
    assert "attention_backward is not available" in err
    assert "n/a vs NumPy" in out


def test_a_failing_contender_is_reported_not_raised(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("boom")
    monkeypatch.setattr(fastattn, "attention", broken)
    (r,) = bench.run_benchmarks(TINY[:1], threads=1, use_torch=False, **FAST)
    assert "boom" in r["skipped"]["fastattn"] and r["ratios"]["numpy"] is None


def test_ceilings_are_positive():
    c = bench.measure_ceilings(1, gemm_n=64, bandwidth_bytes=2**20, repeats=1)
    assert c["sgemm_gflops"] > 0 and c["dgemm_gflops"] > 0 and c["bandwidth_gbs"] > 0


def test_thread_limits_rejects_bad_counts():
    with pytest.raises(ValueError):
        with bench.thread_limits(0):
            pass


# ------------------------------------------------------------------------------ CLI

def test_cli_table_and_json(tmp_path, capsys):
    path = tmp_path / "sub" / "bench.json"
    assert bench.run(parse("--quick", "--threads", "1", "--json", str(path),
                           "--no-progress")) == 0
    out = capsys.readouterr().out
    for case in TINY:
        assert case.label in out
    assert "geometric-mean speed-up" in out and "GFLOP/s" in out and "GB/s" in out
    data = json.loads(path.read_text())
    for key in ("fastattn_version", "mode", "threads", "machine", "ceilings",
                "results", "geomean", "conventions", "settings"):
        assert key in data
    assert data["threads"] == 1 and data["mode"] == "forward"
    assert len(data["results"]) == len(TINY)
    for r in data["results"]:
        for key in ("label", "B", "H", "Hkv", "Lq", "Lk", "E", "dtype", "flops",
                    "times_ms", "ratios", "pct_of_ceiling"):
            assert key in r
        assert positive_finite(r["ratios"]["numpy"]["median"])
        if HAS_TORCH:
            assert positive_finite(r["ratios"]["torch"]["median"])
    assert positive_finite(data["ceilings"]["sgemm_gflops"])


def test_cli_progress_line_without_tqdm(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tqdm", None)
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)
    assert bench.run(parse("--quick", "--no-torch", "--no-ceilings", "--threads", "1",
                           "--only", TINY[0].id)) == 0
    err = capsys.readouterr().err
    assert f"[1/1] {TINY[0].label}" in err


@pytest.mark.skipif(not HAS_MPL, reason="matplotlib is not installed")
def test_cli_plot_writes_a_png(tmp_path):
    path = tmp_path / "bench.png"
    assert bench.run(parse("--quick", "--threads", "1", "--no-progress", "--plot",
                           str(path))) == 0
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_plot_without_matplotlib(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert bench.run(parse("--quick", "--plot", str(tmp_path / "x.png"))) == 2
    assert "needs matplotlib" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()


def test_cli_list_and_only(capsys):
    assert bench.run(parse("--quick", "--list")) == 0
    out = capsys.readouterr().out
    assert all(c.id in out for c in TINY)
    assert bench.run(parse("--quick", "--only", "no-such-shape")) == 2
    assert "no shape matches" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--threads", "0"], ["--threads", "x"],
                                  ["--rounds", "0"], ["--time-budget", "-1"]])
def test_cli_rejects_bad_numbers(argv, capsys):
    with pytest.raises(SystemExit):
        parse(*argv)
    assert "expected" in capsys.readouterr().err


def test_import_is_light(tmp_path):
    """``import fastattn.bench`` imports none of the optional heavy packages."""
    code = ("import sys, fastattn.bench; "
            "print([m for m in ('torch', 'matplotlib', 'tqdm', 'threadpoolctl') "
            "if m in sys.modules])")
    root = os.path.dirname(os.path.dirname(os.path.abspath(fastattn.__file__)))
    env = dict(os.environ, PYTHONPATH=root)
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=tmp_path, env=env).stdout.strip()
    assert got == "[]"


def test_reference_is_the_baseline():
    fn = bench.make_callable(TINY[0], "numpy", bench.make_inputs(TINY[0]), 1)
    arrays = bench.make_inputs(TINY[0])
    want = reference.attention(arrays["q"], arrays["k"], arrays["v"])
    assert (fn() == want).all()


def test_the_fastattn_command(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(bench, "GRID", TINY)
    monkeypatch.setattr(bench, "QUICK_GRID", TINY[:1])
    path = tmp_path / "quick.json"
    rc = cli.main(["bench", "--quick", "--threads", "1", "--no-torch", "--no-ceilings",
                   "--no-progress", "--json", str(path)])
    assert rc == 0
    out = capsys.readouterr().out
    assert TINY[0].label in out and TINY[1].label not in out
    assert json.loads(path.read_text())["threads"] == 1


def test_as_a_subcommand(capsys):
    """The way the ``fastattn`` console script registers it: a subparser."""
    parser = argparse.ArgumentParser(prog="fastattn")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("bench", help="time fastattn")
    bench.add_arguments(p)
    p.set_defaults(_run=bench.run)
    args = parser.parse_args(["bench", "--quick", "--list"])
    assert args._run(args) == 0
    assert TINY[0].id in capsys.readouterr().out


def test_docstring_examples(monkeypatch):
    import doctest
    monkeypatch.setattr(bench, "QUICK_GRID", [c for c in bench.GRID if c.quick])
    result = doctest.testmod(bench, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0 and result.attempted >= 1
