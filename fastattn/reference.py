"""The NumPy baseline: plain, readable implementations of the public functions.

These are the functions that the benchmarks compare against and that the tests use as
an oracle. They take the same arguments as their ``fastattn`` counterparts (less ``out``
and ``num_threads``), follow the same dtype and shape rules, and materialise every
intermediate matrix: clarity first, memory second.

Examples
--------
>>> import numpy as np
>>> from fastattn import reference
>>> reference.softmax(np.array([4.0, 5.0])).round(4)
array([0.2689, 0.7311])
"""

from __future__ import annotations

import numpy as np

from . import _validation as _v

__all__ = ["attention", "scores", "softmax", "weighted_sum", "attention_weights",
           "attention_backward"]


def _expand_gqa(a: np.ndarray, groups: int) -> np.ndarray:
    """Repeat the key/value heads (axis -3) so query head h meets head h // groups."""
    return a if groups == 1 else np.repeat(a, groups, axis=-3)


def _allowed(args: _v.AttentionArgs):
    """Boolean (..., Lq, Lk) of the keys each query may attend to, or None for all."""
    s = args.shapes
    allowed = _v.causal_allowed(args.causal, s.Lq, s.Lk)
    if args.mask is not None:
        allowed = args.mask if allowed is None else (args.mask & allowed)
    return allowed


def _scores(args: _v.AttentionArgs) -> np.ndarray:
    """``scale * q @ k^T + bias`` with blocked entries at -inf, in the computation dtype."""
    comp = args.computation
    k = _expand_gqa(args.k, args.shapes.groups)
    with np.errstate(invalid="ignore", over="ignore"):
        s = np.matmul(args.q, np.swapaxes(k, -1, -2)) * comp.type(args.scale)
        if args.bias is not None:
            s = s + args.bias
    allowed = _allowed(args)
    if allowed is not None:
        s = np.where(allowed, s, comp.type(-np.inf))
    full = args.shapes.batch + (args.shapes.Lq, args.shapes.Lk)
    return np.broadcast_to(s, full).astype(comp)


def _softmax_last(s: np.ndarray):
    """Max-subtracted softmax over the last axis; returns (p, lse)."""
    if s.shape[-1] == 0:
        return np.zeros_like(s), np.full(s.shape[:-1], -np.inf, s.dtype)
    m = np.max(s, axis=-1, keepdims=True)
    m = np.where(m == -np.inf, 0, m).astype(s.dtype)    # an all -inf row: exp(-inf) = 0
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        e = np.exp(s - m)
        total = np.sum(e, axis=-1, keepdims=True)
        p = np.where(total > 0, e / np.where(total > 0, total, 1), e * 0)
        lse = (m + np.log(total))[..., 0]
    return p.astype(s.dtype), lse.astype(s.dtype)


def _apply_weights(p: np.ndarray, v: np.ndarray) -> np.ndarray:
    """``p @ v``, except that a key with weight exactly 0 contributes nothing even when
    its value row holds NaN or inf: a key a query may not attend to never reaches its
    output (plain ``p @ v`` would give ``0 * nan = nan``)."""
    finite = np.isfinite(v)
    if finite.all():
        return np.matmul(p, v)
    out = np.matmul(p, np.where(finite, v, 0))
    bad = np.where(finite, 0, v)[..., None, :, :]               # (..., 1, Lk, Ev)
    pw = p[..., :, :, None]                                     # (..., Lq, Lk, 1)
    with np.errstate(invalid="ignore"):
        extra = np.where(pw != 0, pw * bad, 0).sum(axis=-2)
    return (out + extra).astype(out.dtype)


def scores(q, k, *, mask=None, bias=None, causal=False, scale=None, enable_gqa=False):
    """``scale * q @ k^T + bias`` of shape (*batch, Lq, Lk), blocked entries at -inf."""
    args = _v.attention_args(q, k, mask=mask, bias=bias, causal=causal, scale=scale,
                             enable_gqa=enable_gqa, with_v=False)
    return _scores(args).astype(args.result)


def softmax(x, axis=-1):
    """Max-subtracted softmax of ``x`` along ``axis``; an all -inf slice gives zeros."""
    x = _v.as_real(x, "x")
    res = x.dtype
    comp = _v.computation_dtype(res)
    ax = _v.normalize_axis(axis, x.ndim, "x", x.shape)
    s = np.moveaxis(x.astype(comp), ax, -1)
    p, _ = _softmax_last(s)
    return np.moveaxis(p, -1, ax).astype(res)


def weighted_sum(p, v):
    """``p @ v`` over the last two axes: p (*b1, Lq, Lk), v (*b2, Lk, Ev)."""
    p = _v.as_real(p, "p")
    v = _v.as_real(v, "v")
    res = _v.result_dtype(p, v)
    comp = _v.computation_dtype(res)
    _v.weighted_sum_batch(p, v)
    return np.matmul(p.astype(comp), v.astype(comp)).astype(res)


def attention_weights(q, k, *, mask=None, bias=None, causal=False, scale=None,
                      enable_gqa=False):
    """``softmax(scores(...))``: the (*batch, Lq, Lk) attention probabilities."""
    args = _v.attention_args(q, k, mask=mask, bias=bias, causal=causal, scale=scale,
                             enable_gqa=enable_gqa, with_v=False)
    p, _ = _softmax_last(_scores(args))
    return p.astype(args.result)


def attention(q, k, v, *, mask=None, bias=None, causal=False, scale=None,
              enable_gqa=False, return_lse=False):
    """``softmax(scale * q @ k^T + bias) @ v``, materialising every matrix.

    Returns ``out`` of shape (*batch, Lq, Ev), and ``lse`` (*batch, Lq) when
    ``return_lse`` is true.
    """
    args = _v.attention_args(q, k, v, mask=mask, bias=bias, causal=causal, scale=scale,
                             enable_gqa=enable_gqa)
    p, lse = _softmax_last(_scores(args))
    out = _apply_weights(p, _expand_gqa(args.v, args.shapes.groups))
    s = args.shapes
    out = np.broadcast_to(out, s.batch + (s.Lq, s.Ev)).astype(args.result)
    if return_lse:
        return out, lse.astype(_v.lse_dtype(args.computation))
    return out


def attention_backward(grad_out, q, k, v, out, lse, *, mask=None, bias=None,
                       causal=False, scale=None, enable_gqa=False):
    """Gradients ``(dq, dk, dv)`` of ``attention`` with respect to q, k and v.

    P is rebuilt from ``lse`` (``P = exp(S - lse)``), then ``dV = P^T dO``,
    ``dP = dO V^T``, ``dS = P * (dP - rowsum(dO * O))``, ``dQ = scale * dS K`` and
    ``dK = scale * dS^T Q``; gradients of broadcast inputs (and of a key/value head
    shared by a GQA group) are summed over every use.
    """
    args = _v.attention_args(q, k, v, mask=mask, bias=bias, causal=causal, scale=scale,
                             enable_gqa=enable_gqa)
    sh = args.shapes
    comp = args.computation
    out_shape = sh.batch + (sh.Lq, sh.Ev)
    grad_out = _v.as_real(grad_out, "grad_out")
    out = _v.as_real(out, "out")
    lse = _v.as_real(lse, "lse")
    for name, a, want in (("grad_out", grad_out, out_shape), ("out", out, out_shape),
                          ("lse", lse, sh.batch + (sh.Lq,))):
        if a.shape != want:
            raise ValueError(f"{name} must have shape {want}, got {a.shape}")
    do = grad_out.astype(comp)
    o = out.astype(comp)
    lse = lse.astype(comp)[..., None]
    s = _scores(args)
    with np.errstate(invalid="ignore", over="ignore"):
        p = np.where(lse == -np.inf, 0, np.exp(s - np.where(lse == -np.inf, 0, lse)))
    p = p.astype(comp)
    kx = np.broadcast_to(_expand_gqa(args.k, sh.groups), sh.batch + (sh.Lk, sh.E))
    vx = np.broadcast_to(_expand_gqa(args.v, sh.groups), sh.batch + (sh.Lk, sh.Ev))
    qx = np.broadcast_to(args.q, sh.batch + (sh.Lq, sh.E))
    dv = np.swapaxes(p, -1, -2) @ do
    dp = do @ np.swapaxes(vx, -1, -2)
    delta = np.sum(do * o, axis=-1, keepdims=True)
    ds = p * (dp - delta)
    scale = comp.type(args.scale)
    dq = (ds @ kx) * scale
    dk = (np.swapaxes(ds, -1, -2) @ qx) * scale
    return (_sum_to(dq, args.q.shape, 1).astype(args.result),
            _sum_to(dk, args.k.shape, sh.groups).astype(args.result),
            _sum_to(dv, args.v.shape, sh.groups).astype(args.result))


def _sum_to(g: np.ndarray, shape, groups: int) -> np.ndarray:
    """Sum a gradient over broadcast axes (and GQA groups) back to ``shape``."""
    if groups > 1:
        *lead, hq, L, E = g.shape
        g = g.reshape(*lead, hq // groups, groups, L, E).sum(axis=-3)
    extra = g.ndim - len(shape)
    if extra:
        g = g.sum(axis=tuple(range(extra)))
    axes = tuple(i for i, n in enumerate(shape) if n == 1 and g.shape[i] != 1)
    if axes:
        g = g.sum(axis=axes, keepdims=True)
    return g
