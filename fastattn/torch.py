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
- an autograd formula: the gradients of q, k, v and ``sinks`` come from
  :func:`fastattn.attention_backward` (the operator
  ``torch.ops.fastattn.attention_backward``); those of a float mask (an additive
  bias) and of ``alibi_slopes``, when they require one, from PyTorch's own arithmetic
  with the (*batch, Lq, Lk) score matrix formed (:func:`_score_gradients`), with every
  variant (window, softcap, ALiBi, sinks, lengths, dropout);
- a fake (meta) implementation, so that ``torch.compile`` puts the operator in its
  graph without a graph break.

The ``torch.func`` transforms (``grad``, ``vjp``, ``jacrev``, ``vmap``, ``jvp``,
``jacfwd``) and forward-mode AD with dual tensors (``torch.autograd.forward_ad``) run
the same operator inside a ``torch.autograd.Function`` (:class:`_AttentionFunction`)
whose ``jvp`` computes the tangent of the output with PyTorch's arithmetic, the
attention matrix formed (:func:`_output_tangent`), and whose backward is the
operator's. Differentiating the backward itself (forward-over-reverse, double
backward) is not supported and raises, as does calling the bare operators
(``torch.ops.fastattn.*``) under forward-mode AD: they have no formula of their own.

A call that has nothing for that machinery to do (no input requires a gradient or
grad mode is off; no ``torch.compile``/``torch.export`` tracing, no ``torch.jit``
tracing, no ``torch.func`` transform, no forward-mode AD level, no dispatch or
``__torch_function__`` mode, no tensor subclass, no profiler; CPU tensors) skips the
dispatcher and runs the same implementation directly (:func:`_direct`): the same
results, the same tensors, tens of microseconds less per call.

Every tensor argument must be a strided (dense) tensor on the CPU; a tensor on
another device (``meta`` included, unless every tensor is on ``meta``: shape
inference) or with another layout (sparse, MKL-DNN) raises an error naming it.

This module needs PyTorch (``pip install "fastattn[torch]"``); ``import fastattn``
does not import it.

Dtypes: float32 and float64 are computed natively; bfloat16 and float16 tensors are
handed to the NumPy API as they are (bfloat16 as an ``ml_dtypes.bfloat16`` view of the
same memory), read a block at a time, computed in float32 and rounded once, as the
NumPy API does: the error is no larger than that of PyTorch's own bfloat16/float16
attention. Without ml_dtypes, bfloat16 tensors go through float32 copies.
"""

from __future__ import annotations

import contextlib
import math
import numbers
import threading

import numpy as np

try:
    import torch
except ImportError as exc:          # pragma: no cover - depends on the environment
    raise ImportError(
        "fastattn.torch needs PyTorch, which is not installed. Install the extra: "
        "pip install \"fastattn[torch]\" (or: pip install torch)") from exc

from torch.autograd import forward_ad as _fwad

from . import _philox
from . import _validation as _v
from ._api import attention as _np_attention
from ._grad import attention_backward as _np_attention_backward
from . import _torch_cache
from ._torch_cache import attention_paged, quantize_kv, store_kv

__all__ = ["scaled_dot_product_attention", "attention", "attention_paged", "store_kv",
           "quantize_kv"]

Tensor = torch.Tensor

# causal rules as the operator's integer argument
_NO_CAUSAL, _TOP_LEFT, _BOTTOM_RIGHT = 0, 1, 2
_CAUSAL_NAMES = {_NO_CAUSAL: False, _TOP_LEFT: "top_left", _BOTTOM_RIGHT: "bottom_right"}
_CAUSAL_CODES = {None: _NO_CAUSAL, "top_left": _TOP_LEFT, "bottom_right": _BOTTOM_RIGHT}
_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
_STRIDED = torch.strided
# the largest value of the operators' int arguments (a TorchScript int is 64-bit)
_INT64_MAX = 2 ** 63 - 1

try:                                # bfloat16 tensors as NumPy views (the torch extra)
    import ml_dtypes as _ml_dtypes
except ImportError:                 # pragma: no cover - depends on the environment
    _BFLOAT16 = None
    _FLOAT8_VIEWS = {}
else:
    _BFLOAT16 = np.dtype(_ml_dtypes.bfloat16)
    _FLOAT8_VIEWS = {torch.float8_e4m3fn: np.dtype(_ml_dtypes.float8_e4m3fn),
                     torch.float8_e5m2: np.dtype(_ml_dtypes.float8_e5m2)}
# a quantized cache's short path (_plain_codes): its queries' and codes' dtypes
_CODE_QUERIES = (torch.float32, torch.bfloat16, torch.float16)
_CODE_VIEWS = (torch.int8,) + tuple(_FLOAT8_VIEWS)
# the operators' variant arguments of a call without variants (see _variant_args):
# window_left, window_right, softcap, alibi_slopes, dropout_p, dropout_seed, sinks,
# q_lengths, kv_lengths, precision
_NO_VARIANTS = (None, None, None, None, 0.0, None, None, None, None, None)
# dropout seeds are in [0, 2**64) (the NumPy API's range); the operators carry them
# as one int64, the seeds from 2**63 on as their two's complement
_SEEDS = 2 ** 64


# -------------------------------------------------------------- tensors <-> ndarrays

def _array(t: Tensor | None) -> np.ndarray | None:
    """A NumPy view of a CPU tensor (no copy); bfloat16 as an ``ml_dtypes.bfloat16``
    view of its 16-bit words (a float32 copy without ml_dtypes), float8 codes as
    ``ml_dtypes`` views of their bytes (with ml_dtypes)."""
    if t is None:
        return None
    if t.requires_grad:
        t = t.detach()
    if t.dtype == torch.bfloat16:
        if _BFLOAT16 is None:
            return t.float().numpy()
        return t.view(torch.int16).numpy().view(_BFLOAT16)
    if t.dtype in _FLOAT8_VIEWS:
        return t.view(torch.uint8).numpy().view(_FLOAT8_VIEWS[t.dtype])
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

# the arguments both operators take after their tensors (those after dropout_seed
# with defaults, so that calls written before they existed still mean what they meant)
_OPTIONS = ("Tensor? mask, Tensor? bias, int causal, float? scale, bool enable_gqa, "
            "int? num_threads, int? window_left, int? window_right, float? softcap, "
            "Tensor? alibi_slopes, float dropout_p, Tensor? dropout_seed, "
            "Tensor? sinks=None, Tensor? q_lengths=None, Tensor? kv_lengths=None, "
            "str? precision=None")
# the operators' tensor arguments after q, k, v, by name, for the device checks
_OPTION_TENSORS = ("mask", "bias", "alibi_slopes", "dropout_seed", "sinks",
                   "q_lengths", "kv_lengths")


def _seed_value(seed: Tensor) -> int:
    """The dropout seed in [0, 2**64) that a one-element int64 tensor carries."""
    return int(seed.item()) % _SEEDS


def _variants(window_left, window_right, softcap, alibi_slopes, dropout_p,
              dropout_seed, sinks, q_lengths=None, kv_lengths=None) -> dict:
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
        kw["dropout_seed"] = None if dropout_seed is None else _seed_value(dropout_seed)
    if sinks is not None:
        kw["sinks"] = _array(sinks)
    if q_lengths is not None:
        kw["q_lengths"] = _array(q_lengths)
    if kv_lengths is not None:
        kw["kv_lengths"] = _array(kv_lengths)
    return kw


def _forward(q, k, v, mask, bias, causal, scale, enable_gqa, num_threads,
             window_left, window_right, softcap, alibi_slopes, dropout_p, dropout_seed,
             sinks=None, q_lengths=None, kv_lengths=None, precision=None,
             return_lse=True, out=None):
    """The forward computation on tensors: ``out`` or ``(out, lse)``. The kernels read
    the tensors' memory and write a new buffer that becomes the result tensor (no
    copies of q, k and v, bfloat16 included), or the memory of ``out`` (a checked
    tensor of the result's shape and dtype), which is returned."""
    into = None
    if out is not None and (out.dtype != torch.bfloat16 or _BFLOAT16 is not None):
        into = _array(out)                  # the kernels write the tensor's memory
    res = _np_attention(
        _array(q), _array(k), _array(v), mask=_array(mask), bias=_array(bias),
        causal=_CAUSAL_NAMES[causal], scale=scale, enable_gqa=enable_gqa,
        return_lse=return_lse, num_threads=num_threads, precision=precision, out=into,
        **_variants(window_left, window_right, softcap, alibi_slopes, dropout_p,
                    dropout_seed, sinks, q_lengths, kv_lengths))
    result = res[0] if return_lse else res
    if out is None:
        result = _tensor(result, q.dtype)
    else:
        if into is None:                    # bfloat16 without ml_dtypes: a copy
            out.copy_(_tensor(result, out.dtype))
        result = out
    return (result, torch.from_numpy(res[1])) if return_lse else result


class _Vetted(threading.local):
    """How deep this thread is in a call of an operator that this module made where
    forward-mode AD may be active (:class:`_AttentionFunction`, :func:`_backward`)."""
    depth = 0


_vetted = _Vetted()


class _vetting:
    """Marks the operator calls inside as made by this module (see
    :func:`_refuse_forward_mode`)."""

    def __enter__(self):
        _vetted.depth += 1

    def __exit__(self, *exc):
        _vetted.depth -= 1


def _refuse_forward_mode(name: str) -> None:
    """The operators have no forward-mode formula of their own, and the dispatcher
    runs them below autograd when nothing requires a reverse-mode gradient: the
    tangents would be dropped (a zero derivative). A call made under forward-mode AD
    other than through this module's functions is therefore refused."""
    if _fwad._current_level >= 0 and not _vetted.depth:
        raise RuntimeError(
            f"fastattn::{name} has no forward-mode AD formula of its own: under "
            f"torch.func.jvp/jacfwd or torch.autograd.forward_ad, call "
            f"fastattn.torch.attention or fastattn.torch.scaled_dot_product_attention, "
            f"which differentiate it in forward mode")


def _same_device(q, k, v, options) -> None:
    """Every tensor argument of an operator on q's device: the fake implementations
    run for a call that mixes meta and CPU tensors, and would otherwise answer it
    with an uninitialised CPU tensor."""
    for name, t in zip(("k", "v") + _OPTION_TENSORS, (k, v) + tuple(options)):
        if t is not None and t.device != q.device:
            raise RuntimeError(
                f"fastattn::attention: {name} is on {t.device} but q is on {q.device}; "
                f"every tensor argument must be on the same device")


@torch.library.custom_op(
    "fastattn::attention", mutates_args=(), device_types="cpu",
    schema=f"(Tensor q, Tensor k, Tensor v, {_OPTIONS}) -> (Tensor, Tensor)")
def _attention_op(q, k, v, mask, bias, causal, scale, enable_gqa, num_threads,
                  window_left, window_right, softcap, alibi_slopes, dropout_p,
                  dropout_seed, sinks=None, q_lengths=None, kv_lengths=None,
                  precision=None):
    """(out, lse) of fastattn.attention; causal: 0 none, 1 top-left, 2 bottom-right."""
    _refuse_forward_mode("attention")
    return _forward(q, k, v, mask, bias, causal, scale, enable_gqa, num_threads,
                    window_left, window_right, softcap, alibi_slopes, dropout_p,
                    dropout_seed, sinks, q_lengths, kv_lengths, precision)


@_attention_op.register_fake
def _attention_fake(q, k, v, mask, bias, causal, scale, enable_gqa, num_threads,
                    window_left, window_right, softcap, alibi_slopes, dropout_p,
                    dropout_seed, sinks=None, q_lengths=None, kv_lengths=None,
                    precision=None):
    _same_device(q, k, v, (mask, bias, alibi_slopes, dropout_seed, sinks, q_lengths,
                           kv_lengths))
    batch = _batch_shape(q, k, enable_gqa)
    out = q.new_empty(batch + (q.shape[-2], v.shape[-1]))
    lse = q.new_empty(batch + (q.shape[-2],), dtype=_lse_dtype(q.dtype))
    return out, lse


@torch.library.custom_op(
    "fastattn::attention_backward", mutates_args=(), device_types="cpu",
    schema=(f"(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
            f"{_OPTIONS}) -> (Tensor, Tensor, Tensor, Tensor)"))
def _attention_backward_op(grad_out, q, k, v, out, lse, mask, bias, causal, scale,
                           enable_gqa, num_threads, window_left, window_right, softcap,
                           alibi_slopes, dropout_p, dropout_seed, sinks=None,
                           q_lengths=None, kv_lengths=None, precision=None):
    """(dq, dk, dv, dsinks) of fastattn.attention_backward (dropout regenerated from
    the seed; the rows past q_lengths get zeros); dsinks is shaped like sinks, empty
    (shape (0,)) without them; all in q's dtype."""
    _refuse_forward_mode("attention_backward")
    grads = _np_attention_backward(
        _array(grad_out), _array(q), _array(k), _array(v), _array(out), _array(lse),
        mask=_array(mask), bias=_array(bias), causal=_CAUSAL_NAMES[causal], scale=scale,
        enable_gqa=enable_gqa, num_threads=num_threads, precision=precision,
        **_variants(window_left, window_right, softcap, alibi_slopes, dropout_p,
                    dropout_seed, sinks, q_lengths, kv_lengths))
    grads = tuple(_tensor(g, q.dtype) for g in grads)
    return grads if sinks is not None else grads + (torch.empty(0, dtype=q.dtype),)


@_attention_backward_op.register_fake
def _attention_backward_fake(grad_out, q, k, v, out, lse, mask, bias, causal, scale,
                             enable_gqa, num_threads, window_left, window_right,
                             softcap, alibi_slopes, dropout_p, dropout_seed, sinks=None,
                             q_lengths=None, kv_lengths=None, precision=None):
    _same_device(q, k, v, (mask, bias, alibi_slopes, dropout_seed, sinks, q_lengths,
                           kv_lengths))
    dsinks = q.new_empty((0,) if sinks is None else sinks.shape)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dsinks


# the positions of the operator's inputs (the autograd formula's needs_input_grad)
_Q, _K, _V, _MASK, _BIAS, _ALIBI, _SEED, _SINKS = 0, 1, 2, 3, 4, 12, 14, 15
_N_INPUTS = 19
# the operator's arguments with defaults (sinks, q_lengths, kv_lengths, precision)
_DEFAULTS = (None, None, None, None)


def _with_defaults(inputs) -> tuple:
    """The operator's arguments, those left out (a call written before they existed)
    with their defaults."""
    inputs = tuple(inputs)
    missing = _N_INPUTS - len(inputs)
    return inputs + _DEFAULTS[len(_DEFAULTS) - missing:] if missing else inputs


def _setup_context(ctx, inputs, output):
    (q, k, v, mask, bias, causal, scale, enable_gqa, num_threads, window_left,
     window_right, softcap, alibi_slopes, dropout_p, dropout_seed, sinks, q_lengths,
     kv_lengths, precision) = _with_defaults(inputs)
    out, lse = output
    ctx.save_for_backward(q, k, v, mask, bias, out, lse, alibi_slopes, dropout_seed,
                          sinks, q_lengths, kv_lengths)
    ctx.options = (causal, scale, enable_gqa, num_threads, window_left, window_right,
                   softcap, dropout_p, precision)
    ctx.mark_non_differentiable(lse)


def _backward(ctx, grad_out, grad_lse):
    """The autograd formula: dq, dk, dv and dsinks by the backward operator (the
    kernels), dbias and d(alibi_slopes) by :func:`_score_gradients` (PyTorch's
    arithmetic), each only when it is needed."""
    (q, k, v, mask, bias, out, lse, alibi_slopes, dropout_seed, sinks, q_lengths,
     kv_lengths) = ctx.saved_tensors
    (causal, scale, enable_gqa, num_threads, window_left, window_right, softcap,
     dropout_p, precision) = ctx.options
    needs = tuple(ctx.needs_input_grad) + (False,) * _N_INPUTS
    grads = [None] * len(ctx.needs_input_grad)
    if not _compiling() and (_fw_layers_active() or _has_tangent(
            (grad_out, q, k, v, bias, alibi_slopes, sinks))):
        raise NotImplementedError(
            "fastattn.torch: forward-mode AD over the backward of attention "
            "(forward-over-reverse, e.g. a Hessian-vector product) is not supported")
    # torch.func.grad records every backward for a transform around it; the backward
    # operator has no formula of its own, so one grad level runs it as a constant
    # and nested ones (grad of grad) are refused
    grad_levels = 0 if _compiling() else _grad_layers()
    if grad_levels > 1:
        raise NotImplementedError(
            "fastattn.torch: the backward of attention cannot be differentiated "
            "again (torch.func.grad of grad, hessian)")
    quiet = torch.no_grad() if grad_levels else contextlib.nullcontext()
    want_sinks = sinks is not None and needs[_SINKS]
    if any(needs[:3]) or want_sinks:
        with _vetting(), quiet:
            dq, dk, dv, dsinks = torch.ops.fastattn.attention_backward(
                grad_out, q, k, v, out, lse, mask, bias, causal, scale, enable_gqa,
                num_threads, window_left, window_right, softcap, alibi_slopes,
                dropout_p, dropout_seed, sinks, q_lengths, kv_lengths, precision)
        grads[_Q], grads[_K], grads[_V] = dq, dk, dv
        if want_sinks:
            grads[_SINKS] = dsinks.to(sinks.dtype)
    want_bias = bias is not None and needs[_BIAS]
    want_alibi = alibi_slopes is not None and needs[_ALIBI]
    if want_bias or want_alibi:
        # a recorded backward (create_graph) rebuilds the weights from the scores:
        # the saved lse carries no gradient, and a second derivative needs its
        dbias, dalibi = _score_gradients(
            grad_out, q, k, v, out, None if _grad_enabled() else lse, mask, bias,
            causal, scale, enable_gqa, window_left, window_right, softcap,
            alibi_slopes, dropout_p, dropout_seed, want_bias, want_alibi, sinks,
            q_lengths, kv_lengths)
        grads[_BIAS], grads[_ALIBI] = dbias, dalibi
    return tuple(grads)


_attention_op.register_autograd(_backward, setup_context=_setup_context)


# ------------------------------------------------------------- the direct path

_C = torch._C
_functorch_layers = _C._functorch.peek_interpreter_stack
_interpreter_stack = _C._functorch.get_interpreter_stack
_JVP = _C._functorch.TransformType.Jvp
_GRAD = _C._functorch.TransformType.Grad
_compiling = torch.compiler.is_compiling
_dispatch_modes = _C._len_torch_dispatch_stack
_function_modes = _C._is_torch_function_mode_enabled
_tracing = _C._get_tracing_state
_profiling = _C._autograd._profiler_enabled
_grad_enabled = _C.is_grad_enabled


def _dispatcher_needed() -> bool:
    """Whether something outside the tensors needs the dispatcher: ``torch.compile``
    or ``torch.export`` tracing, ``torch.jit`` tracing, a ``torch.func`` transform, a
    forward-mode AD level (dual tensors), a dispatch or ``__torch_function__`` mode,
    the profiler."""
    return bool(_compiling() or _dispatch_modes() or _function_modes()
                or _functorch_layers() is not None or _fwad._current_level >= 0
                or _tracing() is not None or _profiling())


def _fw_layers_active() -> bool:
    """Whether a ``torch.func.jvp`` (or ``jacfwd``) transform is on the stack."""
    if _functorch_layers() is None:
        return False
    return any(layer.key() == _JVP for layer in _interpreter_stack())


def _grad_layers() -> int:
    """How many ``torch.func.grad`` (``vjp``, ``jacrev``) transforms are on the
    stack."""
    if _functorch_layers() is None:
        return 0
    return sum(layer.key() == _GRAD for layer in _interpreter_stack())


def _has_tangent(tensors) -> bool:
    """Whether one of ``tensors`` is a dual tensor of the current forward-mode AD
    level (``torch.autograd.forward_ad``)."""
    if _fwad._current_level < 0:
        return False
    return any(t is not None and _fwad.unpack_dual(t).tangent is not None
               for t in tensors)


def _direct(tensors) -> bool:
    """Whether a call may run :func:`_forward` itself instead of going through the
    dispatcher (``torch.ops.fastattn.attention``), whose every step would then be a
    pass-through: no ``torch.compile``/``torch.export`` tracing (which needs the
    operator in its graph), no ``torch.jit`` tracing, no ``torch.func`` transform
    (``vmap``, ``grad``, ``jvp``), no forward-mode AD level, no dispatch mode (fake
    tensors, ``make_fx``, FLOP counters), no ``__torch_function__`` mode, no profiler
    (which records the operator by name), only plain CPU tensors (no subclass, no
    meta tensor), and no autograd to record (grad mode off, or no input requires a
    gradient). ``tensors``: the operator's tensor arguments, None where absent. The
    checks cost about a microsecond; the dispatcher's round trip through Python,
    tens."""
    if _dispatcher_needed():
        return False
    grad = _grad_enabled()
    for t in tensors:
        if t is not None and (type(t) is not Tensor or not t.is_cpu
                              or (grad and t.requires_grad)):
            return False
    return True


def _call(q, k, v, mask, bias, causal, scale, enable_gqa, num_threads, variants,
          return_lse, out=None):
    """The operator on checked arguments: directly when nothing needs the dispatcher
    (:func:`_direct`), through :class:`_AttentionFunction` under a ``torch.func``
    transform or a forward-mode AD level, else through
    ``torch.ops.fastattn.attention``. ``variants``: the ten values of
    :func:`_variant_args`; ``num_threads`` not yet checked; ``out``: a checked
    tensor to fill (:func:`_check_out`), or None."""
    tensors = (q, k, v, mask, bias, variants[3], variants[6], variants[7], variants[8],
               out)
    if _direct(tensors):
        # num_threads is checked by the NumPy API (the same check, the same errors)
        return _forward(q, k, v, mask, bias, causal, scale, enable_gqa, num_threads,
                        *variants, return_lse=return_lse, out=out)
    args = (q, k, v, mask, bias, causal, scale, enable_gqa, _check_threads(num_threads),
            *variants)
    if not _compiling() and (_functorch_layers() is not None
                             or _fwad._current_level >= 0):
        res, lse = _AttentionFunction.apply(*args)
    else:
        res, lse = torch.ops.fastattn.attention(*args)
    if out is not None:
        res = out.copy_(res)
    return (res, lse) if return_lse else res


def _plain(q, k, v) -> bool:
    """Whether q, k, v can go straight to the kernels as they are: :func:`_direct`
    holds for them, and they are strided tensors of one of the four dtypes (the
    checks of :func:`_check_data`, which then has nothing to say). Written out for
    three tensors: it runs on every call."""
    if type(q) is not Tensor or type(k) is not Tensor or type(v) is not Tensor:
        return False
    dtype = q.dtype
    if (dtype not in _DTYPES or k.dtype is not dtype or v.dtype is not dtype
            or not (q.is_cpu and k.is_cpu and v.is_cpu)
            or q.layout is not _STRIDED or k.layout is not _STRIDED
            or v.layout is not _STRIDED):
        return False
    if _grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return False
    return not _dispatcher_needed()


def _plain_codes(q, k, v, k_scale, v_scale) -> bool:
    """Whether a quantized cache can go straight to the NumPy API as it is: q a plain
    float32, bfloat16 or float16 tensor, k and v plain tensors of one code dtype (int8,
    or float8 with ml_dtypes), the scales None or plain float32 tensors, none of them
    recording a gradient (the general path refuses that: caches are for inference),
    and no transform that needs the dispatcher. The NumPy API checks the shapes and
    which scales a code dtype needs."""
    if type(q) is not Tensor or type(k) is not Tensor or type(v) is not Tensor:
        return False
    if (q.dtype not in _CODE_QUERIES or k.dtype is not v.dtype
            or k.dtype not in _CODE_VIEWS or _BFLOAT16 is None
            or not (q.is_cpu and k.is_cpu and v.is_cpu) or q.layout is not _STRIDED
            or k.layout is not _STRIDED or v.layout is not _STRIDED):
        return False
    for sc in (k_scale, v_scale):
        if sc is not None and not (type(sc) is Tensor and sc.dtype is torch.float32
                                   and sc.is_cpu and sc.layout is _STRIDED):
            return False
    if _grad_enabled() and any(t is not None and t.requires_grad
                               for t in (q, k, v, k_scale, v_scale)):
        return False
    return not _dispatcher_needed()


def _plain_window(window) -> bool:
    """Whether ``window`` can go to the NumPy API as it is: None, or a tuple or list of
    two sides, each None or a Python int (the NumPy API checks the values, with the
    messages of :func:`_check_window`'s check)."""
    return window is None or (
        type(window) in (tuple, list) and len(window) == 2
        and all(side is None or type(side) is int for side in window))


def _plain_sinks(sinks, q: Tensor) -> bool:
    """Whether ``sinks`` can go to the NumPy API as an array: None, or one per query
    head of 4-D q (shape (Hq,)), a strided CPU tensor (gpt-oss's parameter too) of one
    of the four dtypes with no gradient to record (a forward-mode level already
    fails :func:`_plain`)."""
    return sinks is None or (
        isinstance(sinks, Tensor) and (type(sinks) is Tensor
                                       or type(sinks) is torch.nn.Parameter)
        and sinks.dtype in _DTYPES and sinks.is_cpu and sinks.layout is _STRIDED
        and sinks.ndim == 1 and q.ndim == 4 and sinks.shape[0] == q.shape[1]
        and not (sinks.requires_grad and _grad_enabled()))


def _plain_lengths(lengths) -> bool:
    """Whether ``kv_lengths`` can go to the NumPy API as an array: None, or a strided
    CPU tensor of int32 or int64 with one axis (the NumPy API checks its shape and
    values, with the messages this module's operator gives)."""
    return lengths is None or (
        type(lengths) is Tensor and lengths.is_cpu and lengths.layout is _STRIDED
        and lengths.ndim == 1 and (lengths.dtype is torch.int64
                                   or lengths.dtype is torch.int32))


def _sinks_array(sinks: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """Per-head sinks (a NumPy view) in the computation dtype of inputs of ``dtype``,
    as :func:`_per_head` casts them: float64 for float64, else float32."""
    return sinks.astype(np.float64 if dtype == torch.float64 else np.float32,
                        copy=False)


def _plain_call(q, k, v, causal, scale, enable_gqa, num_threads, return_lse,
                window=None, sinks=None, softcap=None, kv_lengths=None, k_scale=None,
                v_scale=None):
    """The most common call, as few steps as it can be: plain tensors (:func:`_plain`),
    or a quantized cache and its scales (:func:`_plain_codes`), no mask, bias or
    variant but a window (:func:`_plain_window`), sinks (:func:`_plain_sinks`, cast to
    the computation dtype as :func:`_per_head` casts them), a float softcap and the
    keys' lengths (:func:`_plain_lengths`); ``causal`` the NumPy API's value. The NumPy
    API checks ``scale``, ``enable_gqa``, ``window``, ``softcap``, ``kv_lengths``,
    ``num_threads`` and the scales (the checks and messages of this module's)."""
    if sinks is not None:
        sinks = _sinks_array(_array(sinks), q.dtype)
    res = _np_attention(_array(q), _array(k), _array(v), causal=causal, scale=scale,
                        enable_gqa=enable_gqa, window=window, sinks=sinks,
                        softcap=softcap, kv_lengths=_array(kv_lengths),
                        return_lse=return_lse, num_threads=num_threads,
                        k_scale=_array(k_scale), v_scale=_array(v_scale))
    if return_lse:
        return _tensor(res[0], q.dtype), torch.from_numpy(res[1])
    return _tensor(res, q.dtype)


# ------------------------------------------- the score matrix, in PyTorch arithmetic
# What the kernels compute without forming it, formed here for the gradients of a bias
# and of ALiBi slopes (reverse mode) and for the tangent of the output (forward mode):
# S = softcap(scale * q k^T) + bias - slope * |i + d - j|, blocked entries -inf, and
# P = exp(S - lse) with the forward's lse (which holds the sink).

def _per_sequence(lengths: Tensor, ndim: int) -> Tensor:
    """Lengths (B,) shaped (B, 1, ..., 1) to broadcast against (B, ..., Lq, Lk) of
    ``ndim`` dimensions."""
    return lengths.reshape(lengths.shape + (1,) * (ndim - 1))


def _positions(causal: int, Lq, Lk, device, q_lengths=None, kv_lengths=None, ndim=2):
    """Query positions ``i + d`` as (Lq, 1) and key positions ``j`` as (1, Lk):
    ``d = Lk - Lq`` with "bottom_right", else 0; with lengths, each sequence's own
    (``i + d`` then (B, 1, ..., Lq, 1) of ``ndim`` dimensions), as in the NumPy
    API (``_validation.query_offsets``)."""
    i = torch.arange(Lq, device=device)[:, None]
    j = torch.arange(Lk, device=device)[None, :]
    if causal != _BOTTOM_RIGHT:
        return i, j
    if q_lengths is None and kv_lengths is None:
        return i + (Lk - Lq), j
    lq = Lq if q_lengths is None else _per_sequence(q_lengths, ndim)
    lk = Lk if kv_lengths is None else _per_sequence(kv_lengths, ndim)
    return i + (lk - lq), j


def _allowed(mask: Tensor | None, causal: int, Lq, Lk, device, window=(None, None),
             q_lengths=None, kv_lengths=None, ndim=2):
    """The keys each query may attend to under ``mask``, the causal rule, the window
    (sides of ``Lq + Lk`` or more restrict nothing) and the lengths (rows
    ``i >= q_lengths[b]`` and keys ``j >= kv_lengths[b]`` of sequence b: none), or
    None for all. ``ndim``: that of the scores (*batch, Lq, Lk), for the lengths."""
    left, right = (None if w is None or w >= Lq + Lk else w for w in window)
    rules = []
    if causal != _NO_CAUSAL or left is not None or right is not None:
        qpos, j = _positions(causal, Lq, Lk, device, q_lengths, kv_lengths, ndim)
        if causal != _NO_CAUSAL:
            rules.append(j <= qpos)
        if left is not None:
            rules.append(j >= qpos - left)
        if right is not None:
            rules.append(j <= qpos + right)
    if q_lengths is not None:
        i = torch.arange(Lq, device=device)[:, None]
        rules.append(i < _per_sequence(q_lengths, ndim))
    if kv_lengths is not None:
        j = torch.arange(Lk, device=device)[None, :]
        rules.append(j < _per_sequence(kv_lengths, ndim))
    if mask is not None:
        rules.append(mask)
    allowed = None
    for rule in rules:
        allowed = rule if allowed is None else allowed & rule
    return allowed


def _heads(x: Tensor, q: Tensor, enable_gqa: bool) -> Tensor:
    """k or v (or their tangents) with each key/value head repeated for its group."""
    if enable_gqa and x.dim() >= 3 and q.shape[-3] != x.shape[-3]:
        return x.repeat_interleave(q.shape[-3] // x.shape[-3], dim=-3)
    return x


class _Scores:
    """The forward's score matrix and weights, rebuilt in the computation dtype
    (float64 for float64 inputs, else float32): ``p`` of shape (*batch, Lq, Lk), zero
    where a key is blocked or the row has no weight at all; ``cap``, the softcap's
    derivative ``1 - tanh(x / c)^2`` at the scaled scores (None without one);
    ``dist``, ``|i + d - j|`` (with ALiBi); ``allowed``; the dropout factors ``z``
    (1/(1-p) kept, 0 dropped; None without dropout), drawn by ``fastattn._philox``
    from the seed exactly as the kernels draw them. ``q_lengths``/``kv_lengths``
    block the padding (and set each sequence's positions) as in the kernels.

    With ``lse`` (the forward's, which holds the sink) ``p = exp(S - lse)``, as the
    kernels' backward rebuilds it. Without it ``p`` is the softmax of the row and the
    sink, ``exp(S - m) / (sum_j exp(S_j - m) + exp(sink - m))``, and ``sink_weight``
    (*batch, Lq, 1) the sink's share: a function of the inputs that PyTorch can
    differentiate again (the forward-mode tangent under a reverse-mode transform)."""

    def __init__(self, q, k, lse, mask, bias, causal, scale, enable_gqa, window_left,
                 window_right, softcap, alibi_slopes, dropout_p, dropout_seed,
                 sinks=None, q_lengths=None, kv_lengths=None):
        comp = self.comp = _lse_dtype(q.dtype)
        zero = torch.zeros((), dtype=comp, device=q.device)
        self.q = q.to(comp)
        self.k = _heads(k.to(comp), q, enable_gqa)
        Lq, Lk = q.shape[-2], k.shape[-2]
        self.scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
        x = torch.matmul(self.q, self.k.transpose(-1, -2)) * self.scale
        self.cap = None
        if softcap is not None:
            t = torch.tanh(x / softcap)
            x = softcap * t
            self.cap = 1 - t * t
        if bias is not None:
            x = x + bias.to(comp)
        self.dist = None
        if alibi_slopes is not None:
            i, j = _positions(causal, Lq, Lk, q.device, q_lengths, kv_lengths, x.dim())
            self.dist = (i - j).abs().to(comp)
            x = x - alibi_slopes.to(comp)[..., None, None] * self.dist
        self.allowed = _allowed(mask, causal, Lq, Lk, q.device,
                                (window_left, window_right), q_lengths, kv_lengths,
                                x.dim())
        if self.allowed is not None:
            x = x.masked_fill(~self.allowed, float("-inf"))
        self.sink_weight = None
        if lse is not None:
            lse = lse.to(comp)[..., None]
            empty = torch.isneginf(lse)
            p = torch.exp(x - torch.where(empty, zero, lse))
            blocked = empty if self.allowed is None else empty | ~self.allowed
            self.p = torch.where(blocked, zero, p)
        else:
            m = x.amax(dim=-1, keepdim=True)
            if sinks is not None:
                sink = sinks.to(comp)[..., None, None]
                m = torch.maximum(m, sink)
            m = m.detach()
            m = torch.where(torch.isfinite(m), m, zero)
            e = torch.exp(x - m)
            total = e.sum(dim=-1, keepdim=True)
            if sinks is not None:
                es = torch.exp(sink - m)
                total = total + es
            total = torch.where(total > 0, total, torch.ones((), dtype=comp))
            self.p = e / total
            if sinks is not None:
                self.sink_weight = es / total
        self.z = None
        if dropout_p:
            batch = self.p.shape[:-2]
            slices = np.arange(math.prod(batch), dtype=np.int64).reshape(batch)
            keep = _philox.dropout_keep(_seed_value(dropout_seed), dropout_p, slices,
                                        Lq, Lk)
            self.z = torch.where(torch.from_numpy(keep).to(q.device),
                                 torch.tensor(1 / (1 - dropout_p), dtype=comp),
                                 zero)


def _score_gradients(grad_out, q, k, v, out, lse, mask, bias, causal, scale,
                     enable_gqa, window_left, window_right, softcap, alibi_slopes,
                     dropout_p, dropout_seed, want_bias=True, want_alibi=False,
                     sinks=None, q_lengths=None, kv_lengths=None):
    """``(dbias, dalibi_slopes)``: the gradient of the scores,
    ``dS = P * (dP - rowsum(dO * O))`` with ``dP = (dO V^T) * Z`` (the dropout factors;
    the sink, having no value, adds nothing to dP), summed to the bias's shape; and
    ``-sum_ij dS_ij |i + d - j|`` summed to the slopes' shape. The bias is added after
    the softcap, so no cap derivative enters. PyTorch's arithmetic with the (*batch,
    Lq, Lk) matrices formed: only when a bias or slopes require a gradient. ``lse``
    None: P rebuilt from the scores and ``sinks`` (differentiable again)."""
    sc = _Scores(q, k, lse, mask, bias, causal, scale, enable_gqa, window_left,
                 window_right, softcap, alibi_slopes, dropout_p, dropout_seed, sinks,
                 q_lengths, kv_lengths)
    comp = sc.comp
    do, o = grad_out.to(comp), out.to(comp)
    dp = torch.matmul(do, _heads(v.to(comp), q, enable_gqa).transpose(-1, -2))
    if sc.z is not None:
        dp = dp * sc.z
    ds = sc.p * (dp - (do * o).sum(-1, keepdim=True))
    dbias = dalibi = None
    if want_bias:
        dbias = ds.sum_to_size(bias.shape).to(bias.dtype)
    if want_alibi:
        dalibi = (-(ds * sc.dist).sum((-1, -2))).sum_to_size(alibi_slopes.shape)
        dalibi = dalibi.to(alibi_slopes.dtype)
    return dbias, dalibi


def _output_tangent(q, k, v, out, lse, mask, bias, causal, scale, enable_gqa,
                    window_left, window_right, softcap, alibi_slopes, dropout_p,
                    dropout_seed, sinks, tq, tk, tv, tbias, talibi, tsinks,
                    q_lengths=None, kv_lengths=None):
    """The tangent of the output (forward-mode AD) from the tangents of q, k, v, bias,
    alibi_slopes and sinks (None: zero): ``tS = cap' * scale * (tq k^T + q tk^T) +
    tbias - talibi * |i + d - j|``, ``tP = P * (tS - rowsum(P * tS) - p_sink * tsink)``
    with ``p_sink`` the sink's weight, and ``tO = (tP * Z) V + (P * Z) tV``. PyTorch's
    arithmetic with the (*batch, Lq, Lk) matrices formed; P is rebuilt from the
    scores (not from the forward's lse, which carries no gradient), so that a
    reverse-mode transform around the ``jvp`` differentiates it correctly. ``out``
    and ``lse`` give the shape and dtype of the result."""
    sc = _Scores(q, k, None, mask, bias, causal, scale, enable_gqa, window_left,
                 window_right, softcap, alibi_slopes, dropout_p, dropout_seed, sinks,
                 q_lengths, kv_lengths)
    comp = sc.comp
    zero = torch.zeros((), dtype=comp, device=q.device)
    ts = None
    if tq is not None:
        ts = torch.matmul(tq.to(comp), sc.k.transpose(-1, -2))
    if tk is not None:
        tkx = _heads(tk.to(comp), q, enable_gqa)
        term = torch.matmul(sc.q, tkx.transpose(-1, -2))
        ts = term if ts is None else ts + term
    if ts is not None:
        ts = ts * sc.scale
        if sc.cap is not None:
            ts = ts * sc.cap
    if tbias is not None:
        ts = tbias.to(comp) if ts is None else ts + tbias.to(comp)
    if talibi is not None:
        term = -talibi.to(comp)[..., None, None] * sc.dist
        ts = term if ts is None else ts + term
    p = sc.p
    tp = None
    if ts is not None:
        if sc.allowed is not None:
            ts = torch.where(sc.allowed, ts, zero)
        tp = p * (ts - (p * ts).sum(-1, keepdim=True))
    if tsinks is not None and sinks is not None:
        term = -p * (sc.sink_weight * tsinks.to(comp)[..., None, None])
        tp = term if tp is None else tp + term
    if sc.z is not None:
        p = p * sc.z
        tp = None if tp is None else tp * sc.z
    t_out = torch.zeros(out.shape, dtype=comp, device=out.device)
    if tp is not None:
        t_out = t_out + torch.matmul(tp, _heads(v.to(comp), q, enable_gqa))
    if tv is not None:
        t_out = t_out + torch.matmul(p, _heads(tv.to(comp), q, enable_gqa))
    return t_out.to(out.dtype)


class _AttentionFunction(torch.autograd.Function):
    """``torch.ops.fastattn.attention`` with a forward-mode formula, in the form the
    ``torch.func`` transforms accept (``setup_context``; the operator's generated
    autograd function is refused by them): the forward is the operator (the
    kernels), ``jvp`` is :func:`_output_tangent`, ``backward`` the operator's own
    autograd formula. Used only under a ``torch.func`` transform (``grad``, ``vjp``,
    ``jacrev``, ``jvp``, ``jacfwd``, ``vmap``) or a forward-mode AD level (dual
    tensors), so that everywhere else (``torch.compile`` included) the operator is
    what the graph sees. Its ``vmap`` rule is generated (``jacfwd`` is ``vmap`` over
    ``jvp``)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(*args):
        with _vetting():
            return torch.ops.fastattn.attention(*args)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _setup_context(ctx, inputs, output)
        inputs = _with_defaults(inputs)
        (q, k, v, mask, bias, *_), (out, lse) = inputs, output
        ctx.save_for_forward(q, k, v, mask, bias, out, lse, inputs[_ALIBI],
                             inputs[_SEED], inputs[_SINKS], inputs[_SINKS + 1],
                             inputs[_SINKS + 2])

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        return _backward(ctx, grad_out, grad_lse)

    @staticmethod
    def jvp(ctx, *tangents):
        (q, k, v, mask, bias, out, lse, alibi_slopes, dropout_seed, sinks, q_lengths,
         kv_lengths) = ctx.saved_tensors
        (causal, scale, enable_gqa, _, window_left, window_right, softcap,
         dropout_p, _) = ctx.options
        t_out = _output_tangent(
            q, k, v, out, lse, mask, bias, causal, scale, enable_gqa, window_left,
            window_right, softcap, alibi_slopes, dropout_p, dropout_seed, sinks,
            tangents[_Q], tangents[_K], tangents[_V], tangents[_BIAS],
            tangents[_ALIBI], tangents[_SINKS], q_lengths, kv_lengths)
        return t_out, None


# ------------------------------------------------------------------ argument checks

def _check_device(t: Tensor, name: str, device, q_name: str) -> None:
    """``t`` strided and on ``device`` (that of the query, named ``q_name``): PyTorch's
    SDPA raises for mixed devices, and a meta tensor among CPU ones would otherwise
    reach the fake implementation, which answers with an uninitialised CPU tensor."""
    if t.layout is not _STRIDED:
        raise TypeError(
            f"{name} has layout {t.layout}; fastattn reads strided (dense) tensors "
            f"only: convert it with .to_dense()")
    if t.device != device:
        raise ValueError(
            f"{name} is on {t.device} but {q_name} is on {device}: every tensor "
            f"argument must be on the same device (fastattn computes on the CPU)")


def _check_data(tensors, names, same_dtype: bool) -> None:
    for t, name in zip(tensors, names):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not (t.is_cpu or t.is_meta):
            raise ValueError(
                f"fastattn computes on the CPU: {name} is on {t.device}; move it with "
                f".cpu() (or use torch.nn.functional.scaled_dot_product_attention)")
        _check_device(t, name, tensors[0].device, names[0])
        if t.dtype not in _DTYPES:
            raise TypeError(
                f"{name} must be float32, float64, bfloat16 or float16, got {t.dtype}")
    q, k, v = tensors
    if same_dtype and not q.dtype == k.dtype == v.dtype:
        raise TypeError(
            "query, key and value must have the same dtype, got "
            + ", ".join(f"{n} {t.dtype}" for t, n in zip(tensors, names)))


def _check_mask(t, name: str, kind: str, q: Tensor, q_name: str) -> Tensor | None:
    """A mask (boolean) or bias (real) argument, on q's device."""
    if t is None:
        return None
    if not isinstance(t, Tensor):
        t = torch.as_tensor(t)
    _check_device(t, name, q.device, q_name)
    if kind == "mask" and t.dtype != torch.bool:
        raise TypeError(
            f"{name} must be a boolean tensor (True = may attend), got {t.dtype}; "
            f"an additive mask is a bias")
    if kind == "bias" and (t.dtype == torch.bool or t.is_complex()):
        raise TypeError(f"{name} must hold real numbers, got {t.dtype}")
    if kind == "bias" and not t.is_floating_point():
        t = t.to(torch.float64)         # integers, as in the NumPy API
    return t


class _ShapeOf:
    """A tensor's shape as the NumPy API's shape checks read it (``shape``, ``ndim``),
    without its data."""

    __slots__ = ("shape", "ndim")

    def __init__(self, t: Tensor):
        self.shape = tuple(t.shape)
        self.ndim = len(self.shape)


def _shapes(q: Tensor, k: Tensor, v: Tensor, enable_gqa) -> _v.AttentionShapes:
    """The call's layout by the NumPy API's own shape checks (the same errors), for the
    arguments whose shape depends on it (lengths, ``out``)."""
    return _v.attention_shapes(_ShapeOf(q), _ShapeOf(k), _ShapeOf(v),
                               enable_gqa=bool(enable_gqa))


def _check_lengths(values, name: str, q: Tensor, shapes, L: int) -> Tensor | None:
    """``q_lengths``/``kv_lengths`` as an int64 tensor (B,) on q's device. A tensor's
    dtype and shape are checked here as the NumPy API checks them
    (``_validation.check_lengths_layout``), its values (in [0, L]) by the NumPy API
    when the operator runs: reading them here would break a ``torch.compile``
    graph. Anything else (a sequence, an array) is checked whole here by the NumPy
    API's check (under ``torch.compile``, as a tensor)."""
    if values is None:
        return None
    if not isinstance(values, Tensor):
        if _compiling():
            values = torch.as_tensor(values, device=q.device)
        else:
            return torch.from_numpy(_v.check_lengths(values, name, shapes.batch, L)).to(
                q.device)
    _check_device(values, name, q.device, "q")
    integer = not (values.dtype == torch.bool or values.is_floating_point()
                   or values.is_complex())
    _v.check_lengths_layout(name, values.shape, values.dtype, integer, shapes.batch)
    return values if values.dtype == torch.int64 else values.to(torch.int64)


def _refuse_out_under_autograd(out: Tensor, named) -> None:
    """``out=`` writes a tensor in place that autograd cannot see: refused, as PyTorch
    refuses its own out= functions, where an argument requires a gradient (or carries
    a forward-mode tangent, or a ``torch.func`` transform is active) rather than
    dropping the gradient silently."""
    if _grad_enabled():
        for name, t in named + (("out", out),):
            if t is not None and t.requires_grad:
                raise RuntimeError(
                    f"fastattn.torch.attention(): functions with out=... arguments "
                    f"don't support automatic differentiation, but {name} requires "
                    f"grad; call it without out= (or under torch.no_grad())")
    if not _compiling() and _functorch_layers() is not None:
        raise RuntimeError(
            "fastattn.torch.attention(): out= is not supported under torch.func "
            "transforms (grad, vjp, jvp, vmap): call it without out=")
    if _has_tangent([t for _, t in named] + [out]):
        raise RuntimeError(
            "fastattn.torch.attention(): functions with out=... arguments don't "
            "support forward-mode automatic differentiation, but an argument has a "
            "tangent; call it without out=")


def _check_out(out, q: Tensor, shapes) -> Tensor:
    """``out``: a strided tensor on q's device of the result's shape (*batch, Lq, Ev)
    and dtype (that of the promoted q), C-contiguous, as the NumPy API's ``out=``."""
    if not isinstance(out, Tensor):
        raise TypeError(f"out must be a torch.Tensor, got {type(out).__name__}")
    _check_device(out, "out", q.device, "q")
    want = shapes.batch + (shapes.Lq, shapes.Ev)
    if tuple(out.shape) != want or out.dtype != q.dtype:
        raise ValueError(
            f"out must have shape {want} and dtype {q.dtype} (the result's), got "
            f"shape {tuple(out.shape)} and dtype {out.dtype}")
    if not out.is_contiguous():
        raise ValueError(f"out must be C-contiguous, got strides {tuple(out.stride())}")
    return out


def _check_scale(scale) -> float | None:
    if scale is None:
        return None
    if isinstance(scale, (bool, np.bool_)) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a real number or None, got {scale!r}")
    try:
        return float(scale)
    except OverflowError:           # an int beyond float range, as the NumPy API says
        raise ValueError("scale is outside the range of a float") from None


def _check_threads(num_threads) -> int | None:
    """The NumPy API's check; a count beyond the operators' 64-bit ints is capped
    there (the NumPy API caps every count at the usable cores anyway)."""
    if num_threads is None:
        return None
    return min(_v.check_num_threads(num_threads), _INT64_MAX)


# ------------------------------------------------------------------------------------
# The variants (window, softcap, ALiBi, sinks, dropout) are computed by the kernels
# themselves: the operators pass them to the NumPy API. _unfused_attention computes
# attention with PyTorch's own arithmetic (the attention matrix formed), as a
# reference.
# ------------------------------------------------------------------------------------

def _check_window(window):
    """``(left, right)`` as the NumPy API checks it (``_validation.check_window``),
    with a side beyond the operators' 64-bit ints as None: unbounded, which it is (no
    tensor has that many positions; the NumPy API likewise treats a side of
    ``Lq + Lk`` or more as unbounded)."""
    return tuple(None if side is None or side > _INT64_MAX else side
                 for side in _v.check_window(window))


def _per_head(values, name: str, q: Tensor, q_name: str) -> Tensor:
    """``alibi_slopes`` or ``sinks``: a real tensor on q's device, in the computation
    dtype (float64 for float64 q, else float32; the cast is differentiable). A
    parameter (gpt-oss's sinks) that needs no gradient here is read as a plain
    tensor, so that evaluation (``generate``) keeps the direct path."""
    values = torch.as_tensor(values)
    if (isinstance(values, torch.nn.Parameter)
            and not (values.requires_grad and _grad_enabled())):
        values = values.detach()
    _check_device(values, name, q.device, q_name)
    if values.dtype == torch.bool or values.is_complex():
        raise TypeError(f"{name} must hold real numbers, got {values.dtype}")
    return values.to(_lse_dtype(q.dtype))


def _check_precision(precision) -> str | None:
    """``precision`` travels through the operators as an optional string, and the
    NumPy API checks its value when they run (the accepted values are the NumPy
    API's); any other type is refused here with the NumPy API's error."""
    if precision is None or isinstance(precision, str):
        return precision
    return _v.check_precision(precision)


def _variant_args(q, window, softcap, alibi_slopes, dropout_p, sinks=None,
                  q_name="q", *, dropout_seed=None, q_lengths=None, kv_lengths=None,
                  precision=None):
    """The variant arguments of the operators, checked: (window_left, window_right,
    softcap, alibi_slopes, dropout_p, dropout_seed, sinks, q_lengths, kv_lengths,
    precision). ``q_lengths``/``kv_lengths``: tensors checked by
    :func:`_check_lengths`, or None. The dropout seed is ``dropout_seed`` when given
    (an int in [0, 2**64), as in the NumPy API: the same pattern), else drawn from
    torch's default generator (``torch.manual_seed`` makes a run reproducible); it
    travels as a tensor and is regenerated from it in the backward."""
    if (window is None and softcap is None and alibi_slopes is None and sinks is None
            and dropout_seed is None and q_lengths is None and kv_lengths is None
            and precision is None
            and type(dropout_p) in (float, int) and dropout_p == 0):
        return _NO_VARIANTS                 # the common call: nothing to check
    window = _check_window(window)
    if alibi_slopes is not None:
        alibi_slopes = _per_head(alibi_slopes, "alibi_slopes", q, q_name)
    if sinks is not None:
        sinks = _per_head(sinks, "sinks", q, q_name)
    softcap = None if softcap is None else _v.check_softcap(softcap)
    dropout_p, checked_seed = _v.check_dropout(
        dropout_p, 0 if dropout_seed is None else dropout_seed)
    seed = None
    if dropout_p > 0 and dropout_seed is None:
        seed = torch.randint(0, 2**62, (1,), dtype=torch.int64, device=q.device)
    elif dropout_p > 0:
        as_int64 = checked_seed - _SEEDS if checked_seed >= _SEEDS // 2 else checked_seed
        seed = torch.tensor([as_int64], dtype=torch.int64, device=q.device)
    return (window[0], window[1], softcap, alibi_slopes, dropout_p, seed, sinks,
            q_lengths, kv_lengths, _check_precision(precision))


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
                                 sinks=None, num_threads=None):
    """``torch.nn.functional.scaled_dot_product_attention`` on CPU tensors, by fastattn.

    Parameters
    ----------
    query : Tensor of shape (*batch_q, Lq, E)
    key : Tensor of shape (*batch_kv, Lk, E)
    value : Tensor of shape (*batch_kv, Lk, Ev)
        Strided CPU tensors of one dtype: float32, float64, bfloat16 or float16.
        Batch axes broadcast as in PyTorch; any strides (transposed views are read
        in place).
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
        The factor applied to ``query @ key^T``; default ``1 / sqrt(E)``. An int
        beyond the range of a float raises ``ValueError``.
    enable_gqa : bool, default False
        Grouped-query attention: axis -3 of query may be a multiple of that of key and
        value; query head h uses key/value head h // (Hq // Hkv).
    window : (int or None, int or None), optional
        Keyword-only: query i attends only keys i - left <= j <= i + right (a sliding
        window); None on a side is unbounded, and so is a side beyond 2**63 - 1.
    softcap : float, optional
        Keyword-only: the scaled scores become ``softcap * tanh(scores / softcap)``
        before the mask is added (Gemma 2, Grok).
    alibi_slopes : Tensor broadcastable to *batch (last axis: query heads), optional
        Keyword-only: adds ``-slope * |i - j|`` to the scores (ALiBi).
    sinks : Tensor broadcastable to *batch (last axis: query heads), optional
        Keyword-only: attention sinks (gpt-oss's ``s_aux``), one extra logit per head
        that joins every row's softmax and carries no value, as in
        :func:`fastattn.attention`.
    num_threads : int, optional
        Keyword-only: threads for this call (default :func:`fastattn.get_num_threads`;
        any larger count is capped at the usable cores).

    Returns
    -------
    Tensor of shape (*batch, Lq, Ev)
        In the inputs' dtype, C-contiguous. Differentiable (reverse and forward mode)
        with respect to query, key, value, a floating ``attn_mask``, ``alibi_slopes``
        and ``sinks``.

    Raises
    ------
    TypeError
        For a non-tensor or non-float query, key or value, tensors of different
        dtypes, or a non-strided (e.g. sparse) tensor argument.
    ValueError
        For shapes that do not fit, a tensor argument on another device than
        query (``meta`` included) or a query not on the CPU, and bad values of
        the keywords.

    Notes
    -----
    The one difference from PyTorch: a query row with no allowed key gives zeros
    (PyTorch's CPU kernels do so too; its math fallback gives NaN). A floating mask
    whose row is all large negative values is not such a row: it averages the keys,
    as in PyTorch. ``attn_mask`` and ``is_causal`` may be given together (both
    apply). Any floating ``attn_mask`` dtype is accepted and cast to the computation
    dtype. bfloat16 and float16 tensors are read as they are, computed in float32 and
    the result rounded once.

    The gradients of q, k, v and ``sinks`` come from the kernels; those of a floating
    ``attn_mask`` and of ``alibi_slopes`` (only when they require one) and the
    forward-mode tangents (``torch.func.jvp``, ``jacfwd``, dual tensors) are computed
    with PyTorch's arithmetic, the (*batch, Lq, Lk) attention matrix formed.

    Examples
    --------
    >>> import torch, fastattn.torch
    >>> q, k, v = torch.randn(3, 2, 8, 5, 16).unbind(0)
    >>> out = fastattn.torch.scaled_dot_product_attention(q, k, v, is_causal=True)
    >>> want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    >>> out.shape, bool(torch.allclose(out, want, atol=1e-6))
    (torch.Size([2, 8, 5, 16]), True)
    """
    if (attn_mask is None and alibi_slopes is None
            and type(dropout_p) in (float, int) and not dropout_p
            and (softcap is None or type(softcap) is float)
            and _plain_window(window) and _plain(query, key, value)
            and _plain_sinks(sinks, query)):
        return _plain_call(query, key, value, bool(is_causal), scale, bool(enable_gqa),
                           num_threads, False, window, sinks, softcap)
    _check_data((query, key, value), ("query", "key", "value"), same_dtype=True)
    mask = bias = None
    if attn_mask is not None:
        if not isinstance(attn_mask, Tensor):
            attn_mask = torch.as_tensor(attn_mask)
        kind = "mask" if attn_mask.dtype == torch.bool else "bias"
        checked = _check_mask(attn_mask, "attn_mask", kind, query, "query")
        if kind == "mask":
            mask = checked
        else:
            bias = checked
    causal = _TOP_LEFT if is_causal else _NO_CAUSAL
    return _call(query, key, value, mask, bias, causal, _check_scale(scale),
                 bool(enable_gqa), num_threads,
                 _variant_args(query, window, softcap, alibi_slopes, dropout_p, sinks,
                               "query"),
                 return_lse=False)


def attention(q, k, v, *, mask=None, bias=None, causal=False, scale=None,
              enable_gqa=False, return_lse=False, window=None, softcap=None,
              alibi_slopes=None, sinks=None, q_lengths=None, kv_lengths=None,
              dropout_p=0.0, dropout_seed=None, precision=None, k_scale=None,
              v_scale=None, out=None, num_threads=None):
    """:func:`fastattn.attention` on tensors: the NumPy API's keywords, tensors back.

    Parameters
    ----------
    q : Tensor of shape (*batch_q, Lq, E)
    k : Tensor of shape (*batch_kv, Lk, E)
    v : Tensor of shape (*batch_kv, Lk, Ev)
        Strided CPU tensors of float32, float64, bfloat16 or float16; mixed dtypes
        promote as ``torch.promote_types`` (the same as NumPy's rule for these
        dtypes).
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
        float64 inputs, else float32; it includes the sink). It carries no gradient.
    window, softcap, alibi_slopes
        As in :func:`scaled_dot_product_attention`; query i sits at key position
        ``i + d`` with ``d = Lk - Lq`` when ``causal="bottom_right"`` (each
        sequence's own lengths with ``q_lengths``/``kv_lengths``), ``d = 0``
        otherwise.
    sinks : Tensor broadcastable to *batch (last axis: query heads), optional
        Attention sinks, as in :func:`fastattn.attention` (typically shape (Hq,)):
        the weights become ``exp(s_ij) / (sum_j exp(s_ij) + exp(sink))``.
        Differentiable; its gradient has its shape and dtype.
    q_lengths, kv_lengths : integer Tensor (or array_like) of shape (B,), optional
        The valid lengths of each sequence of a padded batch (B = axis 0 of
        *batch), as in :func:`fastattn.attention`: keys j >= kv_lengths[b] are never
        attended; rows i >= q_lengths[b] are zeros (lse -inf) and get zero
        gradients; with "bottom_right", ``d`` is each sequence's own
        ``kv_lengths[b] - q_lengths[b]``. Each in [0, Lk] (kv) or [0, Lq] (q).
        Not differentiable.
    dropout_p : float in [0, 1), default 0.0
        Attention dropout, in the kernels, regenerated (not stored) by the backward.
    dropout_seed : int in [0, 2**64), optional
        The seed of the dropout pattern: the same pattern as
        ``fastattn.attention(..., dropout_p=p, dropout_seed=seed)`` on the same
        arrays. Without it a seed is drawn from torch's default generator
        (``torch.manual_seed`` reproduces a run).
    precision : {None, "highest", "bf16"}, default None
        Passed to :func:`fastattn.attention`, which accepts its values and raises
        its errors (None: bfloat16 weights rounded once for the product with v on
        the bfloat16 units); the backward computes alike for each.
    k_scale, v_scale : Tensor, optional
        A quantized cache: k and v int8 codes (with both scales) or
        ``torch.float8_e4m3fn``/``float8_e5m2`` codes, as in
        :func:`fastattn.attention`. For inference: not differentiable, and a tensor
        that requires a gradient is refused (TypeError).
    out : Tensor of shape (*batch, Lq, Ev), optional
        A C-contiguous CPU tensor of the result's dtype (that of the promoted q, k,
        v), filled and returned, as the NumPy API's ``out=``. Refused (RuntimeError)
        where an input requires a gradient: autograd does not see a result written
        in place.
    num_threads : int, optional
        Threads for this call.

    Returns
    -------
    out : Tensor of shape (*batch, Lq, Ev)
        Differentiable (reverse and forward mode) with respect to q, k, v, bias,
        alibi_slopes and sinks. The ``out`` tensor itself when given.
    lse : Tensor of shape (*batch, Lq)
        Only with ``return_lse``.

    Raises
    ------
    TypeError, ValueError
        As :func:`scaled_dot_product_attention`, and as :func:`fastattn.attention`
        for the lengths, ``dropout_seed``, ``precision`` and ``out`` (each error
        names its argument).
    RuntimeError
        For ``out=`` with an input that requires a gradient (with grad mode on), has
        a forward-mode tangent, or under a ``torch.func`` transform.

    Examples
    --------
    >>> import torch, fastattn.torch
    >>> q = torch.randn(1, 4, 3, 16)          # 3 new queries
    >>> kv = torch.randn(1, 4, 10, 16)        # over a cache of 10 keys
    >>> out, lse = fastattn.torch.attention(q, kv, kv, causal="bottom_right",
    ...                                     return_lse=True)
    >>> out.shape, lse.shape
    (torch.Size([1, 4, 3, 16]), torch.Size([1, 4, 3]))
    >>> sinks = torch.zeros(4, requires_grad=True)   # one sink per head
    >>> fastattn.torch.attention(q, kv, kv, sinks=sinks).sum().backward()
    >>> sinks.grad.shape
    torch.Size([4])
    >>> x = torch.randn(2, 4, 6, 16)          # two sequences padded to 6 rows
    >>> padded = fastattn.torch.attention(x, x, x, q_lengths=torch.tensor([6, 4]),
    ...                                   kv_lengths=torch.tensor([6, 4]))
    >>> bool(padded[1, :, 4:].eq(0).all())    # the padding rows are zeros
    True
    """
    plain_arguments = (
        mask is None and bias is None and alibi_slopes is None and q_lengths is None
        and dropout_seed is None and out is None and precision is None
        and type(dropout_p) in (float, int) and not dropout_p
        and (softcap is None or type(softcap) is float)
        and _plain_window(window) and _plain_sinks(sinks, q)
        and _plain_lengths(kv_lengths))
    if plain_arguments and ((k_scale is None and v_scale is None and _plain(q, k, v))
                            or _plain_codes(q, k, v, k_scale, v_scale)):
        return _plain_call(q, k, v, causal, scale, enable_gqa, num_threads,
                           bool(return_lse), window, sinks, softcap, kv_lengths,
                           k_scale, v_scale)
    if (k_scale is not None or v_scale is not None or _torch_cache.is_code(k)
            or _torch_cache.is_code(v)):
        return _torch_cache.quantized_attention(
            q, k, v, out=out, mask=mask, bias=bias, causal=causal, scale=scale,
            enable_gqa=enable_gqa, return_lse=return_lse, window=window,
            softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks,
            q_lengths=q_lengths, kv_lengths=kv_lengths, dropout_p=dropout_p,
            dropout_seed=dropout_seed, precision=precision, k_scale=k_scale,
            v_scale=v_scale, num_threads=num_threads)
    tensors = [t if isinstance(t, Tensor) else torch.as_tensor(t) for t in (q, k, v)]
    _check_data(tensors, ("q", "k", "v"), same_dtype=False)
    q, k, v = tensors
    if not q.dtype == k.dtype == v.dtype:
        dtype = torch.promote_types(torch.promote_types(q.dtype, k.dtype), v.dtype)
        q, k, v = (t if t.dtype == dtype else t.to(dtype) for t in tensors)
    causal = (_NO_CAUSAL if causal is False else _TOP_LEFT if causal is True
              else _CAUSAL_CODES[_v.parse_causal(causal)])
    mask = _check_mask(mask, "mask", "mask", q, "q")
    bias = _check_mask(bias, "bias", "bias", q, "q")
    shapes = None
    if q_lengths is not None or kv_lengths is not None or out is not None:
        shapes = _shapes(q, k, v, enable_gqa)
        q_lengths = _check_lengths(q_lengths, "q_lengths", q, shapes, shapes.Lq)
        kv_lengths = _check_lengths(kv_lengths, "kv_lengths", q, shapes, shapes.Lk)
    variants = _variant_args(q, window, softcap, alibi_slopes, dropout_p, sinks,
                             dropout_seed=dropout_seed, q_lengths=q_lengths,
                             kv_lengths=kv_lengths, precision=precision)
    if out is not None:
        out = _check_out(out, q, shapes)
        _refuse_out_under_autograd(out, (("q", q), ("k", k), ("v", v), ("bias", bias),
                                         ("alibi_slopes", variants[3]),
                                         ("sinks", variants[6])))
    return _call(q, k, v, mask, bias, causal, _check_scale(scale), bool(enable_gqa),
                 num_threads, variants, return_lse=bool(return_lse), out=out)
