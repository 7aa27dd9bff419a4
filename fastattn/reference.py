"""The NumPy baseline: plain, readable implementations of the public functions.

These are the functions that the benchmarks compare against and that the tests use as
an oracle. They take the same arguments as their ``fastattn`` counterparts (less ``out``
and ``num_threads``), follow the same dtype and shape rules, and materialise every
intermediate matrix: clarity first, memory second.

The attention variants (``window``, ``softcap``, ``alibi_slopes``,
``q_lengths``/``kv_lengths``, ``dropout_p``/``dropout_seed``, and the packed
``attention_varlen``) are spelled out here once, in this order: the scaled scores
``scale * q @ k^T``, capped to ``softcap * tanh(. / softcap)``, plus ``bias``, minus
``slope * |i + d - j|``; then every entry that causal, window, lengths or mask forbid is
``-inf`` (``_allowed``); then the softmax (and its ``lse``); then dropout, drawn by the
counter-based generator of ``fastattn._philox`` (whose docstring gives the exact
mapping from ``(dropout_seed, slice, i, j)`` to kept or dropped).

Examples
--------
>>> import numpy as np
>>> from fastattn import reference
>>> reference.softmax(np.array([4.0, 5.0])).round(4)
array([0.2689, 0.7311])
"""

from __future__ import annotations

import functools

import numpy as np

from . import _philox
from . import _validation as _v

__all__ = ["attention", "scores", "softmax", "weighted_sum", "attention_weights",
           "attention_backward", "attention_varlen", "attention_varlen_backward",
           "attention_paged", "store_kv", "quantize_kv", "dequantize_kv"]


def _expand_gqa(a: np.ndarray, groups: int) -> np.ndarray:
    """Repeat the key/value heads (axis -3) so query head h meets head h // groups."""
    return a if groups == 1 else np.repeat(a, groups, axis=-3)


def _per_sequence(x, ndim: int):
    """A (B,) array (or a scalar) shaped to broadcast against (B, ..., Lq, Lk) of
    ``ndim`` dimensions: one value per sequence of axis 0."""
    x = np.asarray(x)
    return x.reshape(x.shape + (1,) * (ndim - x.ndim)) if x.ndim else x


def _positions(args: _v.AttentionArgs, var: _v.Variants, offset=None):
    """Query positions ``i + d`` as (..., Lq, 1) and key positions ``j`` as (Lk,).

    Key ``j`` sits at position ``j`` and query ``i`` at ``i + d``, where ``d`` comes from
    ``_validation.query_offsets`` (the sequence's own lengths when lengths are given),
    or is ``offset`` when given (a paged cache's queries without the causal rule).
    """
    s = args.shapes
    d = (_v.query_offsets(args.causal, s.Lq, s.Lk, var.q_lengths, var.kv_lengths)
         if offset is None else offset)
    i = np.arange(s.Lq)[:, None]
    return i + _per_sequence(d, len(s.batch) + 2), np.arange(s.Lk)


def _allowed(args: _v.AttentionArgs, var: _v.Variants, qpos, j):
    """Boolean (..., Lq, Lk) of the keys each query may attend to, or None for all:
    causal ``j <= i + d``; window ``i + d - left <= j <= i + d + right``; lengths
    ``i < q_lengths[b]`` and ``j < kv_lengths[b]``; and the mask."""
    ndim = len(args.shapes.batch) + 2
    rules = []
    if args.causal is not None:
        rules.append(j <= qpos)
    left, right = var.window
    if left is not None:
        rules.append(j >= qpos - left)
    if right is not None:
        rules.append(j <= qpos + right)
    if var.q_lengths is not None:
        i = np.arange(args.shapes.Lq)[:, None]
        rules.append(i < _per_sequence(var.q_lengths, ndim))
    if var.kv_lengths is not None:
        rules.append(j < _per_sequence(var.kv_lengths, ndim))
    if args.mask is not None:
        rules.append(args.mask)
    return functools.reduce(np.logical_and, rules) if rules else None


def _scaled_qk(args: _v.AttentionArgs) -> np.ndarray:
    """``scale * q @ k^T`` in the computation dtype, batch axes not yet broadcast."""
    k = _expand_gqa(args.k, args.shapes.groups)
    with np.errstate(invalid="ignore", over="ignore"):
        return np.matmul(args.q, np.swapaxes(k, -1, -2)) * args.computation.type(args.scale)


def _scores(args: _v.AttentionArgs, var: _v.Variants = _v.NO_VARIANTS,
            qk=None, offset=None) -> np.ndarray:
    """The scores of (*batch, Lq, Lk) in the computation dtype: ``softcap`` applied to
    the scaled ``q @ k^T`` (``qk`` when the caller has it), then ``+ bias``, then
    ``- slope * |i + d - j|``; entries that may not be attended are -inf."""
    comp = args.computation
    s = _scaled_qk(args) if qk is None else qk
    qpos, j = _positions(args, var, offset)
    with np.errstate(invalid="ignore", over="ignore"):
        if var.softcap is not None:
            cap = comp.type(var.softcap)
            s = cap * np.tanh(s / cap)
        if args.bias is not None:
            s = s + args.bias
        if var.alibi_slopes is not None:
            slopes = var.alibi_slopes[..., None, None]
            s = s - slopes * np.abs(qpos - j).astype(comp)
    allowed = _allowed(args, var, qpos, j)
    if allowed is not None:
        s = np.where(allowed, s, comp.type(-np.inf))
    full = args.shapes.batch + (args.shapes.Lq, args.shapes.Lk)
    return np.broadcast_to(s, full).astype(comp)


def _dropout_factors(args: _v.AttentionArgs, var: _v.Variants, first_slice: int = 0):
    """(*batch, Lq, Lk): ``1 / (1 - dropout_p)`` where a weight is kept, 0 where it is
    dropped; None without dropout. Slice ``n`` of the C-order flattened ``*batch`` has
    slice index ``first_slice + n``."""
    if var.dropout_p == 0:
        return None
    s = args.shapes
    slices = first_slice + np.arange(int(np.prod(s.batch, dtype=np.int64))).reshape(s.batch)
    keep = _philox.dropout_keep(var.dropout_seed, var.dropout_p, slices, s.Lq, s.Lk)
    comp = args.computation
    return np.where(keep, comp.type(1 / (1 - var.dropout_p)), comp.type(0))


def _row_sinks(args: _v.AttentionArgs, var: _v.Variants):
    """The sink of each query row as (*batch, Lq, 1), -inf for rows past their
    sequence's ``q_lengths`` (padding rows get no sink); None without sinks."""
    if var.sinks is None:
        return None
    sh = args.shapes
    sink = np.broadcast_to(var.sinks, sh.batch)[..., None, None]
    sink = np.broadcast_to(sink, sh.batch + (sh.Lq, 1))
    if var.q_lengths is not None:
        i = np.arange(sh.Lq)[:, None]
        valid = i < _per_sequence(var.q_lengths, len(sh.batch) + 2)
        sink = np.where(valid, sink, -np.inf)
    return sink.astype(args.computation)


def _softmax_last(s: np.ndarray, sink=None):
    """Max-subtracted softmax over the last axis, with an optional sink logit per row
    (``sink`` broadcastable to (..., 1); -inf: none) that joins the sum and has no
    entry; returns (p, lse, reached).

    A weight ``e = exp(s - m)`` (``m`` the row's maximum, the sink's included) below
    the smallest normal number of the dtype counts as 0: ``reached`` is where it does
    not, the keys whose values can reach the row (the rule for NaN and inf values)."""
    if s.shape[-1] == 0 and sink is None:
        return (np.zeros_like(s), np.full(s.shape[:-1], -np.inf, s.dtype),
                np.zeros(s.shape, bool))
    tiny = np.finfo(s.dtype).tiny
    m = np.max(s, axis=-1, keepdims=True, initial=-np.inf)
    if sink is not None:
        with np.errstate(invalid="ignore"):
            m = np.where(np.isnan(sink), sink, np.maximum(m, sink))
    m = np.where(m == -np.inf, 0, m).astype(s.dtype)    # an all -inf row: exp(-inf) = 0
    with np.errstate(invalid="ignore", over="ignore", divide="ignore", under="ignore"):
        e = np.exp(s - m)
        e = np.where(e < tiny, 0, e).astype(s.dtype)
        total = np.sum(e, axis=-1, keepdims=True)
        if sink is not None:
            es = np.exp(np.asarray(sink, s.dtype) - m)
            total = total + np.where(es < tiny, 0, es)
        p = np.where(total > 0, e / np.where(total > 0, total, 1), e * 0)
        lse = (m + np.log(total))[..., 0]
    if sink is not None:                # a NaN or +inf sink: NaN rows
        bad = np.isnan(sink) | (sink == np.inf)
        p = np.where(bad, np.nan, p)
        lse = np.where(bad[..., 0], np.nan, lse)
    return p.astype(s.dtype), lse.astype(s.dtype), e != 0


def _apply_weights(p: np.ndarray, v: np.ndarray, reached=None) -> np.ndarray:
    """``p @ v``, except that a key that does not reach the row (``reached`` False, or
    ``p`` exactly 0 without it) contributes nothing even when its value row holds NaN
    or inf: a key a query may not attend to, or whose weight underflows, never
    reaches its output (plain ``p @ v`` would give ``0 * nan = nan``)."""
    finite = np.isfinite(v)
    if finite.all():
        return np.matmul(p, v)
    out = np.matmul(p, np.where(finite, v, 0))
    bad = np.where(finite, 0, v)[..., None, :, :]               # (..., 1, Lk, Ev)
    pw = p[..., :, :, None]                                     # (..., Lq, Lk, 1)
    hit = (pw != 0) if reached is None else reached[..., :, :, None]
    with np.errstate(invalid="ignore"):
        extra = np.where(hit, pw * bad, 0).sum(axis=-2)
    return (out + extra).astype(out.dtype)


def scores(q, k, *, mask=None, bias=None, causal=False, scale=None, enable_gqa=False,
           window=None, softcap=None, alibi_slopes=None, sinks=None, q_lengths=None,
           kv_lengths=None):
    """``scale * q @ k^T + bias`` of shape (*batch, Lq, Lk), blocked entries at -inf
    (with ``softcap``, ``alibi_slopes``, ``window`` and lengths as in ``attention``).
    ``sinks`` is checked as in ``attention`` and changes no score: a sink is a logit
    of no key, which joins the softmax (``attention_weights``)."""
    args = _v.attention_args(q, k, mask=mask, bias=bias, causal=causal, scale=scale,
                             enable_gqa=enable_gqa, with_v=False)
    var = _v.variants_of(args, window=window, softcap=softcap, alibi_slopes=alibi_slopes,
                    q_lengths=q_lengths, kv_lengths=kv_lengths, sinks=sinks)
    return _scores(args, var).astype(args.result)


def softmax(x, axis=-1):
    """Max-subtracted softmax of ``x`` along ``axis``; an all -inf slice gives zeros."""
    x = _v.as_real(x, "x")
    res = x.dtype
    comp = _v.computation_dtype(res)
    ax = _v.normalize_axis(axis, x.ndim, "x", x.shape)
    s = np.moveaxis(x.astype(comp), ax, -1)
    p, _, _ = _softmax_last(s)
    return np.moveaxis(p, -1, ax).astype(res)


def weighted_sum(p, v):
    """``p @ v`` over the last two axes: ``p`` ``(*batch_p, Lq, Lk)``, ``v`` ``(*batch_v, Lk, Ev)``."""
    p = _v.as_real(p, "p")
    v = _v.as_real(v, "v")
    res = _v.result_dtype(p, v)
    comp = _v.computation_dtype(res)
    _v.weighted_sum_batch(p, v)
    return np.matmul(p.astype(comp), v.astype(comp)).astype(res)


def attention_weights(q, k, *, mask=None, bias=None, causal=False, scale=None,
                      enable_gqa=False, window=None, softcap=None, alibi_slopes=None,
                      sinks=None, q_lengths=None, kv_lengths=None):
    """``softmax(scores(...))``: the (*batch, Lq, Lk) attention probabilities (before
    any dropout, which this function does not take); with ``sinks`` each row leaves
    out the sink's share."""
    args = _v.attention_args(q, k, mask=mask, bias=bias, causal=causal, scale=scale,
                             enable_gqa=enable_gqa, with_v=False)
    var = _v.variants_of(args, window=window, softcap=softcap, alibi_slopes=alibi_slopes,
                    q_lengths=q_lengths, kv_lengths=kv_lengths, sinks=sinks)
    p, _, _ = _softmax_last(_scores(args, var), _row_sinks(args, var))
    return p.astype(args.result)


def _forward(args: _v.AttentionArgs, var: _v.Variants, first_slice: int = 0,
             offset=None):
    """``(out, lse)`` in the computation dtype, of (*batch, Lq, Ev) and (*batch, Lq)
    (``offset``: the query offset, see :func:`_positions`)."""
    p, lse, reached = _softmax_last(_scores(args, var, offset=offset),
                                    _row_sinks(args, var))
    z = _dropout_factors(args, var, first_slice)
    if z is not None:
        p = p * z
        reached = reached & (z != 0)
    out = _apply_weights(p, _expand_gqa(args.v, args.shapes.groups), reached)
    s = args.shapes
    return np.broadcast_to(out, s.batch + (s.Lq, s.Ev)), lse


def attention(q, k, v, *, mask=None, bias=None, causal=False, scale=None,
              enable_gqa=False, window=None, softcap=None, alibi_slopes=None,
              sinks=None, q_lengths=None, kv_lengths=None, dropout_p=0.0,
              dropout_seed=None, k_scale=None, v_scale=None, return_lse=False):
    """``softmax(scale * q @ k^T + bias) @ v``, materialising every matrix.

    Returns ``out`` of shape (*batch, Lq, Ev), and ``lse`` (*batch, Lq) when
    ``return_lse`` is true. With ``dropout_p`` the weights are dropped and rescaled
    after the softmax; ``lse`` is that of the weights before dropout. With ``sinks``
    one more logit per head joins each row's softmax, with no value. A quantized
    cache (k and v codes with ``k_scale``/``v_scale``) is dequantized first
    (:func:`dequantize_kv`) and computed as float32 k and v.
    """
    args = _v.attention_args(q, k, v, mask=mask, bias=bias, causal=causal, scale=scale,
                             enable_gqa=enable_gqa, k_scale=k_scale, v_scale=v_scale,
                             codes=True)
    args = _dequantized(args)
    var = _v.variants_of(args, window=window, softcap=softcap, alibi_slopes=alibi_slopes,
                         q_lengths=q_lengths, kv_lengths=kv_lengths, dropout_p=dropout_p,
                         dropout_seed=dropout_seed, sinks=sinks)
    out, lse = _forward(args, var)
    out = out.astype(args.result)
    if return_lse:
        return out, lse.astype(_v.lse_dtype(args.computation))
    return out


def _backward(args: _v.AttentionArgs, var: _v.Variants, do, o, lse,
              first_slice: int = 0):
    """``(dq, dk, dv)`` with the shapes of args.q, args.k, args.v, computation dtype,
    and ``dsinks`` shaped like ``var.sinks`` when there are sinks.

    ``do``, ``o`` (*batch, Lq, Ev) and ``lse`` (*batch, Lq) are in the computation dtype.
    """
    sh = args.shapes
    comp = args.computation
    qk = _scaled_qk(args)
    s = _scores(args, var, qk)
    lse = lse[..., None]
    with np.errstate(invalid="ignore", over="ignore"):
        p = np.where(lse == -np.inf, 0, np.exp(s - np.where(lse == -np.inf, 0, lse)))
    p = p.astype(comp)
    z = _dropout_factors(args, var, first_slice)         # the forward's pattern again
    kx = np.broadcast_to(_expand_gqa(args.k, sh.groups), sh.batch + (sh.Lk, sh.E))
    vx = np.broadcast_to(_expand_gqa(args.v, sh.groups), sh.batch + (sh.Lk, sh.Ev))
    qx = np.broadcast_to(args.q, sh.batch + (sh.Lq, sh.E))
    pz = p if z is None else p * z                       # the weights that met v
    dv = np.swapaxes(pz, -1, -2) @ do
    dp = do @ np.swapaxes(vx, -1, -2)
    if z is not None:
        dp = dp * z
    # rowsum(dP * P) = rowsum(dO * O), dropout or not (the sink has no value: dP 0)
    delta = np.sum(do * o, axis=-1, keepdims=True)
    ds = p * (dp - delta)
    if var.softcap is not None:
        # d/dx [c tanh(x / c)] = 1 - tanh(x / c)^2
        ds = ds * (1 - np.tanh(qk / comp.type(var.softcap)) ** 2)
    scale = comp.type(args.scale)
    dq = (ds @ kx) * scale
    dk = (np.swapaxes(ds, -1, -2) @ qx) * scale
    grads = (_sum_to(dq, args.q.shape, 1), _sum_to(dk, args.k.shape, sh.groups),
             _sum_to(dv, args.v.shape, sh.groups))
    if var.sinks is None:
        return grads
    # d lse / d sink = the sink's weight exp(sink - lse); d out / d sink = -weight * out
    sink = _row_sinks(args, var)
    with np.errstate(invalid="ignore", over="ignore"):
        weight = np.where(lse == -np.inf, 0, np.exp(sink - lse))
    dsink = -(weight * delta)[..., 0].sum(axis=-1)
    return grads + (_sum_to_shape(dsink, var.sinks.shape),)


def _check_grad_inputs(names_arrays_shapes, comp):
    """``grad_out``, ``out`` and ``lse`` of the wanted shapes, cast to ``comp``."""
    cast = []
    for name, a, want in names_arrays_shapes:
        a = _v.as_real(a, name)
        if a.shape != tuple(want):
            raise ValueError(f"{name} must have shape {tuple(want)}, got {a.shape}")
        cast.append(a.astype(comp))
    return cast


def attention_backward(grad_out, q, k, v, out, lse, *, mask=None, bias=None,
                       causal=False, scale=None, enable_gqa=False, window=None,
                       softcap=None, alibi_slopes=None, sinks=None, q_lengths=None,
                       kv_lengths=None, dropout_p=0.0, dropout_seed=None):
    """Gradients ``(dq, dk, dv)`` of ``attention`` with respect to q, k and v.

    P is rebuilt from ``lse`` (``P = exp(S - lse)``) and the dropout factors ``Z``
    (``1/(1-p)`` kept, 0 dropped; all 1 without dropout) from the seed, then
    ``dV = (P*Z)^T dO``, ``dP = (dO V^T) * Z``, ``dS = P * (dP - rowsum(dO * O))``
    (times ``1 - tanh(x/c)^2`` of the scaled ``x = scale q.k`` with ``softcap=c``),
    ``dQ = scale * dS K`` and ``dK = scale * dS^T Q``; gradients of broadcast inputs
    (and of a key/value head shared by a GQA group) are summed over every use. With
    ``sinks`` a fourth gradient, ``dsinks = -sum_i exp(sink - lse_i) rowsum(dO * O)_i``.
    """
    args = _v.attention_args(q, k, v, mask=mask, bias=bias, causal=causal, scale=scale,
                             enable_gqa=enable_gqa)
    var = _v.variants_of(args, window=window, softcap=softcap, alibi_slopes=alibi_slopes,
                    q_lengths=q_lengths, kv_lengths=kv_lengths, dropout_p=dropout_p,
                    dropout_seed=dropout_seed, sinks=sinks)
    sh = args.shapes
    out_shape = sh.batch + (sh.Lq, sh.Ev)
    do, o, lse = _check_grad_inputs(
        (("grad_out", grad_out, out_shape), ("out", out, out_shape),
         ("lse", lse, sh.batch + (sh.Lq,))), args.computation)
    return tuple(g.astype(args.result) for g in _backward(args, var, do, o, lse))


# ------------------------------------------------------------------------------ varlen

def _varlen_variants(a: _v.VarlenArgs, **kw) -> _v.Variants:
    B = len(a.cu_seqlens_q) - 1
    return _v.variant_args((B, a.Hq), a.q.shape[0], a.k.shape[0], a.q.shape,
                           a.computation, **kw)


def _sequences(a: _v.VarlenArgs, var: _v.Variants):
    """Per sequence ``b``: its query rows, key rows, first slice index ``b * Hq``, and
    its attention problem as (Hq, Lq_b, E), (Hkv, Lk_b, E), (Hkv, Lk_b, Ev) arrays with
    that sequence's ALiBi slopes (Hq,)."""
    B = len(a.cu_seqlens_q) - 1
    per_head = {name: np.broadcast_to(getattr(var, name), (B, a.Hq))
                for name in ("alibi_slopes", "sinks") if getattr(var, name) is not None}
    for b in range(B):
        rq = slice(a.cu_seqlens_q[b], a.cu_seqlens_q[b + 1])
        rk = slice(a.cu_seqlens_k[b], a.cu_seqlens_k[b + 1])
        q, k, v = (np.swapaxes(x, 0, 1) for x in (a.q[rq], a.k[rk], a.v[rk]))
        shapes = _v.AttentionShapes((a.Hq,), q.shape[1], k.shape[1], q.shape[2],
                                    v.shape[2], a.groups)
        args = _v.AttentionArgs(q, k, v, None, None, a.causal, a.scale, shapes,
                                a.result, a.computation)
        var_b = var._replace(**{name: x[b] for name, x in per_head.items()})
        yield rq, rk, b * a.Hq, args, var_b


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, *, causal=False, scale=None,
                     window=None, softcap=None, alibi_slopes=None, sinks=None,
                     dropout_p=0.0, dropout_seed=None, return_lse=False):
    """Attention over a packed batch of variable-length sequences (FlashAttention's
    varlen layout): q (total_q, Hq, E), k (total_k, Hkv, E), v (total_k, Hkv, Ev);
    sequence ``b`` owns rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` of q and
    ``cu_seqlens_k[b]:cu_seqlens_k[b+1]`` of k and v. GQA is implied by ``Hq % Hkv``.

    Returns ``out`` (total_q, Hq, Ev), and ``lse`` (Hq, total_q) when ``return_lse``.
    Each sequence is ``attention`` of its own rows (``causal``, ``window`` and ALiBi
    positions from its own lengths); ``alibi_slopes`` and ``sinks`` broadcast to
    (B, Hq); the dropout slice index of head ``h`` of sequence ``b`` is ``b * Hq + h``.
    """
    a = _v.varlen_args(q, k, v, cu_seqlens_q, cu_seqlens_k, causal=causal, scale=scale)
    var = _varlen_variants(a, window=window, softcap=softcap, alibi_slopes=alibi_slopes,
                           dropout_p=dropout_p, dropout_seed=dropout_seed, sinks=sinks)
    total_q = a.q.shape[0]
    out = np.zeros((total_q, a.Hq, a.v.shape[2]), a.computation)
    lse = np.full((a.Hq, total_q), -np.inf, a.computation)
    for rq, _, first_slice, args, var_b in _sequences(a, var):
        o, lse[:, rq] = _forward(args, var_b, first_slice)
        out[rq] = np.swapaxes(o, 0, 1)
    out = out.astype(a.result)
    if return_lse:
        return out, lse.astype(_v.lse_dtype(a.computation))
    return out


def attention_varlen_backward(grad_out, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                              *, causal=False, scale=None, window=None, softcap=None,
                              alibi_slopes=None, sinks=None, dropout_p=0.0,
                              dropout_seed=None):
    """Gradients ``(dq, dk, dv)`` of ``attention_varlen``: ``grad_out`` and ``out``
    (total_q, Hq, Ev), ``lse`` (Hq, total_q); each sequence as ``attention_backward``.
    With ``sinks``, a fourth gradient ``dsinks`` shaped like ``sinks``."""
    a = _v.varlen_args(q, k, v, cu_seqlens_q, cu_seqlens_k, causal=causal, scale=scale)
    var = _varlen_variants(a, window=window, softcap=softcap, alibi_slopes=alibi_slopes,
                           dropout_p=dropout_p, dropout_seed=dropout_seed, sinks=sinks)
    out_shape = (a.q.shape[0], a.Hq, a.v.shape[2])
    do, o, lse = _check_grad_inputs(
        (("grad_out", grad_out, out_shape), ("out", out, out_shape),
         ("lse", lse, (a.Hq, a.q.shape[0]))), a.computation)
    dq, dk, dv = (np.zeros(x.shape, a.computation) for x in (a.q, a.k, a.v))
    B = len(a.cu_seqlens_q) - 1
    dsinks = np.zeros((B, a.Hq), a.computation)
    for b, (rq, rk, first_slice, args, var_b) in enumerate(_sequences(a, var)):
        grads = _backward(args, var_b, np.swapaxes(do[rq], 0, 1),
                          np.swapaxes(o[rq], 0, 1), lse[:, rq], first_slice)
        dq[rq], dk[rk], dv[rk] = (np.swapaxes(g, 0, 1) for g in grads[:3])
        if var.sinks is not None:
            dsinks[b] = grads[3]
    grads = (dq.astype(a.result), dk.astype(a.result), dv.astype(a.result))
    if var.sinks is None:
        return grads
    return grads + (_sum_to_shape(dsinks, var.sinks.shape).astype(a.result),)


def _sum_to_shape(g: np.ndarray, shape) -> np.ndarray:
    """Sum ``g`` over the axes an array of ``shape`` was broadcast along to reach it."""
    extra = g.ndim - len(shape)
    if extra:
        g = g.sum(axis=tuple(range(extra)))
    axes = tuple(i for i, n in enumerate(shape) if n == 1 and g.shape[i] != 1)
    if axes:
        g = g.sum(axis=axes, keepdims=True)
    return g.reshape(shape)


def _sum_to(g: np.ndarray, shape, groups: int) -> np.ndarray:
    """Sum a gradient over broadcast axes (and GQA groups) back to ``shape``."""
    if groups > 1:
        *lead, hq, L, E = g.shape
        g = g.reshape(*lead, hq // groups, groups, L, E).sum(axis=-3)
    return _sum_to_shape(g, shape)


# -------------------------------------------------------------------- serving caches

def dequantize_kv(codes, scale=None) -> np.ndarray:
    """The values of a quantized cache: ``float(code) * scale`` in float32.

    ``codes``: int8 or ``ml_dtypes`` float8 array; ``scale``: broadcastable to
    ``codes.shape[:-1]`` (one per row of the last axis), or None (1).
    """
    codes = np.asarray(codes)
    values = codes.astype(np.float32)
    if scale is None:
        return values
    return values * np.asarray(scale, np.float32)[..., None]


def _dequantized(args: _v.AttentionArgs) -> _v.AttentionArgs:
    """A quantized cache's arguments with float32 k and v (and q in float32), else
    ``args``."""
    if not (_v.is_code(args.k.dtype) and args.v is not None
            and _v.is_code(args.v.dtype)):
        return args
    return args._replace(q=args.q.astype(np.float32),
                         k=dequantize_kv(args.k, args.k_scale),
                         v=dequantize_kv(args.v, args.v_scale), k_scale=None,
                         v_scale=None)


_CODE_LIMITS = {"int8": 127.0, "float8_e4m3fn": 448.0, "float8_e5m2": 57344.0}


def quantize_kv(x, dtype="int8", *, axis_scale="token"):
    """Symmetric quantization of keys or values to 8-bit codes: ``(codes, scale)``.

    ``x`` is a real array whose last axis is the head dimension, ``(..., L, H, D)``;
    ``axis_scale="token"`` gives one scale per row of the last axis (shape
    ``x.shape[:-1]``), ``"head"`` one per head over every token (x of at least 3
    dimensions; shape ``x.shape[:-3] + (1, H)``). A scale is the row's largest
    magnitude over the code's largest value (127, 448 or 57344), 1 for an all-zero
    row, and the smallest float32 above 0 (2**-149) where that ratio rounds to 0 in
    float32; a code is ``x / scale`` rounded to the nearest (even) code. This is the
    plain twin of :func:`fastattn.quantize_kv`, row by row.
    """
    x = np.asarray(x, np.float64)
    name = str(dtype)
    limit = _CODE_LIMITS[name]
    if axis_scale == "token":
        rows = x.reshape(-1, x.shape[-1])
        scale = np.ones(rows.shape[0], np.float32)
        for r in range(rows.shape[0]):
            amax = np.max(np.abs(rows[r]), initial=0.0)
            if amax > 0:
                scale[r] = max(np.float32(amax / limit), _SMALLEST_SCALE)
        per_row = scale[:, None].astype(np.float64)
        codes = _round_to_codes(rows / per_row, name, limit).reshape(x.shape)
        return codes, scale.reshape(x.shape[:-1])
    H = x.shape[-2]
    scale = np.ones(x.shape[:-3] + (1, H), np.float32)
    for index in np.ndindex(*scale.shape):
        part = x[index[:-2] + (slice(None), index[-1])]
        amax = np.max(np.abs(part), initial=0.0)
        if amax > 0:
            scale[index] = max(np.float32(amax / limit), _SMALLEST_SCALE)
    codes = _round_to_codes(x / scale[..., None].astype(np.float64), name, limit)
    return codes, scale


_SMALLEST_SCALE = np.float32(2.0 ** -149)


def _round_to_codes(y: np.ndarray, name: str, limit: float) -> np.ndarray:
    """y (already divided by its scale) as codes of ``name``, nearest (even)."""
    y = np.clip(y, -limit, limit)
    if name == "int8":
        return np.rint(y).astype(np.int8)
    import ml_dtypes
    return y.astype(getattr(ml_dtypes, name))


def store_kv(k_cache, v_cache, slots, k, v, *, k_scale=None, v_scale=None):
    """Write the rows ``k`` (n, Hkv, E) and ``v`` (n, Hkv, Ev) at ``slots`` of the
    caches (slot ``block * block_size + row``; a negative slot skips its token),
    quantizing them per token and head into a quantized cache (writing their scales
    into ``k_scale``/``v_scale``), in place, one token at a time. The plain twin of
    :func:`fastattn.store_kv` (which checks the arguments)."""
    block_size = k_cache.shape[1]
    for i, slot in enumerate(np.asarray(slots)):
        if slot < 0:
            continue
        b, r = divmod(int(slot), block_size)
        for cache, scales, rows in ((k_cache, k_scale, k), (v_cache, v_scale, v)):
            if scales is None:
                cache[b, r] = np.asarray(rows[i]).astype(cache.dtype)
            else:
                codes, sc = quantize_kv(rows[i][None], cache.dtype.name)
                cache[b, r] = codes[0]
                scales[b, r] = sc[0]


def attention_paged(q, k_cache, v_cache, block_table, kv_lengths, *, cu_seqlens_q=None,
                    k_scale=None, v_scale=None, scale=None, causal=True, window=None,
                    softcap=None, alibi_slopes=None, sinks=None, return_lse=False):
    """Attention over a paged key-value cache, the plain way: for each sequence,
    gather its blocks into contiguous keys and values, dequantize them, and call
    :func:`attention` on its queries (the last ``Lq_b`` positions of its
    ``kv_lengths[b]`` keys: bottom-right, with ``causal`` the causal rule).

    Shapes as :func:`fastattn.attention_paged`: q (B, Lq, Hq, E), or (total_q, Hq, E)
    with ``cu_seqlens_q``; caches (num_blocks, block_size, Hkv, E/Ev); returns
    (..., Hq, Ev) in q's dtype and, with ``return_lse``, lse (B, Hq, Lq) or
    (Hq, total_q).
    """
    q = np.asarray(q)
    table = np.asarray(block_table)
    lengths = np.asarray(kv_lengths)
    B = table.shape[0]
    bs, Hkv = k_cache.shape[1], k_cache.shape[2]
    packed = cu_seqlens_q is not None
    Hq = q.shape[-2]
    starts = (np.asarray(cu_seqlens_q) if packed
              else np.arange(B + 1) * q.shape[1])
    rows = q.reshape(-1, Hq, q.shape[-1])
    out_rows = np.zeros((rows.shape[0], Hq, v_cache.shape[-1]), np.float64)
    lse_rows = np.full((Hq, rows.shape[0]), -np.inf)
    per_head = {}
    for name, x in (("alibi_slopes", alibi_slopes), ("sinks", sinks)):
        if x is not None:
            per_head[name] = np.broadcast_to(np.asarray(x, np.float64), (B, Hq))
    for b in range(B):
        n = int(lengths[b])
        blocks = table[b, :(n + bs - 1) // bs]
        keys = np.asarray(k_cache)[blocks].reshape(-1, Hkv, k_cache.shape[-1])[:n]
        values = np.asarray(v_cache)[blocks].reshape(-1, Hkv, v_cache.shape[-1])[:n]
        if k_scale is not None or _v.is_code(keys.dtype):
            ks = None if k_scale is None else np.broadcast_to(
                k_scale, k_cache.shape[:3])[blocks].reshape(-1, Hkv)[:n]
            vs = None if v_scale is None else np.broadcast_to(
                v_scale, v_cache.shape[:3])[blocks].reshape(-1, Hkv)[:n]
            keys, values = dequantize_kv(keys, ks), dequantize_kv(values, vs)
        qb = rows[starts[b]:starts[b + 1]]
        if not qb.shape[0]:
            continue
        kw = {name: x[b] for name, x in per_head.items()}
        args = _v.attention_args(np.swapaxes(qb, 0, 1), np.swapaxes(keys, 0, 1),
                                 np.swapaxes(values, 0, 1), scale=scale,
                                 causal="bottom_right" if causal else False,
                                 enable_gqa=True)
        args = args._replace(q=args.q.astype(np.float64), k=args.k.astype(np.float64),
                             v=args.v.astype(np.float64),
                             computation=np.dtype(np.float64))
        var = _v.variants_of(args, window=window, softcap=softcap, **kw)
        o, lse = _forward(args, var, offset=None if causal else n - qb.shape[0])
        out_rows[starts[b]:starts[b + 1]] = np.swapaxes(o, 0, 1)
        lse_rows[:, starts[b]:starts[b + 1]] = lse
    out = out_rows.astype(q.dtype)
    wide = any(np.dtype(x.dtype) == np.float64 for x in (q, k_cache, v_cache))
    lse = lse_rows.astype(np.float64 if wide else np.float32)
    if not packed:
        out = out.reshape(q.shape[:-1] + (v_cache.shape[-1],))
        lse = np.moveaxis(lse.reshape(Hq, B, q.shape[1]), 0, 1)
    return (out, lse) if return_lse else out
