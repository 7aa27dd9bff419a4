"""The contenders: fastattn, the NumPy baseline (:mod:`fastattn.reference`) and PyTorch.

:func:`make_callable` turns a case and its inputs into a zero-argument function that
runs one contender once; PyTorch is imported only when a run asks for it.

Attention variants reach each contender in its own terms: fastattn and the NumPy
baseline take them natively (``window=``, ``softcap=``, ``alibi_slopes=``, ``sinks=``,
``q_lengths=``/``kv_lengths=``, a key-padding ``mask=``, or
``attention_varlen``). PyTorch's ``scaled_dot_product_attention`` gets the equivalent
explicit boolean ``attn_mask`` for a window or a ragged batch (all three ragged
flavours: the padded arrays with the key-padding mask, which is what a PyTorch caller
writes), and an additive float ``attn_mask`` for ALiBi (``-inf`` where the mask rules
forbid a key). SDPA has no softcap and takes no sinks: for such a case the PyTorch
contender is the eager composition ``matmul -> softcap * tanh(s / softcap) -> softmax
-> matmul`` (what transformers' eager Gemma 2 attention does), with sinks the sink
logit of each head concatenated to every row before the softmax (less the row's
maximum) and its weight dropped after it (what transformers' eager gpt-oss attention
does); :func:`torch_implementation` names which.
"""

from __future__ import annotations

import math
from typing import Callable, Dict, Optional

import numpy as np

import fastattn
from ... import _validation as _v, reference
from .grid import Case, numpy_dtype

__all__ = ["CONTENDERS", "Unavailable", "make_inputs", "make_callable",
           "alibi_slopes", "torch_implementation", "fastattn_kernel"]

#: The contenders, in the order they run within a round.
CONTENDERS = ("fastattn", "numpy", "torch")


def _import_torch():
    """torch, or None when it is not installed (or does not load)."""
    try:
        import torch
        import torch.nn.functional  # noqa: F401
    except Exception:                                   # noqa: BLE001 - any failure
        return None
    return torch


class Unavailable(Exception):
    """A contender cannot run here (not installed, not built yet); the message says why."""


def alibi_slopes(H: int) -> np.ndarray:
    """The ALiBi slopes of ``H`` heads, ``2 ** (-8 (h + 1) / H)`` (Press et al.)."""
    return 2.0 ** (-8.0 * (np.arange(H) + 1) / H)


def torch_implementation(case: Case) -> str:
    """What the PyTorch contender runs for ``case``, in words."""
    if case.sinks:
        steps = "matmul/tanh/" if case.softcap is not None else "matmul/"
        return (f"eager {steps}cat sink logit/softmax/drop sink/matmul (SDPA takes no "
                f"sinks; as transformers' gpt-oss eager)")
    if case.softcap is not None:
        return "eager matmul/tanh/softmax/matmul (SDPA has no softcap)"
    if case.alibi:
        return "SDPA with an additive float mask"
    if case.window is not None or case.lengths is not None:
        return "SDPA with a boolean mask"
    if case.causal_kind == "bottom_right" and not case.decode:
        return "SDPA with a boolean mask"
    return "SDPA"


def make_inputs(case: Case, seed: int = 0) -> Dict[str, np.ndarray]:
    """Random q, k, v (and grad ``do``) of the case's shapes and dtype, C-contiguous.

    For a ragged case the padded arrays are random everywhere, ``do`` is zero in the
    padded query rows (so every flavour's gradients agree on the real rows), and the
    dict also holds ``lengths`` (int64 (B,)), ``padding_mask`` (bool (B, 1, 1, Lk)),
    ``cu_seqlens`` (int64 (B + 1,)) and the real rows packed without padding,
    ``q_packed`` (total, H, E), ``k_packed``, ``v_packed``, ``do_packed``. With
    ``case.alibi`` it holds ``alibi_slopes`` (H,); with ``case.sinks``, ``sinks`` (H,):
    N(0, 1) logits, exact in the case's dtype, stored in its computation dtype
    (float64 for float64, else float32), drawn after every other array (so q, k, v and
    ``do`` are those of the same case without sinks).
    """
    rng = np.random.default_rng(seed)
    dt = numpy_dtype(case.dtype)

    def randn(*shape):
        return rng.standard_normal(shape, dtype=np.float64).astype(dt)

    arrays = {"q": randn(case.B, case.H, case.Lq, case.E),
              "k": randn(case.B, case.kv_heads, case.Lk, case.E),
              "v": randn(case.B, case.kv_heads, case.Lk, case.ev),
              "do": randn(case.B, case.H, case.Lq, case.ev)}
    if case.alibi:
        arrays["alibi_slopes"] = alibi_slopes(case.H)
    if case.lengths is not None:
        lengths = np.array(case.lengths, dtype=np.int64)
        rows = np.arange(case.Lq)
        arrays["do"] *= (rows[None, :] < lengths[:, None])[:, None, :, None]
        arrays["lengths"] = lengths
        arrays["padding_mask"] = (np.arange(case.Lk)[None, :]
                                  < lengths[:, None])[:, None, None, :]
        arrays["cu_seqlens"] = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        for name in ("q", "k", "v", "do"):
            x = arrays[name]
            arrays[name + "_packed"] = np.ascontiguousarray(np.concatenate(
                [x[b, :, :n].swapaxes(0, 1) for b, n in enumerate(case.lengths)]))
    if case.sinks:
        computation = np.float64 if case.dtype == "float64" else np.float32
        arrays["sinks"] = randn(case.H).astype(computation)
    return arrays


def _variant_kwargs(case: Case, arrays) -> dict:
    """The variant keywords of ``fastattn.attention`` and ``reference.attention``."""
    kw = {}
    if case.window is not None:
        kw["window"] = case.window
    if case.softcap is not None:
        kw["softcap"] = case.softcap
    if case.alibi:
        kw["alibi_slopes"] = arrays["alibi_slopes"]
    if case.sinks:
        kw["sinks"] = arrays["sinks"]
    if case.ragged_flavour == "lengths":
        kw["q_lengths"] = kw["kv_lengths"] = arrays["lengths"]
    elif case.ragged_flavour == "mask":
        kw["mask"] = arrays["padding_mask"]
    return kw


def make_callable(case: Case, contender: str, arrays: Dict[str, np.ndarray],
                  threads: int, *, backward: bool = False,
                  torch_module=None) -> Callable[[], object]:
    """A zero-argument function that runs one contender once on ``arrays``.

    Parameters
    ----------
    case : Case
    contender : {"fastattn", "numpy", "torch"}
    arrays : dict
        From :func:`make_inputs`; PyTorch shares their memory (``torch.from_numpy``).
    threads : int
        Passed to fastattn as ``num_threads=``; PyTorch and BLAS threads are set by
        :func:`thread_limits`.
    backward : bool
        Time forward + backward instead of forward only.
    torch_module : module, optional
        The imported ``torch``; needed for the ``"torch"`` contender.

    Returns
    -------
    callable
        Its return value is the output (forward) or ``(dq, dk, dv)`` (backward):
        packed (total, H, ...) arrays for a ``"varlen"`` case in fastattn and NumPy,
        padded (B, H, L, ...) arrays otherwise (see :func:`real_rows`).

    Raises
    ------
    Unavailable
        When the contender cannot run here (PyTorch not installed, a fastattn function
        not built).
    """
    if contender == "fastattn":
        return _library_callable(fastattn, "fastattn", case, arrays, backward,
                                 dict(num_threads=threads))
    if contender == "numpy":
        return _library_callable(reference, "fastattn.reference", case, arrays,
                                 backward, {})
    if contender == "torch":
        torch = torch_module
        if torch is None:
            raise Unavailable("PyTorch is not installed (pip install torch)")
        return _torch_callable(torch, case, arrays, backward)
    raise ValueError(f"unknown contender {contender!r}; expected one of {CONTENDERS}")


def _library_callable(lib, name: str, case: Case, arrays, backward: bool, extra: dict):
    """fastattn or the reference: the same keywords, natively."""
    causal = case.causal_kind or False
    kw = dict(_variant_kwargs(case, arrays), causal=causal, **extra)
    if case.ragged_flavour == "varlen":
        fwd_name, bwd_name = "attention_varlen", "attention_varlen_backward"
        q, k, v, do = (arrays[n + "_packed"] for n in ("q", "k", "v", "do"))
        cu = arrays["cu_seqlens"]
        lead, tail = (q, k, v), (cu, cu)
    else:
        fwd_name, bwd_name = "attention", "attention_backward"
        q, k, v, do = arrays["q"], arrays["k"], arrays["v"], arrays["do"]
        lead, tail = (q, k, v), ()
        kw["enable_gqa"] = case.gqa
    forward = getattr(lib, fwd_name, None)
    if forward is None:
        raise Unavailable(f"{name}.{fwd_name} is not available in this build")
    if not backward:
        return lambda: forward(*lead, *tail, **kw)
    backward_fn = getattr(lib, bwd_name, None)
    if backward_fn is None:
        raise Unavailable(f"{name}.{bwd_name} is not available in this build; its "
                          f"column is skipped")

    def fwd_bwd():
        out, lse = forward(*lead, *tail, return_lse=True, **kw)
        return backward_fn(do, *lead, out, lse, *tail, **kw)
    return fwd_bwd


def _plan_of(case: Case, arrays):
    """The plan fastattn.attention makes for the case's arrays."""
    from ... import _compute
    kw = _variant_kwargs(case, arrays)
    args = _v.attention_args(arrays["q"], arrays["k"], arrays["v"],
                             mask=kw.pop("mask", None), causal=case.causal_kind or False,
                             enable_gqa=case.gqa)
    var = _v.variants_of(args, **kw)
    s = args.shapes
    return _compute._plan(args, np.empty(s.batch + (s.Lq, s.Ev), args.computation),
                          var=var)


def fastattn_kernel(case: Case, arrays, backward: bool = False) -> str:
    """What computes the case's forward products in fastattn here: "decode" (the
    decoding path), else the fused pass's score kernel ("amx_bf16", "avx512_bf16" or
    "fma": ``AttentionPlan.dot_kernel``), as fastattn.attention would choose it; with
    ``backward``, then "+" and what computes the backward's gradient products
    ("avx512_bf16" or "fma", for a grad_out of q's dtype)."""
    from ... import _dispatch
    plan = _plan_of(case, arrays)
    forward = ("decode" if _dispatch.drivers.forward_path(plan)[0] == "decode"
               else plan.dot_kernel)
    if not backward:
        return forward
    return forward + "+" + _dispatch.drivers.backward_kernel(plan, arrays["q"].dtype)


def _allowed(case: Case, arrays) -> Optional[np.ndarray]:
    """The boolean mask of the causal rule, the window and the key padding, shaped
    (B or 1, 1, Lq, Lk), or None when every key is allowed."""
    kind = case.causal_kind
    left, right = case.window if case.window is not None else (None, None)
    i = np.arange(case.Lq)[:, None]
    j = np.arange(case.Lk)[None, :]
    pos = i + _v.query_offset(kind, case.Lq, case.Lk)       # Lq == Lk when ragged
    allowed = np.ones((case.Lq, case.Lk), dtype=bool)
    if kind is not None:
        allowed &= j <= pos
    if left is not None:
        allowed &= j >= pos - left
    if right is not None:
        allowed &= j <= pos + right
    allowed = allowed[None, None]
    if case.lengths is not None:
        allowed = allowed & arrays["padding_mask"]
    return None if allowed.all() else allowed


def _torch_callable(torch, case: Case, arrays, backward: bool):
    sdpa = torch.nn.functional.scaled_dot_product_attention
    q, k, v, do = arrays["q"], arrays["k"], arrays["v"], arrays["do"]
    kind = case.causal_kind
    kwargs = {}
    if case.gqa:
        kwargs["enable_gqa"] = True
    dtype = np.dtype(np.float32) if case.dtype == "bfloat16" else np.dtype(case.dtype)
    eager = case.softcap is not None or case.sinks       # SDPA cannot run these
    # is_causal=True for SDPA; an eager composition takes the causal rule as a mask
    plain_causal = (kind == "top_left" and case.window is None and case.lengths is None
                    and not case.alibi and not eager)
    allowed = None if plain_causal else _allowed(case, arrays)
    bias = None
    if case.alibi:
        qpos = np.arange(case.Lq)[:, None] + _v.query_offset(kind, case.Lq, case.Lk)
        dist = np.abs(qpos - np.arange(case.Lk)[None, :]).astype(dtype)
        bias = (-arrays["alibi_slopes"].astype(dtype)[None, :, None, None] * dist)
        if allowed is not None:
            bias = np.where(allowed, bias, dtype.type(-np.inf))
        bias = np.ascontiguousarray(bias, dtype=dtype)
    tsinks = _to_torch(torch, arrays["sinks"], case.dtype) if case.sinks else None
    if eager:
        fn = _torch_eager(torch, case, allowed, bias, tsinks)
    else:
        if plain_causal:
            kwargs["is_causal"] = True
        elif bias is not None:
            kwargs["attn_mask"] = _to_torch(torch, bias, case.dtype)
        elif allowed is not None:
            kwargs["attn_mask"] = torch.from_numpy(np.ascontiguousarray(allowed))

        def fn(tq, tk, tv):
            return sdpa(tq, tk, tv, **kwargs)
    tq, tk, tv = (_to_torch(torch, a) for a in (q, k, v))
    if not backward:
        def torch_fwd():
            with torch.no_grad():
                return fn(tq, tk, tv)
        return torch_fwd
    # with sinks, their gradient too (fastattn and the baseline return dsinks)
    inputs = (tq, tk, tv) + ((tsinks,) if tsinks is not None else ())
    for t in inputs:
        t.requires_grad_(True)
    tdo = _to_torch(torch, do)

    def torch_fwd_bwd():
        out = fn(tq, tk, tv)
        return torch.autograd.grad(out, inputs, tdo)
    return torch_fwd_bwd


def _to_torch(torch, a: np.ndarray, dtype: Optional[str] = None):
    """A tensor on the memory of ``a`` (bfloat16 through its 16-bit words), in
    ``dtype`` (a case's dtype name) when given."""
    if a.dtype.name == "bfloat16":
        t = torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    else:
        t = torch.from_numpy(a)
    return t if dtype is None else t.to(getattr(torch, dtype))


def _torch_eager(torch, case: Case, allowed, bias, tsinks=None):
    """PyTorch's composition for softcap and sinks: scores, cap, bias/mask, softmax
    (with the sink logit ``tsinks[h]`` of each head as one more column, dropped after
    it), weights."""
    scale = 1.0 / math.sqrt(case.E)
    cap = case.softcap
    groups = case.H // case.kv_heads
    tmask = None if allowed is None or bias is not None else torch.from_numpy(~allowed)
    tbias = None if bias is None else _to_torch(torch, bias, case.dtype)

    def eager(tq, tk, tv):
        if groups > 1:
            tk = tk.repeat_interleave(groups, dim=-3)
            tv = tv.repeat_interleave(groups, dim=-3)
        s = torch.matmul(tq, tk.transpose(-1, -2)) * scale
        if cap is not None:
            s = torch.tanh(s / cap) * cap
        if tbias is not None:
            s = s + tbias
        elif tmask is not None:
            s = s.masked_fill(tmask, -math.inf)
        if tsinks is not None:
            # transformers' gpt-oss eager_attention_forward: the sink joins each row,
            # the row's maximum is subtracted, and the sink's weight is dropped
            sink = tsinks.reshape(1, -1, 1, 1).expand(s.shape[0], -1, s.shape[-2], 1)
            s = torch.cat([s, sink], dim=-1)
            s = s - s.max(dim=-1, keepdim=True).values
            return torch.matmul(torch.softmax(s, dim=-1)[..., :-1], tv)
        p = torch.softmax(s, dim=-1)
        p = torch.nan_to_num(p, nan=0.0) if tmask is not None or tbias is not None else p
        return torch.matmul(p, tv)
    return eager


def _as_numpy_tuple(result) -> tuple:
    items = result if isinstance(result, (tuple, list)) else (result,)
    out = []
    for x in items:
        if hasattr(x, "detach"):
            x = x.detach()
            x = (x.float() if x.dtype.is_floating_point and x.element_size() == 2
                 else x).numpy()
        out.append(np.asarray(x))
    return tuple(out)


def real_rows(case: Case, x: np.ndarray) -> np.ndarray:
    """The real rows of one output or gradient of a ragged case, flattened in the order
    (sequence, head, row, column), from a padded (B, H, L, D) or a packed (total, H, D)
    array; ``x`` itself for a dense case, or for a per-head gradient (``dsinks``)."""
    if case.lengths is None or x.ndim < 3:              # dense, or dsinks
        return x
    if x.ndim == 3:                                     # packed (varlen)
        starts = np.concatenate([[0], np.cumsum(case.lengths)])
        parts = [x[starts[b]:starts[b + 1]].swapaxes(0, 1)
                 for b in range(case.B)]
    else:
        parts = [x[b, :, :n] for b, n in enumerate(case.lengths)]
    return np.concatenate([p.ravel() for p in parts]) if parts else x.ravel()[:0]


def _max_abs(result, case: Optional[Case] = None) -> float:
    """The largest magnitude in a result (its real rows; several arrays: all of them),
    the scale its differences are judged against."""
    arrays = [real_rows(case, a) if case is not None else a
              for a in _as_numpy_tuple(result)]
    return max((float(np.max(np.abs(a.astype(np.float64)))) for a in arrays if a.size),
               default=0.0)


def _max_abs_diff(result, expected, case: Optional[Case] = None) -> Optional[float]:
    got, want = _as_numpy_tuple(result), _as_numpy_tuple(expected)
    if case is not None:
        got = tuple(real_rows(case, g) for g in got)
        want = tuple(real_rows(case, w) for w in want)
    if len(got) != len(want) or any(g.shape != w.shape for g, w in zip(got, want)):
        return None
    diffs = [float(np.max(np.abs(g.astype(np.float64) - w.astype(np.float64))))
             if g.size else 0.0 for g, w in zip(got, want)]
    return max(diffs) if diffs else 0.0
