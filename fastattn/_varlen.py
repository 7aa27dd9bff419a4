"""Packed batches of variable-length sequences (FlashAttention's varlen layout)."""

from __future__ import annotations

from . import _compute
from . import _validation as _v
from ._config import resolve_num_threads

__all__ = ["attention_varlen", "attention_varlen_backward"]


def _variants(a: _v.VarlenArgs, **keywords) -> _v.Variants:
    B = len(a.cu_seqlens_q) - 1
    longest = max([int(x) for x in (a.cu_seqlens_q[1:] - a.cu_seqlens_q[:-1])]
                  + [int(x) for x in (a.cu_seqlens_k[1:] - a.cu_seqlens_k[:-1])] + [0])
    return _v.variant_args((B, a.Hq), longest, longest, (B, a.Hq, 0, 0), a.computation,
                           **keywords)


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, *, causal=False, scale=None,
                     window=None, softcap=None, alibi_slopes=None, sinks=None,
                     dropout_p=0.0, dropout_seed=None, k_scale=None, v_scale=None,
                     return_lse=False, out=None, num_threads=None):
    """Attention over a packed batch of variable-length sequences, without padding.

    Parameters
    ----------
    q : array_like of shape (total_q, Hq, E)
    k : array_like of shape (total_k, Hkv, E)
    v : array_like of shape (total_k, Hkv, Ev)
        Sequence b owns rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` of q and
        ``cu_seqlens_k[b]:cu_seqlens_k[b+1]`` of k and v. Grouped-query attention is
        implied by ``Hq % Hkv == 0``.
    cu_seqlens_q, cu_seqlens_k : array_like of int32 or int64 of shape (B + 1,)
        Non-decreasing, from 0 to total_q / total_k.
    causal, scale, window, softcap, dropout_p, dropout_seed
        As in :func:`fastattn.attention`, each sequence with its own lengths (so
        "bottom_right" aligns each sequence's last query with its last key).
    alibi_slopes, sinks : array_like broadcastable to (B, Hq), optional
        As in :func:`fastattn.attention`, per sequence and head.
    k_scale, v_scale : array_like broadcastable to (total_k, Hkv), optional
        A quantized cache (int8 or float8 k and v codes), as in
        :func:`fastattn.attention`.
    return_lse : bool, default False
    out : ndarray of shape (total_q, Hq, Ev), optional
    num_threads : int, optional

    Returns
    -------
    out : ndarray of shape (total_q, Hq, Ev)
    lse : ndarray of shape (Hq, total_q)
        Only with ``return_lse`` (FlashAttention's layout).

    Notes
    -----
    The whole batch is one plan: each (sequence, head) is a slice whose rows start at
    its ``cu_seqlens`` offset in the packed arrays (nothing is copied or padded), and
    one parallel region computes every slice's tiles, written straight into their
    rows of ``out`` (a batch of many short sequences costs about what the same batch
    padded with ``q_lengths`` does). The dropout slice index of head h of sequence b
    is ``b * Hq + h``.

    Examples
    --------
    >>> import numpy as np, fastattn
    >>> rng = np.random.default_rng(0)
    >>> q = rng.standard_normal((7, 2, 4))         # sequences of 3 and 4 rows
    >>> cu = np.array([0, 3, 7])
    >>> out = fastattn.attention_varlen(q, q, q, cu, cu, causal=True)
    >>> ref = fastattn.attention(q[3:].swapaxes(0, 1), q[3:].swapaxes(0, 1),
    ...                          q[3:].swapaxes(0, 1), causal=True)
    >>> bool(np.allclose(out[3:], ref.swapaxes(0, 1)))
    True
    """
    if (alibi_slopes is None and type(dropout_p) is float and dropout_p == 0.0
            and dropout_seed is None and k_scale is None and v_scale is None
            and return_lse is False and out is None):
        # packed sequences of one float dtype (transformers' continuous batching) with
        # fewer steps, the same plan and the same bits; None for any other call
        res = _compute.attend_varlen_plain(q, k, v, cu_seqlens_q, cu_seqlens_k, causal,
                                           scale, sinks, num_threads, window, softcap)
        if res is not None:
            return res
    a = _v.varlen_args(q, k, v, cu_seqlens_q, cu_seqlens_k, causal=causal, scale=scale,
                       k_scale=k_scale, v_scale=v_scale, codes=True)
    var = _variants(a, window=window, softcap=softcap, alibi_slopes=alibi_slopes,
                    dropout_p=dropout_p, dropout_seed=dropout_seed, sinks=sinks)
    return _compute.attend_varlen(a, var, return_lse, out,
                                  resolve_num_threads(num_threads))


def attention_varlen_backward(grad_out, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                              *, causal=False, scale=None, window=None, softcap=None,
                              alibi_slopes=None, sinks=None, dropout_p=0.0,
                              dropout_seed=None, num_threads=None):
    """Gradients ``(dq, dk, dv)`` (and ``dsinks``) of :func:`attention_varlen`.

    Parameters
    ----------
    grad_out, out : array_like of shape (total_q, Hq, Ev)
    lse : array_like of shape (Hq, total_q)
        From ``attention_varlen(..., return_lse=True)``.
    q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale, window, softcap, alibi_slopes
    sinks, dropout_p, dropout_seed
        Exactly as given to :func:`attention_varlen`.
    num_threads : int, optional

    Returns
    -------
    dq, dk, dv : ndarray
        Packed like q, k and v, in their result dtype.
    dsinks : ndarray of the shape of sinks
        Only when ``sinks`` is given (as :func:`fastattn.attention_backward`).
    """
    a = _v.varlen_args(q, k, v, cu_seqlens_q, cu_seqlens_k, causal=causal, scale=scale)
    var = _variants(a, window=window, softcap=softcap, alibi_slopes=alibi_slopes,
                    dropout_p=dropout_p, dropout_seed=dropout_seed, sinks=sinks)
    shape = (a.q.shape[0], a.Hq, a.v.shape[2])
    what = "the shape of attention_varlen's output (total_q, Hq, Ev) ="
    grad_out = _v.as_shaped(grad_out, "grad_out", shape, what, a.computation, True)
    out = _v.as_shaped(out, "out", shape, what, a.computation, True)
    lse = _v.as_shaped(lse, "lse", (a.Hq, a.q.shape[0]), "shape (Hq, total_q) =",
                       a.computation)
    grads = _compute.gradients_varlen(a, var, grad_out, out, lse,
                                      resolve_num_threads(num_threads))
    return tuple(g.astype(a.result, copy=False) for g in grads)
