"""Argument checking shared by the public API and the NumPy reference.

Everything here is about *what* a call means (dtypes, shapes, options), never about
how it is computed: the reference computes with plain NumPy, the API with the kernels.
"""

from __future__ import annotations

import math
import numbers
from typing import NamedTuple, Optional, Tuple

import numpy as np

CAUSAL_KINDS = ("top_left", "bottom_right")


# ----------------------------------------------------------------------------- dtypes

def as_real(x, name: str) -> np.ndarray:
    """``numpy.asarray(x)`` with integers taken as float64; anything not real raises.

    float16/32/64 pass through unchanged (non-native byte order is converted to
    native); bool, complex, object, string, bytes and extended precision raise
    ``TypeError`` naming the argument.
    """
    a = np.asarray(x)
    kind = a.dtype.kind
    if kind in "iu":
        return a.astype(np.float64)
    if kind == "f" and a.dtype.itemsize <= 8:
        if not a.dtype.isnative:
            return a.astype(a.dtype.newbyteorder("="))
        # the kernels load whole floats: a misaligned buffer (e.g. from
        # numpy.frombuffer at an odd offset) is copied to an aligned one
        return a if a.flags.aligned else a.copy()
    if kind == "f":
        raise TypeError(
            f"{name} has dtype {a.dtype}, which fastattn does not compute in; "
            f"convert it to float64 first")
    raise TypeError(
        f"{name} must hold real numbers (float or integer), got dtype {a.dtype}")


def result_dtype(*arrays: np.ndarray) -> np.dtype:
    """The result dtype of a call: ``numpy.result_type`` of its (real) data arrays."""
    return np.result_type(*(a.dtype for a in arrays))


def computation_dtype(result: np.dtype) -> np.dtype:
    """float16 results are computed in float32 and rounded once at the end."""
    return np.dtype(np.float32) if result == np.float16 else np.dtype(result)


def lse_dtype(computation: np.dtype) -> np.dtype:
    return np.dtype(np.float64) if computation == np.float64 else np.dtype(np.float32)


def as_mask(mask, name: str = "mask") -> np.ndarray:
    m = np.asarray(mask)
    if m.dtype != np.bool_:
        raise TypeError(
            f"{name} must be boolean (True = may attend), got dtype {m.dtype}; "
            f"an additive mask is passed as bias=")
    return m


def as_bias(bias, computation: np.dtype, name: str = "bias") -> np.ndarray:
    return as_real(bias, name).astype(computation, copy=False)


# ---------------------------------------------------------------------------- options

def parse_causal(causal) -> Optional[str]:
    """``False`` -> None; ``True`` -> "top_left"; the two strings pass; else ValueError."""
    if isinstance(causal, (bool, np.bool_)):
        return "top_left" if causal else None
    if isinstance(causal, str) and causal in CAUSAL_KINDS:
        return str(causal)
    raise ValueError(
        f"causal must be False, True, 'top_left' or 'bottom_right', got {causal!r}")


def check_int(value, name: str, minimum: int = 1) -> int:
    """An integer >= minimum (Python or NumPy); bool and non-integers raise TypeError."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer >= {minimum}, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def check_num_threads(n, name: str = "num_threads") -> int:
    """A thread count: an integer >= 1."""
    return check_int(n, name, 1)


def resolve_scale(scale, E: int) -> float:
    if scale is None:
        if E == 0:
            raise ValueError(
                "the default scale 1/sqrt(E) is undefined for E == 0 (q and k have "
                "a last axis of size 0); pass scale= explicitly")
        return 1.0 / math.sqrt(E)
    if isinstance(scale, (bool, np.bool_)) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a real number or None, got {scale!r}")
    try:
        return float(scale)
    except OverflowError:       # an int beyond float range
        raise ValueError("scale is outside the range of a float") from None


def normalize_axis(axis, ndim: int, name: str, shape) -> int:
    if isinstance(axis, (bool, np.bool_)) or not isinstance(axis, numbers.Integral):
        raise TypeError(f"axis must be an integer, got {axis!r}")
    if not -ndim <= axis < ndim:
        raise np.exceptions.AxisError(
            f"axis {axis} is out of bounds for {name} of shape {tuple(shape)}")
    return int(axis) % ndim


# ----------------------------------------------------------------------------- shapes

def broadcast_batch(a_shape, b_shape, a_name: str, b_name: str, a_full, b_full):
    try:
        return tuple(np.broadcast_shapes(tuple(a_shape), tuple(b_shape)))
    except ValueError:
        raise ValueError(
            f"the batch axes of {a_name} {tuple(a_full)} and {b_name} {tuple(b_full)} "
            f"do not broadcast: {tuple(a_shape)} vs {tuple(b_shape)}") from None


def weighted_sum_batch(p, v):
    """Check p (*b1, Lq, Lk) against v (*b2, Lk, Ev); return the broadcast batch shape."""
    for name, a in (("p", p), ("v", v)):
        if a.ndim < 2:
            raise ValueError(
                f"{name} must have at least 2 dimensions, got shape {a.shape}")
    if p.shape[-1] != v.shape[-2]:
        raise ValueError(
            f"p's last axis must match v's axis -2 (the keys), got p {p.shape} and "
            f"v {v.shape}")
    return broadcast_batch(p.shape[:-2], v.shape[:-2], "p", "v", p.shape, v.shape)


class AttentionShapes(NamedTuple):
    batch: Tuple[int, ...]     # the output's batch shape (*batch)
    Lq: int
    Lk: int
    E: int
    Ev: int
    groups: int                # query heads per key/value head (1 without GQA)


def attention_shapes(q, k, v=None, *, enable_gqa=False) -> AttentionShapes:
    """Check q (*b, Lq, E), k (*bkv, Lk, E) and v (*bkv, Lk, Ev); return the layout."""
    names = (("q", q), ("k", k)) + ((("v", v),) if v is not None else ())
    for name, a in names:
        if a.ndim < 2:
            raise ValueError(
                f"{name} must have at least 2 dimensions (..., L, E), got shape {a.shape}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"q and k must have the same last axis E, got q {q.shape} and k {k.shape}")
    if v is not None:
        if v.shape[-2] != k.shape[-2]:
            raise ValueError(
                f"k and v must have the same number of keys (axis -2), got "
                f"k {k.shape} and v {v.shape}")
        if v.shape[:-2] != k.shape[:-2]:
            raise ValueError(
                f"k and v must have the same batch shape, got k {k.shape} and v {v.shape}")
    Lq, E = q.shape[-2:]
    Lk = k.shape[-2]
    Ev = v.shape[-1] if v is not None else 0
    if enable_gqa:
        for name, a in names:
            if a.ndim < 3:
                raise ValueError(
                    f"enable_gqa needs q, k and v with a head axis (-3); {name} has "
                    f"shape {a.shape}")
        hq, hkv = q.shape[-3], k.shape[-3]
        if hkv == 0 or hq % hkv != 0:
            raise ValueError(
                f"enable_gqa: the query heads of q {q.shape} (axis -3: {hq}) must be a "
                f"multiple of the key/value heads of k {k.shape} (axis -3: {hkv})")
        outer = broadcast_batch(q.shape[:-3], k.shape[:-3], "q", "k", q.shape, k.shape)
        batch = outer + (hq,)
        groups = hq // hkv
    else:
        batch = broadcast_batch(q.shape[:-2], k.shape[:-2], "q", "k", q.shape, k.shape)
        groups = 1
    return AttentionShapes(batch, Lq, Lk, E, Ev, groups)


def check_broadcasts_to(a: np.ndarray, target, name: str) -> None:
    """``a`` must broadcast to ``target`` without enlarging it (no extra leading axes)."""
    target = tuple(target)
    ok = a.ndim <= len(target)
    if ok:
        try:
            ok = tuple(np.broadcast_shapes(a.shape, target)) == target
        except ValueError:
            ok = False
    if not ok:
        raise ValueError(
            f"{name} of shape {a.shape} does not broadcast to (*batch, Lq, Lk) = {target}")


def check_out(out, shape, dtype, name: str = "out") -> np.ndarray:
    if not isinstance(out, np.ndarray):
        raise ValueError(f"{name} must be a numpy.ndarray, got {type(out).__name__}")
    if out.shape != tuple(shape) or out.dtype != dtype:
        raise ValueError(
            f"{name} must have shape {tuple(shape)} and dtype {np.dtype(dtype)}, got "
            f"shape {out.shape} and dtype {out.dtype}")
    if not out.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous")
    if not out.flags.writeable:
        raise ValueError(f"{name} must be writeable")
    return out


class AttentionArgs(NamedTuple):
    q: np.ndarray              # in the computation dtype, shapes as given
    k: np.ndarray
    v: Optional[np.ndarray]
    mask: Optional[np.ndarray]         # bool, shape as given
    bias: Optional[np.ndarray]         # computation dtype, shape as given
    causal: Optional[str]              # None, "top_left" or "bottom_right"
    scale: float
    shapes: AttentionShapes
    result: np.dtype
    computation: np.dtype


def attention_args(q, k, v=None, *, mask=None, bias=None, causal=False, scale=None,
                   enable_gqa=False, with_v=True) -> AttentionArgs:
    """Everything ``attention``/``scores`` check, in the order a user would want it."""
    q = as_real(q, "q")
    k = as_real(k, "k")
    arrays = [q, k]
    if with_v:
        v = as_real(v, "v")
        arrays.append(v)
    else:
        v = None
    res = result_dtype(*arrays)
    comp = computation_dtype(res)
    causal_kind = parse_causal(causal)
    shapes = attention_shapes(q, k, v, enable_gqa=bool(enable_gqa))
    full = shapes.batch + (shapes.Lq, shapes.Lk)
    if mask is not None:
        mask = as_mask(mask)
        check_broadcasts_to(mask, full, "mask")
    if bias is not None:
        bias = as_bias(bias, comp)
        check_broadcasts_to(bias, full, "bias")
    scale = resolve_scale(scale, shapes.E)
    return AttentionArgs(
        q.astype(comp, copy=False), k.astype(comp, copy=False),
        None if v is None else v.astype(comp, copy=False),
        mask, bias, causal_kind, scale, shapes, res, comp)


def query_offset(kind: Optional[str], Lq: int, Lk: int) -> int:
    """The position of query row 0 among the keys: query ``i`` sits at key position
    ``i + d``. ``d = Lk - Lq`` for ``"bottom_right"`` (the key-value-cache convention),
    0 otherwise. The causal rule is ``j <= i + d``. This is the one place that says so.
    """
    return Lk - Lq if kind == "bottom_right" else 0


def causal_allowed(kind: Optional[str], Lq: int, Lk: int) -> Optional[np.ndarray]:
    """The (Lq, Lk) boolean matrix of the causal rule, or None without one."""
    if kind is None:
        return None
    offset = query_offset(kind, Lq, Lk)
    i = np.arange(Lq)[:, None]
    j = np.arange(Lk)[None, :]
    return j <= i + offset
