"""Combining attention results computed over disjoint sets of keys.

This is the split-KV (or ring-attention) merge: attention over keys ``K1 ∪ K2`` is a
weighted mean of the attention over ``K1`` and over ``K2``, with weights given by their
log-sum-exps.
"""

from __future__ import annotations

import numpy as np

from . import _validation as _v

__all__ = ["merge_partials"]


def _as_list(x, name: str) -> list:
    try:
        items = list(x)
    except TypeError:
        raise TypeError(
            f"{name} must be a sequence of arrays, got {type(x).__name__}") from None
    if not items:
        raise ValueError(f"{name} must hold at least one array, got an empty sequence")
    return items


def merge_partials(outs, lses):
    """Merge attention results computed over disjoint key sets for the same queries.

    Parameters
    ----------
    outs : sequence of n >= 1 array_like, each of shape (..., Lq, Ev)
        ``outs[i]`` is ``attention(q, k_i, v_i, ..., return_lse=True)[0]``: the output
        of attention of the same queries over the i-th set of keys.
    lses : sequence of n array_like, each of shape (..., Lq)
        The matching log-sum-exps, ``attention(..., return_lse=True)[1]``.

    Returns
    -------
    out : ndarray of shape (..., Lq, Ev)
        Attention over the union of the key sets, in the result dtype of ``outs``
        (``numpy.result_type``, integers taken as float64).
    lse : ndarray of shape (..., Lq)
        Its log-sum-exp: float64 when the computation dtype of ``outs`` is float64,
        float32 otherwise.

    Raises
    ------
    ValueError
        If ``outs`` and ``lses`` are empty or differ in length, or a shape does not
        match that of ``outs[0]`` (the message names the index and the shapes).
    TypeError
        If an array is not real (bool, complex, ...).

    Notes
    -----
    With ``m = max_i lse_i`` (per row, ignoring ``-inf``) and ``w_i = exp(lse_i - m)``,
    the result is ``out = sum_i w_i * out_i / sum_i w_i`` and
    ``lse = m + log(sum_i w_i)``. The sums run in list order, so the result does not
    depend on anything but the inputs, and they are accumulated in float64 whatever the
    input dtype; the result is rounded once to the output dtypes. This is exact up to
    rounding: merging the pieces of a split of the keys gives the one-shot result.

    A piece with no weight left in a row adds nothing to it, whatever its ``out_i``
    (NaN and inf included): a row whose ``lse_i`` is ``-inf`` (no allowed key in that
    piece), and a row whose weight ``w_i`` underflows to 0 in float64
    (``lse_i - m`` below about -745), as the attention kernels drop a key whose weight
    underflows. A row with ``-inf`` in every piece gives zeros and ``lse = -inf``, as
    ``attention`` does for a row with no allowed key. Otherwise NaN or inf in a piece
    (in ``out_i``, or NaN in ``lse_i``) gives NaN or inf in the affected rows.

    Attention sinks: a sink is a logit of no key, so it belongs to exactly one piece
    (give ``sinks=`` to one of the calls, say the first); that piece's ``lse_i``
    includes it, and the merged ``lse`` counts it once.

    NaN and inf values. ``attention`` lets a NaN or inf in ``v[j]`` reach row ``i``
    exactly when the weight of key ``j`` against the row's maximum over all keys is not
    0 in the computation dtype. A piece measures its weights against its own maximum,
    which may be smaller, so its ``out_i`` may hold a NaN that the one-shot result does
    not: merged, such a row is NaN where the one-shot row is finite (unless the piece's
    weight underflows as above). The converse does not happen: a NaN that the one-shot
    result has is in the merged result too (a piece's weight is at least that of each
    of its keys divided by the number of keys, so it does not underflow while one of
    its keys reaches the row). ``fastattn.dask.attention`` recomputes the rows that
    are not finite over all their keys.

    Merging is associative up to rounding, so partial results may be merged in a tree
    (``merge_partials([merge_partials(a), merge_partials(b)])``), which is what
    ``fastattn.dask.attention`` does with chunks along the key axis.

    Examples
    --------
    >>> import numpy as np
    >>> from fastattn import merge_partials, reference
    >>> rng = np.random.default_rng(0)
    >>> q = rng.standard_normal((2, 5, 8))
    >>> k = rng.standard_normal((2, 12, 8))
    >>> v = rng.standard_normal((2, 12, 4))
    >>> pieces = [reference.attention(q, k[:, s], v[:, s], return_lse=True)
    ...           for s in (slice(0, 7), slice(7, 12))]
    >>> out, lse = merge_partials([p[0] for p in pieces], [p[1] for p in pieces])
    >>> full, full_lse = reference.attention(q, k, v, return_lse=True)
    >>> bool(np.allclose(out, full) and np.allclose(lse, full_lse))
    True
    >>> out.shape, lse.shape
    ((2, 5, 4), (2, 5))
    """
    outs = [_v.as_real(o, f"outs[{i}]") for i, o in enumerate(_as_list(outs, "outs"))]
    lses = [_v.as_real(s, f"lses[{i}]") for i, s in enumerate(_as_list(lses, "lses"))]
    if len(outs) != len(lses):
        raise ValueError(
            f"outs and lses must have the same length, got {len(outs)} and {len(lses)}")
    shape = outs[0].shape
    if len(shape) < 1:
        raise ValueError(
            f"outs[0] must have at least 1 dimension (..., Lq, Ev), got shape {shape}")
    for i, o in enumerate(outs):
        if o.shape != shape:
            raise ValueError(
                f"outs[{i}] has shape {o.shape}, which differs from outs[0] {shape}")
    for i, s in enumerate(lses):
        if s.shape != shape[:-1]:
            raise ValueError(
                f"lses[{i}] has shape {s.shape}; it must be outs' shape {shape} less "
                f"the last axis, {shape[:-1]}")

    result = _v.result_dtype(*outs)
    lse_dtype = _v.lse_dtype(_v.computation_dtype(result))
    f64 = np.float64
    lse64 = [s.astype(f64, copy=False) for s in lses]

    m = lse64[0]
    for s in lse64[1:]:
        m = np.maximum(m, s)                      # NaN propagates
    m = np.where(m == -np.inf, 0.0, m)            # all -inf: every weight is exp(-inf) = 0

    total = np.zeros(shape[:-1], f64)
    acc = np.zeros(shape, f64)
    with np.errstate(invalid="ignore", over="ignore", under="ignore"):
        for o, s in zip(outs, lse64):
            w = np.exp(s - m)             # 0 for -inf and for an underflowing weight
            total += w
            contrib = w[..., None] * o
            acc += np.where((w == 0)[..., None], 0.0, contrib)   # not 0 * nan
    with np.errstate(invalid="ignore", divide="ignore"):
        has_keys = total > 0
        out = np.where(has_keys[..., None], acc / np.where(has_keys, total, 1.0)[..., None],
                       acc * 0.0)
        lse = m + np.log(total)                   # log(0) = -inf for rows with no key
    return out.astype(result), lse.astype(lse_dtype)
