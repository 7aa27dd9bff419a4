"""Attention on ``dask.array`` inputs, scheduled by Dask.

``fastattn.dask.attention`` builds a Dask task graph in which every task runs the fused
``fastattn.attention`` on NumPy blocks; any Dask scheduler then runs it (the threaded
one, processes, or a ``dask.distributed`` cluster). This module needs the optional
extra ``fastattn[dask]``; ``import fastattn`` does not import it.

How the chunks are used
-----------------------
- Batch and head axes: one task per block, each an independent call of ``attention``.
- Query axis (Lq): blocks are independent.
- Key axis (Lk): each key block gives a partial result ``(out, lse)`` and the partials
  of one query block are combined with ``fastattn.merge_partials`` in a tree, so no
  task computes over the keys and values of more than one key block, unless a merged
  row is not finite (below). Causal rules and masks use the global positions of each
  block; a key block that lies wholly in the causal future of a query block is not
  computed at all.
- The feature axes (E, Ev) are used whole.
- The attention variants (``window``, ``softcap``, ``alibi_slopes``, ``sinks``,
  ``q_lengths``, ``kv_lengths``) keep their meaning in every block: a block is given
  its global positions, its own slopes and its lengths clipped to it, and a block that
  no query may attend to (outside the window, past the lengths) is not computed. The
  sink of a row is counted once, in the first key block its query block computes.
  With ``dropout_p > 0`` the query and key axes are used whole (see ``attention``'s
  Notes).
- NaN and inf values follow the rule of ``fastattn.attention`` whatever the chunks: a
  NaN or inf in ``v[j]`` reaches row ``i`` exactly when row ``i`` may attend to key
  ``j`` and the weight of key ``j`` against the row's maximum over all keys (the
  sink's included) does not underflow. A key block measures its weights against its
  own maximum, so after the merge each row that is not finite is computed again by
  one call over all the key blocks of its query block (see ``attention``'s Notes).
"""

from __future__ import annotations

import dataclasses
import itertools
import operator
from dataclasses import dataclass
from typing import Optional

import dask.array as da
import numpy as np
from dask.base import tokenize
from dask.highlevelgraph import HighLevelGraph

from . import _validation as _v
from ._merge import merge_partials

__all__ = ["attention"]

# Partial results merged per task in the key-axis reduction tree.
SPLIT_EVERY = 4


# ------------------------------------------------------------------------ the tasks

@dataclass(frozen=True, eq=False)     # (holds arrays: compared and hashed by identity)
class _Block:
    """What one partial-attention task needs besides its arrays."""

    causal: bool                  # the causal rule j <= i + query_offset applies
    query_offset: object          # query i (local) sits at key position i + this: an
                                  # int, or an int64 array, one per sequence (axis 0 of
                                  # the block), when each sequence has its own
    scale: float
    enable_gqa: bool
    groups: int                   # query heads per key/value head (GQA)
    computation: np.dtype
    result: Optional[np.dtype]    # cast ``out`` to this when the task is a root, else None
    variants: _v.Variants         # the block's own: slopes of its slices, lengths
                                  # clipped to its rows and keys
    starts: tuple                 # the block's first index along each output batch axis
    batch: tuple                  # the output's batch shape (dropout slice indices)
    split: int                    # leading batch axes fixed per kernel call (0: one call)


@dataclass(frozen=True, eq=False)
class _Empty:
    """A query block with no key to attend to: zeros, and lse = -inf (or the row's
    sink, see ``sinks``)."""

    shape: tuple              # of ``out``
    out_dtype: np.dtype
    lse_dtype: np.dtype
    sinks: Optional[np.ndarray] = None    # the block's, of its batch shape: the lse
                                          # of every row that is not padding
    n_rows: Optional[np.ndarray] = None   # per sequence: its rows that are not padding


@dataclass(frozen=True, eq=False)
class _Recompute:
    """What the last task of a query block needs to recompute its rows that are not
    finite over all the keys they may attend to (see ``_recompute``)."""

    block: _Block                 # the block's call over its whole key range, less
                                  # the rows' lengths and query offset
    own_offsets: bool             # a query offset per sequence (else one for all)
    offsets: np.ndarray           # per sequence of the block: global query i at i + this
    q_lengths: Optional[np.ndarray]   # per sequence of the block (global), or None
    kv_lengths: Optional[np.ndarray]
    row0: int                     # the global index of the block's first row
    key0: int                     # ... of its first key (of the first key block given)
    n_keys: int                   # the keys given


def _finish(out, lse, result):
    return (out if result is None else out.astype(result, copy=False)), lse


def _attend(args, var, query_offset, slice_base):
    """The fused pass of one call in a task: ``(out, lse)`` in the computation dtype
    (rounded to the result dtype once, after the merge). ``slice_base``: the dropout
    slice index of the call's slice 0."""
    from . import _compute, _config       # looked up at run time, in the worker
    comp = args.computation
    s = args.shapes
    out = np.empty(s.batch + (s.Lq, s.Ev), comp)
    return _compute.attend(args, True, out, _config.resolve_num_threads(),
                           query_offset=query_offset, var=var, slice_base=slice_base)


def _fixed(x, idx, nb, kv_heads=None):
    """``x``, a block operand whose batch axes end at output batch axis ``nb - 1``,
    with its leading batch axes fixed at the indices ``idx`` (kept as axes of size 1;
    an axis of size 1 broadcasts and stays as it is). ``kv_heads`` = (first query head
    of the block, group size): x holds key/value heads (GQA)."""
    if x is None:
        return None
    lead = nb - (x.ndim - 2)
    index = []
    for a in range(x.ndim - 2):
        d = a + lead
        i = idx[d] if 0 <= d < len(idx) else None
        if i is None or x.shape[a] == 1:
            index.append(slice(None))
            continue
        if kv_heads is not None and d == nb - 1:
            h0, g = kv_heads
            i = (h0 + i) // g - h0 // g
        index.append(slice(i, i + 1))
    return x[tuple(index)]


def _partial(spec: _Block, q, k, v, mask, bias):
    """``attention(...)`` of one query block over one key block, as ``(out, lse)``.

    The block is computed by one call of the fused kernel, or (``spec.split``) by one
    call per index of its first ``split`` batch axes: per sequence when each has its
    own query offset, per run of consecutive slices when dropout needs the slices'
    global indices."""
    comp = spec.computation
    q, k, v = (a.astype(comp, copy=False) for a in (q, k, v))
    if bias is not None:
        bias = bias.astype(comp, copy=False)
    var, nb = spec.variants, len(spec.batch)

    def call(q, k, v, mask, bias, var, offset, first):
        args = _v.attention_args(q, k, v, mask=mask, bias=bias, scale=spec.scale,
                                 causal=spec.causal, enable_gqa=spec.enable_gqa)
        base = (int(np.ravel_multi_index(first, spec.batch))
                if var.dropout_p and spec.batch else 0)
        return _attend(args, var, int(offset), base)

    if not spec.split:
        return _finish(*call(q, k, v, mask, bias, var, spec.query_offset, spec.starts),
                       spec.result)
    if spec.enable_gqa:
        sizes = np.broadcast_shapes(q.shape[:-3], k.shape[:-3]) + (q.shape[-3],)
    else:
        sizes = np.broadcast_shapes(q.shape[:-2], k.shape[:-2])
    sizes = (1,) * (nb - len(sizes)) + tuple(sizes)
    Lq, Ev = q.shape[-2], v.shape[-1]
    out = np.empty(sizes + (Lq, Ev), comp)
    lse = np.empty(sizes + (Lq,), _v.lse_dtype(comp))
    kv_heads = (spec.starts[-1], spec.groups) if spec.enable_gqa else None
    for idx in itertools.product(*(range(n) for n in sizes[:spec.split])):
        slopes, sinks = (None if x is None else x[tuple(slice(i, i + 1) for i in idx)]
                         for x in (var.alibi_slopes, var.sinks))
        lengths = [None if x is None else x[idx[0]:idx[0] + 1]
                   for x in (var.q_lengths, var.kv_lengths)]
        offset = spec.query_offset
        if isinstance(offset, np.ndarray):
            offset = offset[idx[0]]
        first = tuple(s + i for s, i in zip(spec.starts, idx)) + spec.starts[len(idx):]
        o, lse_ = call(_fixed(q, idx, nb), _fixed(k, idx, nb, kv_heads),
                       _fixed(v, idx, nb, kv_heads), _fixed(mask, idx, nb),
                       _fixed(bias, idx, nb), var._replace(
                           alibi_slopes=slopes, sinks=sinks, q_lengths=lengths[0],
                           kv_lengths=lengths[1]), offset, first)
        out[idx] = o.reshape(out[idx].shape)
        lse[idx] = lse_.reshape(lse[idx].shape)
    return _finish(out, lse, spec.result)


def _merge(parts, result):
    out, lse = merge_partials([p[0] for p in parts], [p[1] for p in parts])
    return _finish(out, lse, result)


def _empty(spec: _Empty):
    out = np.zeros(spec.shape, spec.out_dtype)
    if spec.sinks is None:
        return out, np.full(spec.shape[:-1], -np.inf, spec.lse_dtype)
    lse = np.broadcast_to(spec.sinks[..., None], spec.shape[:-1])
    if spec.n_rows is not None:               # padding rows get no sink
        n_rows = spec.n_rows.reshape((-1,) + (1,) * (len(spec.shape) - 2))
        lse = np.where(np.arange(spec.shape[-2]) < n_rows, lse, -np.inf)
    return out, lse.astype(spec.lse_dtype)


def _runs(rows):
    """Runs ``(a, b)`` of consecutive integers in the sorted array ``rows``."""
    cuts = np.flatnonzero(np.diff(rows) != 1) + 1
    return [(int(r[0]), int(r[-1]) + 1) for r in np.split(rows, cuts)]


def _cat(blocks, axis):
    if blocks is None:
        return None
    return blocks[0] if len(blocks) == 1 else np.concatenate(blocks, axis=axis)


def _recompute(spec: _Recompute, merged, q, ks, vs, masks, biases):
    """The merged ``(out, lse)`` of a query block, in which every row that is not
    finite is replaced by one call of the fused kernel over all the keys of the block
    (``ks``, ``vs``, ``masks``, ``biases``: the key blocks, in order).

    The partials measure the weights of their keys against their own maximum, so a
    NaN or inf value whose weight underflows against the row's maximum over all keys
    (and so must not reach the row) may reach a partial and, through it, the merged
    row; a NaN that must reach the row is always in the merged row (see
    ``merge_partials``). Recomputing the rows that are not finite in one call gives
    the answer of one call over the whole arrays. Rows are recomputed in runs of
    consecutive rows, in every slice of the block; only the slices where the row is
    not finite take the new values."""
    out, lse = merged
    bad = ~np.isfinite(out).all(axis=-1)
    if not bad.any():
        return merged
    k, v = _cat(ks, -2), _cat(vs, -2)
    mask, bias = _cat(masks, -1), _cat(biases, -1)
    out, lse = out.copy(), lse.copy()
    block, var = spec.block, spec.block.variants

    def rows(x, a, b):
        return x if x is None or x.shape[-2] == 1 else x[..., a:b, :]

    for a, b in _runs(np.flatnonzero(bad.reshape(-1, bad.shape[-1]).any(axis=0))):
        r0 = spec.row0 + a
        offset = spec.offsets + r0 - spec.key0
        task = dataclasses.replace(
            block, query_offset=offset if spec.own_offsets else int(offset[0]),
            variants=var._replace(
                q_lengths=None if spec.q_lengths is None else
                np.clip(spec.q_lengths - r0, 0, b - a),
                kv_lengths=None if spec.kv_lengths is None else
                np.clip(spec.kv_lengths - spec.key0, 0, spec.n_keys)))
        o, s = _partial(task, q[..., a:b, :], k, v, rows(mask, a, b), rows(bias, a, b))
        here = bad[..., a:b]
        out[..., a:b, :] = np.where(here[..., None], o, out[..., a:b, :])
        lse[..., a:b] = np.where(here, s, lse[..., a:b])
    return out, lse


# ----------------------------------------------------------------------- the inputs

def _as_array(x, name):
    """A dask array as it is; anything else through ``numpy.asarray``."""
    if isinstance(x, da.Array):
        if any(np.isnan(n) for n in x.shape):
            raise ValueError(
                f"{name} has unknown chunk sizes (shape {x.shape}); call "
                f"{name}.compute_chunk_sizes() first")
        return x
    return np.asarray(x)


def _stand_in(x, dtype):
    """A read-only NumPy array of ``x``'s shape and ``dtype`` that takes no memory."""
    return np.broadcast_to(np.zeros((), dtype), x.shape)


def _small(x):
    """A small argument (slopes, lengths) as a NumPy array; a dask array is computed."""
    return None if x is None else np.asarray(x)


def _check(q, k, v, mask, bias, causal, scale, enable_gqa, variants):
    """All of ``attention``'s checks, on metadata only (no data is read; the small
    variant arrays are read): the checked arguments, less the arrays, and variants."""
    result = _v.result_dtype(*(_v.as_real(np.empty(0, a.dtype), name)
                               for name, a in (("q", q), ("k", k), ("v", v))))
    comp = _v.computation_dtype(result)
    if mask is not None:
        _v.as_mask(np.empty(0, mask.dtype))
    if bias is not None:
        _v.as_real(np.empty(0, bias.dtype), "bias")
    args = _v.attention_args(
        _stand_in(q, comp), _stand_in(k, comp), _stand_in(v, comp),
        mask=None if mask is None else _stand_in(mask, np.bool_),
        bias=None if bias is None else _stand_in(bias, comp),
        causal=causal, scale=scale, enable_gqa=enable_gqa)
    var = _v.variant_args(args.shapes.batch, args.shapes.Lq, args.shapes.Lk, q.shape,
                          comp, **variants)
    return args._replace(q=None, k=None, v=None, mask=None, bias=None,
                         result=result, computation=comp), var


def _to_dask(x):
    return x if isinstance(x, da.Array) else da.from_array(x, chunks=-1)


def _bounds(chunks):
    return set(itertools.accumulate(chunks, initial=0))


def _chunks(bounds, size):
    if size == 0:
        return (0,)
    b = sorted(x for x in bounds | {0, size} if 0 <= x <= size)
    return tuple(int(y - x) for x, y in zip(b[:-1], b[1:]))


def _starts(chunks):
    return list(itertools.accumulate(chunks, initial=0))[:-1]


# ------------------------------------------------------------------------ the graph

def attention(q, k, v, *, mask=None, bias=None, causal=False, scale=None,
              enable_gqa=False, window=None, softcap=None, alibi_slopes=None,
              sinks=None, q_lengths=None, kv_lengths=None, dropout_p=0.0,
              dropout_seed=None, return_lse=False):
    """Scaled dot-product attention on ``dask.array`` inputs, as a lazy dask array.

    The same computation and arguments as ``fastattn.attention`` (less ``out``,
    ``num_threads`` and ``precision``); every task runs ``fastattn.attention`` on
    NumPy blocks.

    Parameters
    ----------
    q : dask.array.Array or array_like of shape (*batch_q, Lq, E)
    k : dask.array.Array or array_like of shape (*batch_kv, Lk, E)
    v : dask.array.Array or array_like of shape (*batch_kv, Lk, Ev)
        NumPy inputs are taken as one chunk each.
    mask : dask.array.Array or array_like of bool, optional
        Broadcastable to (*batch, Lq, Lk); True means "may attend".
    bias : dask.array.Array or array_like, optional
        Real, broadcastable to (*batch, Lq, Lk); added to the scaled scores.
    causal : bool or {"top_left", "bottom_right"}, default False
        As in ``fastattn.attention``, over the global query and key positions.
    scale : float, optional
        Default ``1 / sqrt(E)``.
    enable_gqa : bool, default False
        Grouped-query attention over axis -3.
    window : (left, right), optional
        Query i may attend only keys ``i + d - left <= j <= i + d + right`` (global
        positions; a side may be None); key blocks outside every window are skipped.
    softcap : float > 0, optional
        The scaled scores become ``softcap * tanh(scores / softcap)``.
    alibi_slopes : array_like, optional
        Broadcastable to ``*batch``, last axis the query heads: ``-slope * |i + d - j|``
        is added to the scores.
    sinks : array_like, optional
        Broadcastable to ``*batch``, last axis the query heads (e.g. ``(Hq,)``): one
        extra logit per head that joins every row's softmax and carries no value, as
        in ``fastattn.attention``; ``lse`` includes it (a row with no allowed key gives
        zeros and ``lse = sink``; padding rows stay zeros with ``lse = -inf``). Counted
        once per row whatever the chunks (see Notes).
    q_lengths, kv_lengths : array_like of int of shape (B,), optional
        The valid lengths of each sequence (axis 0 of ``*batch``); blocks wholly past
        them are not computed.
    dropout_p : float in [0, 1), default 0
    dropout_seed : int, optional
        Dropout of the weights, the same pattern as ``fastattn.attention`` draws
        (see Notes).
    return_lse : bool, default False
        Also return the log-sum-exp of each query row.

    Returns
    -------
    out : dask.array.Array of shape (*batch, Lq, Ev)
        In the result dtype of ``q``, ``k``, ``v``. Its chunks are those of the
        batch axes of the inputs (see Notes), of ``q`` along Lq (one chunk with
        dropout), and one along Ev.
    lse : dask.array.Array of shape (*batch, Lq)
        Only with ``return_lse``: float64 when the computation dtype is float64,
        float32 otherwise.

    Raises
    ------
    ValueError, TypeError
        As ``fastattn.attention``, when the call is made (from shapes and dtypes only;
        nothing is computed until ``.compute()``). ``alibi_slopes``, ``sinks``,
        ``q_lengths`` and ``kv_lengths`` are small and needed to plan the tasks: they
        are read (a dask array computed) when the call is made.

    Notes
    -----
    Task layout. The batch (and head) axes are split at every chunk boundary of any
    of ``q``, ``k``, ``v`` along that axis; with ``enable_gqa`` a query-head block
    either holds whole groups or lies within one group, so it meets exactly one block
    of key/value heads. Each query block meets every key block (the common refinement
    of the chunks of ``k`` and ``v`` along Lk) in a task of its own, returning the
    partial ``(out, lse)`` in the computation dtype; these are merged with
    ``fastattn.merge_partials`` in key order, ``SPLIT_EVERY`` at a time, so the
    result does not depend on the scheduler. ``mask`` and ``bias`` are rechunked to
    the same blocks (their size-1 broadcast axes stay one chunk). ``E`` and ``Ev``
    are used whole: rechunk them to one chunk beforehand to avoid the copy.

    Causal rules are applied with the global positions: a block of queries
    ``[i0, i1)`` and keys ``[j0, j1)`` gets the rule ``j <= i + d`` (local indices)
    with ``d = i0 - j0`` (``"top_left"``) or ``d = i0 - j0 + Lk - Lq``
    (``"bottom_right"``), which the fused kernel applies as it does its own causal
    rules (key blocks past the limit are skipped, no mask is built); a block where no
    query may see any key is left out of the graph.

    The variants follow the same positions. ``window`` needs nothing more than the
    block's ``d`` (a block wholly outside every query's window is left out: with
    chunked keys, a sliding window computes only the blocks near the diagonal, and
    inside a block the kernel skips what lies outside it); ``alibi_slopes`` are
    cut to the block's slices; ``q_lengths``/``kv_lengths`` become each sequence's rows
    and keys inside the block (blocks wholly past them are left out). With
    ``"bottom_right"`` and lengths each sequence has its own ``d`` (its own
    ``kv_length - q_length``), so such a block runs one kernel call per sequence.

    Sinks. A sink is a logit of no key, so it must join exactly one of the partials
    that are merged for a query block: it is given to the first key block that the
    query block computes (not to key block 0, which a window or the causal rule may
    leave out), and a query block that computes no key block gives zeros with
    ``lse = sink`` (``-inf`` for padding rows) without any task over keys.

    NaN and inf values. ``fastattn.attention`` lets a NaN or inf in ``v[j]`` reach row
    ``i`` exactly when row ``i`` may attend to key ``j`` and the weight of key ``j``
    against the row's maximum over all keys, the sink's included, is not 0 in the
    computation dtype (a weight below the smallest normal number counts as 0). A key
    block measures the weights of its keys against its own maximum, so such a value
    can reach its partial result, and through it the merged row, when its weight
    against the whole row underflows (``merge_partials`` drops only a partial whose
    own weight underflows). A value that must reach the row always does. So the last
    task of each query block that merges two or more partials takes the merged result
    and every key block from the first to the last it computes (of ``k``, ``v``,
    ``mask`` and ``bias``), and computes each row that is not finite again, in runs of
    consecutive rows, with one call of the fused kernel over those keys and the same
    positions and variants: the result is that of one call over the whole arrays,
    whatever the chunks. With only finite values it reads no key block and returns the
    merged result as it is; but its key blocks are still its inputs, so a scheduler
    keeps them until it has run, and ``dask.distributed`` moves them to the worker
    that runs it.

    Dropout. The pattern is a function of ``(dropout_seed, slice, i, j)`` with the
    global slice index (C order over ``*batch``), row ``i`` and key ``j``, exactly as
    in ``fastattn.attention``, and the fused kernel numbers rows and keys from the
    start of the arrays it is given. So with ``dropout_p > 0`` the query and key axes
    are used whole (``q``, ``k``, ``v``, ``mask`` and ``bias`` are rechunked to one
    chunk along Lq and Lk, and ``out`` has one chunk along Lq); the batch and head
    axes are still split, and a block whose slices are not consecutive in C order
    (e.g. two heads of eight, in each of several batch entries) runs one kernel call
    per run of consecutive slices, each told its first global slice index.

    Threads. Each task runs the fused kernel with the default thread count
    (``fastattn.get_num_threads()`` in the process that runs it). ``dask.distributed``
    starts its worker processes with ``OMP_NUM_THREADS=1`` (its configuration
    ``distributed.nanny.pre-spawn-environ``), so there each task runs on one thread and
    the parallelism comes from the worker threads and processes. On the threaded
    scheduler, or to give each task several threads, set the count
    (``fastattn.set_num_threads``, ``OMP_NUM_THREADS``) so that tasks times threads
    does not exceed the cores.

    Examples
    --------
    >>> import numpy as np
    >>> import dask.array as da
    >>> import fastattn
    >>> import fastattn.dask
    >>> rng = np.random.default_rng(0)
    >>> q = da.from_array(rng.standard_normal((2, 4, 64, 16)), chunks=(1, 2, 32, 16))
    >>> k = da.from_array(rng.standard_normal((2, 4, 96, 16)), chunks=(1, 2, 32, 16))
    >>> v = da.from_array(rng.standard_normal((2, 4, 96, 16)), chunks=(1, 2, 32, 16))
    >>> out = fastattn.dask.attention(q, k, v, causal="bottom_right")
    >>> out
    dask.array<fastattn-attention, shape=(2, 4, 64, 16), dtype=float64, chunksize=(1, 2, 32, 16), chunktype=numpy.ndarray>
    >>> want = fastattn.reference.attention(q.compute(), k.compute(), v.compute(),
    ...                                     causal="bottom_right")
    >>> bool(np.allclose(out.compute(scheduler="threads"), want))
    True
    """
    q, k, v = _as_array(q, "q"), _as_array(k, "k"), _as_array(v, "v")
    mask = None if mask is None else _as_array(mask, "mask")
    bias = None if bias is None else _as_array(bias, "bias")
    args, var = _check(q, k, v, mask, bias, causal, scale, enable_gqa, dict(
        window=window, softcap=softcap, alibi_slopes=_small(alibi_slopes),
        sinks=_small(sinks), q_lengths=_small(q_lengths), kv_lengths=_small(kv_lengths),
        dropout_p=dropout_p, dropout_seed=dropout_seed))
    sh = args.shapes
    comp, result = args.computation, args.result
    lse_dtype = _v.lse_dtype(comp)
    B, nb = sh.batch, len(sh.batch)
    out_shape = B + (sh.Lq, sh.Ev)
    if 0 in B or sh.Lq == 0:                              # nothing to compute
        out = da.zeros(out_shape, dtype=result, chunks=-1)
        lse = da.zeros(B + (sh.Lq,), dtype=lse_dtype, chunks=-1)
        return (out, lse) if return_lse else out

    q, k, v = _to_dask(q), _to_dask(k), _to_dask(v)
    gqa = bool(enable_gqa)
    g = sh.groups

    # The grid: chunks of every batch axis of the output, of Lq and of Lk.
    def batch_axis(x, d):
        """The axis of x that maps to output batch axis d, or None."""
        a = d - (nb - (x.ndim - 2))
        return a if a >= 0 else None

    grid = []
    for d in range(nb):
        bounds = set()
        for x in (q, k, v):
            a = batch_axis(x, d)
            if a is None:
                continue
            if gqa and d == nb - 1:
                bounds |= _bounds(x.chunks[a]) if x is q else {
                    g * b for b in _bounds(x.chunks[a])}
            elif x.shape[a] == B[d]:
                bounds |= _bounds(x.chunks[a])
        if gqa and d == nb - 1:      # a block holds whole groups or lies within one
            bounds |= {f(b, g) * g for b in bounds if b % g
                       for f in (operator.floordiv, lambda b, g: -(-b // g))}
        grid.append(_chunks(bounds, B[d]))
    grid_q = _chunks(_bounds(q.chunks[-2]), sh.Lq)
    grid_k = _chunks(_bounds(k.chunks[-2]) | _bounds(v.chunks[-2]), sh.Lk)
    dropout = var.dropout_p > 0
    if dropout:         # the pattern is keyed by the global i and j: whole axes
        grid_q, grid_k = (sh.Lq,), _chunks(set(), sh.Lk)
    if gqa:
        head_starts = _starts(grid[-1])
        kv_bounds = {b // g for b in _bounds(grid[-1]) if b % g == 0}
        grid_kv = _chunks(kv_bounds, sh.batch[-1] // g)
        kv_index = {s: i for i, s in enumerate(_starts(grid_kv))}
        kv_block = [kv_index[s // g] for s in head_starts]

    # Each input's role per axis: None (one chunk, block 0), a batch axis d, "kv"
    # (GQA key/value heads), "q" (Lq) or "k" (Lk).
    def data_roles(x, seq):
        roles = []
        for a in range(x.ndim - 2):
            d = nb - (x.ndim - 2) + a
            if x.shape[a] == 1 and B[d] != 1:
                roles.append(None)
            elif gqa and d == nb - 1 and x is not q:
                roles.append("kv")
            else:
                roles.append(d)
        return roles + [seq, None]

    def side_roles(x):
        full = B + (sh.Lq, sh.Lk)
        return [None if n == 1 and full[d] != 1 else
                ("q" if d == nb else "k" if d == nb + 1 else d)
                for d, n in enumerate(x.shape)]

    def rechunk(x, roles):
        chunks = tuple((n,) if r is None else grid_q if r == "q" else
                       grid_k if r == "k" else grid_kv if r == "kv" else grid[r]
                       for n, r in zip(x.shape, roles))
        return x.rechunk(chunks)

    # name -> (input rechunked to the grid, its roles); mask and bias get the full ndim
    inputs = {"q": (q, data_roles(q, "q")), "k": (k, data_roles(k, "k")),
              "v": (v, data_roles(v, "k"))}
    for name, extra in (("mask", mask), ("bias", bias)):
        if extra is not None:
            x = _to_dask(extra)
            x = x[(None,) * (nb + 2 - x.ndim)]
            inputs[name] = (x, side_roles(x))
    inputs = {name: (rechunk(x, roles), roles) for name, (x, roles) in inputs.items()}
    arrays = [x for x, _ in inputs.values()]

    token = tokenize(*arrays, mask is not None, bias is not None, args.causal,
                     args.scale, gqa, comp, result, tuple(var))
    part_name = f"fastattn-partial-{token}"
    merge_name = f"fastattn-merge-{token}"
    fix_name = f"fastattn-recompute-{token}"
    out_name = f"fastattn-attention-{token}"
    lse_name = f"fastattn-lse-{token}"

    q_starts, k_starts = _starts(grid_q), _starts(grid_k)
    batch_starts = [_starts(c) for c in grid]
    # Per sequence (axis 0 of the batch): lengths and query offset d (query i at i + d)
    n_seq = B[0] if nb else 1
    q_len, kv_len = (np.full(n_seq, n, np.int64) if x is None else x
                     for x, n in ((var.q_lengths, sh.Lq), (var.kv_lengths, sh.Lk)))
    d_seq = np.broadcast_to(np.asarray(_v.query_offsets(
        args.causal, sh.Lq, sh.Lk, var.q_lengths, var.kv_lengths), np.int64), (n_seq,))
    # bottom-right alignment with lengths: a query offset per sequence (the kernel
    # would align each sequence by its lengths within the block, not the global ones)
    own_offsets = args.causal == "bottom_right" and (
        var.q_lengths is not None or var.kv_lengths is not None)
    left, right = var.window
    if args.causal is not None:
        right = 0 if right is None else min(right, 0)
    slopes, sinks = (None if x is None else np.broadcast_to(x, B)
                     for x in (var.alibi_slopes, var.sinks))
    parts, merges, fixes, outs, lses = {}, {}, {}, {}, {}

    for blk in itertools.product(*(range(len(c)) for c in grid), range(len(grid_q))):
        b, qi = blk[:-1], blk[-1]
        lq, r0 = grid_q[qi], q_starts[qi]
        starts = tuple(batch_starts[d][b[d]] for d in range(nb))
        sizes = tuple(grid[d][b[d]] for d in range(nb))
        seq = slice(starts[0], starts[0] + sizes[0]) if nb else slice(0, 1)
        here = tuple(slice(s0, s0 + n0) for s0, n0 in zip(starts, sizes))
        block_var = var._replace(**{
            name: None if x is None else np.ascontiguousarray(x[here])
            for name, x in (("alibi_slopes", slopes), ("sinks", sinks))})
        split = 1 if own_offsets else 0
        if dropout:         # one call per run of slices consecutive in C order
            a = nb - 1
            while a > 0 and sizes[a] == B[a]:
                a -= 1
            split = max(split, a)

        def key_of(x, roles, kj):
            idx = tuple(0 if r is None else qi if r == "q" else kj if r == "k" else
                        kv_block[b[-1]] if r == "kv" else b[r] for r in roles)
            return (x.name,) + idx

        n_rows = np.clip(q_len[seq] - r0, 0, lq)     # per sequence: rows not padding
        tasks = []
        for kj, lk in enumerate(grid_k):
            j0 = k_starts[kj]
            # per sequence of the block: its keys in the block, its offset
            n_keys = np.clip(kv_len[seq] - j0, 0, lk)
            offset = d_seq[seq] + r0 - j0
            needed = (n_rows > 0) & (n_keys > 0)    # some query may see some key:
            if left is not None:                    # row 0's window starts in time
                needed &= offset - left <= n_keys - 1
            if right is not None:                   # the last row's ends in time
                needed &= n_rows - 1 + offset + right >= 0
            if not needed.any():                    # (wholly in the future, ...)
                continue
            tasks.append((kj, block_var._replace(
                q_lengths=None if var.q_lengths is None else n_rows,
                kv_lengths=None if var.kv_lengths is None else n_keys,
                sinks=block_var.sinks if not tasks else None),   # the first only
                offset if own_offsets else int(offset[0])))

        n = len(tasks)
        level = []
        for kj, task_var, offset in tasks:
            spec = _Block(args.causal is not None, offset, args.scale, gqa, g, comp,
                          result if n == 1 else None, task_var, starts, B, split)
            keys = {name: key_of(x, roles, kj) for name, (x, roles) in inputs.items()}
            key = (part_name,) + blk + (kj,)
            parts[key] = (_partial, spec, keys["q"], keys["k"], keys["v"],
                          keys.get("mask"), keys.get("bias"))
            level.append(key)
        if n == 0:
            root = (merge_name,) + blk
            shape = tuple(grid[d][b[d]] for d in range(nb)) + (lq, sh.Ev)
            merges[root] = (_empty, _Empty(
                shape, np.dtype(result), lse_dtype, block_var.sinks,
                None if var.q_lengths is None else n_rows))
        depth = 0
        while len(level) > 1:          # merge SPLIT_EVERY neighbours at a time, in order
            groups = [level[i:i + SPLIT_EVERY] for i in range(0, len(level), SPLIT_EVERY)]
            last = len(groups) == 1
            level = []
            for gi, group in enumerate(groups):
                if len(group) == 1:
                    level.append(group[0])
                    continue
                key = (merge_name,) + blk + ((depth, gi) if not last else ())
                merges[key] = (_merge, list(group), result if last else None)
                level.append(key)
            depth += 1
        if n:
            root = level[0]
        if n > 1:       # rows that are not finite: again, over all their keys at once
            first, last = tasks[0][0], tasks[-1][0]
            span = range(first, last + 1)         # (a block skipped between: no key
            spec = _Recompute(                    # any row may attend to)
                _Block(args.causal is not None, None, args.scale, gqa, g, comp, None,
                       block_var, starts, B, split),
                own_offsets, d_seq[seq], None if var.q_lengths is None else q_len[seq],
                None if var.kv_lengths is None else kv_len[seq], r0, k_starts[first],
                sum(grid_k[first:last + 1]))
            blocks = {}
            for name, (x, roles) in inputs.items():
                blocks[name] = [key_of(x, roles, kj) for kj in
                                (span if "k" in roles else span[:1])]
            fix = (fix_name,) + blk
            fixes[fix] = (_recompute, spec, root, blocks["q"][0], blocks["k"],
                          blocks["v"], blocks.get("mask"), blocks.get("bias"))
            root = fix
        outs[(out_name,) + blk + (0,)] = (operator.getitem, root, 0)
        lses[(lse_name,) + blk] = (operator.getitem, root, 1)

    layers, deps = {}, {}
    for x in arrays:
        graph = x.__dask_graph__()
        layers.update(graph.layers)
        deps.update(graph.dependencies)
    input_layers = {name for x in arrays for name in x.__dask_layers__()}
    roots = set()
    if parts:
        layers[part_name], deps[part_name] = parts, set(input_layers)
        roots.add(part_name)
    if merges:
        layers[merge_name], deps[merge_name] = merges, {part_name} & set(layers)
        roots.add(merge_name)
    if fixes:
        layers[fix_name], deps[fix_name] = fixes, {merge_name} | input_layers
        roots.add(fix_name)
    layers[out_name], deps[out_name] = outs, roots
    layers[lse_name], deps[lse_name] = lses, set(roots)
    graph = HighLevelGraph(layers, deps)

    out = da.Array(graph, out_name, chunks=tuple(grid) + (grid_q, (sh.Ev,)),
                   meta=np.empty((0,) * (nb + 2), result))
    if not return_lse:
        return out
    lse = da.Array(graph, lse_name, chunks=tuple(grid) + (grid_q,),
                   meta=np.empty((0,) * (nb + 1), lse_dtype))
    return out, lse
