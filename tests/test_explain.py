"""fastattn.explain: the numbers behind "divide the scores by sqrt(d_k)".

Oracles: the variance of a sum of d_k products of independent N(0, 1) numbers is d_k;
softmax statistics of hand-made rows (flat, one-hot) and the Jacobian written out.
"""

import math

import numpy as np
import pytest

import fastattn
from fastattn import explain
from fastattn.cli import main


def test_variance_within_3_percent_at_the_default_sample_size():
    dims = (1, 2, 4, 8, 16, 32, 64, 128)
    t = explain.variance_table(dims)                      # default samples and seed
    np.testing.assert_array_equal(t["d_k"], dims)
    np.testing.assert_allclose(t["var_unscaled"], dims, rtol=0.03)
    np.testing.assert_allclose(t["var_scaled"], 1.0, rtol=0.03)
    np.testing.assert_allclose(t["var_scaled"], t["var_unscaled"] / np.array(dims))


@pytest.mark.parametrize("seed", [1, 2])
def test_variance_for_other_seeds(seed):
    t = explain.variance_table((3, 100), samples=40_000, seed=seed)
    np.testing.assert_allclose(t["var_unscaled"], [3, 100], rtol=0.05)


def test_unscaled_softmax_saturates_scaled_stays_bounded():
    t = explain.softmax_table()                           # d_k = 1 ... 1024
    assert list(t["d_k"]) == [2 ** i for i in range(11)]
    up, sc = t["max_p_unscaled"], t["max_p_scaled"]
    assert np.all(np.diff(up) > 0)                        # grows with d_k ...
    assert up[-1] > 0.9                                   # ... toward 1
    assert sc.max() < 0.25 and sc.max() - sc.min() < 0.05  # bounded, flat in d_k
    assert np.all(np.diff(t["entropy_unscaled"]) < 0)
    assert t["entropy_unscaled"][-1] < 0.2
    assert t["entropy_scaled"].min() > 2.9                # log 32 = 3.47 for a flat row
    assert t["jacobian_unscaled"][-1] < 0.3 * t["jacobian_scaled"][-1]
    assert np.ptp(t["jacobian_scaled"]) < 0.05
    # at d_k = 1 the scaled and unscaled scores are the same numbers
    for name in ("max_p", "entropy", "jacobian"):
        assert t[f"{name}_unscaled"][0] == t[f"{name}_scaled"][0]


def test_deterministic_for_a_seed():
    a = explain.explain_table((1, 8, 64), samples=500, rows=30, seed=5)
    b = explain.explain_table((1, 8, 64), samples=500, rows=30, seed=5)
    c = explain.explain_table((1, 8, 64), samples=500, rows=30, seed=6)
    assert a.keys() == b.keys()
    for key in a:
        np.testing.assert_array_equal(a[key], b[key])
    assert not np.array_equal(a["var_unscaled"], c["var_unscaled"])


def test_softmax_stats_hand_values():
    L = 8
    s = explain.softmax_stats(np.zeros((2, L)))
    np.testing.assert_allclose(s["max_p"], 1 / L)
    np.testing.assert_allclose(s["entropy"], math.log(L))
    np.testing.assert_allclose(s["jacobian_norm"], math.sqrt(1 / L - 1 / L ** 2))
    one_hot = explain.softmax_stats([0.0, 1000.0, 0.0])
    assert one_hot["max_p"] == 1.0 and one_hot["entropy"] == 0.0
    assert one_hot["jacobian_norm"] == 0.0
    masked = explain.softmax_stats([0.0, -np.inf, 0.0])
    assert masked["max_p"] == 0.5
    np.testing.assert_allclose(masked["entropy"], math.log(2))


def test_softmax_stats_jacobian_written_out(rng):
    rows = rng.standard_normal((5, 6)) * 3
    s = explain.softmax_stats(rows)
    for i, row in enumerate(rows):
        p = np.exp(row) / np.exp(row).sum()
        J = np.diag(p) - np.outer(p, p)
        np.testing.assert_allclose(s["jacobian_norm"][i], np.linalg.norm(J), rtol=1e-12)
        np.testing.assert_allclose(s["entropy"][i], -(p * np.log(p)).sum(), rtol=1e-12)
        np.testing.assert_allclose(s["max_p"][i], p.max(), rtol=1e-12)


@pytest.mark.parametrize("call, error", [
    (lambda: explain.variance_table(samples=1), ValueError),
    (lambda: explain.variance_table(samples=2.5), TypeError),
    (lambda: explain.variance_table(dims=()), ValueError),
    (lambda: explain.variance_table(dims=(0, 4)), ValueError),
    (lambda: explain.softmax_table(keys=0), ValueError),
    (lambda: explain.softmax_stats(np.zeros((3, 0))), ValueError),
])
def test_errors(call, error):
    with pytest.raises(error):
        call()


def test_format_table():
    t = explain.explain_table((1, 16), samples=200, rows=10)
    text = explain.format_table(t)
    lines = text.splitlines()
    assert "variance" in lines[0] and "Jacobian norm" in lines[0]
    assert lines[2].split()[0] == "1" and lines[3].split()[0] == "16"
    assert len(lines[3].split()) == 9
    # a variance table alone gives the variance columns only
    only = explain.format_table(explain.variance_table((2,), samples=50))
    assert "entropy" not in only and len(only.splitlines()[2].split()) == 3


def test_command_prints_the_table(capsys):
    assert main(["explain", "--samples", "2000", "--rows", "20", "--max-dk", "64",
                 "--seed", "3"]) == 0
    out = capsys.readouterr().out
    assert "sqrt(d_k)" in out
    rows = [line.split() for line in out.splitlines()
            if line.split() and line.split()[0].isdigit() and len(line.split()) == 9]
    assert [int(r[0]) for r in rows] == [1, 2, 4, 8, 16, 32, 64]
    t = explain.explain_table([1, 2, 4, 8, 16, 32, 64], samples=2000, rows=20, seed=3)
    assert [float(r[1]) for r in rows] == [round(float(v), 2) for v in t["var_unscaled"]]


def test_command_rejects_bad_options(capsys):
    for argv in (["--samples", "1"], ["--seed", "-1"], ["--max-dk", "0"]):
        with pytest.raises(SystemExit):
            main(["explain", *argv])
    capsys.readouterr()


def test_command_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    path = tmp_path / "explain.png"
    assert main(["explain", "--samples", "200", "--rows", "10", "--max-dk", "8",
                 "--plot", str(path)]) == 0
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert str(path) in capsys.readouterr().out


def test_command_plot_without_matplotlib(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(explain.importlib.util, "find_spec",
                        lambda name, *a: None if name == "matplotlib" else object())
    assert main(["explain", "--plot", str(tmp_path / "x.png")]) == 1
    assert "matplotlib" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()


def test_reachable_from_the_package():
    assert fastattn.explain.variance_table is explain.variance_table
