"""The gradient of fused attention: validation for the backward drivers.

The arguments are checked exactly as :func:`fastattn.attention` checks them (through
``_validation``); ``_compute.gradients`` describes the call as a Plan and runs the
backward driver, which sums every gradient over the output slices that read an input
slice (broadcasting, grouped-query heads) in a fixed order.
"""

from __future__ import annotations

import numpy as np

from . import _compute
from . import _validation as _v
from ._config import resolve_num_threads

__all__ = ["attention_backward"]


def attention_backward(grad_out, q, k, v, out, lse, *, mask=None, bias=None,
                       causal=False, scale=None, enable_gqa=False, window=None,
                       softcap=None, alibi_slopes=None, sinks=None, q_lengths=None,
                       kv_lengths=None, dropout_p=0.0, dropout_seed=None,
                       precision=None, num_threads=None):
    """Gradients of :func:`fastattn.attention` with respect to q, k and v.

    Parameters
    ----------
    grad_out : array_like of shape (*batch, Lq, Ev)
        The gradient of the loss with respect to the attention output.
    q : array_like of shape (*batch_q, Lq, E)
    k : array_like of shape (*batch_kv, Lk, E)
    v : array_like of shape (*batch_kv, Lk, Ev)
        The forward's inputs.
    out : array_like of shape (*batch, Lq, Ev)
    lse : array_like of shape (*batch, Lq)
        The forward's results, from ``attention(..., return_lse=True)``.
    mask, bias, causal, scale, enable_gqa, window, softcap, alibi_slopes, sinks
    q_lengths, kv_lengths, dropout_p, dropout_seed
        Exactly as given to :func:`fastattn.attention` (the dropout pattern is
        regenerated from the seed, not stored).
    precision : {None, "highest", "bf16"}, default None
        Accepted and checked as in :func:`fastattn.attention`; the backward computes
        alike for each (products summed in float32; on the bfloat16 units the
        weights and their gradients rounded to bfloat16 for the products, as
        PyTorch's bfloat16 backward rounds them).
    num_threads : int, optional
        Threads for this call (default :func:`fastattn.get_num_threads`).

    Returns
    -------
    dq : ndarray of the shape of q
    dk : ndarray of the shape of k
    dv : ndarray of the shape of v
        In the result dtype of q, k and v (``grad_out``, ``out`` and ``lse`` are cast
        to the computation dtype and do not take part in promotion). Where q, k or v
        was broadcast, or a key/value head is shared by a GQA group, the gradient is
        summed over every use.
    dsinks : ndarray of the shape of sinks
        Only when ``sinks`` is given: ``-sum_i exp(sink - lse_i) * rowsum(dO_i * O_i)``
        over the rows of each slice (padding rows excluded), summed over the axes
        ``sinks`` was broadcast along; in the result dtype of q, k and v.

    Raises
    ------
    TypeError, ValueError
        As :func:`fastattn.attention`; also ``ValueError`` when ``grad_out`` or
        ``out`` does not have the output's shape or ``lse`` the shape (*batch, Lq).

    Notes
    -----
    With ``S = scale * q @ k^T + bias`` (blocked entries ``-inf``), the probabilities
    are rebuilt from the saved log-sum-exp, ``P = exp(S - lse)``, one tile of 64 x 64
    at a time (the Lq x Lk matrix is never formed); then ``dV = P^T dO``,
    ``dS = P * (dO V^T - rowsum(dO * O))``, ``dK = scale * dS^T Q`` and
    ``dQ = scale * dS K``. A row with no allowed key (``lse = -inf``) contributes
    nothing.

    The work is split over (key/value slice, chunk of keys) items, which own their dK
    and dV rows and write a partial dQ per chunk, and then over (query slice, block of
    query rows) items that add the partials up. The number of chunks depends only on
    the shapes and every sum runs in a fixed order, so the result is bit-identical for
    any ``num_threads``; no atomics. The GIL is released while the kernels run.
    float32 inputs are computed in float32 (row sums of ``dO * O`` in float64);
    bfloat16 and float16 inputs (q, k, v, ``grad_out``, ``out``) are read as they are
    and computed in float32, and the gradients rounded once at the end. Where q and k
    (v and ``grad_out``) are bfloat16 and the forward computes its scores with
    AVX512-BF16's dot products (exact products, float32 sums), the products
    ``q k^T`` and ``dO v^T`` of the backward do too; where all four are bfloat16 and
    the head sizes are multiples of 64, so do the three gradient products, with the
    probabilities P and the score gradients dS rounded to bfloat16 for them, as
    PyTorch's CPU backward rounds them (each term then errs by at most 2**-9 of its
    size; the sums stay float32). The extra memory is the partial dQ, at most eight
    times the size of dQ, plus a few tiles per thread.

    Examples
    --------
    >>> import numpy as np, fastattn
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = rng.standard_normal((3, 2, 5, 4))
    >>> out, lse = fastattn.attention(q, k, v, causal=True, return_lse=True)
    >>> dq, dk, dv = fastattn.attention_backward(np.ones_like(out), q, k, v, out, lse,
    ...                                          causal=True)
    >>> dq.shape, dk.shape, dv.shape
    ((2, 5, 4), (2, 5, 4), (2, 5, 4))
    >>> bool(np.allclose(dv.sum(axis=-2), 5.0))   # each query's weights sum to 1
    True
    """
    if (mask is None and bias is None and window is None and softcap is None
            and alibi_slopes is None and sinks is None and q_lengths is None
            and kv_lengths is None and dropout_seed is None and precision is None
            and type(dropout_p) is float and dropout_p == 0):
        # the commonest call (plain 4-D arrays; a PyTorch model's training step) with
        # fewer steps, the same plan and the same bits; None for any other call
        res = _compute.gradients_plain(grad_out, q, k, v, out, lse, causal, scale,
                                       enable_gqa, num_threads)
        if res is not None:
            return res
    args = _v.attention_args(q, k, v, mask=mask, bias=bias, causal=causal, scale=scale,
                             enable_gqa=enable_gqa)
    _v.check_precision(precision)
    threads = resolve_num_threads(num_threads)
    s = args.shapes
    comp = args.computation
    out_shape = s.batch + (s.Lq, s.Ev)
    what = "the shape of attention's output (*batch, Lq, Ev) ="
    grad_out = _v.as_shaped(grad_out, "grad_out", out_shape, what, comp, True)
    out = _v.as_shaped(out, "out", out_shape, what, comp, True)
    lse = _v.as_shaped(lse, "lse", s.batch + (s.Lq,), "shape (*batch, Lq) =", comp)

    var = _v.variants_of(args, window=window, softcap=softcap,
                            alibi_slopes=alibi_slopes, q_lengths=q_lengths,
                            kv_lengths=kv_lengths, dropout_p=dropout_p,
                            dropout_seed=dropout_seed, sinks=sinks)
    grads = _compute.gradients(args, grad_out, out, lse, threads, var,
                               result=args.result)
    if var.sinks is None:
        return grads
    return grads + (_compute.sink_gradient(var.sinks, grad_out, out, lse,
                                           args.result),)
