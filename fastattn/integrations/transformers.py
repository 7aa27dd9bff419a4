"""fastattn as an attention implementation of Hugging Face transformers.

>>> import fastattn.integrations.transformers as fa_hf   # doctest: +SKIP
>>> fa_hf.register()                                     # doctest: +SKIP
'fastattn'
>>> model = AutoModelForCausalLM.from_config(cfg, attn_implementation="fastattn")  # doctest: +SKIP

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
  left or right padding (in the mask);
- the config's sliding window: transformers writes it into the mask it builds, so a
  sliding window allows exactly the keys transformers' own mask allows;
- ``scaling``; a ``position_bias`` (T5-style) as an additive bias, differentiable.

A ``softcap`` (Gemma 2's ``attn_logit_softcapping``: the same result as
transformers' eager attention) and dropout in training mode (``dropout > 0``;
transformers passes ``dropout=0.0`` in evaluation mode) run in fastattn's kernels. One
case is computed by PyTorch's own arithmetic with the attention matrix formed
(``fastattn.torch._unfused_attention``): a bias that requires a gradient (T5's learned
position bias) together with a softcap or dropout. Rows with no allowed key give zeros
everywhere.

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
except ImportError as exc:          # pragma: no cover - depends on the environment
    raise ImportError(
        "fastattn.integrations.transformers needs PyTorch and transformers "
        "(>= 4.56). Install the extra: pip install \"fastattn[torch]\"") from exc

from .. import torch as _fa_torch

__all__ = ["register", "attention_forward"]


def attention_forward(module, query, key, value, attention_mask, dropout=0.0,
                      scaling=None, is_causal=None, softcap=None, position_bias=None,
                      **kwargs):
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

    Returns
    -------
    (Tensor of shape (B, Lq, Hq, Ev), None)
        The layout transformers expects, and no attention weights.
    """
    Lq = query.shape[2]
    enable_gqa = query.shape[1] != key.shape[1]
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    # as transformers' SDPA integration: a mask, when there is one, holds the causal
    # rule (bottom-right for a cache); without one, one query row is not causal
    is_causal = bool(Lq > 1 and attention_mask is None and is_causal)
    if (attention_mask is None and position_bias is None and softcap is None
            and not dropout and _fa_torch._plain(query, key, value)):
        # the common call (decoding, prefill without padding), in the fewest steps
        out = _fa_torch._plain_call(query, key, value, is_causal, scaling, enable_gqa,
                                    None, False)
        return out.transpose(1, 2).contiguous(), None
    mask = bias = None
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            mask = attention_mask
        else:
            bias = attention_mask
    if position_bias is not None:
        bias = position_bias if bias is None else position_bias + bias
    if bias is not None and bias.requires_grad and (softcap is not None or dropout > 0):
        # a learned bias (T5) with softcap or dropout: PyTorch's own arithmetic
        out = _fa_torch._unfused_attention(
            query, key, value, mask, bias, is_causal=is_causal, scale=scaling,
            enable_gqa=enable_gqa, softcap=softcap, dropout_p=dropout)
    else:
        out = _fa_torch.attention(query, key, value, mask=mask, bias=bias,
                                  causal=is_causal, scale=scaling, enable_gqa=enable_gqa,
                                  softcap=softcap, dropout_p=dropout)
    return out.transpose(1, 2).contiguous(), None


def register(name="fastattn"):
    """Register fastattn with transformers under ``name``; return ``name``.

    Afterwards ``AutoModel.from_config(cfg, attn_implementation=name)``,
    ``from_pretrained(..., attn_implementation=name)`` and
    ``model.set_attn_implementation(name)`` run every attention layer on
    :func:`attention_forward`; the masks are built by transformers' ``sdpa_mask``
    (boolean, or ``None`` where ``is_causal`` suffices). Registering again is harmless.

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
