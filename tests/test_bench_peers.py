"""``fastattn bench --peers``: the option, the peers' adapters and correctness gate, the
worker processes, the fastest-peer column and its geometric mean. Structure only,
never timings: tiny shapes, one to three rounds, no pause between samples."""

import argparse
import json
import os

import numpy as np
import pytest

from fastattn import reference
from fastattn.cli import bench
from fastattn.cli.bench import ceilings, grid, peers, report, runner, timing

FAST = dict(max_rounds=3, min_rounds=3, time_budget=0.01, min_sample_time=0.0)
PLAIN = bench.Case(1, 2, 9, 11, 8)
GQA_CAUSAL = bench.Case(2, 4, 24, 24, 16, Hkv=2, causal=True)


@pytest.fixture(autouse=True)
def tiny_settings(monkeypatch):
    """A one-case quick grid, tiny probes and no pause between samples."""
    monkeypatch.setattr(timing, "_SETTLE_S", 0.0)
    monkeypatch.setattr(timing, "_SPIN_SETTLE_S", 0.0)
    monkeypatch.setattr(ceilings, "GEMM_N", 64)
    monkeypatch.setattr(ceilings, "BANDWIDTH_BYTES", 1 << 20)
    monkeypatch.setattr(grid, "QUICK_GRID", [PLAIN])
    monkeypatch.setattr(runner, "QUICK_SETTINGS", FAST)


def parse(*argv):
    parser = argparse.ArgumentParser(prog="fastattn bench")
    bench.add_arguments(parser)
    return parser.parse_args(list(argv))


def none_installed(monkeypatch):
    monkeypatch.setattr(peers, "installed", lambda name: False)


# ------------------------------------------------------------------------- options

def test_peers_option_takes_known_names_in_their_order():
    assert parse().peers is None
    assert parse("--peers", "jax, openvino,jax").peers == ["openvino", "jax"]
    assert parse("--peers", "onnxruntime").peers == ["onnxruntime"]


@pytest.mark.parametrize("text", ["torch", "openvino,tensorrt", "", "jax,,openvino"])
def test_unknown_peer_names_are_a_usage_error(text, capsys):
    with pytest.raises(SystemExit) as exc:
        parse("--peers", text)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "openvino, onnxruntime, jax" in err and repr(text) in err


def test_peers_time_one_thread_count(capsys):
    assert bench.run(parse("--quick", "--peers", "jax", "--threads", "1,2")) == 2
    assert "--peers times one thread count" in capsys.readouterr().err


# ------------------------------------------------------------- what a peer runs

@pytest.mark.parametrize("case, flag", [
    (PLAIN, False), (GQA_CAUSAL, True),
    (bench.Case(1, 2, 8, 20, 8, causal=True), True),            # top-left
    (bench.Case(1, 2, 16, 16, 8, causal="bottom_right"), True),  # the same rule
    (bench.Case(1, 4, 1, 70, 8, Hkv=2, causal="bottom_right"), False),  # every key
    (bench.Case(1, 2, 8, 20, 8, causal="bottom_right"), None)])
def test_the_causal_flag_of_the_peers(case, flag):
    assert peers.peer_causal(case) is flag


@pytest.mark.parametrize("case, peer, why", [
    (bench.Case(1, 2, 24, 24, 8, softcap=2.0), "jax", "softcap"),
    (bench.Case(1, 2, 40, 40, 8, causal=True, window=(6, 0)), "openvino",
     "sliding window"),
    (bench.Case(2, 4, 20, 20, 8, alibi=True), "onnxruntime", "ALiBi"),
    (bench.Case(1, 2, 24, 24, 8, causal=True, sinks=True), "jax", "sinks"),
    (bench.Case(3, 2, 24, 24, 8, lengths=(24, 5, 0), ragged="varlen"), "jax",
     "ragged batch"),
    (bench.Case(1, 2, 8, 20, 8, causal="bottom_right"), "onnxruntime",
     "causal=bottom_right with Lq != Lk"),
    (bench.Case(1, 2, 16, 16, 8, dtype="float64"), "openvino", "no float64 kernel"),
    (PLAIN, "jax", None), (GQA_CAUSAL, "openvino", None)])
def test_cases_a_peer_is_not_run_on_are_named(case, peer, why):
    assert peers.case_support(case, peer) == why
    assert peers.case_support(PLAIN, peer, backward=True) == "forward only"
    if why is not None:
        with pytest.raises(peers.NotApplicable, match=why.split(" (")[0]):
            peers.make_peer_callable(case, peer, bench.make_inputs(case), 1)


def test_an_unknown_peer_is_refused():
    with pytest.raises(ValueError, match="unknown peer"):
        peers.case_support(PLAIN, "tensorrt")
    with pytest.raises(ValueError, match="unknown peers"):
        peers.WorkerPool(1, ["tensorrt"])


def test_a_peer_that_is_not_installed_raises_unavailable(monkeypatch):
    none_installed(monkeypatch)
    with pytest.raises(bench.Unavailable, match='fastattn\\[peers\\]'):
        peers.make_peer_callable(PLAIN, "openvino", bench.make_inputs(PLAIN), 1)
    assert peers.not_installed("openvino") == (
        'openvino: not installed (pip install "fastattn[peers]")')


# ------------------------------------------------------------- the correctness gate

@pytest.mark.parametrize("case", [
    bench.Case(1, 2, 400, 500, 8, causal=True),
    bench.Case(1, 2, 300, 300, 8, Hkv=1, causal="bottom_right"),
    bench.Case(1, 4, 1, 70, 8, Hkv=2, causal="bottom_right"), PLAIN])
def test_the_reference_sample_is_the_reference_on_those_rows(case):
    arrays = bench.make_inputs(case)
    rows, expected = peers.reference_sample(case, arrays)
    full = reference.attention(*(arrays[n].astype(np.float64) for n in "qkv"),
                               causal=case.causal or False, enable_gqa=case.gqa)
    assert expected.dtype == np.float64
    np.testing.assert_allclose(expected, full[:, :, rows], rtol=0, atol=1e-12)
    assert len(rows) == min(case.Lq, 3 * peers.SAMPLE_BLOCK)
    assert rows[0] == 0 and rows[-1] == case.Lq - 1


def test_check_answer_uses_the_bench_tolerance():
    case = bench.Case(1, 2, 16, 16, 8, dtype="float16")
    rows, expected = peers.reference_sample(case, bench.make_inputs(case))
    scale = float(np.abs(expected).max())
    tol = report._tolerance("float16", scale)
    close = expected + 0.5 * tol
    ok, err, got_tol = peers.check_answer(case, close, rows, expected)
    assert ok and got_tol == tol and err == pytest.approx(0.5 * tol)
    ok, err, _ = peers.check_answer(case, expected + 2 * tol, rows, expected)
    assert not ok and err == pytest.approx(2 * tol)
    # a wrong shape or a NaN: wrong, with no error to show
    for bad in (expected[:, :1], expected * np.nan):
        assert peers.check_answer(case, bad, rows, expected)[:2] == (False, None)


def fake_adapter(shift):
    """A peer that answers the float32 reference plus ``shift``, counting its calls."""
    calls = []

    def adapter(case, arrays, threads):
        out = reference.attention(arrays["q"], arrays["k"], arrays["v"],
                                  causal=case.causal or False, enable_gqa=case.gqa)

        def call():
            calls.append(1)
            return out + shift

        return peers.PeerCall(call, np.asarray, f"fake, {threads} thread(s)")
    return adapter, calls


@pytest.fixture
def fake_peers(monkeypatch):
    """jax answers wrongly, openvino rightly (fakes, in this process); sampled names
    are recorded."""
    wrong, wrong_calls = fake_adapter(0.5)
    right, _ = fake_adapter(0.0)
    monkeypatch.setitem(peers.ADAPTERS, "jax", wrong)
    monkeypatch.setitem(peers.ADAPTERS, "openvino", right)
    monkeypatch.setattr(peers, "installed", lambda name: name != "onnxruntime")
    sampled = []
    sample = peers._Session.sample

    def spy(self, pause):
        sampled.append(self.name)
        return sample(self, pause)
    monkeypatch.setattr(peers._Session, "sample", spy)
    return wrong_calls, sampled


def test_a_wrong_peer_is_reported_and_not_timed(fake_peers):
    wrong_calls, sampled = fake_peers
    with peers.WorkerPool(1, ["openvino", "onnxruntime", "jax"], inline=True) as pool:
        got = pool.time_case(GQA_CAUSAL, ["fastattn"], backward=False, seed=0, **FAST)
    jax, ov, ort = (got["peers"][n] for n in ("jax", "openvino", "onnxruntime"))
    assert jax["status"] == "wrong" and jax["max_abs_diff"] == pytest.approx(0.5)
    assert jax["reason"].startswith("max err 0.5 >")
    assert "jax" not in got["samples"] and "jax" not in sampled
    assert len(wrong_calls) <= 2                        # the check and its warm-up
    assert ov["status"] == "timed" and ov["max_abs_diff"] < 1e-5
    assert ov["runs"] == "fake, 1 thread(s)"
    assert ort == dict(ort, status="not installed", reason=peers.INSTALL_HINT)
    assert sampled.count("openvino") == sampled.count("fastattn") == 3
    assert len(got["samples"]["openvino"]) == 3
    assert got["max_abs_diff_vs_float64"]["fastattn"] < 1e-5


def test_the_report_shows_wrong_peers_and_the_fastest_peer(fake_peers, monkeypatch):
    pool = peers.WorkerPool
    monkeypatch.setattr(peers, "WorkerPool",
                        lambda *a, **kw: pool(*a, **kw, inline=True))
    rep = runner.benchmark_report([GQA_CAUSAL, PLAIN], 1, use_torch=False,
                                  measure=False, overhead=False,
                                  peers=["openvino", "jax"], **FAST)
    for row in rep["results"]:
        assert row["peers"]["jax"]["status"] == "wrong"
        assert row["peers"]["jax"]["ratio"] is None and "jax" not in row["times_ms"]
        assert row["fastest_peer"]["name"] == "openvino"
        per_round = [o / f for o, f in zip(row["times_ms"]["openvino"]["samples"],
                                           row["times_ms"]["fastattn"]["samples"])]
        assert row["fastest_peer"]["ratio"]["per_round"] == pytest.approx(per_round)
    assert rep["geomean"]["fastest_peer"]["shapes"] == 2
    assert rep["geomean"]["jax"] is None
    assert rep["timing"]["isolation"] == "process"
    text = report.format_report(rep)
    assert "fastest peer (peer/fastattn)" in text and "wrong (max err 0.5)" in text
    assert "vs the fastest peer (2 shapes)" in text
    assert "openvino: fake, 1 thread(s)" in text


# ------------------------------------------------------------------ worker processes

def test_each_contender_runs_in_a_process_of_its_own():
    with peers.WorkerPool(1, []) as pool:
        got = pool.time_case(PLAIN, ["fastattn", "numpy"], backward=False, seed=3,
                             **FAST)
        pids = {n: w.process.pid for n, w in pool.workers.items()}
        processes = [w.process for w in pool.workers.values()]
    assert sorted(pids) == ["fastattn", "numpy"]
    assert len(set(pids.values())) == 2 and os.getpid() not in pids.values()
    assert all(p.exitcode is not None for p in processes)      # stopped by close
    assert [len(s) for s in got["samples"].values()] == [3, 3]
    assert all(t > 0 for s in got["samples"].values() for t in s)
    # their answers came back: the same inputs (seed 3) in each process
    want = reference.attention(*(bench.make_inputs(PLAIN, 3)[n] for n in "qkv"))
    np.testing.assert_array_equal(got["outputs"]["numpy"][0], want)
    assert got["max_abs_diff_vs_float64"]["fastattn"] < 1e-5


def test_a_worker_that_died_is_replaced_for_the_next_case():
    with peers.WorkerPool(1, []) as pool:
        pool.time_case(PLAIN, ["fastattn"], backward=False, seed=0, **FAST)
        first = pool.workers["fastattn"].process
        first.kill()
        first.join(10)
        got = pool.time_case(GQA_CAUSAL, ["fastattn"], backward=False, seed=0, **FAST)
        second = pool.workers["fastattn"].process
        assert second.pid != first.pid and second.is_alive()
    assert len(got["samples"]["fastattn"]) == 3 and got["skipped"] == {}


def test_the_isolated_run_keeps_every_column(tmp_path, capsys, monkeypatch):
    """fastattn and the NumPy baseline only: a decode case (the read probe in the
    same rounds), a variant (its counterpart), a peer that is not installed."""
    none_installed(monkeypatch)
    decode = bench.Case(1, 4, 1, 70, 8, Hkv=2, causal="bottom_right")
    window = bench.Case(1, 2, 40, 40, 8, causal=True, window=(6, 0))
    monkeypatch.setattr(grid, "QUICK_GRID", [decode, window])
    path = tmp_path / "peers.json"
    assert bench.run(parse("--quick", "--threads", "1", "--no-torch", "--no-overhead",
                           "--no-progress", "--peers", "openvino", "--json",
                           str(path))) == 0
    out, err = capsys.readouterr()
    assert ('fastattn bench: openvino: not installed (pip install '
            '"fastattn[peers]")') in err
    assert "each contender in its own process" in out and "3 rounds" in out
    assert "openvino: not installed" in out
    data = json.loads(path.read_text())
    assert data["timing"]["isolation"] == "process"
    assert data["timing"]["peers"] == ["openvino"]
    first, second = data["results"]
    assert first["isolation"] == second["isolation"] == "process"
    assert first["peers"]["openvino"]["status"] == "not installed"
    assert second["peers"]["openvino"] == dict(second["peers"]["openvino"],
                                               status="n/a", reason="sliding window")
    assert first["fastest_peer"] is None and data["geomean"]["fastest_peer"] is None
    assert first["pct_of_bandwidth_same_rounds"]["probe_bytes"] > 0
    assert second["counterpart"]["speedup"]["median"] > 0
    for row in data["results"]:
        assert row["ratios"]["numpy"]["median"] > 0 and row["rounds"] == 3
    assert first["max_abs_diff_vs_float64"]["fastattn"] < 1e-5
    assert second["max_abs_diff_vs_float64"] == {}     # the sample is of plain cases


# ------------------------------------------------------ fastest peer and geo-mean

def test_the_fastest_peer_from_given_times():
    best = peers.fastest_peer({"openvino": [4.0, 6.0, 5.0], "jax": [3.0, 3.0, 9.0],
                               "onnxruntime": []}, [2.0, 2.0, 2.0])
    # medians 5 and 3: jax; per round 3/2, 3/2, 9/2
    assert best["name"] == "jax" and best["median_ms"] == 3000.0
    assert best["ratio"] == {"median": 1.5, "min": 1.5, "max": 4.5,
                             "per_round": [1.5, 1.5, 4.5]}
    assert peers.fastest_peer({}, [1.0]) is None
    assert peers.fastest_peer({"jax": [1.0]}, []) is None


def test_the_geometric_mean_against_the_fastest_peer():
    rows = [{"ratios": {"numpy": None, "torch": None},
             "fastest_peer": {"name": "jax", "ratio": {"median": 0.5}},
             "peers": {"jax": {"ratio": {"median": 0.5}}, "openvino": {"ratio": None}}},
            {"ratios": {"numpy": None, "torch": None},
             "fastest_peer": {"name": "openvino", "ratio": {"median": 8.0}},
             "peers": {"jax": {"ratio": {"median": 32.0}},
                       "openvino": {"ratio": {"median": 8.0}}}},
            {"ratios": {"numpy": None, "torch": None}, "fastest_peer": None,
             "peers": {"jax": {"ratio": None}}}]
    g = runner.geometric_means(rows)
    assert g["fastest_peer"] == {"geomean": pytest.approx(2.0), "shapes": 2}  # √(0.5·8)
    assert g["jax"] == {"geomean": pytest.approx(4.0), "shapes": 2}          # √(0.5·32)
    assert g["openvino"] == {"geomean": pytest.approx(8.0), "shapes": 1}
    assert "fastest_peer" not in runner.geometric_means([{"ratios": {}}])


def test_the_peers_table_from_given_rows():
    ratio = {"median": 1.5, "min": 1.25, "max": 4.5}
    rows = [{"label": "(1,2,9,11,8)", "dtype": "float32",
             "times_ms": {"fastattn": {"median": 2.0}, "jax": {"median": 3.0}},
             "fastest_peer": {"name": "jax", "ratio": ratio},
             "peers": {"jax": {"status": "timed", "runs": "jax on XLA"},
                       "openvino": {"status": "wrong", "max_abs_diff": 0.125,
                                    "reason": "max err 0.12 > 0.002"},
                       "onnxruntime": {"status": "n/a",
                                       "reason": "no bfloat16 kernel"}}}]
    lines, tail = report.format_peers(rows)
    row = next(line for line in lines if line.startswith("(1,2,9,11,8)"))
    for cell in ("2", "3", "wrong (max err 0.12)", "n/a (no bfloat16 kernel)",
                 "jax 1.50x [1.25-4.50]"):
        assert cell in row
    assert "jax: jax on XLA" in lines and tail == []


# ------------------------------------------------------------- the real peers

DTYPES = ["float32", "bfloat16", "float16"]


@pytest.mark.parametrize("peer", peers.PEERS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", [PLAIN, GQA_CAUSAL,
                                  bench.Case(1, 4, 1, 70, 16, Hkv=2,
                                             causal="bottom_right")],
                         ids=lambda c: c.id)
def test_a_real_peer_answers_within_the_tolerance(peer, dtype, case):
    for name in peers.PEER_PACKAGES[peer]:
        pytest.importorskip(name)
    if dtype == "bfloat16":
        pytest.importorskip("ml_dtypes")
    from dataclasses import replace
    case = replace(case, dtype=dtype)
    arrays = bench.make_inputs(case)
    try:
        made = peers.make_peer_callable(case, peer, arrays, 1)
    except peers.NotApplicable as exc:                 # the only reasons here
        assert (str(exc) == f"no {dtype} kernel"
                or (peer, dtype) == ("openvino", "float16")
                and str(exc) == f"no {dtype} kernel on this CPU: it computes in bf16")
        return
    got = made.output(made.call())
    rows, expected = peers.reference_sample(case, arrays)
    ok, err, tol = peers.check_answer(case, got, rows, expected)
    assert ok, (err, tol)
    assert got.dtype == arrays["q"].dtype and made.runs


@pytest.mark.parametrize("peer", peers.PEERS)
@pytest.mark.parametrize("case", [GQA_CAUSAL, bench.Case(1, 8, 512, 512, 64)],
                         ids=lambda c: c.id)
def test_a_real_peer_in_its_worker_process(peer, case):
    """Built, checked and sampled in a worker (the second case: inputs of 1 MiB, whose
    memory the worker reuses once the arrays it made are dropped: a peer whose tensors
    read the arrays without holding them read freed memory, or crash)."""
    for name in peers.PEER_PACKAGES[peer]:
        pytest.importorskip(name)
    with peers.WorkerPool(1, [peer]) as pool:
        got = pool.time_case(case, ["fastattn"], backward=False, seed=0, **FAST)
    entry = got["peers"][peer]
    assert entry["status"] == "timed", entry
    assert entry["max_abs_diff"] <= entry["tolerance"]
    assert len(got["samples"][peer]) == len(got["samples"]["fastattn"]) == 3
    if peer == "jax":                          # one thread: the flag and one core
        assert "1 core(s)" in entry["runs"]
        assert "multi_thread_eigen=false" in entry["runs"]
    else:       # INFERENCE_NUM_THREADS=1, intra_op_num_threads=1
        assert "=1" in entry["runs"]


def test_jax_float64_is_named_with_its_float32_softmax():
    pytest.importorskip("jax")
    case = bench.Case(1, 2, 40, 50, 16, dtype="float64", causal=True)
    arrays = bench.make_inputs(case)
    made = peers.make_peer_callable(case, "jax", arrays, 1)
    assert "its softmax in float32" in made.runs
    rows, expected = peers.reference_sample(case, arrays)
    _, err, _ = peers.check_answer(case, made.output(made.call()), rows, expected)
    assert 1e-12 < err < 1e-5         # float32 rounding, not float64's


def test_the_jax_worker_runs_jax_on_the_cpu(monkeypatch):
    # a jax with a GPU plugin would otherwise time the accelerator, not the CPU
    monkeypatch.setenv("JAX_PLATFORMS", "cuda")
    if hasattr(os, "sched_getaffinity"):
        monkeypatch.setattr(os, "sched_setaffinity", lambda pid, cores: None)
    done = peers.jax_environment(4)
    assert os.environ["JAX_PLATFORMS"] == "cpu"
    assert done["JAX_PLATFORMS"] == "cpu"
