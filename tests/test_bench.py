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
from dataclasses import replace

import numpy as np
import pytest

import fastattn
from fastattn import cli, reference
from fastattn.cli import bench
from fastattn.cli.bench import ceilings, grid, overhead, runner, scaling, serving, timing
from fastattn.cli.bench.contenders import real_rows, torch_implementation
from fastattn.cli.bench.serving import ServingCase


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

# one tiny case of each variant, and of each way a ragged batch reaches the kernel
TINY_VARIANTS = [
    bench.Case(1, 2, 40, 40, 8, causal=True, window=(6, 0)),
    bench.Case(1, 2, 12, 30, 8, causal="bottom_right", window=(4, 2)),
    bench.Case(1, 2, 24, 24, 8, softcap=2.0),
    bench.Case(2, 4, 20, 20, 8, alibi=True, causal=True),
    bench.Case(1, 4, 16, 16, 8, Hkv=2, window=(3, None), softcap=1.5, alibi=True),
    bench.Case(3, 2, 24, 24, 8, lengths=(24, 5, 0)),
    bench.Case(3, 2, 24, 24, 8, lengths=(24, 5, 0), ragged="mask"),
    bench.Case(3, 2, 24, 24, 8, lengths=(24, 5, 0), ragged="varlen"),
    bench.Case(3, 2, 24, 24, 8, lengths=(24, 9, 1), ragged="varlen", causal=True,
               window=(4, 0), alibi=True),
    bench.Case(2, 2, 24, 24, 8, lengths=(13, 24), causal="bottom_right",
               dtype="float64"),
    # attention sinks: alone (PyTorch: the eager gpt-oss composition, causal as a
    # mask), with the other score variants, in a packed ragged batch, in float64
    bench.Case(1, 2, 24, 24, 8, causal=True, sinks=True),
    bench.Case(2, 4, 20, 30, 8, Hkv=2, causal="bottom_right", softcap=2.0, alibi=True,
               sinks=True),
    bench.Case(3, 2, 24, 24, 8, lengths=(24, 9, 0), ragged="varlen", causal=True,
               sinks=True),
    bench.Case(2, 2, 16, 16, 8, causal=True, window=(3, 0), sinks=True, dtype="float64"),
]


# the serving rows of the real grids, before the fixture below replaces them
SERVING_GRID = list(serving.SERVING_GRID)
QUICK_SERVING_GRID = list(serving.QUICK_SERVING_GRID)

# tiny serving rows: a paged int8 decoding step (--quick), a contiguous bfloat16 one, a
# ragged paged batch and a chunked prefill (4, 8 and 16 query heads per kv head)
TINY_SERVING = [
    ServingCase((70,), H=4, Hkv=2, E=16, cache="int8", block_size=4, quick=True),
    ServingCase((70,), H=4, Hkv=2, E=16, cache="bfloat16", block_size=None),
    ServingCase((33, 5, 70), H=4, Hkv=2, E=16, cache="int8", block_size=4),
    ServingCase((33, 9, 70), q_len=5, H=4, Hkv=2, E=16, block_size=4, baselines=False),
]


@pytest.fixture(autouse=True)
def tiny_settings(monkeypatch):
    """Tiny grids, tiny ceiling probes and no pause between contenders."""
    monkeypatch.setattr(timing, "_SETTLE_S", 0.0)
    monkeypatch.setattr(timing, "_SPIN_SETTLE_S", 0.0)
    monkeypatch.setattr(overhead, "OVERHEAD_SETTINGS",
                        dict(rounds=2, min_sample_time=0.0))
    monkeypatch.setattr(ceilings, "GEMM_N", 64)
    monkeypatch.setattr(ceilings, "BANDWIDTH_BYTES", 1 << 20)
    monkeypatch.setattr(grid, "QUICK_GRID", TINY)
    monkeypatch.setattr(runner, "QUICK_SETTINGS", FAST)
    monkeypatch.setattr(runner, "FULL_SETTINGS", FAST)
    monkeypatch.setattr(serving, "SERVING_GRID", TINY_SERVING)
    monkeypatch.setattr(serving, "QUICK_SERVING_GRID", TINY_SERVING[:1])


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


def test_grid_holds_the_variant_rows():
    by_id = {c.id: c for c in bench.GRID}
    assert len(by_id) == len(bench.GRID)
    # a sliding window at Lq = Lk = 8192 beside the same shape fully causal
    window = [c for c in bench.GRID if c.window == (256, 0) and c.Lq == c.Lk == 8192]
    assert window and window[0].causal_kind == "top_left"
    w = window[0]
    full = [c for c in bench.GRID if c.window is None and c.causal_kind == "top_left"
            and (c.B, c.H, c.Lq, c.Lk, c.E) == (w.B, w.H, w.Lq, w.Lk, w.E)]
    assert full and w.E == 64 and w.B == 1
    # softcap and ALiBi on the plain mid shape, which is also in the grid
    mid = (1, 8, 2048, 2048, 64)
    shape = lambda c: (c.B, c.H, c.Lq, c.Lk, c.E)      # noqa: E731
    assert any(shape(c) == mid and not c.variant and not c.causal for c in bench.GRID)
    assert any(shape(c) == mid and c.softcap and not c.alibi for c in bench.GRID)
    assert any(shape(c) == mid and c.alibi and c.softcap is None for c in bench.GRID)
    # one ragged batch, three ways: the same shape and lengths
    ragged = [c for c in bench.GRID if c.lengths is not None]
    assert sorted(c.ragged for c in ragged) == sorted(grid.RAGGED_FLAVOURS)
    assert len({(shape(c), c.lengths, c.causal_kind) for c in ragged}) == 1
    r = ragged[0]
    assert r.B == 8 and r.Lq == r.Lk == 2048
    assert min(r.lengths) == 256 and max(r.lengths) == 2048 and len(set(r.lengths)) == 8
    assert len({c.flops() for c in ragged}) == 1
    # attention sinks: (1,8,2048,2048,64) causal with sinks, beside it without them;
    # a smaller pair in --quick; PyTorch runs its eager composition on them
    sinks = [c for c in bench.GRID if c.sinks]
    assert {shape(c) for c in sinks} == {mid, (1, 8, 512, 512, 64)}
    ids = {c.id for c in bench.GRID}
    for c in sinks:
        assert c.causal_kind == "top_left" and not c.softcap and not c.alibi
        assert c.counterpart() == replace(c, sinks=False, quick=False)
        assert c.counterpart().id in ids
        assert "gpt-oss" in torch_implementation(c)
    assert [shape(c) for c in sinks if c.quick] == [(1, 8, 512, 512, 64)]
    # --quick gains at most two of them
    assert sum(c.variant for c in bench.GRID if c.quick) <= 2


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


@pytest.mark.parametrize("causal", [True, "bottom_right"])
@pytest.mark.parametrize("Lq,Lk", [(4, 4), (2, 5), (5, 2), (1, 7), (7, 1)])
def test_allowed_pairs_follow_the_causal_rule_of_fastattn(causal, Lq, Lk):
    c = bench.Case(1, 1, Lq, Lk, 2, causal=causal)
    assert c.allowed_pairs() == brute_force_pairs(c)


def brute_force_pairs(case):
    """Allowed query-key pairs of one head, summed over the batch, by the rules of
    the contract, one pair at a time."""
    total = 0
    left, right = case.window or (None, None)
    for lq, lk in case.real_lengths():
        d = lk - lq if case.causal_kind == "bottom_right" else 0
        for i in range(lq):
            for j in range(lk):
                ok = (case.causal_kind is None or j <= i + d)
                ok = ok and (left is None or j >= i + d - left)
                ok = ok and (right is None or j <= i + d + right)
                total += ok
    return total


VARIANT_COUNTS = TINY_VARIANTS + [
    bench.Case(1, 1, 9, 9, 2, causal=True, window=(0, 0)),
    bench.Case(1, 1, 9, 9, 2, window=(2, 3)),
    bench.Case(1, 1, 9, 9, 2, window=(None, 0)),
    bench.Case(1, 1, 9, 9, 2, window=(0, None)),
    bench.Case(1, 1, 3, 11, 2, causal="bottom_right", window=(20, 0)),
    bench.Case(1, 1, 11, 3, 2, causal="bottom_right", window=(1, 1)),
    bench.Case(1, 1, 11, 3, 2, causal=True, window=(None, 5)),
    bench.Case(4, 1, 10, 10, 2, lengths=(10, 0, 1, 7), causal=True, window=(2, 1)),
    bench.Case(2, 3, 10, 10, 2, lengths=(3, 10), causal="bottom_right", window=(1, 0)),
]


@pytest.mark.parametrize("case", VARIANT_COUNTS, ids=lambda c: c.id)
def test_flops_count_the_allowed_pairs(case):
    pairs = brute_force_pairs(case)
    assert case.allowed_pairs() == pairs
    assert case.flops() == 2 * case.H * pairs * (case.E + case.ev)
    assert case.flops(backward=True) == 3.5 * case.flops()


@pytest.mark.parametrize("case", VARIANT_COUNTS, ids=lambda c: c.id)
def test_allowed_pairs_are_the_finite_scores_of_the_reference(case):
    """The pairs fastattn.reference leaves finite, one head of each sequence."""
    arrays = bench.make_inputs(case)
    kw = dict(causal=case.causal_kind or False, window=case.window)
    if case.lengths is not None:
        kw.update(q_lengths=arrays["lengths"], kv_lengths=arrays["lengths"])
    s = reference.scores(arrays["q"], arrays["k"], enable_gqa=case.gqa, **kw)
    assert int(np.isfinite(s[:, 0]).sum()) == case.allowed_pairs()


def test_variant_labels_and_ids():
    w = bench.Case(1, 4, 8192, 8192, 64, causal=True, window=(256, 0))
    assert w.label == "(1,4,8192,8192,64) causal window=(256,0)"
    assert w.id == "1x4x8192x8192x64-float32-causal-window256_0"
    assert "window=(None,0)" in bench.Case(1, 1, 4, 4, 2, window=(None, 0)).label
    assert "softcap=30" in bench.Case(1, 1, 4, 4, 2, softcap=30.0).label
    assert bench.Case(1, 1, 4, 4, 2, alibi=True).id.endswith("-alibi")
    sinks = bench.Case(1, 8, 2048, 2048, 64, causal=True, sinks=True)
    assert sinks.label == "(1,8,2048,2048,64) causal sinks"
    assert sinks.id == "1x8x2048x2048x64-float32-causal-sinks" and sinks.variant
    flavours = [bench.Case(2, 1, 8, 8, 2, lengths=(8, 3), ragged=r)
                for r in grid.RAGGED_FLAVOURS]
    assert len({c.id for c in flavours}) == len({c.label for c in flavours}) == 3
    assert all("ragged 3..8" in c.label for c in flavours)
    assert not bench.Case(1, 1, 4, 4, 2).variant and w.variant
    # window=(None, None) is no window
    assert bench.Case(1, 1, 4, 4, 2, window=(None, None)).window is None


@pytest.mark.parametrize("kwargs", [
    dict(lengths=(4,)),                           # B = 2 needs two lengths
    dict(lengths=(4, 9)),                         # longer than L
    dict(lengths=(4, 3), Lk=6),                   # lengths need Lq == Lk
    dict(ragged="varlen"),                        # a flavour without lengths
    dict(lengths=(4, 3), ragged="nested"),
    dict(window=(-1, 0)),
    dict(softcap=0.0),
])
def test_bad_variant_cases_are_refused(kwargs):
    shape = dict(B=2, H=1, Lq=8, Lk=8, E=2)
    shape.update(kwargs)
    with pytest.raises(ValueError):
        bench.Case(**shape)


def test_counterparts():
    w = bench.Case(1, 2, 64, 64, 8, causal=True, window=(8, 0), quick=True)
    assert w.counterpart() == bench.Case(1, 2, 64, 64, 8, causal=True)
    assert bench.Case(1, 2, 8, 8, 8, softcap=3.0, alibi=True).counterpart() == \
        bench.Case(1, 2, 8, 8, 8)
    lengths = dict(B=2, H=1, Lq=8, Lk=8, E=2, lengths=(8, 3))
    assert bench.Case(**lengths, ragged="lengths").counterpart() == \
        bench.Case(**lengths, ragged="mask")
    assert bench.Case(**lengths, ragged="varlen").counterpart() == \
        bench.Case(**lengths, ragged="lengths")
    assert bench.Case(**lengths, ragged="mask").counterpart() is None
    assert bench.Case(1, 2, 8, 8, 8, causal=True, sinks=True, quick=True).counterpart() \
        == bench.Case(1, 2, 8, 8, 8, causal=True)
    assert bench.Case(1, 2, 8, 8, 8, softcap=2.0, sinks=True).counterpart() == \
        bench.Case(1, 2, 8, 8, 8)
    assert bench.Case(1, 2, 8, 8, 8, causal=True).counterpart() is None
    # the counterparts of the grid's variant rows are rows of the grid themselves
    ids = {c.id for c in bench.GRID}
    twins = [c.counterpart() for c in bench.GRID if c.counterpart() is not None]
    assert len(twins) >= 6 and all(t.id in ids for t in twins)


def test_real_rows_of_padded_and_packed_arrays_agree():
    case = bench.Case(3, 2, 6, 6, 4, lengths=(6, 2, 0), ragged="varlen")
    arrays = bench.make_inputs(case)
    np.testing.assert_array_equal(real_rows(case, arrays["q"]),
                                  real_rows(case, arrays["q_packed"]))
    assert real_rows(case, arrays["q"]).size == 8 * 2 * 4
    # the gradient of the padded rows is zero, so every flavour's gradients agree
    assert not arrays["do"][1, :, 2:].any() and arrays["do"][0].any()
    assert arrays["padding_mask"].shape == (3, 1, 1, 6)
    assert list(arrays["cu_seqlens"]) == [0, 6, 8, 8]


def test_torch_implementation_is_named():
    assert torch_implementation(bench.Case(1, 1, 4, 4, 2)) == "SDPA"
    assert "boolean" in torch_implementation(bench.Case(1, 1, 4, 4, 2, window=(1, 0)))
    assert "boolean" in torch_implementation(
        bench.Case(2, 1, 4, 4, 2, lengths=(4, 1), ragged="varlen"))
    assert "float" in torch_implementation(bench.Case(1, 1, 4, 4, 2, alibi=True))
    assert "eager" in torch_implementation(bench.Case(1, 1, 4, 4, 2, softcap=5.0))
    sinks = torch_implementation(bench.Case(1, 1, 4, 4, 2, causal=True, sinks=True))
    assert "eager" in sinks and "sink" in sinks and "SDPA takes no sinks" in sinks
    assert "tanh" in torch_implementation(
        bench.Case(1, 1, 4, 4, 2, softcap=5.0, sinks=True))


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


@pytest.mark.parametrize("backward", [False, True], ids=["forward", "backward"])
def test_variant_contenders_agree_with_the_reference(backward):
    """Every contender passes the variants on: fastattn, the NumPy baseline and
    PyTorch (boolean mask, float bias, eager softcap) agree on the real rows."""
    rows = bench.run_benchmarks(TINY_VARIANTS, threads=2, backward=backward,
                                use_torch=HAS_TORCH, **FAST)
    check_rows(rows, TINY_VARIANTS, with_torch=HAS_TORCH)
    for r, case in zip(rows, TINY_VARIANTS):
        tol = 1e-10 if case.dtype == "float64" else 1e-4
        if HAS_TORCH:
            assert r["max_abs_diff_vs_numpy"]["torch"] < tol, r["label"]
            assert r["max_abs_diff_fastattn_vs_torch"] < tol, r["label"]
            assert r["torch_runs"] == torch_implementation(case)
        assert r["flops"] == case.flops(backward)
        assert r["ragged"] == case.ragged_flavour
        # fastattn on the counterpart, timed in the same rounds
        twin = case.counterpart()
        if twin is None:
            assert r["counterpart"] is None
        else:
            assert r["counterpart"]["id"] == twin.id
            assert len(r["times_ms"]["counterpart"]["samples"]) == r["rounds"]
            assert positive_finite(r["counterpart"]["speedup"]["median"])
            speedup, cost = r["counterpart"]["speedup"], r["counterpart"]["cost"]
            assert cost["min"] == pytest.approx(1 / speedup["max"])
            assert cost["max"] == pytest.approx(1 / speedup["min"])
    text = bench.format_report({"results": rows, "mode": "forward", "threads": 2,
                                "machine": {}, "geomean": bench.geometric_means(rows)})
    assert "variants against their counterpart" in text
    assert [r["sinks"] for r in rows] == [c.sinks for c in TINY_VARIANTS]
    if HAS_TORCH:
        # the table says what the PyTorch column of the sinks rows ran
        note = [l for l in text.splitlines() if "PyTorch column of the sinks" in l]
        assert len(note) == 1 and "gpt-oss eager" in note[0], text
    # the sinks rows beside their counterpart without sinks, with the ratio
    table = text.split("variants against their counterpart")[1]
    for case in TINY_VARIANTS:
        if case.sinks:
            line = next(l for l in table.splitlines() if l.startswith(case.label))
            assert case.counterpart().label in line and "x [" in line


def test_sinks_inputs():
    """The sinks of a case: one per query head, exact in the case's dtype, in its
    computation dtype; q, k, v and do are those of the case without sinks."""
    for dtype, want in (("float32", np.float32), ("float64", np.float64),
                        ("float16", np.float32)):
        case = bench.Case(2, 4, 8, 8, 8, Hkv=2, causal=True, sinks=True, dtype=dtype)
        arrays = bench.make_inputs(case, seed=3)
        plain = bench.make_inputs(case.counterpart(), seed=3)
        assert arrays["sinks"].shape == (4,) and arrays["sinks"].dtype == want
        assert (arrays["sinks"].astype(dtype) == arrays["sinks"]).all()
        assert arrays["sinks"].std() > 0.1
        for name in ("q", "k", "v", "do"):
            assert (arrays[name] == plain[name]).all()
        assert "sinks" not in plain


@pytest.mark.parametrize("contender", ["fastattn", "numpy", "torch"])
def test_each_contender_matches_the_reference_on_a_ragged_batch(contender):
    if contender == "torch" and not HAS_TORCH:
        pytest.skip("PyTorch is not installed")
    torch_module = bench._import_torch() if contender == "torch" else None
    lengths = (16, 3, 9)
    want = None
    for flavour in grid.RAGGED_FLAVOURS:
        case = bench.Case(3, 2, 16, 16, 8, causal=True, window=(5, 0), alibi=True,
                          lengths=lengths, ragged=flavour)
        arrays = bench.make_inputs(case)
        got = np.asarray(bench.make_callable(case, contender, arrays, 1,
                                             torch_module=torch_module)())
        if want is None:       # each sequence alone, through the reference
            slopes = arrays["alibi_slopes"]
            want = np.concatenate([reference.attention(
                arrays["q"][b, :, :n], arrays["k"][b, :, :n], arrays["v"][b, :, :n],
                causal=True, window=(5, 0), alibi_slopes=slopes).ravel()
                for b, n in enumerate(lengths)])
        np.testing.assert_allclose(real_rows(case, got), want, atol=1e-5)


def test_the_numpy_baseline_may_be_left_out():
    case = bench.Case(1, 2, 16, 16, 8, causal=True, baseline=False)
    (r,) = bench.run_benchmarks([case], threads=1, use_torch=HAS_TORCH, **FAST)
    assert "numpy" not in r["times_ms"] and "left out" in r["skipped"]["numpy"]
    assert r["ratios"]["numpy"] is None and positive_finite(r["gflops"])
    if HAS_TORCH:
        assert r["max_abs_diff_fastattn_vs_torch"] < 1e-4


def test_differences_are_flagged_per_unit_of_the_largest_value():
    """A row is flagged (" !" and a warning) when fastattn's result differs from
    PyTorch's by more than the dtype's tolerance times max(1, its largest magnitude):
    half a bfloat16 ulp at 8 (a long row's gradient) is no alarm, 0.3 is."""
    (measured,) = bench.run_benchmarks([bench.Case(1, 2, 16, 16, 8)], threads=1,
                                       use_torch=False, **FAST)
    assert 0 < measured["max_abs_fastattn"] < 10       # |out| <= max |v|
    r = dict(measured, dtype="bfloat16", max_abs_fastattn=8.0)

    def text(diff):
        row = dict(r, max_abs_diff_fastattn_vs_torch=diff)
        return bench.format_report({"results": [row], "mode": "forward", "threads": 1,
                                    "machine": {},
                                    "geomean": bench.geometric_means([row])})
    assert "differs from PyTorch" not in text(0.03125)
    assert "differs from PyTorch by 0.3" in text(0.3)


def test_decode_rows_take_their_bandwidth_share_from_the_probe_in_their_rounds():
    """A decode row's % of the read bandwidth: per round, its GB/s over the read
    probe's in the same round (the probe runs as a contender of the decode cases
    only); without the probe, the run's best bandwidth."""
    report = bench.benchmark_report([TINY[0], TINY[2]], threads=1, use_torch=False,
                                    use_numpy=False, overhead=False, **FAST)
    plain, decode = report["results"]
    assert plain["pct_of_bandwidth_same_rounds"] is None
    assert "read" not in plain["times_ms"]
    same = decode["pct_of_bandwidth_same_rounds"]
    assert same["probe_bytes"] == report["ceilings"]["bandwidth_bytes"] == 1 << 20
    read, fa = decode["times_ms"]["read"]["samples"], decode["times_ms"]["fastattn"]["samples"]
    assert len(same["per_round"]) == len(read) == len(fa) == decode["rounds"] >= 1
    for pct, r, f in zip(same["per_round"], read, fa):
        assert pct == pytest.approx(100 * (decode["kv_bytes"] / f) / ((1 << 20) / r))
    assert decode["pct_of_ceiling"] == same["median"]
    assert decode["ceiling"] == "read probe, same rounds"
    line = [x for x in bench.format_report(report).splitlines()
            if x.startswith(TINY[2].label)][0]
    assert (f"{same['median']:.0f}% [{same['min']:.0f}-{same['max']:.0f}]"
            in line)
    rows = bench.run_benchmarks([TINY[2]], threads=1, use_torch=False, **FAST)
    assert rows[0]["pct_of_bandwidth_same_rounds"] is None
    assert "read" not in rows[0]["times_ms"]


def test_a_sample_after_a_spinning_contender_waits_longer(monkeypatch):
    """OpenBLAS's threads spin for about 0.1 s after a call: the sample after a
    ``spinning`` contender (and a case's first) pauses _SPIN_SETTLE_S, the others
    _SETTLE_S."""
    monkeypatch.setattr(timing, "_SETTLE_S", 0.001)
    monkeypatch.setattr(timing, "_SPIN_SETTLE_S", 0.002)
    events = []
    monkeypatch.setattr(timing.time, "sleep", lambda s: events.append(s))
    calls = {name: (lambda name=name: events.append(name)) for name in "abc"}
    timing.interleaved(calls, max_rounds=3, min_rounds=3, time_budget=0,
                       min_sample_time=0.0, spinning=("b",))
    timed = events[6:]                       # after the warm-up and calibration
    assert timed[1::2] == list("abcbcacab")  # one call a sample, in rotating order
    assert timed[0::2] == [0.002, 0.001, 0.002,     # a (first), b, c (after b)
                           0.001, 0.002, 0.001,     # b, c (after b), a
                           0.001, 0.001, 0.001]     # c, a, b


def test_report_with_ceilings_and_no_torch():
    report = bench.benchmark_report(TINY[:2], threads=1, use_torch=False, **FAST)
    c = report["ceilings"]
    for key in ("sgemm_gflops", "dgemm_gflops", "bandwidth_gbs"):
        assert positive_finite(c[key])
    for r in report["results"]:
        assert r["ratios"]["torch"] is None
        assert r["skipped"]["torch"] == "left out (--no-torch)"
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
    assert all(r["kernel"] == "fma+fma" for r in rows)   # float32: forward, backward


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


def test_overhead_probe():
    o = bench.measure_overhead(1, torch_module=bench._import_torch())
    assert o["label"] == "(1,1,16,16,64)" and o["threads"] == 1 and o["rounds"] == 2
    names = ("fastattn", "floor") + (("torch",) if HAS_TORCH else ())
    for name in names:
        t = o["us"][name]
        assert len(t["samples"]) == 2 and all(positive_finite(x) for x in t["samples"])
    assert positive_finite(o["ratios"]["floor"]["median"])
    assert (o["ratios"]["torch"] is not None) == HAS_TORCH
    lines = bench.report.format_overhead(o)
    assert "per-call overhead" in lines[0] and "numpy.empty" in "\n".join(lines)


def test_report_has_the_overhead_row():
    report = bench.benchmark_report(TINY[:1], threads=1, use_torch=False,
                                    measure=False, **FAST)
    assert report["overhead"]["threads"] == 1
    assert "per-call overhead" in bench.format_report(report)
    report = bench.benchmark_report(TINY[:1], threads=1, use_torch=False,
                                    measure=False, overhead=False, **FAST)
    assert report["overhead"] is None
    assert "per-call overhead" not in bench.format_report(report)


def test_scaling_rows():
    over = scaling.usable_cores() + 1
    counts = [2, 1, over, 1]                      # sorted, duplicates dropped
    rows = bench.run_scaling(TINY[:2], counts, use_torch=HAS_TORCH, **FAST)
    assert [r["id"] for r in rows] == [c.id for c in TINY[:2]]
    for r in rows:
        assert [e["threads"] for e in r["counts"]] == [1, 2, over]
        assert r["base_threads"] == 1
        for e in r["counts"]:
            assert e["oversubscribed"] == (e["threads"] > scaling.usable_cores())
            assert 1 <= e["fastattn_threads"] <= min(e["threads"],
                                                    scaling.usable_cores())
            fa = e["fastattn"]
            assert positive_finite(fa["median"]) and positive_finite(fa["gflops"])
            assert positive_finite(fa["efficiency"]["median"])
            if HAS_TORCH:
                assert positive_finite(e["vs_torch"]["median"])
                assert positive_finite(e["torch"]["efficiency"]["median"])
            else:
                assert e["torch"] is None and e["vs_torch"] is None
        first = r["counts"][0]["fastattn"]["efficiency"]
        assert first["median"] == first["min"] == first["max"] == 1.0
    with pytest.raises(ValueError):
        bench.run_scaling(TINY[:1], [0, 1], **FAST)


def test_scaling_report_and_table():
    report = bench.scaling_report(TINY[:2], [1, 2], use_torch=HAS_TORCH, **FAST)
    assert report["threads"] == [1, 2] and len(report["scaling"]) == 2
    assert set(report["ceilings"]) == set(report["overhead"]) == {"1", "2"}
    text = bench.format_report(report)
    for case in TINY[:2]:
        assert case.label in text
    assert "efficiency" in text and "vs torch" in text and "per-call overhead" in text
    json.dumps(bench.report._jsonable(report), allow_nan=False)


# ------------------------------------------------------------------------------ CLI

def ml_dtypes_missing():
    try:
        import ml_dtypes  # noqa: F401
    except ImportError:
        return True
    return False


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
        # float32 and float64 products: the micro-GEMM, or the decoding path
        assert r["kernel"] == ("decode" if r["Lq"] == 1 else "fma")
    assert positive_finite(data["ceilings"]["sgemm_gflops"])
    assert "kernel" in out


@pytest.mark.skipif(ml_dtypes_missing(), reason="ml_dtypes is not installed")
@pytest.mark.parametrize("bf16_dot, amx, E, want", [
    (False, False, 64, "fma"), (True, False, 64, "avx512_bf16"), (True, False, 7, "fma"),
    (True, True, 64, "amx_bf16"), (False, True, 48, "fma")])
def test_bench_names_the_kernel_of_a_bfloat16_row(monkeypatch, bf16_dot, amx, E, want):
    """The kernel column: what fastattn.attention's plan chooses for the row's arrays
    (the choice itself, not a run: AMX need not exist here)."""
    from fastattn import _dispatch
    from fastattn.cli.bench.contenders import fastattn_kernel, make_inputs
    monkeypatch.setattr(_dispatch, "bf16_dot", bf16_dot)
    monkeypatch.setattr(_dispatch, "amx", amx)
    case = bench.Case(1, 2, 40, 40, E, dtype="bfloat16")
    assert fastattn_kernel(case, make_inputs(case)) == want
    decode = bench.Case(1, 4, 1, 70, E, Hkv=2, dtype="bfloat16")
    assert fastattn_kernel(decode, make_inputs(decode)) == "decode"
    # the backward's gradient products: on vdpbf16ps beside its scores, E % 64 == 0
    # (in a driver module that has the kernel)
    on_bf16 = (want == "avx512_bf16" and E % 64 == 0
               and _dispatch.drivers.HAS_AVX512_BF16)
    both = want + ("+avx512_bf16" if on_bf16 else "+fma")
    assert fastattn_kernel(case, make_inputs(case), backward=True) == both


def test_cli_progress_line_without_tqdm(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tqdm", None)
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)
    assert bench.run(parse("--quick", "--no-torch", "--no-ceilings", "--threads", "1",
                           "--only", TINY[0].id)) == 0
    err = capsys.readouterr().err
    assert f"[1/2] {TINY[0].label}" in err and "[2/2] per-call overhead" in err


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
    # a text no shape of any grid has: refused by argparse (tests/test_cli_options.py)
    with pytest.raises(SystemExit):
        parse("--quick", "--only", "no-such-shape")
    assert "no shape of the grid has 'no-such-shape'" in capsys.readouterr().err
    # one of the full grid only: refused by run
    assert bench.run(parse("--quick", "--only", bench.GRID[1].id)) == 2
    assert "no shape matches" in capsys.readouterr().err


def test_cli_thread_scaling(tmp_path, capsys):
    path = tmp_path / "scaling.json"
    over = scaling.usable_cores() + 2
    assert bench.run(parse("--quick", "--threads", f"1,2,{over}", "--only", TINY[0].id,
                           "--no-progress", "--no-ceilings", "--json",
                           str(path))) == 0
    out = capsys.readouterr().out
    assert "thread scaling" in out and TINY[0].label in out
    assert f"{over}*" in out and "oversubscribed" in out
    assert "per-call overhead" in out
    data = json.loads(path.read_text())
    assert data["threads"] == [1, 2, over]
    assert [e["threads"] for e in data["scaling"][0]["counts"]] == [1, 2, over]


def test_cli_thread_counts():
    assert parse("--threads", "2").threads == [2]
    assert parse("--threads", "4, 1,2,2").threads == [1, 2, 4]
    assert bench.run(parse("--threads", "1,2", "--plot", "x.png")) == 2


def test_cli_no_numpy(capsys, monkeypatch):
    case = TINY_VARIANTS[0]
    monkeypatch.setattr(grid, "GRID", [case])
    assert bench.run(parse("--threads", "1", "--no-progress", "--no-ceilings",
                           "--no-torch", "--no-overhead", "--no-numpy")) == 0
    out = capsys.readouterr().out
    assert "skipped numpy: left out (--no-numpy)" in out
    assert "variants against their counterpart" in out
    rows = bench.run_benchmarks([case], threads=1, use_torch=False, use_numpy=False,
                                **FAST)
    assert set(rows[0]["times_ms"]) == {"fastattn", "counterpart"}
    assert rows[0]["skipped"]["numpy"] == "left out (--no-numpy)"
    assert positive_finite(rows[0]["counterpart"]["speedup"]["median"])


def test_cli_no_overhead(capsys):
    assert bench.run(parse("--quick", "--threads", "1", "--only", TINY[0].id,
                           "--no-progress", "--no-ceilings", "--no-torch",
                           "--no-overhead")) == 0
    assert "per-call overhead" not in capsys.readouterr().out


# ----------------------------------------------------------- --torch-op (the operator)

needs_torch = pytest.mark.skipif(not HAS_TORCH, reason="PyTorch is not installed")
TINY_OP = bench.Case(1, 2, 8, 8, 8)


def test_cli_torch_op_option(capsys, monkeypatch):
    assert parse().torch_op is False and parse("--torch-op").torch_op is True
    assert bench.run(parse("--torch-op", "--no-torch")) == 2
    assert "--torch-op" in capsys.readouterr().err
    assert bench.run(parse("--torch-op", "--threads", "1,2")) == 2
    monkeypatch.setattr(bench.command, "_import_torch", lambda: None)
    assert bench.run(parse("--quick", "--torch-op")) == 2
    assert "needs PyTorch" in capsys.readouterr().err


def test_torch_op_cases():
    cases = bench.torch_op.torch_op_cases(TINY + TINY_VARIANTS)
    assert cases[0] == bench.TORCH_OP_CASE == bench.Case(1, 8, 128, 128, 64)
    assert [c.ragged_flavour for c in cases if c.lengths] == ["mask"]
    assert any(c.sinks for c in cases)               # the operator takes sinks
    left_out = [c for c in TINY_VARIANTS if c.ragged_flavour in ("lengths", "varlen")]
    assert len(cases) == 1 + len(TINY) + len(TINY_VARIANTS) - len(left_out)
    assert bench.torch_op.torch_op_cases([bench.TORCH_OP_CASE]) == [bench.TORCH_OP_CASE]


@needs_torch
@pytest.mark.parametrize("backward", [False, True])
def test_the_operator_runs_a_case_with_sinks(backward):
    # the operator's result against the reference (its forward) or its gradients
    # against the reference's backward
    case = bench.Case(1, 2, 8, 8, 8, causal=True, sinks=True)
    arrays = bench.make_inputs(case)
    call = bench.torch_op.make_operator_callable(case, arrays, 1, backward=backward,
                                                 torch_module=bench._import_torch())
    kw = dict(causal=True, sinks=arrays["sinks"])
    got = call()
    if not backward:
        want = reference.attention(arrays["q"], arrays["k"], arrays["v"], **kw)
        np.testing.assert_allclose(got.detach().numpy(), want, rtol=1e-5, atol=1e-6)
        return
    out, lse = reference.attention(arrays["q"], arrays["k"], arrays["v"],
                                   return_lse=True, **kw)
    want = reference.attention_backward(arrays["do"], arrays["q"], arrays["k"],
                                        arrays["v"], out, lse, **kw)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g.numpy(), w, rtol=1e-4, atol=1e-5)


@needs_torch
def test_cli_torch_op_table_and_json(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(bench.torch_op, "TORCH_OP_CASE", TINY_OP)
    path = tmp_path / "op.json"
    assert bench.run(parse("--quick", "--threads", "1", "--only", TINY[2].id,
                           "--no-progress", "--no-ceilings", "--no-overhead",
                           "--torch-op", "--json", str(path))) == 0
    out = capsys.readouterr().out
    assert "PyTorch operator" in out and "operator/NumPy API" in out
    assert TINY_OP.label in out.split("PyTorch operator")[1]
    assert "fastattn.torch.attention" in out             # the bottom-right decode row
    section = json.loads(path.read_text())["torch_op"]
    assert section["threads"] == 1 and section["mode"] == "forward"
    assert [r["label"] for r in section["rows"]] == [TINY_OP.label, TINY[2].label]
    for r in section["rows"]:
        assert set(r["times_ms"]) == {"numpy_api", "operator", "torch"}
        assert positive_finite(r["ratios"]["overhead"]["median"])
        assert positive_finite(r["ratios"]["vs_torch"]["median"])
        assert math.isfinite(r["overhead_us"]["median"])
        assert r["max_abs_diff_operator_vs"]["numpy_api"] == 0.0
        assert r["max_abs_diff_operator_vs"]["torch"] < 1e-5


@needs_torch
@pytest.mark.parametrize("backward", [False, True], ids=["forward", "backward"])
def test_torch_op_variants_agree_with_the_numpy_api(backward):
    cases = [c for c in TINY_VARIANTS
             if c.ragged_flavour not in ("lengths", "varlen") and not c.sinks]
    rows = bench.measure_torch_op(cases, 1, torch_module=bench._import_torch(),
                                  backward=backward, **FAST)
    assert [r["label"] for r in rows] == [c.label for c in cases]
    for r, case in zip(rows, cases):
        assert r["backward"] == backward and not r["skipped"], r["skipped"]
        tol = 1e-12 if case.dtype == "float64" else 2e-5
        assert r["max_abs_diff_operator_vs"]["numpy_api"] <= tol, r["label"]


@pytest.mark.parametrize("argv", [["--threads", "0"], ["--threads", "x"],
                                  ["--threads", "1,0"], ["--threads", "1,,2"],
                                  ["--rounds", "0"], ["--time-budget", "-1"]])
def test_cli_rejects_bad_numbers(argv, capsys):
    with pytest.raises(SystemExit):
        parse(*argv)
    assert "expected" in capsys.readouterr().err


def test_import_is_light(tmp_path):
    """``import fastattn.cli.bench`` imports none of the optional heavy packages."""
    code = ("import sys, fastattn.cli.bench; "
            "print([m for m in ('torch', 'matplotlib', 'tqdm', 'threadpoolctl', "
            "'openvino', 'onnxruntime', 'onnx', 'jax') "
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
    monkeypatch.setattr(grid, "GRID", TINY)
    monkeypatch.setattr(grid, "QUICK_GRID", TINY[:1])
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


@pytest.mark.parametrize("module", [bench, grid, serving], ids=lambda m: m.__name__)
def test_docstring_examples(module, monkeypatch):
    import doctest
    monkeypatch.setattr(grid, "QUICK_GRID", [c for c in grid.GRID if c.quick])
    result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0 and result.attempted >= 1


# ------------------------------------------------------------ bfloat16 and float16

TINY_16 = [grid.Case(1, 2, 40, 50, 16, dtype="bfloat16"),
           grid.Case(1, 2, 40, 50, 16, dtype="float16", causal=True),
           grid.Case(1, 4, 1, 70, 16, Hkv=2, dtype="bfloat16", causal="bottom_right")]


def test_sixteen_bit_rows_agree_with_the_reference_and_pytorch():
    pytest.importorskip("ml_dtypes")
    rows = bench.run_benchmarks(TINY_16, threads=1, use_torch=HAS_TORCH, **FAST)
    for r, case in zip(rows, TINY_16):
        assert r["dtype"] == case.dtype and positive_finite(r["gflops"])
        tol = 2e-2 if case.dtype == "bfloat16" else 3e-3
        assert r["max_abs_diff_vs_numpy"]["fastattn"] < tol, r["label"]
        if HAS_TORCH:
            assert r["max_abs_diff_fastattn_vs_torch"] < 2 * tol, r["label"]


def test_the_grid_has_a_sixteen_bit_section_and_dtype_replaces_every_dtype():
    assert {c.dtype for c in grid.GRID} >= {"bfloat16", "float16"}
    quick = [c for c in grid.GRID if c.quick]
    assert any(c.dtype == "bfloat16" for c in quick)
    moved = grid.with_dtype(quick, "float16")
    assert moved and {c.dtype for c in moved} == {"float16"}
    assert len({c.id for c in moved}) == len(moved)
    assert grid.numpy_dtype("float16") == np.float16
    with pytest.raises(SystemExit):
        parse("--dtype", "int8")


def test_cli_dtype(capsys, monkeypatch):
    pytest.importorskip("ml_dtypes")
    monkeypatch.setattr(grid, "QUICK_GRID", TINY_16[:1] + TINY[:1])
    args = parse("--quick", "--dtype", "bfloat16", "--no-ceilings", "--no-overhead",
                 "--no-progress", "--threads", "1", "--rounds", "1")
    assert bench.run(args) == 0
    out = capsys.readouterr().out
    assert out.count("bfloat16") >= 2 and "float32" not in out.split("\n\n")[1]


def test_bf16_ceiling_when_torch_is_installed():
    """With PyTorch the ceilings have a bfloat16 matmul's rate, or say why it was not
    timed (a trial product below a tenth of the sgemm's rate)."""
    if not HAS_TORCH:
        pytest.skip("PyTorch is not installed")
    c = bench.measure_ceilings(1, gemm_n=64, bandwidth_bytes=2**20, repeats=1,
                               torch_module=bench._import_torch())
    assert ("bf16gemm_gflops" in c) != ("bf16gemm_skipped" in c)
    if "bf16gemm_gflops" in c:
        assert c["bf16gemm_gflops"] > 0
    else:
        assert "no bfloat16 units" in c["bf16gemm_skipped"]


class _SlowBf16Torch:
    """A stand-in for torch whose matmul takes 10 ms whatever the size, and counts."""
    bfloat16 = "bfloat16"

    def __init__(self):
        self.sizes = []

    def randn(self, n, m, dtype=None):
        return np.zeros((n, m), np.float32)

    def matmul(self, a, b):
        import time
        self.sizes.append(a.shape[0])
        time.sleep(0.01)


def test_a_slow_bf16_matmul_is_not_timed_at_full_size():
    """On a CPU without bfloat16 units PyTorch's bf16 matmul ran at 0.3 GFLOP/s, a
    minute per 2048 x 2048 product: one small trial says so, and only it runs."""
    fake = _SlowBf16Torch()
    out = ceilings._bf16_matmul(fake, 2048, 3, sgemm_gflops=1000.0)   # trial 26.8
    assert set(fake.sizes) == {ceilings.BF16_TRIAL_N}
    assert "bf16gemm_gflops" not in out and "no bfloat16 units" in out["bf16gemm_skipped"]
    text = report_ceilings_line({"sgemm_gflops": 100.0, "dgemm_gflops": 50.0,
                                 "gemm_n": 2048, "bandwidth_gbs": 20.0,
                                 "bandwidth_bytes": 2 ** 28, **out})
    assert "bf16 matmul not timed" in text
    fast = ceilings._bf16_matmul(fake, 2048, 3, sgemm_gflops=1.0)    # 26.8 GFLOP/s
    assert fast["bf16gemm_gflops"] > 0 and 2048 in fake.sizes


def report_ceilings_line(c):
    from fastattn.cli.bench import report
    rep = {"mode": "forward", "threads": 1, "machine": {}, "ceilings": c, "results": []}
    return report.format_report(rep).split("\n")[1]


def test_bf16_ceiling_is_the_sgemm_where_bf16_matmuls_are_slower():
    """A bfloat16 row's % peak is of PyTorch's bf16 matmul where that is the faster
    (bfloat16 units), else of the sgemm: on a CPU without them PyTorch's bf16 matmul
    ran at 0.3 GFLOP/s and the share had read 19790 %."""
    row = {"decode": False, "dtype": "bfloat16",
           "times_ms": {"fastattn": {"gflops": 60.0}}}
    slow = bench.runner._peak(row, {"sgemm_gflops": 150.0, "bf16gemm_gflops": 0.3})
    assert slow["ceiling"] == "sgemm" and slow["pct_of_ceiling"] == pytest.approx(40.0)
    fast = bench.runner._peak(row, {"sgemm_gflops": 150.0, "bf16gemm_gflops": 600.0})
    assert fast["ceiling"] == "bf16gemm" and fast["pct_of_ceiling"] == pytest.approx(10.0)


def test_torch_op_rows_in_sixteen_bits():
    """The operator section takes bfloat16 cases (tensors on the arrays' memory)."""
    pytest.importorskip("ml_dtypes")
    if not HAS_TORCH:
        pytest.skip("PyTorch is not installed")
    rows = bench.torch_op.measure_torch_op(TINY_16[:2], 1, torch_module=bench._import_torch(),
                                           **FAST)
    assert [r["dtype"] for r in rows][-2:] == ["bfloat16", "float16"]


def test_each_short_sample_follows_the_pause_and_one_untimed_call(monkeypatch):
    """The rounds: a pause, then (for a call repeated within its sample) one untimed
    call, then the timed ones; a call long enough to be a sample alone runs once."""
    monkeypatch.setattr(timing, "_SETTLE_S", 1e-4)
    log = []
    calls = {"short": lambda: log.append("short"),
             "long": lambda: (log.append("long"), __import__("time").sleep(0.012))}
    samples, _, numbers, _ = timing.interleaved(calls, max_rounds=2, min_rounds=2,
                                                time_budget=0, min_sample_time=0.01)
    assert numbers["long"] == 1 and numbers["short"] > 1
    assert {len(s) for s in samples.values()} == {2}
    # warm-up and calibration (a first call, then one timed), then per round
    assert log.count("long") == 2 + 2
    assert log.count("short") == 2 + 2 * (1 + numbers["short"])


# --------------------------------------------------- serving: paged and quantized caches

needs_ml_dtypes = pytest.mark.skipif(ml_dtypes_missing(),
                                     reason="ml_dtypes is not installed")
SHAPE_32_8 = dict(B=1, H=32, Hkv=8, q_len=1, E=128)


def serving_shape(c):
    return dict(B=c.B, H=c.H, Hkv=c.Hkv, q_len=c.q_len, E=c.E)


def test_the_serving_rows_of_the_grid():
    """Decoding (1, 32:8, 1, Lk, 128) at 8192 and 32768 tokens for bfloat16, int8 and
    float8 caches, contiguous and paged in blocks of 16 and 64 (and at 8192 tokens
    bfloat16 and int8 blocks of 16 stored heads first); a ragged paged batch of 32
    sequences over 256..16384 tokens (bfloat16 and int8); a chunked prefill."""
    rows = {(c.kv_lengths, c.q_len, c.cache, c.block_size, c.heads_first): c
            for c in SERVING_GRID}
    assert len(rows) == len(SERVING_GRID)
    for lk in (8192, 32768):
        for cache in ("bfloat16", "int8", "float8_e4m3fn"):
            for block_size in (None, 16, 64):
                c = rows[((lk,), 1, cache, block_size, False)]
                assert serving_shape(c) == SHAPE_32_8 and c.baselines
        assert ((lk,), 1, "float8_e5m2", 16, False) in rows
    assert sorted(c.cache for c in SERVING_GRID if c.heads_first) == ["bfloat16", "int8"]
    for cache in ("bfloat16", "int8"):
        c = rows[((8192,), 1, cache, 16, True)]
        assert serving_shape(c) == SHAPE_32_8 and c.baselines
    ragged = [c for c in SERVING_GRID if c.B > 1 and c.decode]
    assert sorted(c.cache for c in ragged) == ["bfloat16", "int8"]
    for c in ragged:
        assert c.B == 32 and c.block_size == 16 and (c.H, c.Hkv, c.E) == (32, 8, 128)
        assert min(c.kv_lengths) == 256 and max(c.kv_lengths) == 16384
        assert len(set(c.kv_lengths)) == 32                       # really ragged
        assert list(c.kv_lengths) != sorted(c.kv_lengths)         # and not in order
    (prefill,) = [c for c in SERVING_GRID if not c.decode]
    assert prefill.B == 4 and prefill.q_len == 512 and prefill.paged
    assert min(prefill.kv_lengths) == 2048 and max(prefill.kv_lengths) == 8192
    assert prefill.cache == "bfloat16" and not prefill.baselines
    # ids: unique, apart from the attention grid's, each selecting its own row only
    ids = [c.id for c in SERVING_GRID]
    assert len(set(ids)) == len(ids) and all(i.startswith("serve-") for i in ids)
    attention = [c.id for c in bench.GRID] + [c.label for c in bench.GRID]
    for c in SERVING_GRID:
        assert [d.id for d in SERVING_GRID if c.id in d.id] == [c.id]
        assert not any(c.id in t or c.label in t for t in attention)
    # --quick: one row, the int8 paged decoding step at 8192 tokens
    assert [(c.kv_lengths, c.cache, c.block_size, c.heads_first)
            for c in QUICK_SERVING_GRID] == [((8192,), "int8", 16, False)]


def test_serving_labels_ids_and_bad_rows():
    c = ServingCase((8192,), cache="float8_e4m3fn", block_size=64)
    assert c.label == "decode (1,32:8,1,8192,128) float8_e4m3fn paged bs=64"
    assert c.id == "serve-decode-1x32h8x1x8192x128-float8_e4m3fn-paged64"
    r = ServingCase((300, 20, 7000), cache="int8", block_size=None)
    assert r.label == "decode (3,32:8,1,20..7000,128) int8 contiguous"
    assert r.id == "serve-decode-3x32h8x1x20_7000x128-int8-contiguous"
    h = ServingCase((8192,), cache="int8", block_size=16, heads_first=True)
    assert h.label == "decode (1,32:8,1,8192,128) int8 paged bs=16 heads first"
    assert h.id == "serve-decode-1x32h8x1x8192x128-int8-pagedh16"
    for kwargs in (dict(kv_lengths=()), dict(kv_lengths=(4,), q_len=5),
                   dict(kv_lengths=(8,), cache="float16"), dict(kv_lengths=(8,), H=6),
                   dict(kv_lengths=(8,), block_size=0),
                   dict(kv_lengths=(8,), block_size=None, heads_first=True)):
        with pytest.raises(ValueError):
            ServingCase(**kwargs)


def test_serving_bytes_and_flops_by_hand():
    """The bytes a decoding step reads: 2 per bfloat16 element, or 1 per code plus a
    4-byte scale per token and head, for K and for V."""
    assert ServingCase((8192,), cache="bfloat16").kv_bytes() == 33554432   # 8*8192*256*2
    for cache in ("int8", "float8_e4m3fn", "float8_e5m2"):
        for block_size in (None, 16, 64):               # the layout reads the same bytes
            c = ServingCase((8192,), cache=cache, block_size=block_size)
            assert c.kv_bytes() == 8 * 8192 * 256 + 8 * 8192 * 2 * 4 == 17301504
    assert ServingCase((32768,), cache="int8").kv_bytes() == 4 * 17301504
    assert sum(serving.RAGGED_DECODE_LENGTHS) == 128718
    assert ServingCase(serving.RAGGED_DECODE_LENGTHS).kv_bytes() == 128718 * 8 * 256 * 2
    assert ServingCase(serving.RAGGED_DECODE_LENGTHS, cache="int8").kv_bytes() == \
        128718 * 8 * (256 + 8)
    # decoding: one query sees every key; prefill: the last 512 positions, causal
    assert ServingCase((8192,)).flops() == 2 * 32 * 8192 * 256
    p = ServingCase((2048, 8192), q_len=512)
    pairs = sum(sum(n - 512 + i + 1 for i in range(512)) for n in (2048, 8192))
    assert p.allowed_pairs() == pairs == 512 * (1536 + 7680) + 2 * 512 * 513 // 2
    assert p.flops() == 2 * 32 * pairs * 256


@needs_ml_dtypes
@pytest.mark.parametrize("cache", serving.CACHES)
def test_serving_inputs_have_the_intended_layouts(cache):
    import ml_dtypes
    case = ServingCase((33, 5, 70), q_len=3, H=4, Hkv=2, E=16, cache=cache, block_size=4)
    a = serving.make_serving_inputs(case, seed=1)
    codes = {"bfloat16": ml_dtypes.bfloat16, "int8": np.int8,
             "float8_e4m3fn": ml_dtypes.float8_e4m3fn,
             "float8_e5m2": ml_dtypes.float8_e5m2}[cache]
    assert a["q_packed"].dtype == ml_dtypes.bfloat16 and a["q_packed"].shape == (9, 4, 16)
    assert a["q_paged"] is a["q_packed"]                       # prefill: packed queries
    assert list(a["lengths"]) == [33, 5, 70]
    assert list(a["cu_seqlens_k"]) == [0, 33, 38, 108]
    assert list(a["cu_seqlens_q"]) == [0, 3, 6, 9]
    blocks = [9, 2, 18]                                        # ceil(L / 4)
    assert a["k_cache"].shape == a["v_cache"].shape == (29, 4, 2, 16)
    assert a["k_cache"].dtype == a["v_cache"].dtype == codes
    if cache == "bfloat16":
        assert a["k_scale_cache"] is None and a["k_scale_packed"] is None
    else:
        assert a["k_scale_cache"].shape == (29, 4, 2)
        assert a["k_scale_cache"].dtype == np.float32
        assert a["k_scale_packed"].shape == (108, 2)
    # every block used once, in a random order: not the identity, not sorted
    table = a["block_table"]
    assert table.shape == (3, 18) and table.dtype == np.int32
    used = np.concatenate([table[b, :n] for b, n in enumerate(blocks)])
    assert sorted(used) == list(range(29))
    assert list(used) != sorted(used)
    assert (table[1, 2:] == 0).all()                           # entries past the end
    # the blocks through the table hold the packed tokens, and so do the slots
    for name in ("k", "v"):
        packed = a[f"{name}_packed"]
        for b, n in enumerate(blocks):
            s, e = a["cu_seqlens_k"][b], a["cu_seqlens_k"][b + 1]
            gathered = a[f"{name}_cache"][table[b, :n]].reshape(-1, 2, 16)[:e - s]
            np.testing.assert_array_equal(gathered.view(np.uint8),
                                          packed[s:e].view(np.uint8))
        flat = a[f"{name}_cache"].reshape(-1, 2, 16)
        np.testing.assert_array_equal(flat[a["slots"]].view(np.uint8),
                                      packed.view(np.uint8))
        if cache != "bfloat16":
            np.testing.assert_array_equal(
                a[f"{name}_scale_cache"].reshape(-1, 2)[a["slots"]],
                a[f"{name}_scale_packed"])
    # a contiguous row of one sequence: the same values, head-major for attention
    one = ServingCase((70,), H=4, Hkv=2, E=16, cache=cache, block_size=None)
    c = serving.make_serving_inputs(one, seed=1)
    p = serving.make_serving_inputs(replace(one, block_size=16), seed=1)
    assert "k_cache" not in c and c["k_heads"].shape == (1, 2, 70, 16)
    assert c["k_heads"].flags.c_contiguous and c["q_heads"].shape == (1, 4, 1, 16)
    np.testing.assert_array_equal(c["k_heads"][0].swapaxes(0, 1).view(np.uint8),
                                  c["k_packed"].view(np.uint8))
    for name in ("q_packed", "k_packed", "v_packed"):       # layouts share their data
        np.testing.assert_array_equal(c[name].view(np.uint8), p[name].view(np.uint8))
    assert p["q_paged"].shape == (1, 1, 4, 16)
    # blocks stored heads first: the same blocks, table and slots, seen through a view
    # of (num_blocks, Hkv, block_size, E) memory
    h = serving.make_serving_inputs(replace(case, heads_first=True), seed=1)
    np.testing.assert_array_equal(h["block_table"], a["block_table"])
    for name in ("k_cache", "v_cache", "k_scale_cache", "v_scale_cache"):
        if a[name] is None:
            assert h[name] is None
            continue
        assert h[name].shape == a[name].shape and not h[name].flags.c_contiguous
        assert h[name].swapaxes(1, 2).flags.c_contiguous
        np.testing.assert_array_equal(np.ascontiguousarray(h[name]).view(np.uint8),
                                      a[name].view(np.uint8))
    # the contiguous contender of a paged row reads the cache in the blocks' order of
    # tokens and heads: the packed tokens (token-major blocks), head-major otherwise
    k, v, ks, vs = serving._blocks_layout(replace(one, block_size=16), p)
    assert k.shape == p["k_heads"].shape and np.shares_memory(k, p["k_packed"])
    assert k.strides[2] == 2 * 16 * p["k_packed"].itemsize          # token after token
    assert (ks is None) == (cache == "bfloat16")
    hp = serving.make_serving_inputs(replace(one, block_size=16, heads_first=True), seed=1)
    k, v, ks, vs = serving._blocks_layout(replace(one, block_size=16, heads_first=True),
                                          hp)
    assert k is hp["k_heads"] and v is hp["v_heads"] and k.flags.c_contiguous


def serving_tolerance(contender, scale):
    """A few bfloat16 roundings of a result of largest magnitude ``scale``; PyTorch's
    SDPA computes bfloat16 attention with bfloat16 intermediates (about 2**-7 of the
    largest value here), so its share is larger."""
    return (2 ** -5 if contender == "torch" else 2 ** -7) * scale


def expected_rows(case, arrays):
    """Each sequence alone through fastattn.reference.attention on the dequantized
    values, in float64: packed rows (total_q, H, E)."""
    q = arrays["q_packed"].astype(np.float64)
    out = []
    for b in range(case.B):
        s, e = arrays["cu_seqlens_k"][b], arrays["cu_seqlens_k"][b + 1]
        kv = []
        for name in ("k", "v"):
            sc = arrays[f"{name}_scale_packed"]
            x = arrays[f"{name}_packed"][s:e]
            kv.append(reference.dequantize_kv(x, None if sc is None else sc[s:e])
                      .astype(np.float64).swapaxes(0, 1))
        qb = q[arrays["cu_seqlens_q"][b]:arrays["cu_seqlens_q"][b + 1]].swapaxes(0, 1)
        o = reference.attention(qb, kv[0], kv[1], causal="bottom_right",
                                enable_gqa=True)
        out.append(o.swapaxes(0, 1))
    return np.concatenate(out)


SERVING_CHECKS = [
    *[ServingCase((70,), H=4, Hkv=2, E=16, cache=cache, block_size=bs)
      for cache in serving.CACHES for bs in (None, 4, 16)],
    *[ServingCase((70,), H=4, Hkv=2, E=16, cache=cache, block_size=16, heads_first=True)
      for cache in ("bfloat16", "int8")],
    ServingCase((33, 5, 70), H=4, Hkv=2, E=16, cache="int8", block_size=4,
                heads_first=True),
    ServingCase((33, 5, 70), H=8, Hkv=1, E=16, cache="int8", block_size=4),
    ServingCase((33, 5, 70), H=4, Hkv=4, E=16, cache="bfloat16", block_size=4),
    ServingCase((33, 9, 70), q_len=5, H=4, Hkv=2, E=16, block_size=4),
    ServingCase((33, 9, 70), q_len=5, H=4, Hkv=2, E=16, block_size=4,
                cache="float8_e5m2"),
    ServingCase((40,), q_len=6, H=4, Hkv=2, E=16, cache="int8", block_size=None),
]


@needs_ml_dtypes
@pytest.mark.parametrize("case", SERVING_CHECKS, ids=lambda c: c.id)
def test_each_serving_contender_matches_the_reference(case):
    """fastattn (paged or contiguous), the contiguous call, and what a caller writes
    today with NumPy and PyTorch: every row and head within bfloat16 rounding of each
    sequence alone through the reference; the bench's own subsampled reference agrees;
    a paged call through a wrong block table does not."""
    torch_module = bench._import_torch() if HAS_TORCH else None
    arrays = serving.make_serving_inputs(case, seed=2)
    want = expected_rows(case, arrays)
    scale = np.abs(want).max()
    ran = []
    for name in serving.SERVING_CONTENDERS:
        try:
            call, rows = serving.make_serving_callable(case, name, arrays, 2,
                                                       torch_module=torch_module)
        except serving.Unavailable as exc:
            expected_skip = ((name == "contiguous" and not case.paged)
                             or (name == "numpy" and not case.paged
                                 and not case.quantized)
                             or (name == "torch" and torch_module is None))
            assert expected_skip, f"{name}: {exc}"
            continue
        got = np.asarray(rows(call()), np.float64)
        assert got.shape == want.shape == (case.B * case.q_len, case.H, case.E)
        assert np.abs(got - want).max() <= serving_tolerance(name, scale), name
        ran.append(name)
    assert "fastattn" in ran and ("contiguous" in ran) == case.paged
    assert ("numpy" in ran) == (case.paged or case.quantized)
    # the subsample the bench checks: every sequence, first and last kv head's query
    # heads, first/middle/last query
    idx, heads, sub = serving.serving_reference(case, arrays)
    assert len(idx) == case.B * len({0, case.q_len // 2, case.q_len - 1})
    assert heads == sorted(set(range(case.H // case.Hkv)) |
                           set(range(case.H - case.H // case.Hkv, case.H)))
    np.testing.assert_allclose(sub, want[idx][:, heads], atol=1e-12)
    if case.paged:
        bad = dict(arrays, block_table=arrays["block_table"][:, ::-1].copy())
        bad["block_table"][bad["block_table"] >= len(arrays["k_cache"])] = 0
        call, rows = serving.make_serving_callable(case, "fastattn", bad, 1)
        assert np.abs(np.asarray(rows(call()), np.float64) - want).max() > \
            10 * serving_tolerance("fastattn", scale)


@needs_ml_dtypes
def test_run_serving_rows():
    """Each row: the contenders that apply, per-round ratios, the bytes counted, the
    differences from the reference, the skipped contenders with their reasons."""
    rows = serving.run_serving(TINY_SERVING, 1, torch_module=bench._import_torch()
                               if HAS_TORCH else None, **FAST)
    assert [r["id"] for r in rows] == [c.id for c in TINY_SERVING]
    paged, contiguous, ragged, prefill = rows
    assert set(paged["times_ms"]) == {"fastattn", "contiguous", "numpy"} | (
        {"torch"} if HAS_TORCH else set())
    assert "numpy" in contiguous["skipped"] and "contiguous" in contiguous["skipped"]
    assert set(prefill["times_ms"]) == {"fastattn", "contiguous"}
    assert "left out" in prefill["skipped"]["numpy"]
    for r, case in zip(rows, TINY_SERVING):
        assert r["kv_bytes"] == case.kv_bytes() and r["flops"] == case.flops()
        assert r["rounds"] >= 1 and r["decode"] == case.decode
        fa = r["times_ms"]["fastattn"]["samples"]
        for other in ("numpy", "torch"):
            if other in r["times_ms"]:
                per = r["speedup"][other]["per_round"]
                assert per == pytest.approx(
                    [o / f for o, f in zip(r["times_ms"][other]["samples"], fa)])
            else:
                assert r["speedup"][other] is None
        if case.paged:
            per = r["paged_over_contiguous"]["per_round"]
            assert per == pytest.approx(
                [f / c for f, c in zip(fa, r["times_ms"]["contiguous"]["samples"])])
            assert r["max_abs_diff_vs_contiguous"] <= serving_tolerance(
                "fastattn", r["max_abs_reference"])
        else:
            assert r["paged_over_contiguous"] is None
        assert set(r["max_abs_diff_vs_reference"]) == set(r["times_ms"])
        for name, diff in r["max_abs_diff_vs_reference"].items():
            assert 0 <= diff <= serving_tolerance(name, r["max_abs_reference"]), name
        assert (r["gbs"] is not None) == case.decode
    text = "\n".join(bench.format_serving(rows))
    for case in TINY_SERVING:
        line = next(l for l in text.splitlines() if l.startswith(case.label))
        assert " !" not in line
    assert "warning" not in text
    # a difference beyond bfloat16 rounding is flagged
    bad = dict(paged, max_abs_diff_vs_reference=dict(
        paged["max_abs_diff_vs_reference"], numpy=0.5))
    text = "\n".join(bench.format_serving([bad]))
    assert f"{paged['label']} !" in text
    assert "the numpy contender differs from the reference by 0.5" in text


@needs_ml_dtypes
def test_serving_decode_rows_take_their_share_of_the_read_probe():
    """% read bandwidth: per round, the row's bytes over fastattn's time against the
    probe's bytes over its time in the same round."""
    report = bench.benchmark_report([], threads=1, use_torch=False, use_numpy=False,
                                    overhead=False, serving=TINY_SERVING[:1], **FAST)
    assert report["results"] == []
    (r,) = report["serving"]
    same = r["pct_of_bandwidth_same_rounds"]
    assert same["probe_bytes"] == 1 << 20
    fa, read = r["times_ms"]["fastattn"]["samples"], r["times_ms"]["read"]["samples"]
    # 70 tokens, 2 kv heads: 16 + 16 one-byte codes and two 4-byte scales each
    assert r["kv_bytes"] == 70 * 2 * (16 + 16 + 4 + 4) == 5600
    for pct, f, t in zip(same["per_round"], fa, read):
        assert pct == pytest.approx(100 * (5600 / f) / ((1 << 20) / t))
    assert r["pct_of_ceiling"] == same["median"]
    with pytest.raises(ValueError, match="inference"):
        bench.benchmark_report([], threads=1, backward=True, use_torch=False,
                               serving=TINY_SERVING[:1], **FAST)


@needs_ml_dtypes
def test_cli_runs_a_serving_row_end_to_end(tmp_path, capsys):
    """``fastattn bench --only <id>`` of a serving row (the full grid, with the quick
    settings of this file), then the one row of --quick."""
    case = TINY_SERVING[2]
    path = tmp_path / "serve.json"
    assert bench.run(parse("--only", case.id, "--threads", "1", "--no-progress",
                           "--no-overhead", "--json", str(path))) == 0
    out = capsys.readouterr().out
    assert "serving: paged and quantized key-value caches" in out
    line = next(l for l in out.splitlines() if l.startswith(case.label))
    assert "GB/s" in line and " !" not in line
    assert "geometric-mean" not in out                   # no attention row selected
    data = json.loads(path.read_text())
    assert data["results"] == [] and [r["id"] for r in data["serving"]] == [case.id]
    (r,) = data["serving"]
    assert set(r["times_ms"]) >= {"fastattn", "contiguous", "numpy", "read"}
    assert positive_finite(r["speedup"]["numpy"]["median"])
    assert positive_finite(r["pct_of_ceiling"])
    assert r["kv_bytes"] == (33 + 5 + 70) * 2 * (2 * 16 + 8)
    assert bench.run(parse("--quick", "--only", "serve-", "--threads", "1",
                           "--no-progress", "--no-overhead", "--no-ceilings")) == 0
    out = capsys.readouterr().out
    assert TINY_SERVING[0].label in out and case.label not in out
    # --list names the serving rows after the attention rows
    assert bench.run(parse("--quick", "--list")) == 0
    listed = capsys.readouterr().out
    assert TINY_SERVING[0].id in listed and TINY_SERVING[2].id not in listed
    assert bench.run(parse("--list")) == 0
    listed = capsys.readouterr().out
    assert all(c.id in listed for c in TINY_SERVING)


@pytest.mark.parametrize("argv, why", [
    (["--backward"], "--backward"), (["--dtype", "float32"], "--dtype"),
    (["--threads", "1,2"], "thread scaling")])
def test_options_that_leave_the_serving_rows_out(argv, why, capsys):
    """Inference rows with their own cache dtypes: left out with a note, and an error
    when nothing else is selected."""
    assert bench.run(parse("--quick", "--only", "serve-", *argv)) == 2
    err = capsys.readouterr().err
    assert why in err and "leaves out the serving rows" in err
    assert bench.run(parse("--quick", "--no-progress", "--no-ceilings", "--no-overhead",
                           "--no-torch", "--rounds", "1", "--only", TINY[0].id,
                           "--only", "serve-", *argv)) == 0
    captured = capsys.readouterr()
    assert "serving rows" in captured.err and why in captured.err
    assert "serving:" not in captured.out and TINY[0].label in captured.out


@needs_ml_dtypes
def test_cli_no_numpy_and_no_torch_leave_the_serving_baselines_out(capsys):
    assert bench.run(parse("--quick", "--only", "serve-", "--threads", "1", "--no-numpy",
                           "--no-torch", "--no-progress", "--no-overhead",
                           "--no-ceilings")) == 0
    out = capsys.readouterr().out
    assert "skipped in the serving table, numpy: left out (--no-numpy)" in out
    assert "skipped in the serving table, torch: left out (--no-torch)" in out
    line = next(l for l in out.splitlines() if l.startswith(TINY_SERVING[0].label))
    assert line.split()[-1] != "n/a"                    # fastattn's difference
