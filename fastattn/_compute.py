"""The computations on checked arguments: plan, drivers, result.

``_api`` (the public functions), ``_grad`` (the backward) and ``fastattn.dask`` check
their arguments with ``_validation`` and call these functions, which describe the call
as a Plan (``_plan.make_plan``: pointers and strides, no copies) and run the drivers of
the instruction set in use (``_dispatch``).
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np

from . import _validation as _v
from . import _dispatch
from ._config import resolve_num_threads
from ._dispatch import drivers
from ._plan import (make_plan, packed_plan, paged_plan, plain_packed_plan,
                    plain_paged_plan, plain_plan)
from ._scratch import owns_scratch, scratch

__all__ = ["attend", "attend_plain", "attend_paged", "attend_paged_plain", "score",
           "weigh", "normalise", "gradients", "gradients_plain", "result_buffer",
           "finish", "narrow", "sink_gradient"]


_F32 = np.dtype(np.float32)


def narrow(res: np.ndarray, result: np.dtype, threads: int, out=None) -> np.ndarray:
    """``res`` as ``result``: a float32 result rounded to bfloat16 or float16 by the
    drivers (in parallel, the bits of ``astype``), into ``out`` (C-contiguous, res's
    shape) or a new array; any other case by NumPy."""
    if (result.itemsize == 2 and result.isnative and res.dtype == _F32
            and res.flags.c_contiguous):            # (a 16-bit result: float or bfloat16)
        if out is None:
            out = np.empty(res.shape, result)
        if type(out) is np.ndarray and out.flags.c_contiguous:
            drivers.narrow(res, out, threads)
            return out
    if out is None:
        return res.astype(result, copy=False)
    out[...] = res
    return out


def finish(buf: np.ndarray, shape, result: np.dtype, out=None,
           threads: Optional[int] = None) -> np.ndarray:
    """Give the computed buffer the result's shape and dtype (into ``out`` if given);
    a 16-bit result is rounded with ``threads`` (default: the configured number)."""
    res = buf.reshape(shape)
    if res.dtype == result:
        if out is None:
            return res
        if not np.shares_memory(res, out):
            out[...] = res
        return out
    threads = resolve_num_threads() if threads is None else threads
    return narrow(res, result, threads, out)


def result_buffer(out, size: int, result: np.dtype, comp: np.dtype,
                  inputs=(), rounds: bool = False) -> np.ndarray:
    """Where the drivers write: ``out`` itself when it has the dtype they write and
    shares no memory with the ``inputs`` they read (else a new buffer, copied into
    ``out`` by :func:`finish`, as NumPy does for overlapping ``out=``). They write the
    computation dtype, or with ``rounds`` (the fused pass: ``_tiles.narrow_out``) a
    16-bit result over a float32 computation too, each row rounded once as it is
    written. A result in another dtype than they write is computed into the calling
    thread's kept scratch, which :func:`finish` then rounds into a new array."""
    written = comp
    if rounds and comp == _F32 and result.itemsize == 2 and result.isnative:
        written = result
    if (out is not None and result == written and out.flags.aligned
            and not any(np.may_share_memory(out, a) for a in inputs)):
        return np.asarray(out).reshape(-1)      # a plain ndarray even for subclasses
    if result != written:
        return scratch(size, comp, "result")[:size]
    return np.empty(size, dtype=written)


def _inputs(args: _v.AttentionArgs, var: _v.Variants = _v.NO_VARIANTS):
    """Every array the drivers read: ``out`` must not overlap any of them."""
    return tuple(a for a in (args.q, args.k, args.v, args.mask, args.bias,
                             args.k_scale, args.v_scale, var.alibi_slopes, var.sinks,
                             var.q_lengths, var.kv_lengths)
                 if a is not None)


def _plan(args: _v.AttentionArgs, out, lse=None, query_offset=None,
          var: _v.Variants = _v.NO_VARIANTS, slice_base: int = 0,
          round_weights: bool = False):
    s = args.shapes
    return make_plan(s.batch, s.Lq, s.Lk, s.E, s.Ev, args.scale, args.computation,
                     q=args.q, k=args.k, v=args.v, out=out, lse=lse, mask=args.mask,
                     bias=args.bias, k_scale=args.k_scale, v_scale=args.v_scale,
                     groups=s.groups, causal=args.causal,
                     query_offset=query_offset, window=var.window, softcap=var.softcap,
                     alibi_slopes=var.alibi_slopes, sinks=var.sinks,
                     q_lengths=var.q_lengths,
                     kv_lengths=var.kv_lengths, dropout_p=var.dropout_p,
                     dropout_seed=var.dropout_seed, dropout_slice_base=slice_base,
                     bf16_dot=_dispatch.bf16_dot, amx=_dispatch.amx,
                     round_weights=round_weights)


@owns_scratch
def attend(args: _v.AttentionArgs, return_lse: bool, out, threads: int,
           query_offset: Optional[int] = None, var: _v.Variants = _v.NO_VARIANTS,
           slice_base: int = 0, round_weights: bool = True):
    """The fused pass: ``out`` (and ``lse``) of checked arguments and variants.

    ``query_offset`` overrides the causal rule's offset (query i may attend to keys
    j <= i + query_offset when ``args.causal`` is set): ``fastattn.dask`` passes a key
    block's own. ``slice_base``: the dropout slice index of the call's slice 0 (a
    block of a larger batch). ``round_weights``: the bfloat16 units may round the
    weights once to bfloat16 for the product with V (``precision=None``; False for
    ``"highest"``).
    """
    s = args.shapes
    out_shape = s.batch + (s.Lq, s.Ev)
    if out is not None:
        _v.check_out(out, out_shape, args.result)
    n = math.prod(s.batch)
    # The results first: a request too large to allocate fails here, before any
    # other work; an empty one skips the kernels (however many empty rows it has).
    buf = result_buffer(out, n * s.Lq * s.Ev, args.result, args.computation,
                        _inputs(args, var), rounds=True)
    lse = np.empty(n * s.Lq if return_lse else 0, dtype=args.computation)
    if buf.size or lse.size:
        plan = _plan(args, buf.reshape(out_shape),
                     lse.reshape(s.batch + (s.Lq,)) if return_lse else None,
                     query_offset, var, slice_base, round_weights)
        drivers.attention(plan, threads)
    result = finish(buf, out_shape, args.result, out, threads)
    if return_lse:
        return result, lse.reshape(s.batch + (s.Lq,)).astype(
            _v.lse_dtype(args.computation), copy=False)
    return result


def bfloat16_operands(args: _v.AttentionArgs) -> _v.AttentionArgs:
    """``precision="bf16"``: float32 q, k and v rounded to bfloat16 copies (round to
    nearest even) where the AMX kernels compute bfloat16 (``_dispatch.amx``); the
    result stays float32. Elsewhere, or without ml_dtypes, the arguments unchanged
    (``"highest"``)."""
    f32 = np.dtype(np.float32)
    if not _dispatch.amx or args.v is None or any(
            x.dtype != f32 for x in (args.q, args.k, args.v)):
        return args
    try:
        import ml_dtypes
    except ImportError:
        return args
    bf = ml_dtypes.bfloat16
    return args._replace(q=args.q.astype(bf), k=args.k.astype(bf), v=args.v.astype(bf))


@owns_scratch
def attend_plain(q, k, v, causal, scale, enable_gqa, num_threads, sinks=None,
                 window=None, softcap=None, kv_lengths=None, k_scale=None,
                 v_scale=None):
    """The output of the commonest call (see ``_plan.plain_plan``: 4-D arrays of one
    float dtype or a quantized cache with its scales per token and head, no mask, bias
    or variant but per-head sinks, a window, a softcap and the keys' lengths), or None
    for any other call, which then takes the general path and its checks."""
    made = plain_plan(q, k, v, causal, scale, enable_gqa, _dispatch.bf16_dot,
                      _dispatch.amx, sinks=sinks, round_weights=True, window=window,
                      softcap=softcap, kv_lengths=kv_lengths, k_scale=k_scale,
                      v_scale=v_scale)
    return _computed(made, num_threads)


def _computed(made, num_threads) -> Optional[np.ndarray]:
    """A short path's output, computed by its plan (``made``: (plan, out), or None
    where the call is not the short path's: then None)."""
    if made is None:
        return None
    plan, out = made
    drivers.attention(plan, resolve_num_threads(num_threads))
    return out


@owns_scratch
def score(args: _v.AttentionArgs, softmax: bool, threads: int,
          var: _v.Variants = _v.NO_VARIANTS) -> np.ndarray:
    """The scores (or, with ``softmax``, the weights) of checked arguments."""
    s = args.shapes
    shape = s.batch + (s.Lq, s.Lk)
    buf = np.empty(math.prod(shape), dtype=args.computation)
    if buf.size:
        drivers.scores(_plan(args, buf.reshape(shape), var=var), softmax, threads)
    return finish(buf, shape, args.result, None, threads)


@owns_scratch
def weigh(p: np.ndarray, v: np.ndarray, batch, out, result: np.dtype,
          threads: int) -> np.ndarray:
    """``p @ v`` batched: p (*b1, Lq, Lk) and v (*b2, Lk, Ev) in the computation
    dtype, broadcast to ``batch``."""
    Lq, Lk = p.shape[-2:]
    Ev = v.shape[-1]
    shape = tuple(batch) + (Lq, Ev)
    buf = result_buffer(out, math.prod(shape), result, p.dtype, (p, v))
    if buf.size:
        plan = make_plan(batch, Lq, Lk, Lk, Ev, 1.0, p.dtype, q=p, v=v,
                         out=buf.reshape(shape))
        drivers.weighted_sum(plan, threads)
    return finish(buf, shape, result, out, threads)


@owns_scratch
def normalise(x: np.ndarray, axis: int, out, result: np.dtype, threads: int):
    """The softmax of ``x`` (real, in the computation dtype) along ``axis``, in
    ``result`` (into ``out`` when given, checked by the caller)."""
    moved = np.ascontiguousarray(np.moveaxis(x, axis, -1))
    last = axis == x.ndim - 1
    # the driver may write over its input in place, but not over a shifted copy of it
    in_place = (out is not None and out.__array_interface__["data"][0]
                == moved.__array_interface__["data"][0])
    buf = result_buffer(out if last else None, moved.size, result, moved.dtype,
                        () if in_place else (moved,))
    n = moved.shape[-1]
    rows = moved.size // n if n else 0
    drivers.softmax(moved.reshape(-1), buf, rows, n, threads)
    res = np.moveaxis(buf.reshape(moved.shape), -1, axis)
    return finish(res, x.shape, result, out)


def _readers(own_batch, batch, groups: int = 1):
    """The output slices (C order over ``batch``) grouped by the slice of an array of
    batch shape ``own_batch`` that they read (GQA: head h reads h // groups), in
    increasing order: ``users[starts[u]:starts[u + 1]]`` read slice u."""
    own_batch, batch = tuple(own_batch), tuple(batch)
    n = math.prod(batch)
    if own_batch == (batch[:-1] + (batch[-1] // groups,) if batch else ()):
        # nothing broadcast (the commonest call): slice n reads slice n // groups
        every = np.arange(n + 1, dtype=np.intp)
        return every[:n], every[::groups]
    index = np.arange(math.prod(own_batch), dtype=np.intp).reshape(own_batch)
    if groups > 1:
        index = np.repeat(index, groups, axis=-1)
    index = np.ascontiguousarray(np.broadcast_to(index, batch)).reshape(-1)
    users = np.argsort(index, kind="stable").astype(np.intp)
    starts = np.searchsorted(index[users], np.arange(math.prod(own_batch) + 1))
    return users, starts.astype(np.intp)


def gradients(args: _v.AttentionArgs, grad_out: np.ndarray, out: np.ndarray,
              lse: np.ndarray, threads: int, var: _v.Variants = _v.NO_VARIANTS,
              slice_base: int = 0, result: Optional[np.dtype] = None):
    """(dq, dk, dv) shaped as q, k and v, in ``result`` (default: the computation
    dtype); grad_out and out (*batch, Lq, Ev) in the computation dtype or 16-bit, lse
    (*batch, Lq) in the computation dtype. 16-bit q, k, v, grad_out and out are read
    in place; gradients returned in 16 bits are summed in float32 by the drivers and
    rounded once."""
    s = args.shapes
    plan = _plan(args, None, np.ascontiguousarray(lse), var=var, slice_base=slice_base)
    return _run_backward(plan, grad_out, out, (args.q, args.k, args.v),
                         _readers(args.k.shape[:-2], s.batch, s.groups),
                         _readers(args.q.shape[:-2], s.batch), args.computation,
                         result, threads)


def gradients_plain(grad_out, q, k, v, out, lse, causal, scale, enable_gqa,
                    num_threads):
    """(dq, dk, dv) of the backward's commonest call, or None for any other call (which
    then takes the general path and its checks): q, k and v as ``_plan.plain_plan``
    takes them; grad_out and out (B, Hq, Lq, Ev) and lse (B, Hq, Lq) C-contiguous
    ndarrays, lse in the computation dtype, grad_out and out in it or in q's."""
    made = plain_plan(q, k, v, causal, scale, enable_gqa, _dispatch.bf16_dot,
                      _dispatch.amx, lse)
    if made is None:
        return None
    plan = made[0]
    comp = plan.dtype
    shape = q.shape[:3] + v.shape[3:]
    for a in (grad_out, out):
        if not (type(a) is np.ndarray and a.shape == shape and a.flags.c_contiguous
                and (a.dtype == comp or a.dtype == q.dtype)):
            return None
    return _run_backward(plan, grad_out, out, (q, k, v),
                         _readers(k.shape[:2], shape[:2], plan.groups),
                         _readers(q.shape[:2], shape[:2]), comp, q.dtype,
                         resolve_num_threads(num_threads))


def sink_gradient(sinks: np.ndarray, grad_out, out, lse: np.ndarray,
                  result: np.dtype) -> np.ndarray:
    """The gradient of the sinks, shaped like ``sinks``: per slice,
    ``-sum_i exp(sink - lse_i) * rowsum(dO_i * O_i)`` over its query rows (the sink's
    weight in row i times the row's ``delta``; rows with ``lse = -inf``, padding,
    add nothing), summed in float64 over the axes ``sinks`` was broadcast along.
    ``grad_out`` and ``out`` (*batch, Lq, Ev), ``lse`` (*batch, Lq)."""
    f64 = np.float64
    delta = np.einsum("...e,...e->...", np.asarray(grad_out, f64), np.asarray(out, f64))
    lse = np.asarray(lse, f64)
    batch = lse.shape[:-1]
    s = np.broadcast_to(np.asarray(sinks, f64), batch)[..., None]
    with np.errstate(over="ignore", invalid="ignore"):
        weight = np.where(lse == -np.inf, 0.0, np.exp(s - lse))
    d = -(weight * delta).sum(axis=-1)
    extra = d.ndim - sinks.ndim
    if extra:
        d = d.sum(axis=tuple(range(extra)))
    axes = tuple(i for i, n in enumerate(sinks.shape) if n == 1 and d.shape[i] != 1)
    if axes:
        d = d.sum(axis=axes, keepdims=True)
    return d.reshape(sinks.shape).astype(result)


@owns_scratch
def _run_backward(plan, grad_out, out, qkv, kv_readers, q_readers, comp, result,
                  threads):
    """The backward's drivers on a plan: dq, dk and dv shaped as ``qkv`` in ``result``
    (None: the computation dtype ``comp``); 16-bit ones (beside float32) are written
    by the drivers, summed in float32 and rounded once."""
    result = comp if result is None else np.dtype(result)
    dq, dk, dv = (np.empty(x.shape, dtype=result) for x in qkv)
    drivers.backward(plan, np.ascontiguousarray(grad_out), np.ascontiguousarray(out),
                     dq, dk, dv, *kv_readers, *q_readers, threads)
    return dq, dk, dv


# ------------------------------------------------------------- packed (varlen) batches

def _sequences(a: _v.VarlenArgs, var: _v.Variants):
    """Per sequence b of a packed batch: (query rows, key rows, dropout slice base,
    checked arguments over (Hq, L_b, E) views, variants). The views are the packed
    arrays seen through swapaxes: read in place."""
    B = len(a.cu_seqlens_q) - 1
    per_head = {name: np.broadcast_to(getattr(var, name), (B, a.Hq))
                for name in ("alibi_slopes", "sinks") if getattr(var, name) is not None}
    for b in range(B):
        rq = slice(int(a.cu_seqlens_q[b]), int(a.cu_seqlens_q[b + 1]))
        rk = slice(int(a.cu_seqlens_k[b]), int(a.cu_seqlens_k[b + 1]))
        q, k, v = (x[r].swapaxes(0, 1) for x, r in ((a.q, rq), (a.k, rk), (a.v, rk)))
        args = _v.attention_args(q, k, v, causal=a.causal or False, scale=a.scale,
                                 enable_gqa=a.groups > 1)
        var_b = var._replace(**{name: x[b] for name, x in per_head.items()})
        yield rq, rk, b * a.Hq, args, var_b


@owns_scratch
def attend_varlen(a: _v.VarlenArgs, var: _v.Variants, return_lse: bool, out,
                  threads: int):
    """attention_varlen on checked arguments: one plan of every (sequence, head) slice
    of the packed batch, written straight into the packed out (total_q, Hq, Ev) and
    lse (Hq, total_q)."""
    shape = (a.q.shape[0], a.Hq, a.v.shape[2])
    if out is not None:
        _v.check_out(out, shape, a.result)
    inputs = (a.q, a.k, a.v) + tuple(x for x in (a.k_scale, a.v_scale, var.alibi_slopes,
                                                 var.sinks) if x is not None)
    buf = result_buffer(out, math.prod(shape), a.result, a.computation,
                        inputs, rounds=True).reshape(shape)
    lse = np.empty((a.Hq, a.q.shape[0]), a.computation) if return_lse else None
    if buf.size or return_lse:
        plan = packed_plan(a.q, a.k, a.v, buf, lse, a.cu_seqlens_q, a.cu_seqlens_k,
                           a.scale, a.computation, k_scale=a.k_scale,
                           v_scale=a.v_scale, groups=a.groups, causal=a.causal,
                           window=var.window, softcap=var.softcap,
                           alibi_slopes=var.alibi_slopes, sinks=var.sinks,
                           dropout_p=var.dropout_p, dropout_seed=var.dropout_seed,
                           bf16_dot=_dispatch.bf16_dot, amx=_dispatch.amx,
                           round_weights=True)
        drivers.attention(plan, threads)
    return _with_lse(finish(buf, shape, a.result, out, threads), lse, a.computation)


@owns_scratch
def attend_varlen_plain(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale, sinks,
                        num_threads, window=None, softcap=None):
    """The output of the commonest ``attention_varlen`` call (packed sequences of one
    float dtype: see ``_plan.plain_packed_plan``), or None for any other call, which
    then takes the general path and its checks."""
    made = plain_packed_plan(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale, sinks,
                             _dispatch.bf16_dot, _dispatch.amx, window=window,
                             softcap=softcap)
    return _computed(made, num_threads)


def _with_lse(result: np.ndarray, lse: Optional[np.ndarray], computation: np.dtype):
    """A packed or paged call's result, with its lse (in the dtype the API gives it)
    when one was asked for."""
    if lse is None:
        return result
    return result, lse.astype(_v.lse_dtype(computation), copy=False)


@owns_scratch
def attend_paged_plain(q, k_cache, v_cache, block_table, kv_lengths, k_scale, v_scale,
                       causal, scale, sinks, num_threads, window=None,
                       softcap=None, cu_seqlens_q=None):
    """The output of the commonest ``attention_paged`` call (a decoding step, or packed
    queries: see ``_plan.plain_paged_plan``), or None for any other call, which then
    takes the general path and its checks."""
    made = plain_paged_plan(q, k_cache, v_cache, block_table, kv_lengths, k_scale,
                            v_scale, causal, scale, sinks, _dispatch.bf16_dot,
                            _dispatch.amx, window=window, softcap=softcap,
                            cu_seqlens_q=cu_seqlens_q)
    return _computed(made, num_threads)


@owns_scratch
def attend_paged(a: _v.PagedArgs, var: _v.Variants, return_lse: bool, out,
                 threads: int):
    """attention_paged on checked arguments: one plan of every (sequence, head) slice,
    its keys and values read in place from the blocks of the caches."""
    packed = a.cu_seqlens_q is not None
    shape = a.q.shape[:-1] + (a.v_cache.shape[-1],)
    if out is not None:
        _v.check_out(out, shape, a.result)
    inputs = tuple(x for x in (a.q, a.k_cache, a.v_cache, a.k_scale, a.v_scale,
                               var.alibi_slopes, var.sinks) if x is not None)
    buf = result_buffer(out, math.prod(shape), a.result, a.computation,
                        inputs, rounds=True).reshape(shape)
    B = a.block_table.shape[0]
    lse = None
    if return_lse:
        lse = np.empty((a.Hq, a.q.shape[0]) if packed else (B, a.Hq, a.Lq),
                       a.computation)
    if buf.size or return_lse:
        plan = paged_plan(a.q, a.k_cache, a.v_cache, a.block_table, a.kv_lengths, buf,
                          lse, a.cu_seqlens_q, a.scale, a.computation,
                          k_scale=a.k_scale, v_scale=a.v_scale, groups=a.groups,
                          causal=a.causal, window=var.window, softcap=var.softcap,
                          alibi_slopes=var.alibi_slopes, sinks=var.sinks,
                          bf16_dot=_dispatch.bf16_dot, amx=_dispatch.amx,
                          round_weights=True)
        drivers.attention(plan, threads)
    return _with_lse(finish(buf, shape, a.result, out, threads), lse, a.computation)


def gradients_varlen(a: _v.VarlenArgs, var: _v.Variants, grad_out: np.ndarray,
                     out: np.ndarray, lse: np.ndarray, threads: int):
    """attention_varlen_backward on checked arguments (grad_out and out in the
    computation dtype or 16-bit, lse in the computation dtype): (dq, dk, dv) packed
    like q, k and v."""
    dq, dk, dv = (np.zeros(x.shape, a.computation) for x in (a.q, a.k, a.v))
    for rq, rk, base, args, var_b in _sequences(a, var):
        g = gradients(args, grad_out[rq].swapaxes(0, 1), out[rq].swapaxes(0, 1),
                      lse[:, rq], threads, var_b, base)
        dq[rq], dk[rk], dv[rk] = (x.swapaxes(0, 1) for x in g)
    if var.sinks is None:
        return dq, dk, dv
    B = len(a.cu_seqlens_q) - 1
    rows = np.repeat(np.arange(B), np.diff(a.cu_seqlens_q))     # each row's sequence
    # per (sequence, head): the rows of that sequence, as a (B, Hq, total_q) batch
    # whose other sequences' rows carry lse -inf (they add nothing)
    lse_b = np.where(rows[None, None, :] == np.arange(B)[:, None, None],
                     lse[None, :, :], -np.inf)
    out_b = np.broadcast_to(out.swapaxes(0, 1)[None], (B,) + out.swapaxes(0, 1).shape)
    do_b = np.broadcast_to(grad_out.swapaxes(0, 1)[None], out_b.shape)
    return dq, dk, dv, sink_gradient(var.sinks, do_b, out_b, lse_b, a.computation)
