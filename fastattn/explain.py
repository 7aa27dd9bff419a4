"""Why attention divides the scores by sqrt(d_k), reproduced from random data.

"Attention Is All You Need" (section 3.2.1) justifies the factor ``1/sqrt(d_k)`` so: if
the components of ``q`` and ``k`` are independent with mean 0 and variance 1, then
``q·k`` has mean 0 and variance ``d_k``; for large ``d_k`` the scores are large, softmax
saturates and its gradient becomes tiny. Dividing by ``sqrt(d_k)`` brings the variance
back to 1.

This module measures each step on seeded normal draws, for ``d_k = 1, 2, 4, ..., 1024``:

- :func:`variance_table`: the sample variance of ``q·k`` (about ``d_k``) and of
  ``q·k / sqrt(d_k)`` (about 1);
- :func:`softmax_table`: softmax over a row of scores of one query against ``keys``
  keys, unscaled and scaled: the largest probability, the entropy and the Frobenius
  norm of softmax's Jacobian ``diag(p) - p pᵀ`` (the factor every gradient passes
  through), averaged over the rows;
- :func:`explain_table` (both), :func:`format_table` and :func:`plot`.

The tables are dicts of equal-length NumPy arrays (``pandas.DataFrame(table)`` works).
Each draw is ``max(dims)`` components wide and is cut into ``max(dims) // d_k``
non-overlapping ``d_k``-wide pieces, which are independent ``d_k``-dimensional vectors:
one set of random numbers serves every row of the table, and the small ``d_k`` (whose
sample variance is the noisiest) get the most samples.

The ``fastattn explain`` command (:mod:`fastattn.cli.explain`) prints these tables.

Examples
--------
>>> from fastattn import explain
>>> t = explain.variance_table(dims=(1, 64), samples=20_000, seed=0)
>>> t["d_k"]
array([ 1, 64])
>>> [round(float(v), 1) for v in t["var_unscaled"] / t["d_k"]]
[1.0, 1.0]
"""

from __future__ import annotations

import math
import sys

import numpy as np

from . import _validation as _v

__all__ = ["DIMS", "variance_table", "softmax_table", "explain_table", "softmax_stats",
           "format_table", "plot"]

DIMS = tuple(2 ** i for i in range(11))           # 1, 2, 4, ..., 1024
DEFAULT_SAMPLES = 50_000                          # (q, k) pairs of max(dims): within 3 %
DEFAULT_KEYS = 32                                 # scores in one softmax row
DEFAULT_ROWS = 250                                # softmax rows of max(dims)
_CHUNK_ELEMENTS = 1 << 22                         # random numbers drawn at a time


# ------------------------------------------------------------------------- arguments

def _check_dims(dims) -> np.ndarray:
    dims = list(dims)
    if not dims:
        raise ValueError("dims must hold at least one dimension")
    return np.array([_v.check_int(d, "every d_k in dims") for d in dims], dtype=np.int64)


def _streams(seed):
    """Independent generators for the variance and the softmax experiments."""
    return [np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(2)]


def _block_dots(q, k, dims):
    """Dot products of the non-overlapping d-wide pieces of q and k, for each d in dims.

    ``q`` and ``k`` broadcast to ``(..., W)``; returns a list with, for each ``d``, an
    array ``(..., W // d)`` whose entry ``j`` is ``q[..., jd:(j+1)d] · k[..., jd:(j+1)d]``.
    """
    c = np.cumsum(q * k, axis=-1)
    c = np.concatenate([np.zeros(c.shape[:-1] + (1,)), c], axis=-1)    # c[i] = sum of i
    out = []
    for d in dims:
        ends = c[..., d::d]                                 # sums up to d, 2d, 3d, ...
        out.append(ends - c[..., 0:ends.shape[-1] * d:d])
    return out


def _chunks(total, per_item):
    """Split ``total`` items into chunks of about ``_CHUNK_ELEMENTS`` random numbers."""
    step = max(1, _CHUNK_ELEMENTS // per_item)
    for start in range(0, total, step):
        yield min(step, total - start)


# ------------------------------------------------------------------------ experiments

def variance_table(dims=DIMS, *, samples=DEFAULT_SAMPLES, seed=0):
    """Sample variance of ``q·k`` and of ``q·k / sqrt(d_k)`` for each ``d_k``.

    Parameters
    ----------
    dims : sequence of int, default (1, 2, 4, ..., 1024)
        The key dimensions ``d_k``.
    samples : int, default 50000
        ``(q, k)`` pairs of width ``W = max(dims)`` drawn, components from N(0, 1);
        each is cut into ``W // d_k`` independent ``d_k``-wide pairs, so row ``d_k``
        averages over ``samples * (W // d_k)`` pairs (column ``pairs``). At the
        default the variances are within 3 % of ``d_k`` and of 1 (the relative
        standard error is ``sqrt((2 + 6/d_k) / pairs)``, 0.63 % at ``d_k = 1024``).
    seed : int or None, default 0
        Seed of the draws; the same seed gives the same table.

    Returns
    -------
    table : dict of str to ndarray
        ``d_k`` (int64), ``pairs`` (int64), ``var_unscaled`` (about ``d_k``) and
        ``var_scaled`` (about 1), each of shape ``(len(dims),)``.
    """
    dims = _check_dims(dims)
    samples = _v.check_int(samples, "samples", 2)
    rng = _streams(seed)[0]
    width = int(dims.max())
    pairs = samples * (width // dims)
    total = np.zeros(len(dims))
    squares = np.zeros(len(dims))
    for n in _chunks(samples, width):
        q = rng.standard_normal((n, width))
        k = rng.standard_normal((n, width))
        for i, dots in enumerate(_block_dots(q, k, dims)):
            total[i] += dots.sum()
            squares[i] += np.square(dots).sum()
    var = (squares - total * total / pairs) / (pairs - 1)
    return {"d_k": dims, "pairs": pairs, "var_unscaled": var, "var_scaled": var / dims}


def softmax_stats(scores):
    """How saturated softmax is on each row of ``scores``.

    Parameters
    ----------
    scores : array_like of shape (..., L)
        Rows of scores (``-inf`` allowed; a row needs one finite entry).

    Returns
    -------
    stats : dict of str to ndarray of shape (...)
        ``max_p``: the largest probability (``1/L`` for a flat row, 1 for a one-hot
        one); ``entropy``: ``-sum p log p`` in nats (``log L`` down to 0);
        ``jacobian_norm``: the Frobenius norm of ``J = diag(p) - p pᵀ``, i.e.
        ``sqrt(sum p² - 2 sum p³ + (sum p²)²)`` (``sqrt(1/L - 1/L²)`` down to 0).

    Examples
    --------
    >>> from fastattn.explain import softmax_stats
    >>> s = softmax_stats([[0.0, 0.0, 0.0, 0.0], [0.0, 100.0, 0.0, 0.0]])
    >>> s["max_p"].round(3), s["entropy"].round(3), s["jacobian_norm"].round(3)
    (array([0.25, 1.  ]), array([1.386, 0.   ]), array([0.433, 0.   ]))
    """
    s = np.asarray(scores, dtype=np.float64)
    if s.ndim < 1 or s.shape[-1] == 0:
        raise ValueError(f"scores must have a non-empty last axis, got shape {s.shape}")
    e = np.exp(s - s.max(axis=-1, keepdims=True))
    p = e / e.sum(axis=-1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        plogp = np.where(p > 0, p * np.log(p), 0.0)
    p2 = np.sum(p * p, axis=-1)
    p3 = np.sum(p * p * p, axis=-1)
    return {"max_p": p.max(axis=-1),
            "entropy": -plogp.sum(axis=-1),
            "jacobian_norm": np.sqrt(np.maximum(p2 - 2 * p3 + p2 * p2, 0.0))}


def softmax_table(dims=DIMS, *, keys=DEFAULT_KEYS, rows=DEFAULT_ROWS, seed=0):
    """Softmax over rows of unscaled and scaled scores, for each ``d_k``.

    Each row is one query ``q`` against ``keys`` keys ``k_j``, all with N(0, 1)
    components; its unscaled scores are ``q·k_j`` and its scaled ones
    ``q·k_j / sqrt(d_k)``. The statistics of :func:`softmax_stats` are averaged over
    the rows.

    Parameters
    ----------
    dims : sequence of int, default (1, 2, 4, ..., 1024)
    keys : int, default 32
        Scores per row (the sequence length).
    rows : int, default 250
        Rows of width ``W = max(dims)`` drawn; as in :func:`variance_table` each is
        cut into ``W // d_k`` independent rows of width ``d_k`` (column ``rows``).
    seed : int or None, default 0

    Returns
    -------
    table : dict of str to ndarray of shape (len(dims),)
        ``d_k``, ``rows``, then ``max_p_*``, ``entropy_*`` and ``jacobian_*``, each
        as ``*_unscaled`` and ``*_scaled``.
    """
    dims = _check_dims(dims)
    keys = _v.check_int(keys, "keys")
    rows = _v.check_int(rows, "rows")
    rng = _streams(seed)[1]
    width = int(dims.max())
    names = [f"{stat}_{kind}" for stat in ("max_p", "entropy", "jacobian")
             for kind in ("unscaled", "scaled")]
    sums = {name: np.zeros(len(dims)) for name in names}
    for n in _chunks(rows, width * (keys + 1)):
        q = rng.standard_normal((n, 1, width))
        k = rng.standard_normal((n, keys, width))
        for i, (d, dots) in enumerate(zip(dims, _block_dots(q, k, dims))):
            raw = np.swapaxes(dots, -1, -2)                  # (n, W // d, keys)
            for kind, s in (("unscaled", raw), ("scaled", raw / math.sqrt(d))):
                stats = softmax_stats(s)
                sums[f"max_p_{kind}"][i] += stats["max_p"].sum()
                sums[f"entropy_{kind}"][i] += stats["entropy"].sum()
                sums[f"jacobian_{kind}"][i] += stats["jacobian_norm"].sum()
    count = rows * (width // dims)
    table = {"d_k": dims, "rows": count}
    table.update({name: sums[name] / count for name in names})
    return table


def explain_table(dims=DIMS, *, samples=DEFAULT_SAMPLES, keys=DEFAULT_KEYS,
                  rows=DEFAULT_ROWS, seed=0):
    """:func:`variance_table` and :func:`softmax_table` in one dict (one ``d_k`` column)."""
    table = variance_table(dims, samples=samples, seed=seed)
    table.update(softmax_table(dims, keys=keys, rows=rows, seed=seed))
    return table


# --------------------------------------------------------------------------- output

_GROUPS = (
    ("variance", (("var_unscaled", "q.k", "{:.2f}"), ("var_scaled", "scaled", "{:.4f}"))),
    ("max probability", (("max_p_unscaled", "unscaled", "{:.3f}"),
                         ("max_p_scaled", "scaled", "{:.3f}"))),
    ("entropy (nats)", (("entropy_unscaled", "unscaled", "{:.3f}"),
                        ("entropy_scaled", "scaled", "{:.3f}"))),
    ("Jacobian norm", (("jacobian_unscaled", "unscaled", "{:.4f}"),
                       ("jacobian_scaled", "scaled", "{:.4f}"))),
)


def format_table(table) -> str:
    """The table as aligned text: one line per ``d_k``, columns grouped in pairs.

    Columns missing from ``table`` (e.g. for a :func:`variance_table` alone) are left
    out.
    """
    w = 9
    groups = [(title, [c for c in cols if c[0] in table]) for title, cols in _GROUPS]
    groups = [(title, cols) for title, cols in groups if cols]
    top = " " * 6
    head = f"{'d_k':>6}"
    for title, cols in groups:
        top += "   " + title.center(len(cols) * (w + 1) - 1)
        head += "   " + " ".join(f"{label:>{w}}" for _, label, _ in cols)
    lines = [top.rstrip(), head]
    for r, d in enumerate(table["d_k"]):
        line = f"{int(d):>6}"
        for _, cols in groups:
            line += "   " + " ".join(f"{fmt.format(float(table[key][r])):>{w}}"
                                     for key, _, fmt in cols)
        lines.append(line)
    return "\n".join(lines)


def plot(table, path, *, keys=None):
    """Draw the table as a 2×2 figure and save it to ``path`` (needs matplotlib).

    Parameters
    ----------
    table : dict
        From :func:`explain_table`.
    path : str or path-like
        Where to save; the format follows the extension (``.png``).
    keys : int, optional
        Row length used for the softmax rows; draws the flat-row references.
    """
    import matplotlib
    if "matplotlib.pyplot" not in sys.modules:
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    d = np.asarray(table["d_k"])
    fig, axes = plt.subplots(2, 2, figsize=(9, 6.5), dpi=90, constrained_layout=True)
    panels = (
        ("variance of the scores", "var", True),
        ("largest softmax probability", "max_p", False),
        ("softmax entropy (nats)", "entropy", False),
        ("softmax Jacobian norm", "jacobian", True),
    )
    for ax, (title, key, logy) in zip(axes.flat, panels):
        if key == "var":
            ax.plot(d, table["var_unscaled"], "o-", label="q·k")
            ax.plot(d, table["var_scaled"], "s-", label="q·k / sqrt(d_k)")
            ax.plot(d, d, "k:", lw=1, label="d_k")
        else:
            ax.plot(d, table[f"{key}_unscaled"], "o-", label="unscaled")
            ax.plot(d, table[f"{key}_scaled"], "s-", label="scaled by 1/sqrt(d_k)")
            if keys:
                flat = {"max_p": 1 / keys, "entropy": math.log(keys),
                        "jacobian": math.sqrt(1 / keys - 1 / keys ** 2)}[key]
                ax.axhline(flat, color="k", ls=":", lw=1, label=f"{keys} equal scores")
        ax.set_xscale("log", base=2)
        if logy:
            ax.set_yscale("log")
        ax.set_xlabel("d_k")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.savefig(path)
    plt.close(fig)
