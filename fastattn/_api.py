"""The public functions: validation, dtype promotion, then the computation.

Every function converts its inputs with ``numpy.asarray``, checks them (see
``_validation``), settles the computation dtype (float32 or float64; bfloat16 and
float16 are read in place and computed in float32) and hands them to ``_compute``,
which describes the call as a Plan (pointers and strides: broadcast and transposed
inputs are read in place) and runs the drivers with the GIL released. The commonest
call of :func:`attention` (plain 4-D arrays of one float dtype, no mask, bias or
variant but sinks, a window, a softcap and kv_lengths) has a shorter path to the
same Plan (``_compute.attend_plain``); any other call, and every error, takes the
full one.
"""

from __future__ import annotations

import numpy as np

from . import _compute
from . import _validation as _v
from ._config import resolve_num_threads

__all__ = ["attention", "scores", "softmax", "weighted_sum", "attention_weights"]


# ------------------------------------------------------------------------ functions

def attention(q, k, v, *, mask=None, bias=None, causal=False, scale=None,
              enable_gqa=False, window=None, softcap=None, alibi_slopes=None,
              sinks=None, q_lengths=None, kv_lengths=None, dropout_p=0.0,
              dropout_seed=None, precision=None, k_scale=None, v_scale=None,
              return_lse=False, out=None, num_threads=None):
    """Scaled dot-product attention, ``softmax(scale * q @ k^T + bias) @ v``, fused.

    Parameters
    ----------
    q : array_like of shape (*batch_q, Lq, E)
        Queries. ``*batch`` is any number of leading axes (none for a plain matrix).
    k : array_like of shape (*batch_kv, Lk, E)
        Keys. Their batch shape broadcasts against q's with NumPy rules.
    v : array_like of shape (*batch_kv, Lk, Ev)
        Values, with the same batch shape as k.
    mask : array_like of bool, broadcastable to (*batch, Lq, Lk), optional
        True where a query may attend to a key.
    bias : array_like of real, broadcastable to (*batch, Lq, Lk), optional
        Added to the scaled scores (cast to the computation dtype; ``-inf`` blocks a
        key).
    causal : {False, True, "top_left", "bottom_right"}, default False
        ``True``/"top_left": query i attends to keys j <= i. "bottom_right": to keys
        j <= i + (Lk - Lq) (the key-value-cache convention). Combines with mask/bias.
    scale : float, optional
        The factor applied to ``q @ k^T``; default ``1 / sqrt(E)``.
    enable_gqa : bool, default False
        Grouped-query attention: axis -3 of q (Hq heads) may be a multiple of axis -3
        of k and v (Hkv heads); query head h uses key/value head h // (Hq // Hkv).
    window : (left, right), optional
        Query i (at key position i + d, d = Lk - Lq for "bottom_right", else 0) may
        attend only keys i + d - left <= j <= i + d + right; a side may be None
        (unbounded). Sliding-window attention is ``causal=True, window=(w, 0)``. Blocks
        of keys outside every row's window are skipped.
    softcap : float > 0, optional
        The scaled scores become ``softcap * tanh(scores / softcap)`` before the bias.
    alibi_slopes : array_like, broadcastable to *batch, optional
        Last axis the query heads (e.g. (Hq,) or (B, Hq)): ``-slope * |i + d - j|`` is
        added to the scores.
    sinks : array_like, broadcastable to *batch, optional
        Attention sinks (gpt-oss's ``s_aux``), last axis the query heads like
        ``alibi_slopes``: one extra logit per head that joins every row's softmax and
        carries no value, so the weights are ``exp(s_ij) / (sum_j exp(s_ij) +
        exp(sink))``. It is applied after every other rule and is never masked,
        capped or dropped; ``lse`` includes it (a row with no allowed key gives zeros
        and ``lse = sink``; padding rows stay zeros with ``lse = -inf``).
    q_lengths, kv_lengths : array_like of int of shape (B,), optional
        The valid lengths of each sequence of a padded batch (B = axis 0 of *batch):
        keys j >= kv_lengths[b] are never attended; rows i >= q_lengths[b] are zeros
        (lse -inf). With "bottom_right", d is each sequence's own Lk - Lq. Padding
        costs nothing.
    dropout_p : float in [0, 1), default 0
        Each weight is zeroed with this probability and the others scaled by
        1 / (1 - dropout_p), after normalisation (lse is that before dropout).
    dropout_seed : int, optional
        Required with dropout_p > 0: the pattern is a pure function of (seed, slice,
        i, j) (Philox-4x32-10), the same for any num_threads and in the reference.
    precision : {None, "highest", "bf16"}, default None
        None: float32 and float64 inputs compute in their own precision; where the
        bfloat16 units compute bfloat16 inputs (AMX, AVX512-BF16), the weights are
        rounded once to bfloat16 for the product with v, as PyTorch does (max error
        at most 1.25 times PyTorch's bfloat16 SDPA's on the same inputs). "highest":
        every intermediate in at least float32 (16-bit inputs: error no larger than
        PyTorch's). "bf16": float32 q, k and v rounded to bfloat16 copies computed
        on the AMX tiles where those are in use (and ml_dtypes is installed), the
        result float32 (error as for bfloat16 inputs); elsewhere as None. Any other
        value is a ``ValueError`` ("bf16x3" was removed). See
        :func:`fastattn.show_config`.
    k_scale, v_scale : array_like of float, optional
        Broadcastable to ``k.shape[:-1]`` and ``v.shape[:-1]``. A quantized key-value cache: k and v int8 codes (both scales required) or
        ``ml_dtypes.float8_e4m3fn``/``float8_e5m2`` codes (scales optional, 1), one
        float32 scale per token and head, per head, or one for all; a kernel's value
        is ``float(code) * scale``. The codes are widened block by block in
        registers or scratch, never written out. q must then be float32, bfloat16
        or float16 (the result's dtype). int8 k and v without scales are integer
        values (computed in float64). See :func:`fastattn.quantize_kv`.
    return_lse : bool, default False
        Also return the log-sum-exp of each row's allowed scores.
    out : ndarray of shape (*batch, Lq, Ev), optional
        C-contiguous, of the result dtype; filled and returned.
    num_threads : int, optional
        Threads for this call (default :func:`fastattn.get_num_threads`).

    Returns
    -------
    out : ndarray of shape (*batch, Lq, Ev)
        In the result dtype (``numpy.result_type`` of q, k, v; integers as float64;
        q's dtype beside a quantized cache).
    lse : ndarray of shape (*batch, Lq)
        Only with ``return_lse``: float64 if the computation is float64, else
        float32; ``-inf`` for a row with no allowed key.

    Raises
    ------
    TypeError
        For non-real inputs, a non-boolean mask, or a non-integer ``num_threads``.
    ValueError
        For shapes that do not fit, a bad ``causal``, ``out`` or ``num_threads``.

    Notes
    -----
    The Lq x Lk score matrix is never formed: keys are visited in blocks with the
    running-max ("online") softmax, so the extra memory is a few blocks per thread.
    The work is split over (batch·head, block of 64 query rows) items; each item is
    computed whole by one thread in a fixed order, so the result is bit-identical for
    any ``num_threads``. The GIL is released while the kernels run. float32 inputs
    are computed in float32 (softmax sums in float64); bfloat16
    (``ml_dtypes.bfloat16``) and float16 inputs are read as they are, a block at a
    time, computed in float32 and rounded once at the end. A query row with no allowed key gives zeros; NaN or Inf in the
    inputs give NaN in the rows they reach.

    Examples
    --------
    >>> import numpy as np, fastattn
    >>> x = np.array([[1., 0, 1, 0], [0, 1, 0, 1], [1, 1, 1, 1]])
    >>> fastattn.attention(x, x, x, scale=0.5).round(3)
    array([[0.845, 0.578, 0.845, 0.578],
           [0.578, 0.845, 0.578, 0.845],
           [0.788, 0.788, 0.788, 0.788]])
    """
    if (mask is None and bias is None
            and alibi_slopes is None and q_lengths is None
            and dropout_seed is None and out is None
            and not return_lse
            and precision is None and type(dropout_p) is float and dropout_p == 0):
        # the commonest call (plain 4-D arrays, or a quantized cache; a PyTorch
        # model's or a server's decoding step) with fewer steps, the same plan and
        # the same bits; None for any other call
        res = _compute.attend_plain(q, k, v, causal, scale, enable_gqa, num_threads,
                                    sinks, window, softcap, kv_lengths, k_scale,
                                    v_scale)
        if res is not None:
            return res
    args = _v.attention_args(q, k, v, mask=mask, bias=bias, causal=causal, scale=scale,
                             enable_gqa=enable_gqa, k_scale=k_scale, v_scale=v_scale,
                             codes=True)
    var = _v.variants_of(args, window=window, softcap=softcap,
                         alibi_slopes=alibi_slopes, q_lengths=q_lengths,
                         kv_lengths=kv_lengths, dropout_p=dropout_p,
                         dropout_seed=dropout_seed, sinks=sinks)
    if _v.check_precision(precision) == "bf16":
        args = _compute.bfloat16_operands(args)
    return _compute.attend(args, return_lse, out, resolve_num_threads(num_threads),
                           var=var, round_weights=precision != "highest")


def _scores(q, k, mask, bias, causal, scale, enable_gqa, softmax, variants):
    args = _v.attention_args(q, k, mask=mask, bias=bias, causal=causal, scale=scale,
                             enable_gqa=enable_gqa, with_v=False)
    var = _v.variants_of(args, **variants)
    if not softmax and var.sinks is not None:
        var = var._replace(sinks=None)      # checked; the scores are the keys' alone
    return _compute.score(args, softmax, resolve_num_threads(), var)


def scores(q, k, *, mask=None, bias=None, causal=False, scale=None, enable_gqa=False,
           window=None, softcap=None, alibi_slopes=None, sinks=None, q_lengths=None,
           kv_lengths=None):
    """The attention scores ``scale * q @ k^T + bias``, blocked entries set to -inf.

    Parameters
    ----------
    q : array_like of shape (*batch_q, Lq, E)
    k : array_like of shape (*batch_kv, Lk, E)
    mask, bias, causal, scale, enable_gqa, window, softcap, alibi_slopes
        As in :func:`attention`.
    sinks : array_like, broadcastable to *batch, optional
        Checked exactly as in :func:`attention` (last axis the query heads, e.g.
        (Hq,) or (B, Hq); ``ValueError`` naming ``sinks`` otherwise), so that one
        set of keywords serves ``scores``, :func:`attention_weights` and
        :func:`attention`. The scores are those of the keys, the same with or
        without sinks: a sink is an extra logit of no key that joins the softmax
        (so the rows of ``attention_weights(..., sinks=...)`` sum to less than 1).
    q_lengths, kv_lengths
        As in :func:`attention`; rows past a sequence's length are all -inf.

    Returns
    -------
    ndarray of shape (*batch, Lq, Lk)
        In the result dtype of q and k. Entries a query may not attend to are -inf.

    Notes
    -----
    The first of the three kernels: dot products of every query with every key.
    Runs on :func:`fastattn.get_num_threads` threads, bit-identical for any count.

    Examples
    --------
    >>> import numpy as np, fastattn
    >>> x = np.array([[1., 0, 1, 0], [0, 1, 0, 1], [1, 1, 1, 1]])
    >>> fastattn.scores(x, x, scale=0.5, causal=True)
    array([[  1., -inf, -inf],
           [  0.,   1., -inf],
           [  1.,   1.,   2.]])
    """
    return _scores(q, k, mask, bias, causal, scale, enable_gqa, False,
                   dict(window=window, softcap=softcap, alibi_slopes=alibi_slopes,
                        sinks=sinks, q_lengths=q_lengths, kv_lengths=kv_lengths))


def attention_weights(q, k, *, mask=None, bias=None, causal=False, scale=None,
                      enable_gqa=False, window=None, softcap=None, alibi_slopes=None,
                      sinks=None, q_lengths=None, kv_lengths=None):
    """The attention probabilities ``softmax(scores(q, k, ...))``, for inspection.

    Parameters
    ----------
    q : array_like of shape (*batch_q, Lq, E)
    k : array_like of shape (*batch_kv, Lk, E)
    mask, bias, causal, scale, enable_gqa, window, softcap, alibi_slopes, sinks
    q_lengths, kv_lengths
        As in :func:`attention` (rows past a sequence's length are zeros).

    Returns
    -------
    ndarray of shape (*batch, Lq, Lk)
        Each row sums to 1, or is all zeros where the query may attend to no key;
        with ``sinks`` a row sums to ``1 - exp(sink - lse)``, the sink's share.

    Examples
    --------
    >>> import numpy as np, fastattn
    >>> x = np.array([[1., 0, 1, 0], [0, 1, 0, 1], [1, 1, 1, 1]])
    >>> fastattn.attention_weights(x, x, scale=0.5)[0].round(3)
    array([0.422, 0.155, 0.422])
    """
    return _scores(q, k, mask, bias, causal, scale, enable_gqa, True,
                   dict(window=window, softcap=softcap, alibi_slopes=alibi_slopes,
                        sinks=sinks, q_lengths=q_lengths, kv_lengths=kv_lengths))


def softmax(x, axis=-1, *, out=None):
    """Max-subtracted softmax of ``x`` along ``axis``.

    Parameters
    ----------
    x : array_like of real
        Any shape with at least one dimension.
    axis : int, default -1
        The axis to normalise along.
    out : ndarray of the shape of x, optional
        C-contiguous, of the result dtype; filled and returned.

    Returns
    -------
    ndarray of the shape of x
        ``exp(x - max) / sum(exp(x - max))`` along ``axis``; a slice that is all -inf
        gives zeros; a slice with a NaN gives NaN.

    Notes
    -----
    The second of the three kernels. Subtracting the slice's maximum first keeps
    ``exp`` from overflowing, so logits of 1e4 give exact, finite results. Sums are
    accumulated in float64.

    Examples
    --------
    >>> import fastattn
    >>> fastattn.softmax([4.0, 5.0]).round(4)
    array([0.2689, 0.7311])
    >>> fastattn.softmax([1.0, 10.0]).round(5)
    array([1.2000e-04, 9.9988e-01])
    """
    x = _v.as_real(x, "x")
    result = x.dtype
    comp = _v.computation_dtype(result)
    ax = _v.normalize_axis(axis, x.ndim, "x", x.shape)
    if out is not None:
        _v.check_out(out, x.shape, result)
    return _compute.normalise(x.astype(comp, copy=False), ax, out, result,
                              resolve_num_threads())


def weighted_sum(p, v, *, out=None):
    """The weighted sum of value rows, ``p @ v`` over the last two axes.

    Parameters
    ----------
    p : array_like of shape (*batch_p, Lq, Lk)
        Weights (usually attention probabilities).
    v : array_like of shape (*batch_v, Lk, Ev)
        Values; the batch shapes broadcast with NumPy rules.
    out : ndarray of shape (*batch, Lq, Ev), optional
        C-contiguous, of the result dtype; filled and returned.

    Returns
    -------
    ndarray of shape (*batch, Lq, Ev)

    Notes
    -----
    The third of the three kernels. Runs on :func:`fastattn.get_num_threads` threads,
    bit-identical for any count.

    Examples
    --------
    >>> import fastattn
    >>> fastattn.weighted_sum([[0.25, 0.75]], [[1.0, 0.0], [0.0, 1.0]])
    array([[0.25, 0.75]])
    """
    p = _v.as_real(p, "p")
    v = _v.as_real(v, "v")
    result = _v.result_dtype(p, v)
    comp = _v.computation_dtype(result)
    batch = _v.weighted_sum_batch(p, v)
    if out is not None:
        _v.check_out(out, batch + (p.shape[-2], v.shape[-1]), result)
    return _compute.weigh(p.astype(comp, copy=False), v.astype(comp, copy=False), batch,
                          out, result, resolve_num_threads())
