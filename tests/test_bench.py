"""The benchmark instrument: structure of its results, its table, JSON and plot.

Never a timed assertion: speed is what the instrument reports, not what tests check.
"""

import argparse
import json
import math

import numpy as np
import pytest

from fastattn import bench, cli

TINY = [bench.Case(1, 2, 9, 11, 8), bench.Case(1, 4, 1, 70, 8, Hkv=2, causal="bottom_right"),
        bench.Case(2, 2, 16, 16, 8, causal=True, dtype="float64")]
FAST = dict(max_rounds=2, min_rounds=2, time_budget=0.01, min_sample_time=0.0)


def test_the_grid_has_the_shapes_that_matter():
    labels = {c.id for c in bench.GRID}
    for want in ["1x8x512x512x64-float32", "1x8x2048x2048x64-float32",
                 "1x12x1024x1024x64-float32", "4x8x256x256x64-float32",
                 "16x12x128x128x64-float32", "1x8x4096x4096x128-float32",
                 "1x8x2048x2048x64-float32-causal", "1x32x1x4096x128-float32-decode",
                 "1x32h8x1x4096x128-float32-causal_br-decode",
                 "1x8x1024x1024x64-float64"]:
        assert want in labels
    assert set(bench.QUICK_GRID) <= set(bench.GRID)


def test_flop_and_byte_counts():
    c = bench.Case(1, 8, 512, 512, 64)
    assert c.flops() == 4 * 8 * 512 * 512 * 64
    causal = bench.Case(1, 1, 4, 4, 2, causal=True)
    assert causal.allowed_pairs() == 1 + 2 + 3 + 4
    br = bench.Case(1, 1, 2, 5, 2, causal="bottom_right")
    assert br.allowed_pairs() == 4 + 5
    gqa = bench.Case(1, 32, 1, 4096, 128, Hkv=8)
    assert gqa.kv_bytes() == 8 * 4096 * 256 * 4     # each kv head read once


@pytest.mark.parametrize("backward", [False, True])
def test_run_benchmarks_rows(backward):
    rows = bench.run_benchmarks(TINY, threads=1, backward=backward, use_torch=False,
                                **FAST)
    cases = [c for c in TINY if not (backward and c.decode)]
    assert [r["id"] for r in rows] == [c.id for c in cases]
    for row in rows:
        for name in ("fastattn", "numpy"):
            t = row["times_ms"][name]
            assert len(t["samples"]) == row["rounds"] == 2
            assert 0 < t["min"] <= t["median"] <= t["max"]
        ratio = row["ratios"]["numpy"]
        assert all(math.isfinite(x) and x > 0 for x in ratio["per_round"])
        assert row["ratios"]["torch"] is None
        # the instrument checks that the contenders agree (against NumPy)
        tol = 1e-10 if row["dtype"] == "float64" else 1e-4
        assert row["max_abs_diff_vs_numpy"]["fastattn"] < tol


def test_report_table_json_and_geomean(tmp_path, capsys):
    report = bench.benchmark_report(TINY, threads=1, use_torch=False, measure=False,
                                    **FAST)
    text = bench.format_report(report)
    for case in TINY:
        assert case.label in text
    assert "geometric-mean speed-up" in text
    g = report["geomean"]["numpy"]
    ratios = [r["ratios"]["numpy"]["median"] for r in report["results"]]
    assert g["shapes"] == len(TINY)
    assert g["geomean"] == pytest.approx(math.exp(np.mean(np.log(ratios))))
    path = tmp_path / "bench.json"
    bench.write_json(report, str(path))
    loaded = json.loads(path.read_text())
    assert {"results", "geomean", "machine", "threads", "conventions"} <= set(loaded)
    assert len(loaded["results"]) == len(TINY)


def test_ceilings_are_positive():
    c = bench.measure_ceilings(1, gemm_n=64, bandwidth_bytes=2**20, repeats=1)
    assert c["sgemm_gflops"] > 0 and c["dgemm_gflops"] > 0 and c["bandwidth_gbs"] > 0


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    report = bench.benchmark_report(TINY[:2], threads=1, use_torch=False, measure=False,
                                    **FAST)
    path = tmp_path / "bench.png"
    bench.plot_report(report, str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_command_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(bench, "GRID", TINY)
    monkeypatch.setattr(bench, "QUICK_GRID", TINY[:1])
    path = tmp_path / "quick.json"
    rc = cli.main(["bench", "--quick", "--threads", "1", "--no-torch",
                            "--no-ceilings", "--no-progress", "--json", str(path)])
    assert rc == 0
    out = capsys.readouterr().out
    assert TINY[0].label in out and TINY[1].label not in out
    assert json.loads(path.read_text())["threads"] == 1


def test_bad_threads_is_an_error():
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--threads", "0"])
