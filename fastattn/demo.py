"""The worked example "The cat sat", step by step: the ``fastattn demo`` command.

Three tokens with 4-dimensional embeddings, The = [1, 0, 1, 0], cat = [0, 1, 0, 1],
sat = [1, 1, 1, 1]; the projections W_Q, W_K, W_V are the identity, so Q = K = V = X.
Then the raw scores ``Q Kᵀ``, the scaled scores ``Q Kᵀ / sqrt(d_k)`` with d_k = 4,
the softmax weights row by row, and the outputs ``weights · V``. The weights and the
outputs come from fastattn's kernels (``attention_weights`` and ``attention``); the
intermediate steps are plain NumPy, printed so that each can be checked by hand.

Examples
--------
>>> from fastattn import demo
>>> steps = demo.steps()
>>> steps["weights"][0].round(3)
array([0.422, 0.155, 0.422])
>>> steps["outputs"].round(3)
array([[0.845, 0.578, 0.845, 0.578],
       [0.578, 0.845, 0.578, 0.845],
       [0.788, 0.788, 0.788, 0.788]])
"""

from __future__ import annotations

import argparse
import math

import numpy as np

from ._api import attention, attention_weights

__all__ = ["TOKENS", "EMBEDDINGS", "steps", "format_matrix", "render", "add_arguments",
           "run"]

TOKENS = ("The", "cat", "sat")
EMBEDDINGS = np.array([[1.0, 0.0, 1.0, 0.0],
                       [0.0, 1.0, 0.0, 1.0],
                       [1.0, 1.0, 1.0, 1.0]])


def steps():
    """Every intermediate result of the example.

    Returns
    -------
    steps : dict of str to ndarray
        ``X`` (3, 4) the embeddings; ``W_Q``, ``W_K``, ``W_V`` (4, 4) identities;
        ``Q``, ``K``, ``V`` (3, 4); ``scores`` (3, 3) ``Q Kᵀ``; ``scaled`` (3, 3)
        ``Q Kᵀ / sqrt(4)``; ``weights`` (3, 3) the softmax of each row of
        ``scaled``; ``outputs`` (3, 4) ``weights @ V``. All float64.

    Examples
    --------
    >>> from fastattn.demo import steps
    >>> s = steps()
    >>> s["scores"]
    array([[2., 0., 2.],
           [0., 2., 2.],
           [2., 2., 4.]])
    >>> s["scaled"]
    array([[1., 0., 1.],
           [0., 1., 1.],
           [1., 1., 2.]])
    """
    X = EMBEDDINGS.copy()
    d_k = X.shape[1]
    W_Q = W_K = W_V = np.eye(d_k)
    Q, K, V = X @ W_Q, X @ W_K, X @ W_V
    scores = Q @ K.T
    scaled = scores / math.sqrt(d_k)
    return {"X": X, "W_Q": W_Q, "W_K": W_K.copy(), "W_V": W_V.copy(),
            "Q": Q, "K": K, "V": V, "scores": scores, "scaled": scaled,
            "weights": attention_weights(Q, K),           # default scale 1/sqrt(d_k)
            "outputs": attention(Q, K, V)}


def format_matrix(title, matrix, rows, columns, digits=3) -> str:
    """A small labelled matrix as text.

    Parameters
    ----------
    title : str
    matrix : array_like of shape (R, C)
    rows : sequence of R str
        Row labels.
    columns : sequence of C str
        Column labels.
    digits : int, default 3
        Decimals shown.

    Returns
    -------
    str
        The title on its own line, then a header and one line per row.

    Examples
    --------
    >>> from fastattn.demo import format_matrix
    >>> print(format_matrix("M", [[1, 0.5]], ["a"], ["x", "y"], digits=2))
    M
             x      y
    a     1.00   0.50
    """
    m = np.asarray(matrix, dtype=np.float64)
    label = max([len(r) for r in rows] + [3])
    width = max([digits + 4] + [len(c) for c in columns])
    lines = [title, " " * label + "".join(f" {c:>{width}}" for c in columns)]
    for name, row in zip(rows, m):
        lines.append(f"{name:<{label}}" + "".join(f" {x:>{width}.{digits}f}" for x in row))
    return "\n".join(lines)


def render(digits=3) -> str:
    """The whole example as the text that ``fastattn demo`` prints."""
    s = steps()
    t = list(TOKENS)
    dims = [f"d{i}" for i in range(s["X"].shape[1])]

    def block(title, key, cols):
        return format_matrix(title, s[key], t, cols, digits)

    parts = [
        'The worked example "The cat sat": scaled dot-product attention step by step.',
        block("1. Embeddings X (one row per token)", "X", dims),
        format_matrix("2. Projections W_Q = W_K = W_V = identity (4 x 4)", s["W_Q"],
                      dims, dims, digits),
        block("3. Queries Q = X W_Q", "Q", dims),
        block("   Keys K = X W_K", "K", dims),
        block("   Values V = X W_V", "V", dims),
        block("4. Raw scores Q K^T (row: query, column: key)", "scores", t),
        block("5. Scaled scores Q K^T / sqrt(d_k), d_k = 4, so divided by 2",
              "scaled", t),
        block("6. Softmax weights: each row of scaled scores exponentiated and "
              "normalised", "weights", t),
        block("7. Outputs = weights V: each token's new representation", "outputs",
              dims),
        ("Each output row is a weighted average of the value rows: 'The' attends to "
         "itself and 'sat'\n(0.422 each) more than to 'cat' (0.155), because its "
         "scaled score with them is 1, not 0."),
    ]
    return "\n\n".join(parts)


# ------------------------------------------------------------------ command line

def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the options of ``fastattn demo`` to ``parser``."""
    parser.add_argument("--digits", type=int, default=3, choices=range(0, 10),
                        metavar="N", help="decimals shown (default: %(default)s)")


def run(args: argparse.Namespace) -> int:
    """Run ``fastattn demo``: print the example; return 0."""
    print(render(getattr(args, "digits", 3)))
    return 0
