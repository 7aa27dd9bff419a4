"""The contenders: fastattn, the NumPy baseline (:mod:`fastattn.reference`) and PyTorch.

:func:`make_callable` turns a case and its inputs into a zero-argument function that
runs one contender once; PyTorch is imported only when a run asks for it.
"""

from __future__ import annotations

from typing import Callable, Dict, Optional

import numpy as np

import fastattn
from ... import _validation as _v, reference
from .grid import Case

__all__ = ["CONTENDERS", "Unavailable", "make_inputs", "make_callable"]

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


def make_inputs(case: Case, seed: int = 0) -> Dict[str, np.ndarray]:
    """Random q, k, v (and grad ``do``) of the case's shapes and dtype, C-contiguous."""
    rng = np.random.default_rng(seed)
    dt = np.dtype(case.dtype)

    def randn(*shape):
        return rng.standard_normal(shape, dtype=np.float64).astype(dt)

    return {"q": randn(case.B, case.H, case.Lq, case.E),
            "k": randn(case.B, case.kv_heads, case.Lk, case.E),
            "v": randn(case.B, case.kv_heads, case.Lk, case.ev),
            "do": randn(case.B, case.H, case.Lq, case.ev)}


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
        Its return value is the output (forward) or ``(dq, dk, dv)`` (backward).

    Raises
    ------
    Unavailable
        When the contender cannot run here (PyTorch not installed, a fastattn function
        not built).
    """
    q, k, v, do = arrays["q"], arrays["k"], arrays["v"], arrays["do"]
    causal = case.causal_kind or False
    gqa = case.gqa
    if contender == "fastattn":
        attention = getattr(fastattn, "attention", None)
        if attention is None:
            raise Unavailable("fastattn.attention is not available in this build")
        if not backward:
            return lambda: attention(q, k, v, causal=causal, enable_gqa=gqa,
                                     num_threads=threads)
        attention_backward = getattr(fastattn, "attention_backward", None)
        if attention_backward is None:
            raise Unavailable("fastattn.attention_backward is not available in this "
                              "build; its column is skipped")

        def fastattn_fwd_bwd():
            out, lse = attention(q, k, v, causal=causal, enable_gqa=gqa,
                                 return_lse=True, num_threads=threads)
            return attention_backward(do, q, k, v, out, lse, causal=causal,
                                      enable_gqa=gqa, num_threads=threads)
        return fastattn_fwd_bwd
    if contender == "numpy":
        if not backward:
            return lambda: reference.attention(q, k, v, causal=causal, enable_gqa=gqa)

        def numpy_fwd_bwd():
            out, lse = reference.attention(q, k, v, causal=causal, enable_gqa=gqa,
                                           return_lse=True)
            return reference.attention_backward(do, q, k, v, out, lse, causal=causal,
                                                enable_gqa=gqa)
        return numpy_fwd_bwd
    if contender == "torch":
        torch = torch_module
        if torch is None:
            raise Unavailable("PyTorch is not installed (pip install torch)")
        return _torch_callable(torch, case, q, k, v, do, backward)
    raise ValueError(f"unknown contender {contender!r}; expected one of {CONTENDERS}")


def _torch_callable(torch, case: Case, q, k, v, do, backward: bool):
    sdpa = torch.nn.functional.scaled_dot_product_attention
    kind = case.causal_kind
    kwargs = {}
    if case.gqa:
        kwargs["enable_gqa"] = True
    if kind == "top_left":
        kwargs["is_causal"] = True
    elif kind == "bottom_right":
        allowed = _v.causal_allowed(kind, case.Lq, case.Lk)
        if not allowed.all():                   # decode (Lq = 1) may attend to every key
            kwargs["attn_mask"] = torch.from_numpy(allowed)
    tq, tk, tv = (torch.from_numpy(a) for a in (q, k, v))
    if not backward:
        def torch_fwd():
            with torch.no_grad():
                return sdpa(tq, tk, tv, **kwargs)
        return torch_fwd
    for t in (tq, tk, tv):
        t.requires_grad_(True)
    tdo = torch.from_numpy(do)

    def torch_fwd_bwd():
        out = sdpa(tq, tk, tv, **kwargs)
        return torch.autograd.grad(out, (tq, tk, tv), tdo)
    return torch_fwd_bwd


def _as_numpy_tuple(result) -> tuple:
    items = result if isinstance(result, (tuple, list)) else (result,)
    out = []
    for x in items:
        if hasattr(x, "detach"):
            x = x.detach().numpy()
        out.append(np.asarray(x))
    return tuple(out)


def _max_abs_diff(result, expected) -> Optional[float]:
    got, want = _as_numpy_tuple(result), _as_numpy_tuple(expected)
    if len(got) != len(want) or any(g.shape != w.shape for g, w in zip(got, want)):
        return None
    diffs = [float(np.max(np.abs(g.astype(np.float64) - w.astype(np.float64))))
             if g.size else 0.0 for g, w in zip(got, want)]
    return max(diffs) if diffs else 0.0
