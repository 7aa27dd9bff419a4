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
and transformers' own ``sdpa_mask`` to its ``AttentionMaskInterface`` under the same
name, so a model built with that ``attn_implementation`` (or switched to it with
``model.set_attn_implementation``) gets exactly the masks it would give PyTorch's SDPA
and runs every attention layer on fastattn's operator (``fastattn.torch``):

- boolean 4-D masks (True = may attend) and additive float masks, including the large
  negative values (``torch.finfo(dtype).min``) that transformers uses as well as
  ``-inf``; ``None`` with ``is_causal`` (top-left, as SDPA);
- grouped-query heads natively (no ``repeat_kv`` copies), key-value caches
  (``Lq < Lk``: the mask, or none for a single query, makes the bottom-right rule),
  left or right padding and packed sequences (in the mask);
- ``sliding_window``: accepted because transformers writes the window into the mask
  it builds with ``sdpa_mask`` (and leaves the mask out only where the window cannot
  bind), so a sliding window allows exactly the keys transformers' own mask allows;
  fastattn does not apply it a second time;
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
``sinks`` of some models, DeepSeek's sparse ``indices``, FlashAttention's
``cu_seq_lens_q``/``cu_seq_lens_k``). ``output_attentions=True`` logs the warning
transformers' SDPA integration logs: no attention weights are returned.

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

try:
    import torch
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    from transformers.utils import logging as _hf_logging
except ImportError as exc:          # pragma: no cover - depends on the environment
    raise ImportError(
        "fastattn.integrations.transformers needs PyTorch and transformers "
        "(>= 4.56). Install the extra: pip install \"fastattn[torch]\"") from exc

from .. import torch as _fa_torch

__all__ = ["register", "attention_forward", "IGNORED_KEYWORDS"]

logger = _hf_logging.get_logger(__name__)

#: Keywords that transformers passes to attention functions and that do not change
#: the result here, whatever their value: the positions (already in the rotary
#: embeddings of query and key, and in the mask, packed sequences included), the
#: cache's bookkeeping (the cache is already in key and value), the model's output
#: flags, a loss normaliser, a determinism request (fastattn is deterministic) and
#: FlashAttention's length hints. ``output_attentions=True`` also logs a warning.
IGNORED_KEYWORDS = frozenset({
    "position_ids", "cache_position", "use_cache", "output_attentions",
    "output_hidden_states", "output_router_logits", "num_items_in_batch",
    "deterministic", "max_length_q", "max_length_k",
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


def attention_forward(module, query, key, value, attention_mask, dropout=0.0,
                      scaling=None, is_causal=None, softcap=None, position_bias=None,
                      s_aux=None, sliding_window=None, **kwargs):
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
    attention_mask : Tensor of shape (B or 1, 1 or Hq, Lq, Lk), optional
        Boolean (True = may attend) or additive float.
    dropout : float, default 0.0
        Attention dropout (transformers passes 0.0 outside training).
    scaling : float, optional
        Default ``1 / sqrt(E)``.
    is_causal : bool, optional
        Used, as in transformers' SDPA integration, only for ``Lq > 1`` without a mask.
    softcap : float, optional
        ``softcap * tanh(scores / softcap)`` before the mask (Gemma 2).
    position_bias : Tensor, optional
        Added to the scores (T5-style relative positions).
    s_aux : Tensor of shape (Hq,), optional
        Attention sinks (gpt-oss): one logit per query head that joins every row's
        softmax and carries no value (fastattn's ``sinks``); differentiable.
    sliding_window : int, optional
        The layer's window; transformers has already written it into
        ``attention_mask`` (``sdpa_mask``), which is what applies it here.
    **kwargs
        :data:`IGNORED_KEYWORDS` (any value); any other keyword must be None.

    Returns
    -------
    (Tensor of shape (B, Lq, Hq, Ev), None)
        The layout transformers expects, and no attention weights.

    Raises
    ------
    NotImplementedError
        For a keyword not listed above whose value is not None.
    """
    if kwargs:
        _refuse_unknown(kwargs)
    Lq = query.shape[2]
    enable_gqa = query.shape[1] != key.shape[1]
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    # as transformers' SDPA integration: a mask, when there is one, holds the causal
    # rule (bottom-right for a cache); without one, one query row is not causal
    is_causal = bool(Lq > 1 and attention_mask is None and is_causal)
    mask = bias = None
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            mask = attention_mask
        else:
            bias = attention_mask
    if position_bias is not None:
        bias = position_bias if bias is None else position_bias + bias
    out = _fa_torch.attention(query, key, value, mask=mask, bias=bias,
                              causal=is_causal, scale=scaling, enable_gqa=enable_gqa,
                              softcap=softcap, sinks=s_aux, dropout_p=dropout)
    return out.transpose(1, 2).contiguous(), None


def register(name="fastattn"):
    """Register fastattn with transformers under ``name``; return ``name``.

    Afterwards ``AutoModel.from_config(cfg, attn_implementation=name)``,
    ``from_pretrained(..., attn_implementation=name)`` and
    ``model.set_attn_implementation(name)`` run every attention layer on
    :func:`attention_forward`; the masks are built by transformers' ``sdpa_mask``
    (boolean, or ``None`` where ``is_causal`` suffices). Call it before building or
    loading a model with ``attn_implementation=name``: transformers checks the name
    then. Registering again is harmless.

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
    AttentionMaskInterface.register(name, sdpa_mask)
    return name
