"""fastattn for PyTorch tensors: a drop-in ``scaled_dot_product_attention``.

``fastattn.torch.scaled_dot_product_attention`` takes the arguments of
``torch.nn.functional.scaled_dot_product_attention`` and gives its results on CPU
tensors; ``fastattn.torch.attention`` is :func:`fastattn.attention` (the NumPy API's
keywords) on tensors. Both run the custom operator ``torch.ops.fastattn.attention``,
registered with ``torch.library``:

- the real implementation reads the tensors in place through their strides
  (``Tensor.numpy()`` views; a ``(B, L, H, E)`` buffer seen as ``(B, H, L, E)`` is
  not copied), runs the kernels with the GIL released, and wraps the NumPy result as
  the output tensor (``torch.from_numpy``: no copy);
- an autograd formula: the gradients of q, k and v come from
  :func:`fastattn.attention_backward` (the operator ``torch.ops.fastattn.attention_backward``);
  that of a float mask (an additive bias), when it requires one, from PyTorch's own
  arithmetic;
- a fake (meta) implementation, so that ``torch.compile`` puts the operator in its
  graph without a graph break.

A call that has nothing for that machinery to do (no input requires a gradient or
grad mode is off; no ``torch.compile``/``torch.export`` tracing, no ``torch.jit``
tracing, no ``torch.func`` transform, no dispatch or ``__torch_function__`` mode, no
tensor subclass, no profiler; CPU tensors) skips the dispatcher and runs the same
implementation directly (:func:`_direct`): the same results, the same tensors, tens
of microseconds less per call.

This module needs PyTorch (``pip install "fastattn[torch]"``); ``import fastattn``
does not import it.

Dtypes: float32 and float64 are computed natively; bfloat16 and float16 tensors are
handed to the NumPy API as they are (bfloat16 as an ``ml_dtypes.bfloat16`` view of the
same memory), read a block at a time, computed in float32 and rounded once, as the
NumPy API does: the error is no larger than that of PyTorch's own bfloat16/float16
attention. Without ml_dtypes, bfloat16 tensors go through float32 copies.
"""

from __future__ import annotations

import math
import numbers

import numpy as np

try:
    import torch
except ImportError as exc:          # pragma: no cover - depends on the environment
    raise ImportError(
        "fastattn.torch needs PyTorch, which is not installed. Install the extra: "
        "pip install \"fastattn[torch]\" (or: pip install torch)") from exc

from . import _validation as _v
from ._api import attention as _np_attention
from ._grad import attention_backward as _np_attention_backward

__all__ = ["scaled_dot_product_attention", "attention"]

Tensor = torch.Tensor

# causal rules as the operator's integer argument
_NO_CAUSAL, _TOP_LEFT, _BOTTOM_RIGHT = 0, 1, 2
_CAUSAL_NAMES = {_NO_CAUSAL: False, _TOP_LEFT: "top_left", _BOTTOM_RIGHT: "bottom_right"}
_CAUSAL_CODES = {None: _NO_CAUSAL, "top_left": _TOP_LEFT, "bottom_right": _BOTTOM_RIGHT}
_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)

try:                                # bfloat16 tensors as NumPy views (the torch extra)
    import ml_dtypes as _ml_dtypes
except ImportError:                 # pragma: no cover - depends on the environment
    _BFLOAT16 = None
else:
    _BFLOAT16 = np.dtype(_ml_dtypes.bfloat16)
# the operators' variant arguments of a call without variants (see _variant_args)
_NO_VARIANTS = (None, None, None, None, 0.0, None)


# -------------------------------------------------------------- tensors <-> ndarrays

def _array(t: Tensor | None) -> np.ndarray | None:
    """A NumPy view of a CPU tensor (no copy); bfloat16 as an ``ml_dtypes.bfloat16``
    view of its 16-bit words (a float32 copy without ml_dtypes)."""
    if t is None:
        return None
    if t.requires_grad:
        t = t.detach()
    if t.dtype == torch.bfloat16:
        if _BFLOAT16 is None:
            return t.float().numpy()
        return t.view(torch.int16).numpy().view(_BFLOAT16)
    return t.numpy()


def _tensor(a: np.ndarray, dtype: torch.dtype) -> Tensor:
    """The kernels' result as a tensor (no copy; bfloat16 through its 16-bit words),
    rounded to ``dtype`` if it is another."""
    if _BFLOAT16 is not None and a.dtype == _BFLOAT16:
        t = torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    else:
        t = torch.from_numpy(a)
    return t if t.dtype == dtype else t.to(dtype)


def _lse_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _batch_shape(q: Tensor, k: Tensor, enable_gqa: bool):
    """The output's batch shape (*batch), for the fake implementation."""
    if enable_gqa:
        return tuple(torch.broadcast_shapes(q.shape[:-3], k.shape[:-3])) + (q.shape[-3],)
    return tuple(torch.broadcast_shapes(q.shape[:-2], k.shape[:-2]))


# ------------------------------------------------------------------ the operators

# the arguments both operators take after their tensors
_OPTIONS = ("Tensor? mask, Tensor? bias, int causal, float? scale, bool enable_gqa, "
            "int? num_threads, int? window_left, int? window_right, float? softcap, "
            "Tensor? alibi_slopes, float dropout_p, Tensor? dropout_seed")


def _variants(window_left, window_right, softcap, alibi_slopes, dropout_p,
              dropout_seed) -> dict:
    """The NumPy API's variant keywords from the operators' arguments, only those that
    are set (a call with none takes the NumPy API's no-variant shortcut); the dropout
    seed travels as a one-element tensor, so that drawing it never breaks a graph."""
    kw = {}
    if window_left is not None or window_right is not None:
        kw["window"] = (window_left, window_right)
    if softcap is not None:
        kw["softcap"] = softcap
    if alibi_slopes is not None:
        kw["alibi_slopes"] = _array(alibi_slopes)
    if dropout_p:
        kw["dropout_p"] = dropout_p
        kw["dropout_seed"] = None if dropout_seed is None else int(dropout_seed.item())
    return kw


def _forward(q, k, v, mask, bias, causal, scale, enable_gqa, num_threads,
             window_left, window_right, softcap, alibi_slopes, dropout_p, dropout_seed,
             return_lse=True):
    """The forward computation on tensors: ``out`` or ``(out, lse)``. The kernels read
    the tensors' memory and write a new buffer that becomes the result tensor (no
    copies of q, k and v, bfloat16 included)."""
    res = _np_attention(
        _array(q), _array(k), _array(v), mask=_array(mask), bias=_array(bias),
        causal=_CAUSAL_NAMES[causal], scale=scale, enable_gqa=enable_gqa,
        return_lse=return_lse, num_threads=num_threads,
        **_variants(window_left, window_right, softcap, alibi_slopes, dropout_p,
                    dropout_seed))
    if return_lse:
        return _tensor(res[0], q.dtype), torch.from_numpy(res[1])
    return _tensor(res, q.dtype)


@torch.library.custom_op(
    "fastattn::attention", mutates_args=(), device_types="cpu",
    schema=f"(Tensor q, Tensor k, Tensor v, {_OPTIONS}) -> (Tensor, Tensor)")
def _attention_op(q, k, v, mask, bias, causal, scale, enable_gqa, num_threads,
                  window_left, window_right, softcap, alibi_slopes, dropout_p,
                  dropout_seed):
    """(out, lse) of fastattn.attention; causal: 0 none, 1 top-left, 2 bottom-right."""
    return _forward(q, k, v, mask, bias, causal, scale, enable_gqa, num_threads,
                    window_left, window_right, softcap, alibi_slopes, dropout_p,
                    dropout_seed)


@_attention_op.register_fake
def _attention_fake(q, k, v, mask, bias, causal, scale, enable_gqa, num_threads,
                    *variants):
    batch = _batch_shape(q, k, enable_gqa)
    out = q.new_empty(batch + (q.shape[-2], v.shape[-1]))
    lse = q.new_empty(batch + (q.shape[-2],), dtype=_lse_dtype(q.dtype))
    return out, lse


@torch.library.custom_op(
    "fastattn::attention_backward", mutates_args=(), device_types="cpu",
    schema=(f"(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
            f"{_OPTIONS}) -> (Tensor, Tensor, Tensor)"))
def _attention_backward_op(grad_out, q, k, v, out, lse, mask, bias, causal, scale,
                           enable_gqa, num_threads, window_left, window_right, softcap,
                           alibi_slopes, dropout_p, dropout_seed):
    """(dq, dk, dv) of fastattn.attention_backward (dropout regenerated from the seed)."""
    grads = _np_attention_backward(
        _array(grad_out), _array(q), _array(k), _array(v), _array(out), _array(lse),
        mask=_array(mask), bias=_array(bias), causal=_CAUSAL_NAMES[causal], scale=scale,
        enable_gqa=enable_gqa, num_threads=num_threads,
        **_variants(window_left, window_right, softcap, alibi_slopes, dropout_p,
                    dropout_seed))
    return tuple(_tensor(g, q.dtype) for g in grads)


@_attention_backward_op.register_fake
def _attention_backward_fake(grad_out, q, k, v, out, lse, mask, bias, causal, scale,
                             enable_gqa, num_threads, *variants):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    (q, k, v, mask, bias, causal, scale, enable_gqa, num_threads, window_left,
     window_right, softcap, alibi_slopes, dropout_p, dropout_seed) = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, mask, bias, out, lse, alibi_slopes, dropout_seed)
    ctx.options = (causal, scale, enable_gqa, num_threads, window_left, window_right,
                   softcap, dropout_p)
    ctx.mark_non_differentiable(lse)


def _backward(ctx, grad_out, grad_lse):
    q, k, v, mask, bias, out, lse, alibi_slopes, dropout_seed = ctx.saved_tensors
    (causal, scale, enable_gqa, num_threads, window_left, window_right, softcap,
     dropout_p) = ctx.options
    dq = dk = dv = dbias = None
    if any(ctx.needs_input_grad[:3]):
        dq, dk, dv = torch.ops.fastattn.attention_backward(
            grad_out, q, k, v, out, lse, mask, bias, causal, scale, enable_gqa,
            num_threads, window_left, window_right, softcap, alibi_slopes, dropout_p,
            dropout_seed)
    if bias is not None and ctx.needs_input_grad[4]:
        if (window_left, window_right, softcap, dropout_p) != (None, None, None, 0.0) \
                or alibi_slopes is not None:
            raise NotImplementedError(
                "the gradient of a floating attn_mask is computed only without window, "
                "softcap, alibi_slopes and dropout")
        dbias = _bias_grad(grad_out, q, k, v, out, lse, mask, bias, causal, scale,
                           enable_gqa)
    return (dq, dk, dv, None, dbias) + (None,) * 10


_attention_op.register_autograd(_backward, setup_context=_setup_context)


# ------------------------------------------------------------- the direct path

_C = torch._C
_functorch_layers = _C._functorch.peek_interpreter_stack
_compiling = torch.compiler.is_compiling
_dispatch_modes = _C._len_torch_dispatch_stack
_function_modes = _C._is_torch_function_mode_enabled
_tracing = _C._get_tracing_state
_profiling = _C._autograd._profiler_enabled
_grad_enabled = _C.is_grad_enabled


def _dispatcher_needed() -> bool:
    """Whether something outside the tensors needs the dispatcher: ``torch.compile``
    or ``torch.export`` tracing, ``torch.jit`` tracing, a ``torch.func`` transform, a
    dispatch or ``__torch_function__`` mode, the profiler."""
    return bool(_compiling() or _dispatch_modes() or _function_modes()
                or _functorch_layers() is not None or _tracing() is not None
                or _profiling())


def _direct(tensors) -> bool:
    """Whether a call may run :func:`_forward` itself instead of going through the
    dispatcher (``torch.ops.fastattn.attention``), whose every step would then be a
    pass-through: no ``torch.compile``/``torch.export`` tracing (which needs the
    operator in its graph), no ``torch.jit`` tracing, no ``torch.func`` transform
    (``vmap``, ``grad``), no dispatch mode (fake tensors, ``make_fx``, FLOP counters),
    no ``__torch_function__`` mode, no profiler (which records the operator by name),
    only plain CPU tensors (no subclass, no meta tensor), and no autograd to record
    (grad mode off, or no input requires a gradient). ``tensors``: the operator's
    tensor arguments, None where absent. The checks cost about a microsecond; the
    dispatcher's round trip through Python, tens."""
    if _dispatcher_needed():
        return False
    grad = _grad_enabled()
    for t in tensors:
        if t is not None and (type(t) is not Tensor or not t.is_cpu
                              or (grad and t.requires_grad)):
            return False
    return True


def _call(q, k, v, mask, bias, causal, scale, enable_gqa, num_threads, variants,
          return_lse):
    """The operator on checked arguments: directly when nothing needs the dispatcher
    (:func:`_direct`), else through ``torch.ops.fastattn.attention``. ``variants``:
    the six values of :func:`_variant_args`; ``num_threads`` not yet checked."""
    if _direct((q, k, v, mask, bias, variants[3])):
        # num_threads is checked by the NumPy API (the same check, the same errors)
        return _forward(q, k, v, mask, bias, causal, scale, enable_gqa, num_threads,
                        *variants, return_lse=return_lse)
    out, lse = torch.ops.fastattn.attention(q, k, v, mask, bias, causal, scale,
                                            enable_gqa, _check_threads(num_threads),
                                            *variants)
    return (out, lse) if return_lse else out


def _plain(q, k, v) -> bool:
    """Whether q, k, v can go straight to the kernels as they are: :func:`_direct`
    holds for them, and they are tensors of one of the four dtypes (the checks of
    :func:`_check_data`, which then has nothing to say). Written out for three
    tensors: it runs on every call."""
    if type(q) is not Tensor or type(k) is not Tensor or type(v) is not Tensor:
        return False
    dtype = q.dtype
    if (dtype not in _DTYPES or k.dtype is not dtype or v.dtype is not dtype
            or not (q.is_cpu and k.is_cpu and v.is_cpu)):
        return False
    if _grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return False
    return not _dispatcher_needed()


def _plain_call(q, k, v, causal, scale, enable_gqa, num_threads, return_lse):
    """The most common call, as few steps as it can be: plain tensors (:func:`_plain`),
    no mask, bias or variant; ``causal`` the NumPy API's value. The NumPy API checks
    ``scale``, ``enable_gqa`` and ``num_threads`` (the checks and messages of this
    module's)."""
    res = _np_attention(_array(q), _array(k), _array(v), causal=causal, scale=scale,
                        enable_gqa=enable_gqa, return_lse=return_lse,
                        num_threads=num_threads)
    if return_lse:
        return _tensor(res[0], q.dtype), torch.from_numpy(res[1])
    return _tensor(res, q.dtype)


def _allowed(mask: Tensor | None, causal: int, Lq, Lk, device) -> Tensor | None:
    """The keys each query may attend to under ``mask`` and the causal rule."""
    if causal != _NO_CAUSAL:
        offset = Lk - Lq if causal == _BOTTOM_RIGHT else 0
        i = torch.arange(Lq, device=device)[:, None]
        j = torch.arange(Lk, device=device)[None, :]
        rule = j <= i + offset
        mask = rule if mask is None else mask & rule
    return mask


def _bias_grad(grad_out, q, k, v, out, lse, mask, bias, causal, scale, enable_gqa):
    """The gradient of a float mask (bias): ``dS = P * (dO V^T - rowsum(dO * O))``,
    summed over the axes the bias was broadcast along. PyTorch's arithmetic, with the
    (*batch, Lq, Lk) matrix formed: only when a bias requires a gradient."""
    comp = _lse_dtype(q.dtype)
    q, k, v, grad_out, out, lse = (t.to(comp) for t in (q, k, v, grad_out, out, lse))
    if enable_gqa:
        groups = q.shape[-3] // k.shape[-3]
        k = k.repeat_interleave(groups, dim=-3)
        v = v.repeat_interleave(groups, dim=-3)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    s = torch.matmul(q, k.transpose(-1, -2)) * scale + bias.to(comp)
    p = torch.exp(s - lse[..., None])
    blocked = torch.isneginf(lse)[..., None]
    allowed = _allowed(mask, causal, q.shape[-2], k.shape[-2], q.device)
    if allowed is not None:
        blocked = blocked | ~allowed
    p = torch.where(blocked, torch.zeros((), dtype=comp), p)
    dp = torch.matmul(grad_out, v.transpose(-1, -2))
    ds = p * (dp - (grad_out * out).sum(-1, keepdim=True))
    return ds.sum_to_size(bias.shape).to(bias.dtype)


# ------------------------------------------------------------------ argument checks

def _check_data(tensors, names, same_dtype: bool) -> None:
    for t, name in zip(tensors, names):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not (t.is_cpu or t.is_meta):
            raise ValueError(
                f"fastattn computes on the CPU: {name} is on {t.device}; move it with "
                f".cpu() (or use torch.nn.functional.scaled_dot_product_attention)")
        if t.dtype not in _DTYPES:
            raise TypeError(
                f"{name} must be float32, float64, bfloat16 or float16, got {t.dtype}")
    q, k, v = tensors
    if same_dtype and not q.dtype == k.dtype == v.dtype:
        raise TypeError(
            "query, key and value must have the same dtype, got "
            + ", ".join(f"{n} {t.dtype}" for t, n in zip(tensors, names)))


def _check_mask(t, name: str, kind: str) -> Tensor | None:
    if t is None:
        return None
    if not isinstance(t, Tensor):
        t = torch.as_tensor(t)
    if kind == "mask" and t.dtype != torch.bool:
        raise TypeError(
            f"{name} must be a boolean tensor (True = may attend), got {t.dtype}; "
            f"an additive mask is a bias")
    if kind == "bias" and (t.dtype == torch.bool or t.is_complex()):
        raise TypeError(f"{name} must hold real numbers, got {t.dtype}")
    if kind == "bias" and not t.is_floating_point():
        t = t.to(torch.float64)         # integers, as in the NumPy API
    return t


def _check_scale(scale) -> float | None:
    if scale is None:
        return None
    if isinstance(scale, (bool, np.bool_)) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a real number or None, got {scale!r}")
    return float(scale)


def _check_threads(num_threads) -> int | None:
    return None if num_threads is None else _v.check_num_threads(num_threads)


# ------------------------------------------------------------------------------------
# The variants (window, softcap, ALiBi, dropout) are computed by the kernels
# themselves: the operators pass them to the NumPy API. _unfused_attention computes
# attention with PyTorch's own arithmetic (the attention matrix formed), for the
# gradient of a floating mask and as a reference.
# ------------------------------------------------------------------------------------

def _check_window(window):
    if window is None:
        return None
    try:
        left, right = window
    except (TypeError, ValueError):
        raise ValueError(f"window must be a pair (left, right), got {window!r}") from None
    for side in (left, right):
        if side is not None and (isinstance(side, (bool, np.bool_))
                                 or not isinstance(side, numbers.Integral) or side < 0):
            raise ValueError(
                f"window sides must be None or integers >= 0, got {window!r}")
    return (None if left is None else int(left), None if right is None else int(right))


def _variant_args(q, window, softcap, alibi_slopes, dropout_p):
    """The variant arguments of the operators, checked: (window_left, window_right,
    softcap, alibi_slopes, dropout_p, dropout_seed). The dropout seed is drawn from
    torch's default generator (``torch.manual_seed`` makes a run reproducible) as a
    tensor, and regenerated from it in the backward."""
    if (window is None and softcap is None and alibi_slopes is None
            and type(dropout_p) in (float, int) and dropout_p == 0):
        return _NO_VARIANTS                 # the common call: nothing to check
    window = _check_window(window) or (None, None)
    if alibi_slopes is not None:
        alibi_slopes = torch.as_tensor(alibi_slopes)
        if alibi_slopes.dtype == torch.bool or alibi_slopes.is_complex():
            raise TypeError(f"alibi_slopes must hold real numbers, got "
                            f"{alibi_slopes.dtype}")
        alibi_slopes = alibi_slopes.to(_lse_dtype(q.dtype))
    softcap = None if softcap is None else _v.check_softcap(softcap)
    dropout_p, _ = _v.check_dropout(dropout_p, 0)
    seed = None
    if dropout_p > 0:
        seed = torch.randint(0, 2**62, (1,), dtype=torch.int64)
    return window[0], window[1], softcap, alibi_slopes, dropout_p, seed


def _unfused_attention(query, key, value, mask=None, bias=None, *, is_causal=False,
                       scale=None, enable_gqa=False, softcap=None, dropout_p=0.0):
    """Attention with PyTorch's own arithmetic and the attention matrix formed, in
    float32 (float64 for float64 inputs), with softcap and dropout; rows with no
    allowed key give zeros, as everywhere in fastattn. Causal is top-left."""
    comp = _lse_dtype(query.dtype)
    q, k, v = query.to(comp), key.to(comp), value.to(comp)
    if enable_gqa and q.shape[-3] != k.shape[-3]:
        groups = q.shape[-3] // k.shape[-3]
        k = k.repeat_interleave(groups, dim=-3)
        v = v.repeat_interleave(groups, dim=-3)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    if bias is not None:
        s = s + bias.to(comp)
    allowed = _allowed(mask, _TOP_LEFT if is_causal else _NO_CAUSAL,
                       q.shape[-2], k.shape[-2], q.device)
    if allowed is not None:
        s = s.masked_fill(~allowed, float("-inf"))
    top = s.amax(dim=-1, keepdim=True).detach()
    top = torch.where(torch.isfinite(top), top, torch.zeros((), dtype=comp))
    e = torch.exp(s - top)
    total = e.sum(dim=-1, keepdim=True)
    p = e / torch.where(total > 0, total, torch.ones((), dtype=comp))
    if dropout_p:
        p = torch.nn.functional.dropout(p, p=dropout_p)
    return torch.matmul(p, v).to(query.dtype)


# ------------------------------------------------------------------ public functions

def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0,
                                 is_causal=False, scale=None, enable_gqa=False, *,
                                 window=None, softcap=None, alibi_slopes=None,
                                 num_threads=None):
    """``torch.nn.functional.scaled_dot_product_attention`` on CPU tensors, by fastattn.

    Parameters
    ----------
    query : Tensor of shape (*batch_q, Lq, E)
    key : Tensor of shape (*batch_kv, Lk, E)
    value : Tensor of shape (*batch_kv, Lk, Ev)
        CPU tensors of one dtype: float32, float64, bfloat16 or float16. Batch axes
        broadcast as in PyTorch; any strides (transposed views are read in place).
    attn_mask : Tensor, broadcastable to (*batch, Lq, Lk), optional
        Boolean: True where a query may attend to a key. Floating: added to the
        scaled scores (``-inf`` or a large negative value blocks a key).
    dropout_p : float, default 0.0
        Attention dropout, in the kernels: the pattern comes from a seed drawn from
        torch's default generator (``torch.manual_seed`` reproduces it) and is
        regenerated, not stored, by the backward.
    is_causal : bool, default False
        Query i attends to keys j <= i (top-left aligned, as PyTorch, also when
        Lq != Lk); combines with ``attn_mask``.
    scale : float, optional
        The factor applied to ``query @ key^T``; default ``1 / sqrt(E)``.
    enable_gqa : bool, default False
        Grouped-query attention: axis -3 of query may be a multiple of that of key and
        value; query head h uses key/value head h // (Hq // Hkv).
    window : (int or None, int or None), optional
        Keyword-only: query i attends only keys i - left <= j <= i + right (a sliding
        window); None on a side is unbounded.
    softcap : float, optional
        Keyword-only: the scaled scores become ``softcap * tanh(scores / softcap)``
        before the mask is added (Gemma 2, Grok).
    alibi_slopes : Tensor broadcastable to *batch (last axis: query heads), optional
        Keyword-only: adds ``-slope * |i - j|`` to the scores (ALiBi).
    num_threads : int, optional
        Keyword-only: threads for this call (default :func:`fastattn.get_num_threads`).

    Returns
    -------
    Tensor of shape (*batch, Lq, Ev)
        In the inputs' dtype, C-contiguous. Differentiable with respect to query, key,
        value and a floating ``attn_mask``.

    Notes
    -----
    The one difference from PyTorch: a query row with no allowed key gives zeros
    (PyTorch's CPU kernels do so too; its math fallback gives NaN). A floating mask
    whose row is all large negative values is not such a row: it averages the keys,
    as in PyTorch. ``attn_mask`` and ``is_causal`` may be given together (both
    apply). Any floating ``attn_mask`` dtype is accepted and cast to the computation
    dtype. bfloat16 and float16 tensors are read as they are, computed in float32 and
    the result rounded once.

    Examples
    --------
    >>> import torch, fastattn.torch
    >>> q, k, v = torch.randn(3, 2, 8, 5, 16).unbind(0)
    >>> out = fastattn.torch.scaled_dot_product_attention(q, k, v, is_causal=True)
    >>> want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    >>> out.shape, bool(torch.allclose(out, want, atol=1e-6))
    (torch.Size([2, 8, 5, 16]), True)
    """
    if (attn_mask is None and window is None and softcap is None
            and alibi_slopes is None and type(dropout_p) in (float, int)
            and not dropout_p and _plain(query, key, value)):
        return _plain_call(query, key, value, bool(is_causal),
                           scale, bool(enable_gqa), num_threads, False)
    _check_data((query, key, value), ("query", "key", "value"), same_dtype=True)
    mask = bias = None
    if attn_mask is not None:
        if not isinstance(attn_mask, Tensor):
            attn_mask = torch.as_tensor(attn_mask)
        if attn_mask.dtype == torch.bool:
            mask = attn_mask
        else:
            bias = _check_mask(attn_mask, "attn_mask", "bias")
    causal = _TOP_LEFT if is_causal else _NO_CAUSAL
    return _call(query, key, value, mask, bias, causal, _check_scale(scale),
                 bool(enable_gqa), num_threads,
                 _variant_args(query, window, softcap, alibi_slopes, dropout_p),
                 return_lse=False)


def attention(q, k, v, *, mask=None, bias=None, causal=False, scale=None,
              enable_gqa=False, return_lse=False, window=None, softcap=None,
              alibi_slopes=None, dropout_p=0.0, num_threads=None):
    """:func:`fastattn.attention` on tensors: the NumPy API's keywords, tensors back.

    Parameters
    ----------
    q : Tensor of shape (*batch_q, Lq, E)
    k : Tensor of shape (*batch_kv, Lk, E)
    v : Tensor of shape (*batch_kv, Lk, Ev)
        CPU tensors of float32, float64, bfloat16 or float16; mixed dtypes promote as
        ``torch.promote_types`` (the same as NumPy's rule for these dtypes).
    mask : bool Tensor, broadcastable to (*batch, Lq, Lk), optional
        True where a query may attend to a key.
    bias : Tensor, broadcastable to (*batch, Lq, Lk), optional
        Added to the scaled scores.
    causal : {False, True, "top_left", "bottom_right"}, default False
        As in :func:`fastattn.attention`: "bottom_right" is the key-value-cache rule,
        query i attends to keys j <= i + (Lk - Lq).
    scale, enable_gqa
        As in :func:`fastattn.attention`.
    return_lse : bool, default False
        Also return the log-sum-exp of each row, shape (*batch, Lq) (float64 for
        float64 inputs, else float32). It carries no gradient.
    window, softcap, alibi_slopes, dropout_p
        As in :func:`scaled_dot_product_attention`; query i sits at key position
        ``i + Lk - Lq`` when ``causal="bottom_right"``, at ``i`` otherwise.
    num_threads : int, optional
        Threads for this call.

    Returns
    -------
    out : Tensor of shape (*batch, Lq, Ev)
        Differentiable with respect to q, k, v and bias.
    lse : Tensor of shape (*batch, Lq)
        Only with ``return_lse``.

    Examples
    --------
    >>> import torch, fastattn.torch
    >>> q = torch.randn(1, 4, 3, 16)          # 3 new queries
    >>> kv = torch.randn(1, 4, 10, 16)        # over a cache of 10 keys
    >>> out, lse = fastattn.torch.attention(q, kv, kv, causal="bottom_right",
    ...                                     return_lse=True)
    >>> out.shape, lse.shape
    (torch.Size([1, 4, 3, 16]), torch.Size([1, 4, 3]))
    """
    if (mask is None and bias is None and window is None and softcap is None
            and alibi_slopes is None and type(dropout_p) in (float, int)
            and not dropout_p and _plain(q, k, v)):
        return _plain_call(q, k, v, causal, scale, enable_gqa, num_threads,
                           bool(return_lse))
    tensors = [t if isinstance(t, Tensor) else torch.as_tensor(t) for t in (q, k, v)]
    _check_data(tensors, ("q", "k", "v"), same_dtype=False)
    q, k, v = tensors
    if not q.dtype == k.dtype == v.dtype:
        dtype = torch.promote_types(torch.promote_types(q.dtype, k.dtype), v.dtype)
        q, k, v = (t if t.dtype == dtype else t.to(dtype) for t in tensors)
    causal = (_NO_CAUSAL if causal is False else _TOP_LEFT if causal is True
              else _CAUSAL_CODES[_v.parse_causal(causal)])
    mask = _check_mask(mask, "mask", "mask")
    bias = _check_mask(bias, "bias", "bias")
    return _call(q, k, v, mask, bias, causal, _check_scale(scale), bool(enable_gqa),
                 num_threads,
                 _variant_args(q, window, softcap, alibi_slopes, dropout_p),
                 return_lse=bool(return_lse))
