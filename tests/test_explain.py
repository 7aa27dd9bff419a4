"""fastattn explain: the numbers behind the 1/sqrt(d_k) factor.

Oracles: the statistics themselves (Var(q·k) = d_k for independent components of
mean 0 and variance 1), the softmax Jacobian built as a matrix, and values worked out
by hand for flat and one-hot rows.
"""

import argparse
import doctest
import math

import numpy as np
import pytest

import fastattn.explain
from fastattn import explain
from fastattn.cli import explain as command


def parse(*argv):
    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.fixture(scope="module")
def default_table():
    """The full table at the default sample sizes (the expensive call, made once)."""
    return explain.explain_table()


def test_doctests():
    result = doctest.testmod(fastattn.explain, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0


def test_variances_within_3_percent(default_table):
    d = default_table["d_k"]
    assert d.tolist() == [2 ** i for i in range(11)]
    np.testing.assert_allclose(default_table["var_unscaled"], d, rtol=0.03)
    np.testing.assert_allclose(default_table["var_scaled"], 1.0, rtol=0.03)
    np.testing.assert_allclose(default_table["var_scaled"] * d,
                               default_table["var_unscaled"], rtol=1e-12)


def test_unscaled_softmax_saturates_scaled_does_not(default_table):
    t = default_table
    keys = explain.DEFAULT_KEYS
    # at d_k = 1 the scaled and unscaled scores are the same numbers
    for name in ("max_p", "entropy", "jacobian"):
        assert t[f"{name}_unscaled"][0] == t[f"{name}_scaled"][0]
    max_p = t["max_p_unscaled"]
    assert np.all(np.diff(max_p) > 0) and max_p[-1] > 0.9          # toward 1
    assert np.all(np.diff(t["entropy_unscaled"]) < 0) and t["entropy_unscaled"][-1] < 0.2
    assert t["jacobian_unscaled"][-1] < 0.1                          # toward 0
    scaled = t["max_p_scaled"]
    assert np.all(scaled < 0.25) and scaled.max() - scaled.min() < 0.05   # bounded
    assert np.all(t["entropy_scaled"] > 2.9) and np.all(t["entropy_scaled"] < math.log(keys))
    assert np.all(t["jacobian_scaled"] > 0.2)


def test_deterministic_for_a_seed():
    kw = dict(dims=(1, 8, 64), samples=500, keys=8, rows=50)
    a = explain.explain_table(seed=5, **kw)
    b = explain.explain_table(seed=5, **kw)
    c = explain.explain_table(seed=6, **kw)
    assert list(a) == list(b)
    for key in a:
        np.testing.assert_array_equal(a[key], b[key])
    assert not np.array_equal(a["var_unscaled"], c["var_unscaled"])
    np.testing.assert_array_equal(explain.variance_table((1, 8, 64), samples=500,
                                                         seed=5)["var_unscaled"],
                                  a["var_unscaled"])


def test_block_dots_are_dot_products_of_pieces():
    rng = np.random.default_rng(0)
    q = rng.standard_normal((3, 16))
    k = rng.standard_normal((3, 16))
    dims = np.array([1, 3, 4, 16])
    got = explain._block_dots(q, k, dims)
    for d, g in zip(dims, got):
        expect = [[q[i, j * d:(j + 1) * d] @ k[i, j * d:(j + 1) * d] for j in range(16 // d)]
                  for i in range(3)]
        np.testing.assert_allclose(g, expect, rtol=1e-12, atol=1e-12)


def test_sample_counts():
    v = explain.variance_table((1, 4, 16), samples=10)
    np.testing.assert_array_equal(v["pairs"], [160, 40, 10])
    s = explain.softmax_table((2, 8), keys=4, rows=3)
    np.testing.assert_array_equal(s["rows"], [12, 3])


def test_softmax_stats_against_explicit_jacobian():
    rng = np.random.default_rng(1)
    s = rng.standard_normal((5, 7)) * 3
    stats = explain.softmax_stats(s)
    for row, mp, ent, jn in zip(s, stats["max_p"], stats["entropy"],
                                stats["jacobian_norm"]):
        p = np.exp(row - row.max())
        p /= p.sum()
        jac = np.diag(p) - np.outer(p, p)
        assert mp == pytest.approx(p.max(), rel=1e-13)
        assert ent == pytest.approx(-np.sum(p * np.log(p)), rel=1e-12)
        assert jn == pytest.approx(np.linalg.norm(jac), rel=1e-12)


def test_softmax_stats_flat_and_one_hot():
    L = 32
    flat = explain.softmax_stats(np.zeros(L))
    assert float(flat["max_p"]) == pytest.approx(1 / L)
    assert float(flat["entropy"]) == pytest.approx(math.log(L))
    assert float(flat["jacobian_norm"]) == pytest.approx(math.sqrt(1 / L - 1 / L ** 2))
    hot = explain.softmax_stats([0.0, 1000.0, -np.inf, 0.0])
    assert float(hot["max_p"]) == 1 and float(hot["entropy"]) == 0
    assert float(hot["jacobian_norm"]) == 0
    with pytest.raises(ValueError, match="scores"):
        explain.softmax_stats(np.zeros((2, 0)))


def test_argument_errors():
    with pytest.raises(ValueError, match="samples"):
        explain.variance_table(samples=1)
    with pytest.raises(TypeError, match="samples"):
        explain.variance_table(samples=10.0)
    with pytest.raises(ValueError, match="dims"):
        explain.variance_table(dims=())
    with pytest.raises(ValueError, match="d_k"):
        explain.variance_table(dims=(4, 0))
    with pytest.raises(ValueError, match="keys"):
        explain.softmax_table(keys=0)
    with pytest.raises(SystemExit):
        parse("--samples", "0")


def test_format_table(default_table):
    text = explain.format_table(default_table)
    lines = text.splitlines()
    assert len(lines) == 2 + 11
    assert "variance" in lines[0] and "max probability" in lines[0]
    assert lines[1].split()[0] == "d_k"
    last = lines[-1].split()
    assert last[0] == "1024" and len(last) == 9
    assert float(last[1]) == pytest.approx(default_table["var_unscaled"][-1], abs=0.01)
    only_var = explain.format_table(explain.variance_table((1, 2), samples=100))
    assert "entropy" not in only_var and len(only_var.splitlines()[-1].split()) == 3


def test_run_prints_table(capsys):
    assert command.run(parse("--samples", "200", "--rows", "20", "--max-dk", "64",
                             "--seed", "3")) == 0
    out = capsys.readouterr().out
    rows = [l.split() for l in out.splitlines() if l.split()[:1] and l.split()[0].isdigit()]
    assert [r[0] for r in rows] == ["1", "2", "4", "8", "16", "32", "64"]
    table = explain.explain_table((1, 2, 4, 8, 16, 32, 64), samples=200, rows=20, seed=3)
    assert float(rows[-1][2]) == pytest.approx(table["var_scaled"][-1], abs=1e-4)
    assert "sqrt(d_k)" in out


def test_run_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    path = tmp_path / "explain.png"
    assert command.run(parse("--samples", "100", "--rows", "10", "--max-dk", "16",
                             "--plot", str(path))) == 0
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert str(path) in capsys.readouterr().out
