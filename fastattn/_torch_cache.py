"""Paged and quantized key-value caches on PyTorch tensors (``fastattn.torch``).

The NumPy functions of ``fastattn._serving`` (and a quantized cache in
``fastattn.attention``) on CPU tensors, read and written in place through NumPy
views: int8 and ``torch.float8_e4m3fn``/``float8_e5m2`` codes, bfloat16 through its
16-bit words. These are for inference: a cache has no gradient, and a tensor that
requires one is refused rather than silently cut off from autograd.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from . import _serving
from ._api import attention as _np_attention

__all__ = ["attention_paged", "store_kv", "quantize_kv", "is_code",
           "quantized_attention"]

_FLOAT8 = {torch.float8_e4m3fn: "float8_e4m3fn", torch.float8_e5m2: "float8_e5m2"}


def is_code(t) -> bool:
    """Is ``t`` a tensor of 8-bit codes (int8, float8)?"""
    return isinstance(t, Tensor) and (t.dtype == torch.int8 or t.dtype in _FLOAT8)


def _ml_dtypes():
    try:
        import ml_dtypes
    except ImportError:                 # pragma: no cover - depends on the environment
        raise TypeError("float8 and bfloat16 tensors need ml_dtypes "
                        "(pip install ml_dtypes)") from None
    return ml_dtypes


def _view(t, name: str, *, writeable: bool = False) -> np.ndarray | None:
    """A NumPy view of a CPU tensor's memory (no copy): float32/64, float16, bfloat16,
    int8 and float8 codes, and integer index tensors."""
    if t is None:
        return None
    if not isinstance(t, Tensor):
        if writeable:
            raise TypeError(f"{name} must be a torch.Tensor (written in place), got "
                            f"{type(t).__name__}")
        return np.asarray(t)
    if not t.is_cpu or t.layout != torch.strided:
        raise ValueError(f"fastattn computes on the CPU: {name} is a {t.layout} tensor "
                         f"on {t.device}; move it with .cpu()")
    if t.requires_grad and torch.is_grad_enabled():
        raise TypeError(
            f"{name} requires a gradient, but paged and quantized caches are for "
            f"inference (no gradient): call under torch.no_grad() or detach it")
    if t.requires_grad:                 # (under no_grad: a view without the graph)
        t = t.detach()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(_ml_dtypes().bfloat16)
    if t.dtype in _FLOAT8:
        return t.view(torch.uint8).numpy().view(getattr(_ml_dtypes(), _FLOAT8[t.dtype]))
    return t.numpy()


def _to_tensor(a: np.ndarray) -> Tensor:
    """A result array as a tensor (no copy; bfloat16 and float8 through their words)."""
    if a.dtype.isbuiltin == 1:      # one of NumPy's own (dtype.name costs microseconds)
        return torch.from_numpy(a)
    name = a.dtype.name
    if name == "bfloat16":
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    for dtype, code in _FLOAT8.items():
        if name == code:
            return torch.from_numpy(a.view(np.uint8)).view(dtype)
    return torch.from_numpy(a)


def _results(res, out):
    """The NumPy call's result(s) as tensors; ``out`` filled (and returned) if given."""
    lse = None
    if isinstance(res, tuple):
        res, lse = res
    t = _to_tensor(res)
    if out is not None:
        out.copy_(t)
        t = out
    return t if lse is None else (t, torch.from_numpy(lse))


def _check_out(out):
    if out is not None and not (isinstance(out, Tensor) and out.is_cpu):
        raise TypeError(f"out must be a CPU torch.Tensor, got {type(out).__name__}")
    if out is not None and out.requires_grad and torch.is_grad_enabled():
        raise RuntimeError("out requires a gradient: a result written in place has none")


def quantized_attention(q, k, v, *, out=None, **keywords):
    """:func:`fastattn.attention` with a quantized cache (int8 or float8 k and v and
    their scales) on tensors; not differentiable (see the module's docstring)."""
    _check_out(out)
    arrays = {name: _view(x, name) for name, x in keywords.items()
              if isinstance(x, Tensor)}
    keywords.update(arrays)
    res = _np_attention(_view(q, "q"), _view(k, "k"), _view(v, "v"), **keywords)
    return _results(res, out)


def attention_paged(q, k_cache, v_cache, block_table, kv_lengths, *, cu_seqlens_q=None,
                    k_scale=None, v_scale=None, scale=None, causal=True, window=None,
                    softcap=None, alibi_slopes=None, sinks=None, return_lse=False,
                    out=None, num_threads=None):
    """:func:`fastattn.attention_paged` on CPU tensors, read in place.

    Parameters
    ----------
    q : Tensor of shape (B, Lq, Hq, E), or (total_q, Hq, E) with cu_seqlens_q
    k_cache, v_cache : Tensor of shape (num_blocks, block_size, Hkv, E / Ev)
        float32, float64, bfloat16, float16, or 8-bit codes (int8 with scales,
        ``torch.float8_e4m3fn``/``float8_e5m2``); any strides.
    block_table : int Tensor of shape (B, max_blocks)
    kv_lengths : int Tensor of shape (B,)
    cu_seqlens_q, k_scale, v_scale, scale, causal, window, softcap, alibi_slopes,
    sinks, return_lse, num_threads
        As in :func:`fastattn.attention_paged`.
    out : Tensor, optional
        Filled with the result and returned.

    Returns
    -------
    out : Tensor of shape (B, Lq, Hq, Ev) or (total_q, Hq, Ev), in q's dtype
    lse : Tensor of shape (B, Hq, Lq) or (Hq, total_q)
        Only with ``return_lse``.

    Raises
    ------
    TypeError
        For a tensor that requires a gradient (with grad mode on): a cache is for
        inference. Else as :func:`fastattn.attention_paged`.

    Examples
    --------
    >>> import torch, fastattn.torch
    >>> k_cache = torch.randn(8, 16, 2, 64, dtype=torch.bfloat16)
    >>> table = torch.tensor([[3, 5], [7, 0]], dtype=torch.int32)
    >>> q = torch.randn(2, 1, 4, 64, dtype=torch.bfloat16)
    >>> fastattn.torch.attention_paged(q, k_cache, k_cache, table,
    ...                                torch.tensor([20, 9])).shape
    torch.Size([2, 1, 4, 64])
    """
    _check_out(out)
    res = _serving.attention_paged(
        _view(q, "q"), _view(k_cache, "k_cache"), _view(v_cache, "v_cache"),
        _view(block_table, "block_table"), _view(kv_lengths, "kv_lengths"),
        cu_seqlens_q=_view(cu_seqlens_q, "cu_seqlens_q"),
        k_scale=_view(k_scale, "k_scale"), v_scale=_view(v_scale, "v_scale"),
        scale=scale, causal=causal, window=window, softcap=softcap,
        alibi_slopes=_view(alibi_slopes, "alibi_slopes"), sinks=_view(sinks, "sinks"),
        return_lse=return_lse, num_threads=num_threads)
    return _results(res, out)


def store_kv(k_cache, v_cache, slots, k, v, *, k_scale=None, v_scale=None):
    """:func:`fastattn.store_kv` on CPU tensors: the caches (and a quantized cache's
    full-shape scales) written in place.

    Parameters
    ----------
    k_cache, v_cache : Tensor of shape (num_blocks, block_size, Hkv, E / Ev)
    slots : int Tensor of shape (n,)
    k, v : Tensor of shape (n, Hkv, E / Ev)
    k_scale, v_scale : Tensor, optional
        As in :func:`fastattn.store_kv` (written when of the caches' full shape
        (num_blocks, block_size, Hkv)).

    Examples
    --------
    >>> import torch, fastattn.torch
    >>> k_cache = torch.zeros(4, 2, 1, 8)
    >>> fastattn.torch.store_kv(k_cache, k_cache.clone(), torch.tensor([3]),
    ...                         torch.ones(1, 1, 8), torch.ones(1, 1, 8))
    >>> k_cache[1, 1].sum().item()
    8.0
    """
    full = None if k_cache is None else tuple(k_cache.shape[:3])

    def scales(t, name):
        if isinstance(t, Tensor) and tuple(t.shape) == full:
            return _view(t, name, writeable=True)
        return _view(t, name)

    _serving.store_kv(_view(k_cache, "k_cache", writeable=True),
                      _view(v_cache, "v_cache", writeable=True), _view(slots, "slots"),
                      _view(k, "k"), _view(v, "v"), k_scale=scales(k_scale, "k_scale"),
                      v_scale=scales(v_scale, "v_scale"))


def quantize_kv(x, dtype="int8", *, axis_scale="token"):
    """:func:`fastattn.quantize_kv` on a tensor: ``(codes, scale)`` tensors (int8 or
    ``torch.float8_e4m3fn``/``float8_e5m2`` codes; float32 scales). ``dtype`` may be
    a name or a torch dtype.

    Examples
    --------
    >>> import torch, fastattn.torch
    >>> codes, scale = fastattn.torch.quantize_kv(torch.tensor([[1.0, -0.5]]))
    >>> codes.dtype, codes.tolist(), round(scale.item() * 127, 6)
    (torch.int8, [[127, -64]], 1.0)
    """
    if isinstance(dtype, torch.dtype):
        dtype = "int8" if dtype == torch.int8 else _FLOAT8.get(dtype, str(dtype))
    codes, scale = _serving.quantize_kv(_view(x, "x"), dtype, axis_scale=axis_scale)
    return _to_tensor(codes), torch.from_numpy(scale)
