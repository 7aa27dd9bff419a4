"""fastattn demo: the worked "The cat sat" example.

Oracles: the numbers worked out by hand (scores 2, 0, 2 / 0, 2, 2 / 2, 2, 4; weights
e/(2e+1), 1/(2e+1); outputs as weighted sums of the values) and fastattn.reference.
"""

import argparse
import doctest
import math

import numpy as np
import pytest

import fastattn.demo
from fastattn import demo, reference
from fastattn.cli import demo as command

E = math.e
W_THE = [E / (2 * E + 1), 1 / (2 * E + 1), E / (2 * E + 1)]        # 0.422, 0.155, 0.422
W_SAT = [E / (2 * E + E ** 2), E / (2 * E + E ** 2), E ** 2 / (2 * E + E ** 2)]
OUT_THE = [W_THE[0] + W_THE[2], W_THE[1] + W_THE[2]] * 2          # 0.845, 0.578, ...
OUT_SAT = [W_SAT[0] + W_SAT[2]] * 4                               # 0.788 each


def parse(*argv):
    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_doctests():
    result = doctest.testmod(fastattn.demo, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0


def test_hand_values():
    assert np.round(W_THE, 3).tolist() == [0.422, 0.155, 0.422]
    assert np.round(OUT_THE, 3).tolist() == [0.845, 0.578, 0.845, 0.578]
    assert np.round(OUT_SAT, 3).tolist() == [0.788] * 4


def test_worked_example_steps():
    s = demo.worked_example()
    x = np.array([[1, 0, 1, 0], [0, 1, 0, 1], [1, 1, 1, 1]], float)
    for name in ("X", "Q", "K", "V"):
        np.testing.assert_array_equal(s[name], x)
    np.testing.assert_array_equal(s["scores"], [[2, 0, 2], [0, 2, 2], [2, 2, 4]])
    np.testing.assert_array_equal(s["scaled"], [[1, 0, 1], [0, 1, 1], [1, 1, 2]])
    np.testing.assert_allclose(s["weights"][0], W_THE, rtol=1e-14)
    np.testing.assert_allclose(s["weights"][1], W_THE[1::-1] + W_THE[2:], rtol=1e-14)
    np.testing.assert_allclose(s["weights"][2], W_SAT, rtol=1e-14)
    np.testing.assert_allclose(s["output"][0], OUT_THE, rtol=1e-14)
    np.testing.assert_allclose(s["output"][1], OUT_THE[1:] + OUT_THE[:1], rtol=1e-14)
    np.testing.assert_allclose(s["output"][2], OUT_SAT, rtol=1e-14)
    assert list(s) == ["X", "W_Q", "W_K", "W_V", "Q", "K", "V", "scores", "scaled",
                       "weights", "output"]


def test_run_prints_the_numbers(capsys):
    assert command.run(parse()) == 0
    out = capsys.readouterr().out
    for title in ("Embeddings", "identity", "Raw scores", "Scaled scores", "/ sqrt(d_k)",
                  "weights", "Outputs"):
        assert title in out
    lines = out.splitlines()
    weights = lines.index(next(l for l in lines if l.startswith("6.")))
    outputs = lines.index(next(l for l in lines if l.startswith("7.")))
    assert lines[weights + 2].split() == ["The", "0.422", "0.155", "0.422"]
    assert lines[weights + 4].split() == ["sat", "0.212", "0.212", "0.576"]
    assert lines[outputs + 2].split() == ["The", "0.845", "0.578", "0.845", "0.578"]
    assert lines[outputs + 3].split() == ["cat", "0.578", "0.845", "0.578", "0.845"]
    assert lines[outputs + 4].split() == ["sat"] + ["0.788"] * 4
    assert "divided by 2" in out
    assert "same outputs" in out


def test_own_sentence_and_embeddings(capsys):
    assert command.run(parse("--sentence", "a b", "--embeddings", "1,2; 3 4",
                          "--decimals", "4")) == 0
    out = capsys.readouterr().out
    x = np.array([[1.0, 2.0], [3.0, 4.0]])
    expect = reference.attention(x, x, x)
    lines = out.splitlines()
    start = lines.index(next(l for l in lines if l.startswith("7.")))
    got = np.array([[float(v) for v in lines[start + 2 + i].split()[1:]] for i in range(2)])
    np.testing.assert_allclose(got, expect, atol=1e-4)


def test_seeded_random_example_matches_reference(capsys):
    args = parse("--sentence", "one two three four", "--seed", "3", "--dim", "5")
    assert command.run(args) == 0
    first = capsys.readouterr().out
    assert command.run(args) == 0
    assert capsys.readouterr().out == first
    rng = np.random.default_rng(3)
    x = rng.standard_normal((4, 5)).round(2)
    wq, wk, wv = (rng.standard_normal((5, 5)).round(2) for _ in range(3))
    s = demo.worked_example("one two three four".split(), x, w_q=wq, w_k=wk, w_v=wv)
    np.testing.assert_allclose(s["output"], reference.attention(x @ wq, x @ wk, x @ wv),
                               rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(s["weights"], reference.attention_weights(x @ wq, x @ wk),
                               rtol=1e-12, atol=1e-12)


def test_bad_options(capsys):
    assert command.run(parse("--sentence", "a dog")) == 2
    assert "--embeddings" in capsys.readouterr().err
    assert command.run(parse("--sentence", "a b c", "--embeddings", "1,2;3,4")) == 2
    assert "2 rows for 3 words" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse("--embeddings", "1,x")
    with pytest.raises(SystemExit):
        parse("--embeddings", "1,2;3")


def test_worked_example_errors():
    with pytest.raises(ValueError, match="w_q"):
        demo.worked_example(w_q=np.eye(3))
    with pytest.raises(ValueError, match="w_q and w_k"):
        demo.worked_example(w_q=np.ones((4, 2)), w_k=np.ones((4, 3)))
    with pytest.raises(ValueError, match="embeddings"):
        demo.worked_example(["a"], np.ones(3))
