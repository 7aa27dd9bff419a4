"""fastattn demo: the worked example "The cat sat", against hand-computed values."""

import math
import subprocess
import sys

import numpy as np

from fastattn import demo
from fastattn.cli import main

from helpers import OUTSIDE_SOURCE

E = math.e
# Scaled scores of The: [1, 0, 1] -> weights e/(2e+1), 1/(2e+1), e/(2e+1)
W_THE = [E / (2 * E + 1), 1 / (2 * E + 1), E / (2 * E + 1)]
# sat: [1, 1, 2] -> e/(2e+e²), e/(2e+e²), e²/(2e+e²)
W_SAT = [1 / (2 + E), 1 / (2 + E), E / (2 + E)]
OUT_THE = [W_THE[0] + W_THE[2], W_THE[1] + W_THE[2]] * 2
OUT_SAT = [W_SAT[0] + W_SAT[2]] * 4


def test_steps_hand_values():
    s = demo.steps()
    X = np.array([[1, 0, 1, 0], [0, 1, 0, 1], [1, 1, 1, 1]], float)
    for name in ("X", "Q", "K", "V"):
        np.testing.assert_array_equal(s[name], X)
    np.testing.assert_array_equal(s["W_Q"], np.eye(4))
    np.testing.assert_array_equal(s["scores"], [[2, 0, 2], [0, 2, 2], [2, 2, 4]])
    np.testing.assert_array_equal(s["scaled"], [[1, 0, 1], [0, 1, 1], [1, 1, 2]])
    np.testing.assert_allclose(s["weights"][0], W_THE, rtol=1e-12)
    np.testing.assert_allclose(s["weights"][1], [W_THE[1], W_THE[0], W_THE[2]], rtol=1e-12)
    np.testing.assert_allclose(s["weights"][2], W_SAT, rtol=1e-12)
    np.testing.assert_allclose(s["outputs"][0], OUT_THE, rtol=1e-12)
    np.testing.assert_allclose(s["outputs"][1], OUT_THE[1::-1] * 2, rtol=1e-12)
    np.testing.assert_allclose(s["outputs"][2], OUT_SAT, rtol=1e-12)
    # the numbers the example quotes
    np.testing.assert_allclose(s["weights"][0], [0.422, 0.155, 0.422], atol=5e-4)
    np.testing.assert_allclose(s["outputs"][0], [0.845, 0.578, 0.845, 0.578], atol=5e-4)
    np.testing.assert_allclose(s["outputs"][2], [0.788] * 4, atol=5e-4)


def _row(text, title, label):
    """The numbers of row ``label`` in the matrix printed under ``title``."""
    block = text.split(title, 1)[1].split("\n\n", 1)[0]
    for line in block.splitlines():
        if line.startswith(label + " "):           # not the column header
            return [float(x) for x in line.split()[1:]]
    raise AssertionError(f"no row {label!r} under {title!r}")


def _check_printed(out):
    assert _row(out, "Raw scores", "sat") == [2.0, 2.0, 4.0]
    assert _row(out, "Scaled scores", "The") == [1.0, 0.0, 1.0]
    assert _row(out, "Softmax weights", "The") == [0.422, 0.155, 0.422]
    assert _row(out, "Softmax weights", "sat") == [0.212, 0.212, 0.576]
    assert _row(out, "Outputs", "The") == [0.845, 0.578, 0.845, 0.578]
    assert _row(out, "Outputs", "cat") == [0.578, 0.845, 0.578, 0.845]
    assert _row(out, "Outputs", "sat") == [0.788] * 4
    for step in ("Embeddings", "Queries", "Keys", "Values", "identity"):
        assert step in out


def test_command_prints_the_steps(capsys):
    assert main(["demo"]) == 0
    _check_printed(capsys.readouterr().out)


def test_command_digits(capsys):
    assert main(["demo", "--digits", "5"]) == 0
    assert _row(capsys.readouterr().out, "Outputs", "sat") == [round(OUT_SAT[0], 5)] * 4


def test_python_dash_m():
    done = subprocess.run([sys.executable, "-m", "fastattn", "demo"], cwd=OUTSIDE_SOURCE,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    _check_printed(done.stdout)
