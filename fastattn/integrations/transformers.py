"""fastattn as an attention implementation of Hugging Face transformers.

>>> import fastattn.integrations.transformers as fa_hf   # doctest: +SKIP
>>> fa_hf.register()                                     # doctest: +SKIP
'fastattn'
>>> model = AutoModelForCausalLM.from_config(cfg, attn_implementation="fastattn")  # doctest: +SKIP

Call :func:`register` before ``from_config``/``from_pretrained`` (or
``model.set_attn_implementation``) names ``attn_implementation="fastattn"``:
transformers looks the name up when it builds the model and, before the name is
registered, refuses it with its own error. Registering again is harmless.

:func:`register` adds :func:`attention_forward` to transformers' ``AttentionInterface``
and :func:`build_mask` to its ``AttentionMaskInterface`` under the same name, so a
model built with that ``attn_implementation`` (or switched to it with
``model.set_attn_implementation``) runs every attention layer on fastattn's operator
(``fastattn.torch``):

- the masks transformers builds. Where a mask is exactly causal, with or without the
  layer's sliding window, with or without padding, and its queries are the last
  tokens of its keys (no cache, or a ``DynamicCache``), :func:`build_mask` hands the
  layers a :class:`MaskDescription` instead of a ``(B, 1, Lq, Lk)`` tensor, and the
  kernels apply the rules themselves: ``causal="bottom_right"``, the sliding window as
  ``window=(sliding_window - 1, 0)`` (key blocks outside it are skipped), the padding
  as a ``(B, 1, 1, Lk)`` boolean vector of the keys (left or right padding alike). Any
  other mask (custom mask functions, packed sequences found from ``position_ids``, a
  ``StaticCache``, a 4-D mask given by the caller, tracing by ``torch.compile``) is
  transformers' own SDPA mask (``sdpa_mask``): boolean 4-D masks (True = may attend),
  additive float masks with ``torch.finfo(dtype).min`` or ``-inf``, ``None`` with
  ``is_causal`` (top-left, as SDPA);
- a sliding window allows exactly the keys transformers' own mask allows: a window of
  ``W`` lets a query see itself and the ``W - 1`` keys before it;
- grouped-query heads natively (no ``repeat_kv`` copies), key-value caches
  (``Lq < Lk``, bottom-right);
- packed sequences given as ``cu_seq_lens_q``/``cu_seq_lens_k`` (FlashAttention's
  varlen keywords, as transformers' continuous batching passes them): each sequence
  attends only to its own keys, its queries being its last tokens (bottom-right
  causal), with the layer's ``sliding_window`` as a window;
- ``s_aux`` (attention sinks: gpt-oss and others, one learned logit per query head)
  as fastattn's ``sinks``, with a gradient;
- ``scaling``; a ``position_bias`` (T5-style) as an additive bias, differentiable;
- a ``softcap`` (Gemma 2's ``attn_logit_softcapping``: the same result as
  transformers' eager attention) and dropout in training mode (``dropout > 0``;
  transformers passes ``dropout=0.0`` in evaluation mode), in fastattn's kernels,
  together with any of the above (a learned bias's gradient included).

Rows with no allowed key give zeros everywhere (with a sink: zeros too, as eager
attention gives them).

Every other keyword transformers passes is either known not to change the result
(:data:`IGNORED_KEYWORDS`: positions, cache and output flags whose effect is already in
the query, key, value and mask) or, when it is not ``None``, refused with
``NotImplementedError`` naming it, rather than silently dropped (e.g. the per-token
``sinks`` of some models, DeepSeek's sparse ``indices``). ``output_attentions=True``
logs the warning transformers' SDPA
integration logs: no attention weights are returned.

Continuous batching (``model.generate_batch``, transformers' paged cache) runs on a
model built with the registered name: transformers' manager accepts only its own
implementations, so :func:`register` lets it keep the registered name (instead of
refusing it). It then builds no mask and passes ``cu_seq_lens_q``/``cu_seq_lens_k``.
In prefill steps the keys and values reach :func:`attention_forward` gathered from
the paged cache by transformers, and in evaluation the packed sequences are one call
of :func:`fastattn.attention_varlen` on views of the packed tensors (all the
sequences' heads share the threads); where a gradient is recorded, a mask or bias is
given, dropout runs or a tracer needs the operator, each sequence is one call of the
operator on views. In decoding steps (one new token per sequence) transformers hands
FlashAttention 2/3 on an accelerator its block table instead ("decode fast path"):
:func:`register` lets it hand a model on the registered name the same where every
layer's cache takes a block table (not sliding-window layers), and the step then
writes each sequence's new key and value rows into its pages and attends to them in
place (:func:`fastattn.store_kv` and :func:`fastattn.attention_paged` on views of its
tensors), with no gathered copy of the cache.

In evaluation (``torch.no_grad()``, as in ``generate``) a call goes straight to the
kernels, without the dispatcher of the custom operator (see ``fastattn.torch``); the
key-value cache, the query and the mask are read in place, and the only copy is the
output's ``transpose(1, 2).contiguous()`` into the layout transformers expects (as in
its own SDPA integration; a no-op when decoding one token).

A model uses the registered implementation where its code dispatches attention through
``AttentionInterface`` (most decoder models of transformers 4.5x; BERT, T5 and others
only from transformers 5). This module needs PyTorch and transformers
(``pip install "fastattn[torch]"``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

try:
    import torch
    from transformers import AttentionInterface
    from transformers import masking_utils as _masking
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    from transformers.utils import logging as _hf_logging
except ImportError as exc:          # pragma: no cover - depends on the environment
    raise ImportError(
        "fastattn.integrations.transformers needs PyTorch and transformers "
        "(>= 4.56). Install the extra: pip install \"fastattn[torch]\"") from exc

import numpy as np

from .. import torch as _fa_torch
from .._serving import attention_paged as _attention_paged
from .._serving import store_kv as _store_kv
from .._torch_cache import _to_tensor, _view
from .._varlen import attention_varlen as _attention_varlen

__all__ = ["register", "attention_forward", "build_mask", "MaskDescription",
           "IGNORED_KEYWORDS"]

logger = _hf_logging.get_logger(__name__)

#: Keywords that transformers passes to attention functions and that do not change
#: the result here, whatever their value: the positions (already in the rotary
#: embeddings of query and key, and in the mask, packed sequences included), the
#: cache's bookkeeping (the cache is already in key and value; continuous batching's
#: ``read_index``/``write_index`` have been applied by its cache before the call), the
#: model's output flags, the logits continuous batching keeps, a loss normaliser, a
#: determinism request (fastattn is deterministic) and FlashAttention's length hints.
#: ``output_attentions=True`` also logs a warning.
IGNORED_KEYWORDS = frozenset({
    "position_ids", "cache_position", "use_cache", "output_attentions",
    "output_hidden_states", "output_router_logits", "num_items_in_batch",
    "deterministic", "max_length_q", "max_length_k", "read_index", "write_index",
    "logits_indices", "logits_processor_args",
})


def _refuse_unknown(kwargs) -> None:
    """``NotImplementedError`` for a keyword that is not None and not known to leave
    the result unchanged; the warning of transformers' SDPA for output_attentions."""
    for name, value in kwargs.items():
        if value is None:
            continue
        if name not in IGNORED_KEYWORDS:
            raise NotImplementedError(
                f"fastattn's attention does not handle the keyword {name!r} (got a "
                f"{type(value).__name__}), which may change the result; use another "
                f"attn_implementation for this model")
        if name == "output_attentions" and value:
            logger.warning_once(
                "`fastattn` attention does not support `output_attentions=True`."
                " Please set your attention to `eager` if you want any of these "
                "features.")


# ------------------------------------------------------------------------ the masks

@dataclass(frozen=True, eq=False)
class MaskDescription:
    """What :func:`build_mask` hands the attention layers instead of a mask tensor:
    causal attention whose queries are the last ``q_length`` of ``kv_length`` keys
    (bottom-right), within a sliding window, over the keys that are not padding.

    Parameters
    ----------
    q_length, kv_length : int
        The query and key lengths the mask was built for (checked against the tensors).
    window : (int, 0) or None
        fastattn's ``window``: ``(sliding_window - 1, 0)``, or None without a window.
    key_mask : bool Tensor of shape (B, 1, 1, kv_length), optional
        True for the keys that are not padding; None when no key is padding.
    """

    q_length: int
    kv_length: int
    window: tuple[int, int] | None = None
    key_mask: torch.Tensor | None = None


try:
    _AND_MASKS = _masking.and_masks(_masking.causal_mask_function).__code__
    _SLIDING_OVERLAY = _masking.sliding_window_overlay(1).__code__
    _is_tracing = _masking.is_tracing
    _padding_mask = _masking.prepare_padding_mask
except AttributeError:              # pragma: no cover - older transformers
    _AND_MASKS = _SLIDING_OVERLAY = _is_tracing = _padding_mask = None


def _closure(function) -> dict:
    """The variables a closure captured, by name."""
    cells = function.__closure__ or ()
    return dict(zip(function.__code__.co_freevars, (c.cell_contents for c in cells)))


def _causal_window(mask_function):
    """``(True, window)`` when ``mask_function`` is transformers' causal rule (window
    None) or its sliding-window causal rule (window ``(sliding_window - 1, 0)``: its
    ``kv_idx > q_idx - sliding_window`` lets a query see itself and the
    ``sliding_window - 1`` keys before it), recognised by their code objects;
    ``(False, None)`` for any other function."""
    if mask_function is _masking.causal_mask_function:
        return True, None
    if _AND_MASKS is None or getattr(mask_function, "__code__", None) is not _AND_MASKS:
        return False, None
    parts = _closure(mask_function).get("mask_functions", ())
    if (len(parts) == 2 and parts[1] is _masking.causal_mask_function
            and getattr(parts[0], "__code__", None) is _SLIDING_OVERLAY):
        size = _closure(parts[0]).get("sliding_window")
        if type(size) is int and size > 0:
            return True, (size - 1, 0)
    return False, None


def _describe(batch_size, q_length, kv_length, q_offset=0, kv_offset=0,
              mask_function=_masking.causal_mask_function, attention_mask=None,
              allow_is_causal_skip=True, **_):
    """The :class:`MaskDescription` of the mask ``sdpa_mask`` would build from these
    arguments, or None where none describes it exactly."""
    # the caller wants a tensor (e.g. to concatenate it with another mask), or is
    # tracing a graph, where a mask's values must not be read
    if not allow_is_causal_skip or _is_tracing is None or _is_tracing(attention_mask):
        return None
    causal, window = _causal_window(mask_function)
    # query i sits at position q_offset + i, key j at kv_offset + j: bottom-right when
    # the queries are the last keys (no cache, or a cache that returns all it holds)
    if (not causal or type(q_offset) is not int or type(kv_offset) is not int
            or q_offset - kv_offset != kv_length - q_length):
        return None
    key_mask = None
    if attention_mask is not None:
        if attention_mask.dim() != 2:
            return None
        keys = _padding_mask(attention_mask.bool(), kv_length, kv_offset)
        keys = keys[:, kv_offset:kv_offset + kv_length]
        if not bool(keys.all()):
            key_mask = keys[:, None, None, :]
    return MaskDescription(q_length, kv_length, window, key_mask)


def build_mask(*args, **kwargs):
    """An attention-mask function for transformers' ``AttentionMaskInterface``.

    Called by transformers' ``create_causal_mask`` (and its sliding-window and
    bidirectional siblings) with the arguments of its ``sdpa_mask``. Returns a
    :class:`MaskDescription` where the mask is exactly causal, with or without a
    sliding window and padding, with the queries the last tokens of the keys;
    otherwise whatever ``sdpa_mask`` returns for these arguments.

    Parameters
    ----------
    *args, **kwargs
        ``sdpa_mask``'s arguments (``batch_size``, ``q_length``, ``kv_length``,
        ``q_offset``, ``kv_offset``, ``mask_function``, ``attention_mask``,
        ``allow_is_causal_skip``, ``local_size``, ...); only calls by keyword are
        described.

    Returns
    -------
    MaskDescription, bool Tensor of shape (B, 1, Lq, Lk), or None
    """
    if not args and "q_length" in kwargs:
        description = _describe(**kwargs)
        if description is not None:
            return description
    return sdpa_mask(*args, **kwargs)


# ----------------------------------------------------------------- the attention

def _rules(attention_mask, position_bias, is_causal, sliding_window, Lq, packed):
    """``(mask, bias, causal, window)`` for fastattn from what transformers passes."""
    if isinstance(attention_mask, MaskDescription):
        return (attention_mask.key_mask, position_bias, "bottom_right",
                attention_mask.window)
    mask = bias = None
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            mask = attention_mask
        else:
            bias = attention_mask
    if position_bias is not None:
        bias = position_bias if bias is None else position_bias + bias
    if attention_mask is not None:
        # the mask holds every rule (the causal one, bottom-right for a cache, and
        # the window), as for transformers' SDPA integration
        return mask, bias, False, None
    if packed:
        # FlashAttention's varlen rules: each sequence's queries are its last tokens,
        # and its window of W keys spans W - 1 on each side (the causal rule cuts the
        # right one)
        window = None
        if sliding_window is not None:
            if sliding_window < 1:
                raise ValueError(
                    f"sliding_window must be positive, got {sliding_window}")
            window = (sliding_window - 1, 0 if is_causal else sliding_window - 1)
        return mask, bias, "bottom_right" if is_causal else False, window
    # as transformers' SDPA integration: without a mask, one query row is not causal
    # (and transformers leaves the mask out only where a sliding window cannot bind)
    return mask, bias, bool(Lq > 1 and is_causal), None


def _block(t, rows, cols):
    """The part of a mask or bias (broadcastable to (..., Lq, Lk)) for these rows and
    columns."""
    if t is None:
        return None
    if t.shape[-2] != 1:
        t = t[..., rows, :]
    if t.shape[-1] != 1:
        t = t[..., cols]
    return t


def _packed(query, key, value, cu_seq_lens_q, cu_seq_lens_k, mask, bias, options):
    """Packed sequences (one batch row; sequence b owns the queries
    ``cu_seq_lens_q[b]:cu_seq_lens_q[b + 1]`` and the keys
    ``cu_seq_lens_k[b]:cu_seq_lens_k[b + 1]``): one call of the kernels for them all
    where nothing needs the operator (:func:`_in_one_call`), else one call of the
    operator each, on views; the output (1, Lq, Hq, Ev), zeros in rows past the last
    sequence (the padding of a captured graph)."""
    if query.shape[0] != 1:
        raise NotImplementedError(
            f"cu_seq_lens_q/cu_seq_lens_k describe sequences packed into one batch "
            f"row; got a batch of {query.shape[0]}")
    if cu_seq_lens_k is None:
        cu_seq_lens_k = cu_seq_lens_q
    starts_q, starts_k = cu_seq_lens_q.tolist(), cu_seq_lens_k.tolist()
    if len(starts_q) != len(starts_k):
        raise ValueError(f"cu_seq_lens_q and cu_seq_lens_k describe {len(starts_q) - 1} "
                         f"and {len(starts_k) - 1} sequences")
    _refuse_unaligned_window(starts_q, starts_k, options)
    if mask is None and bias is None and _in_one_call(query, key, value, starts_q,
                                                      starts_k, options):
        return _packed_in_one_call(query, key, value, starts_q, starts_k, options)
    pieces = []
    for q0, q1, k0, k1 in zip(starts_q, starts_q[1:], starts_k, starts_k[1:]):
        if q1 > q0:
            rows, cols = slice(q0, q1), slice(k0, k1)
            out = _fa_torch.attention(
                query[:, :, rows], key[:, :, cols], value[:, :, cols],
                mask=_block(mask, rows, cols), bias=_block(bias, rows, cols), **options)
            pieces.append(out.transpose(1, 2))
    rest = query.shape[2] - starts_q[-1]
    if rest or not pieces:
        pieces.append(query.new_zeros(1, rest, query.shape[1], value.shape[-1]))
    return torch.cat(pieces, dim=1)


def _refuse_unaligned_window(starts_q, starts_k, options) -> None:
    """FlashAttention places a packed sequence's queries at its last positions for the
    window with or without the causal rule; fastattn does so only with it (without,
    query i sits at position i). The two agree where each sequence has as many
    queries as keys, or the window cannot bind; any other non-causal window is
    refused rather than computed differently."""
    window = options["window"]
    if options["causal"] or window is None:
        return
    for q0, q1, k0, k1 in zip(starts_q, starts_q[1:], starts_k, starts_k[1:]):
        nq, nk = q1 - q0, k1 - k0
        if nq and nq != nk and min(window) < nq + nk:
            raise NotImplementedError(
                f"a sliding window without the causal rule over packed sequences "
                f"whose query and key counts differ ({nq} queries, {nk} keys): its "
                f"queries would sit at their first positions, not their last")


def _in_one_call(query, key, value, starts_q, starts_k, options) -> bool:
    """Whether packed sequences without a mask or bias can be one call of the kernels
    (:func:`_packed_in_one_call`): plain tensors with nothing to record or trace (the
    operator's short path, as for one sequence), no dropout, sinks one per query head,
    sequences from row 0 in order, within the tensors, and heads that group."""
    return (_fa_torch._plain(query, key, value)
            and _fa_torch._plain_sinks(options["sinks"], query)
            and not options["dropout_p"] and query.shape[1] % key.shape[1] == 0
            and options["enable_gqa"] == (query.shape[1] != key.shape[1])
            and value.shape[:3] == key.shape[:3]
            and starts_q[0] == starts_k[0] == 0
            and all(a <= b for a, b in zip(starts_q, starts_q[1:]))
            and all(a <= b for a, b in zip(starts_k, starts_k[1:]))
            and starts_q[-1] <= query.shape[2] and starts_k[-1] <= key.shape[2])


def _packed_in_one_call(query, key, value, starts_q, starts_k, options):
    """Packed sequences as one call of :func:`fastattn.attention_varlen` on NumPy views
    of the packed tensors (every sequence's heads in one parallel region, where a call
    per sequence would run each alone); the output (1, Lq, Hq, Ev) as
    :func:`_packed` gives it, zeros in rows past the last sequence."""
    nq, nk = starts_q[-1], starts_k[-1]
    sinks = options["sinks"]
    if sinks is not None:       # in the computation's dtype, as the operator casts it
        sinks = _fa_torch._sinks_array(_fa_torch._array(sinks), query.dtype)
    view = _fa_torch._array
    res = _attention_varlen(view(query[0, :, :nq]).swapaxes(0, 1),
                            view(key[0, :, :nk]).swapaxes(0, 1),
                            view(value[0, :, :nk]).swapaxes(0, 1),
                            np.asarray(starts_q), np.asarray(starts_k),
                            causal=options["causal"], scale=options["scale"],
                            window=options["window"], softcap=options["softcap"],
                            sinks=sinks)
    out = _fa_torch._tensor(res, query.dtype)[None]
    rest = query.shape[2] - nq
    if rest:
        out = torch.cat([out, query.new_zeros(1, rest, *out.shape[2:])], dim=1)
    return out


def _decode_in_pages(query, key, value, pages, cu_seq_lens_q, cu_seq_lens_k,
                     attention_mask, position_bias, options):
    """A decoding step of continuous batching over transformers' paged cache, read in
    place (what FlashAttention's ``flash_attn_with_kvcache`` does with a block table):
    sequence s's new key and value rows (``key``/``value`` (1, Hkv, S, E), one token
    per sequence) are written at its position ``cu_seq_lens_k[s + 1] -
    cu_seq_lens_k[s] - 1`` of its pages (:func:`fastattn.store_kv` on views of the
    tensors), then its query attends to its pages (:func:`fastattn.attention_paged`).
    ``pages``: the layer's block table (S or more rows of page indices, -1 past a
    sequence's pages) and its page views ``k_cache``/``v_cache`` of shape (num_pages,
    page_size, Hkv, E). Returns (1, Lq, Hq, Ev): the S sequences' rows, then zeros in
    rows past the last sequence (the padding of static shapes, as :func:`_packed`
    gives them)."""
    block_table, k_cache, v_cache = pages
    if any(x is None for x in pages):
        missing = [n for n, x in zip(("block_table", "k_cache", "v_cache"), pages)
                   if x is None]
        raise NotImplementedError(
            f"a paged cache needs block_table, k_cache and v_cache; {missing} missing")
    if cu_seq_lens_q is None or cu_seq_lens_k is None or query.shape[0] != 1:
        raise NotImplementedError(
            "a paged cache (block_table) needs the packed sequences' cu_seq_lens_q and "
            "cu_seq_lens_k, in one batch row")
    if attention_mask is not None or position_bias is not None or options["dropout_p"]:
        raise NotImplementedError(
            "a paged cache (block_table) with an attention mask, a position bias or "
            "dropout")
    if (torch.is_grad_enabled()
            and any(t.requires_grad for t in (query, key, value, k_cache, v_cache))):
        raise NotImplementedError(
            "a paged cache (block_table) is written in place: inference only")
    # one new token per sequence; padded batches (static shapes) end in sequences of
    # none, whose rows (and any past the last sequence) come back as zeros
    starts_q = cu_seq_lens_q.tolist()
    S = starts_q[-1]
    if (starts_q[:S + 1] != list(range(S + 1)) or any(x != S for x in starts_q[S:])
            or S > query.shape[2]):
        raise NotImplementedError(
            f"a paged cache (block_table) takes one new token per sequence (decoding), "
            f"got cu_seq_lens_q {starts_q}")
    rows = query.shape[2]
    if not S:
        return query.new_zeros(1, rows, query.shape[1], v_cache.shape[-1])
    starts_k = cu_seq_lens_k.numpy()
    lengths = (starts_k[1:S + 1] - starts_k[:S]).astype(np.int64) \
        if starts_k.shape == (starts_k.size,) and starts_k.size > S else None
    if lengths is None or lengths.min() < 1:
        raise ValueError(
            f"cu_seq_lens_k must give each of the {S} sequences at least its new token, "
            f"got {cu_seq_lens_k.tolist()}")
    # NumPy views of the tensors (what fastattn.torch's store_kv and attention_paged
    # take), sliced and indexed in NumPy: tens of microseconds less a step than torch
    table = _view(block_table, "block_table")[:S]
    page = k_cache.shape[1]
    position = lengths - 1
    if (int(lengths.max()) - 1) // page >= table.shape[1]:
        raise ValueError(
            f"a sequence of {int(lengths.max())} tokens needs more than the block "
            f"table's {table.shape[1]} pages of {page} tokens")
    pages_of = table[np.arange(S), position // page].astype(np.int64)
    if (pages_of < 0).any():
        s = int(np.argmax(pages_of < 0))
        raise ValueError(
            f"block_table[{s}, {int(position[s]) // page}] = {int(pages_of[s])}: no page "
            f"for sequence {s}'s new token (position {int(position[s])})")
    k_pages, v_pages = _view(k_cache, "k_cache"), _view(v_cache, "v_cache")
    new = [_view(x, name)[0, :, :S].swapaxes(0, 1)
           for x, name in ((key, "key"), (value, "value"), (query, "query"))]
    _store_kv(k_pages, v_pages, pages_of * page + position % page, new[0], new[1])
    sinks = options["sinks"]
    if sinks is not None:       # in the computation's dtype, as the operator casts it
        sinks = _fa_torch._sinks_array(_view(sinks, "s_aux"), query.dtype)
    res = _attention_paged(
        new[2][:, None], k_pages, v_pages, table, lengths,
        causal=bool(options["causal"]), scale=options["scale"],
        window=options["window"], softcap=options["softcap"], sinks=sinks)
    res = res.reshape(1, S, *res.shape[2:])     # (S, 1, Hq, Ev): a view, in NumPy
    if S == rows:
        return _to_tensor(res)
    out = query.new_zeros(1, rows, *res.shape[2:])
    out[0, :S] = _to_tensor(res[0])
    return out


def attention_forward(module, query, key, value, attention_mask, dropout=0.0,
                      scaling=None, is_causal=None, softcap=None, position_bias=None,
                      s_aux=None, sliding_window=None, cu_seq_lens_q=None,
                      cu_seq_lens_k=None, **kwargs):
    """An attention function for transformers' ``AttentionInterface``.

    Parameters
    ----------
    module : torch.nn.Module
        The calling attention layer (its ``is_causal`` is read when ``is_causal`` is
        not given).
    query : Tensor of shape (B, Hq, Lq, E)
    key : Tensor of shape (B, Hkv, Lk, E)
    value : Tensor of shape (B, Hkv, Lk, Ev)
        ``Hq`` a multiple of ``Hkv``.
    attention_mask : MaskDescription or Tensor of shape (B or 1, 1 or Hq, Lq, Lk), optional
        A :class:`MaskDescription` (from :func:`build_mask`), or a boolean (True = may
        attend) or additive float mask.
    dropout : float, default 0.0
        Attention dropout (transformers passes 0.0 outside training).
    scaling : float, optional
        Default ``1 / sqrt(E)``.
    is_causal : bool, optional
        Used, as in transformers' SDPA integration, only for ``Lq > 1`` without a mask
        (and for each packed sequence without a mask).
    softcap : float, optional
        ``softcap * tanh(scores / softcap)`` before the mask (Gemma 2).
    position_bias : Tensor, optional
        Added to the scores (T5-style relative positions).
    s_aux : Tensor of shape (Hq,), optional
        Attention sinks (gpt-oss): one logit per query head that joins every row's
        softmax and carries no value (fastattn's ``sinks``); differentiable.
    sliding_window : int, optional
        The layer's window. With a mask (or a :class:`MaskDescription`), the mask's
        window applies, as in transformers' SDPA integration; without one, for packed
        sequences, ``window=(sliding_window - 1, 0)`` (``sliding_window - 1`` on both
        sides when not causal, as FlashAttention's integration in transformers).
    cu_seq_lens_q, cu_seq_lens_k : int Tensor of shape (S + 1,), optional
        Packed sequences in one batch row (continuous batching): sequence s owns the
        queries ``cu_seq_lens_q[s]:cu_seq_lens_q[s + 1]`` and the keys
        ``cu_seq_lens_k[s]:cu_seq_lens_k[s + 1]`` (``cu_seq_lens_k`` defaults to
        ``cu_seq_lens_q``); its queries are its last tokens.
    **kwargs
        :data:`IGNORED_KEYWORDS` (any value); ``block_table`` (int Tensor (S, max
        pages), -1 past a sequence's pages), ``k_cache`` and ``v_cache`` (Tensors
        (num_pages, page_size, Hkv, E)) together: a decoding step over transformers'
        paged cache, one new token per sequence in ``key``/``value`` (written into the
        pages first); any other keyword must be None.

    Returns
    -------
    (Tensor of shape (B, Lq, Hq, Ev), None)
        The layout transformers expects, and no attention weights.

    Raises
    ------
    NotImplementedError
        For a keyword not listed above whose value is not None; for a paged step
        missing one of its three tensors, with more than one new token in a sequence,
        a mask, a position bias, dropout or a gradient to record.
    ValueError
        For a :class:`MaskDescription` built for other lengths than the tensors'.
    """
    pages = tuple(kwargs.pop(name, None)
                  for name in ("block_table", "k_cache", "v_cache"))
    if kwargs:
        _refuse_unknown(kwargs)
    Lq = query.shape[2]
    if isinstance(attention_mask, MaskDescription):
        built_for = (attention_mask.q_length, attention_mask.kv_length)
        if built_for != (Lq, key.shape[2]):
            raise ValueError(
                f"the mask was built for {built_for[0]} queries and {built_for[1]} "
                f"keys; the layer has {Lq} and {key.shape[2]}")
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    packed = cu_seq_lens_q is not None or cu_seq_lens_k is not None
    mask, bias, causal, window = _rules(attention_mask, position_bias, is_causal,
                                        sliding_window, Lq, packed)
    options = dict(causal=causal, window=window, scale=scaling,
                   enable_gqa=query.shape[1] != key.shape[1], softcap=softcap,
                   sinks=s_aux, dropout_p=dropout)
    if any(x is not None for x in pages):
        return _decode_in_pages(query, key, value, pages, cu_seq_lens_q, cu_seq_lens_k,
                                attention_mask, position_bias, options), None
    if packed:
        if cu_seq_lens_q is None:
            raise ValueError("cu_seq_lens_k was given without cu_seq_lens_q")
        if (isinstance(attention_mask, MaskDescription) and cu_seq_lens_k is not None
                and not torch.equal(cu_seq_lens_q, cu_seq_lens_k)):
            # the description's rules are those of the whole row: they coincide with
            # the sequences' own only where each sequence's queries are its keys
            raise NotImplementedError(
                "a causal mask over the whole row with packed sequences whose queries "
                "and keys differ (cu_seq_lens_q != cu_seq_lens_k)")
        return _packed(query, key, value, cu_seq_lens_q, cu_seq_lens_k, mask, bias,
                       options), None
    out = _fa_torch.attention(query, key, value, mask=mask, bias=bias, **options)
    return out.transpose(1, 2).contiguous(), None


# ------------------------------------------------------------------ registration

def _is_registered(name) -> bool:
    return AttentionInterface._global_mapping.get(name) is attention_forward


def _let_continuous_batching_keep(manager_class) -> None:
    """Let transformers' continuous-batching manager keep a model on a name registered
    here: it accepts only its own implementations and refuses others. Done once."""
    switch = manager_class.switch_to_cb_friendly_attn
    if getattr(switch, "_keeps_fastattn", False):
        return

    @functools.wraps(switch)
    def switch_to_cb_friendly_attn(self, model, *args, **kwargs):
        if _is_registered(model.config._attn_implementation):
            return None
        return switch(self, model, *args, **kwargs)

    switch_to_cb_friendly_attn._keeps_fastattn = True
    manager_class.switch_to_cb_friendly_attn = switch_to_cb_friendly_attn


def _let_continuous_batching_read_pages() -> None:
    """Let transformers' continuous batching hand a model on a name registered here its
    block table in decoding steps (its "decode fast path", which it offers only to
    FlashAttention 2/3 on an accelerator), so that :func:`_decode_in_pages` reads the
    paged cache in place instead of a gathered copy of it; where some layer's cache
    cannot be read through a block table (sliding-window layers), transformers' own
    decision stands. Done once; nothing where transformers has no such decision."""
    try:
        from transformers.generation.continuous_batching import initialization as init
        decide = init.ensure_decode_fast_path_is_available
        allocators, grouped = init.ATTN_TYPE_TO_ALLOCATOR, init.group_layers_by_attn_type
    except (ImportError, AttributeError):   # pragma: no cover - other transformers
        return
    if getattr(decide, "_keeps_fastattn", False):
        return

    @functools.wraps(decide)
    def ensure_decode_fast_path_is_available(config, cb_config, *args, **kwargs):
        if (_is_registered(config._attn_implementation)
                and all(allocators[kind].supports_block_table
                        for kind in grouped(config))):
            return None         # keeps cb_config.max_blocks_per_request as resolved
        return decide(config, cb_config, *args, **kwargs)

    ensure_decode_fast_path_is_available._keeps_fastattn = True
    init.ensure_decode_fast_path_is_available = ensure_decode_fast_path_is_available


def register(name="fastattn"):
    """Register fastattn with transformers under ``name``; return ``name``.

    Afterwards ``AutoModel.from_config(cfg, attn_implementation=name)``,
    ``from_pretrained(..., attn_implementation=name)`` and
    ``model.set_attn_implementation(name)`` run every attention layer on
    :func:`attention_forward`, with the masks of :func:`build_mask`; and
    ``model.generate_batch`` (continuous batching) keeps such a model on ``name``.
    Call it before building or loading a model with ``attn_implementation=name``:
    transformers checks the name then. Registering again is harmless.

    Parameters
    ----------
    name : str, default "fastattn"

    Returns
    -------
    str
        ``name``.
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a non-empty string, got {name!r}")
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, build_mask)
    try:
        from transformers.generation.continuous_batching import ContinuousBatchingManager
    except ImportError:             # pragma: no cover - transformers without it
        pass
    else:
        if hasattr(ContinuousBatchingManager, "switch_to_cb_friendly_attn"):
            _let_continuous_batching_keep(ContinuousBatchingManager)
        _let_continuous_batching_read_pages()
    return name
