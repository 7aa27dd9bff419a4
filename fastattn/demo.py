"""The worked example of scaled dot-product attention, step by step.

Three words with 4-dimensional embeddings, ``The = [1, 0, 1, 0]``,
``cat = [0, 1, 0, 1]`` and ``sat = [1, 1, 1, 1]``, and identity projections
``W_Q = W_K = W_V = I``:

1. ``Q = X W_Q``, ``K = X W_K``, ``V = X W_V``;
2. raw scores ``Q Kᵀ``;
3. scaled scores ``Q Kᵀ / sqrt(d_k)`` (here ÷ 2);
4. weights: softmax of each row;
5. outputs: ``weights V``.

Each step runs on fastattn's kernels (:func:`fastattn.scores`, :func:`fastattn.softmax`,
:func:`fastattn.weighted_sum`). :func:`worked_example` returns the matrices for a
notebook; the ``fastattn demo`` command (:mod:`fastattn.cli.demo`) prints them and
checks the result against the fused :func:`fastattn.attention`.

Examples
--------
>>> from fastattn.demo import worked_example
>>> steps = worked_example()
>>> steps["weights"][0].round(3)          # how much "The" attends to The, cat, sat
array([0.422, 0.155, 0.422])
>>> steps["output"].round(3)
array([[0.845, 0.578, 0.845, 0.578],
       [0.578, 0.845, 0.578, 0.845],
       [0.788, 0.788, 0.788, 0.788]])
"""

from __future__ import annotations

import math

import numpy as np

from . import _validation as _v
from ._api import scores, softmax, weighted_sum

__all__ = ["WORDS", "EMBEDDINGS", "worked_example", "format_matrix", "format_steps"]

WORDS = ("The", "cat", "sat")
EMBEDDINGS = np.array([[1.0, 0.0, 1.0, 0.0],
                       [0.0, 1.0, 0.0, 1.0],
                       [1.0, 1.0, 1.0, 1.0]])


def _matrix(a, name, shape=None):
    a = _v.as_real(a, name).astype(np.float64)
    if a.ndim != 2:
        raise ValueError(f"{name} must be a matrix (2 dimensions), got shape {a.shape}")
    if shape is not None and a.shape != shape:
        raise ValueError(f"{name} must have shape {shape}, got {a.shape}")
    return a


def worked_example(words=WORDS, embeddings=None, *, w_q=None, w_k=None, w_v=None):
    """Every intermediate matrix of attention over one short sentence.

    Parameters
    ----------
    words : sequence of str, default ("The", "cat", "sat")
        Labels of the rows.
    embeddings : array_like of shape (len(words), d_model), optional
        One row per word; defaults to :data:`EMBEDDINGS` (needs three words).
    w_q, w_k, w_v : array_like of shape (d_model, d_k), optional
        Projections applied as ``Q = X @ w_q``; default the identity. ``w_q`` and
        ``w_k`` need the same number of columns ``d_k``.

    Returns
    -------
    steps : dict of str to ndarray (float64)
        ``X``, ``W_Q``, ``W_K``, ``W_V``, ``Q``, ``K``, ``V``, ``scores`` (``Q Kᵀ``),
        ``scaled`` (``/ sqrt(d_k)``), ``weights`` (row softmax) and ``output``
        (``weights @ V``), in that order.

    Raises
    ------
    ValueError
        Embeddings whose rows do not match ``words``, or projections of the wrong
        shape.
    """
    words = [str(w) for w in words]
    if embeddings is None:
        if len(words) != len(EMBEDDINGS):
            raise ValueError(
                f"the built-in embeddings are for {len(EMBEDDINGS)} words "
                f"{list(WORDS)}; got {len(words)} words {words}: give embeddings "
                f"(--embeddings, or random ones with --seed)")
        embeddings = EMBEDDINGS
    x = _matrix(embeddings, "embeddings")
    if x.shape[0] != len(words):
        raise ValueError(f"embeddings has {x.shape[0]} rows for {len(words)} words "
                         f"{words}; shape {x.shape}")
    d_model = x.shape[1]
    eye = np.eye(d_model)
    wq = eye if w_q is None else _matrix(w_q, "w_q")
    wk = eye if w_k is None else _matrix(w_k, "w_k")
    wv = eye if w_v is None else _matrix(w_v, "w_v")
    for name, w in (("w_q", wq), ("w_k", wk), ("w_v", wv)):
        if w.shape[0] != d_model:
            raise ValueError(f"{name} must have d_model = {d_model} rows (embeddings "
                             f"{x.shape}), got shape {w.shape}")
    if wq.shape[1] != wk.shape[1]:
        raise ValueError(f"w_q and w_k must have the same number of columns d_k, got "
                         f"w_q {wq.shape} and w_k {wk.shape}")
    q, k, v = x @ wq, x @ wk, x @ wv
    raw = scores(q, k, scale=1.0)
    scaled = scores(q, k)                       # the default scale 1/sqrt(d_k)
    weights = softmax(scaled, axis=-1)
    out = weighted_sum(weights, v)
    return {"X": x, "W_Q": wq, "W_K": wk, "W_V": wv, "Q": q, "K": k, "V": v,
            "scores": raw, "scaled": scaled, "weights": weights, "output": out}


def format_matrix(title, a, rows=None, cols=None, *, decimals=3) -> str:
    """A small matrix as text, with a title line and optional row/column labels."""
    a = np.asarray(a, dtype=np.float64)
    rows = [""] * a.shape[0] if rows is None else [str(r) for r in rows]
    cols = [f"[{j}]" for j in range(a.shape[1])] if cols is None else [str(c) for c in cols]
    cells = [[f"{x:.{decimals}f}" for x in row] for row in a]
    w = max([len(c) for c in cols] + [len(c) for row in cells for c in row] + [1])
    lw = max(len(r) for r in rows) if rows else 0
    lines = [title, " " * lw + "".join(f"  {c:>{w}}" for c in cols)]
    for label, row in zip(rows, cells):
        lines.append(f"{label:<{lw}}" + "".join(f"  {c:>{w}}" for c in row))
    return "\n".join(lines)


def format_steps(steps, words, *, decimals=3) -> str:
    """The steps of :func:`worked_example` as labelled matrices, one after another."""
    d_k = steps["Q"].shape[1]
    dims = [f"d{j}" for j in range(steps["X"].shape[1])]
    kdims = [f"d{j}" for j in range(d_k)]
    vdims = [f"d{j}" for j in range(steps["V"].shape[1])]
    eye = all(np.array_equal(steps[n], np.eye(*steps[n].shape))
              for n in ("W_Q", "W_K", "W_V"))
    parts = [format_matrix("1. Embeddings X (one row per word)", steps["X"], words, dims,
                           decimals=decimals)]
    if eye:
        parts.append(f"2. Projections: W_Q = W_K = W_V = the {len(dims)}x{len(dims)} "
                     f"identity, so Q = K = V = X")
    else:
        parts += [format_matrix("2. Projections W_Q" if n == "W_Q" else f"   {n}",
                                steps[n], dims, kdims if n != "W_V" else vdims,
                                decimals=decimals)
                  for n in ("W_Q", "W_K", "W_V")]
    parts += [
        format_matrix("3. Queries Q = X W_Q", steps["Q"], words, kdims, decimals=decimals),
        format_matrix("   Keys K = X W_K", steps["K"], words, kdims, decimals=decimals),
        format_matrix("   Values V = X W_V", steps["V"], words, vdims, decimals=decimals),
        format_matrix("4. Raw scores Q K^T (row: query, column: key)", steps["scores"],
                      words, words, decimals=decimals),
        format_matrix(f"5. Scaled scores Q K^T / sqrt(d_k): d_k = {d_k}, divided by "
                      f"{math.sqrt(d_k):.4g}",
                      steps["scaled"], words, words, decimals=decimals),
        format_matrix("6. Attention weights softmax(scaled scores), each row sums to 1",
                      steps["weights"], words, words, decimals=decimals),
        format_matrix("7. Outputs = weights V (each word: a weighted mix of the values)",
                      steps["output"], words, vdims, decimals=decimals),
    ]
    return "\n\n".join(parts)
