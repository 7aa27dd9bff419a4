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

def is_bfloat16(dtype) -> bool:
    """Is this ``ml_dtypes.bfloat16`` (recognised without importing ml_dtypes)?"""
    return dtype.kind == "V" and dtype.itemsize == 2 and dtype.name == "bfloat16"


def is_reduced(dtype) -> bool:
    """bfloat16 or float16: stored in 16 bits, computed in float32."""
    return dtype.itemsize == 2 and (dtype.kind == "f" or is_bfloat16(dtype))


FLOAT8_NAMES = ("float8_e4m3fn", "float8_e5m2")


def is_float8(dtype) -> bool:
    """Is this ``ml_dtypes.float8_e4m3fn`` or ``float8_e5m2`` (recognised without
    importing ml_dtypes)?"""
    return dtype.itemsize == 1 and dtype.kind in "Vf" and dtype.name in FLOAT8_NAMES


def is_code(dtype) -> bool:
    """int8 or float8: the 8-bit codes of a quantized key-value cache."""
    return dtype == np.int8 or is_float8(dtype)


def as_real(x, name: str) -> np.ndarray:
    """``numpy.asarray(x)`` with integers taken as float64; anything not real raises.

    float16/32/64 and ``ml_dtypes.bfloat16`` pass through unchanged (non-native byte
    order is converted to native); bool, complex, object, string, bytes, extended
    precision and the other ml_dtypes formats (float8, int4, ...) raise ``TypeError``
    naming the argument.
    """
    a = np.asarray(x)
    kind = a.dtype.kind
    if kind in "iu":
        return a.astype(np.float64)
    if is_float8(a.dtype):
        raise TypeError(
            f"{name} has dtype {a.dtype}: float8 arrays are the codes of a quantized "
            f"key-value cache, which attention, attention_varlen and attention_paged "
            f"read as k and v (quantized caches are for inference: no gradients, "
            f"scores or weights); convert it to a float dtype for anything else")
    if (kind == "f" and a.dtype.itemsize in (2, 4, 8)) or is_bfloat16(a.dtype):
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
        f"{name} must hold real numbers (float, bfloat16 or integer), got dtype "
        f"{a.dtype}")


def result_dtype(*arrays: np.ndarray) -> np.dtype:
    """The result dtype of a call: ``numpy.result_type`` of its (real) data arrays,
    with bfloat16 promoting like float16 and mixed bfloat16/float16 giving float32."""
    dtypes = [a.dtype for a in arrays]
    if all(d == dtypes[0] for d in dtypes):         # the common call
        return dtypes[0]
    if all(d.kind == "f" for d in dtypes):
        return np.result_type(*dtypes)
    bf16 = [d for d in dtypes if is_bfloat16(d)]
    if not bf16:
        return np.result_type(*dtypes)
    rest = [d for d in dtypes if not is_bfloat16(d)]
    if not rest:
        return bf16[0]
    res = np.result_type(np.float16, *rest)
    return np.dtype(np.float32) if res == np.float16 else res


def computation_dtype(result: np.dtype) -> np.dtype:
    """bfloat16 and float16 results are computed in float32 and rounded once."""
    result = np.dtype(result)
    return np.dtype(np.float32) if is_reduced(result) else result


def storage_dtype(result: np.dtype) -> np.dtype:
    """The dtype the kernels read q, k and v in: bfloat16 and float16 as they are
    (a reduced result means every data array has that dtype), else the computation
    dtype."""
    result = np.dtype(result)
    return result if is_reduced(result) else computation_dtype(result)


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

PRECISIONS = (None, "highest", "bf16")


def check_precision(precision) -> Optional[str]:
    """``precision=``: one of PRECISIONS, else ``ValueError`` naming them ("bf16x3"
    was removed)."""
    if precision is None or (isinstance(precision, str) and precision in PRECISIONS):
        return precision
    why = ("; 'bf16x3' was removed (three bfloat16 products cost more than one float32 "
           "product on every CPU measured)" if precision == "bf16x3" else "")
    raise ValueError(f"precision must be None, 'highest' or 'bf16', got "
                     f"{precision!r}{why}")


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
    if type(value) is int and value >= minimum:     # (the common case, at once)
        return value
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
    if a_shape == b_shape:              # the common call
        return tuple(a_shape)
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


def check_broadcasts_to(a: np.ndarray, target, name: str,
                        what: str = "(*batch, Lq, Lk)") -> None:
    """``a`` must broadcast to ``target`` (``what`` it is) without enlarging it (no
    extra leading axes)."""
    target = tuple(target)
    ok = a.ndim <= len(target)
    if ok and a.shape != target:
        try:
            ok = tuple(np.broadcast_shapes(a.shape, target)) == target
        except ValueError:
            ok = False
    if not ok:
        raise ValueError(
            f"{name} of shape {a.shape} does not broadcast to {what} = {target}")


def as_shaped(a, name: str, shape, what: str, computation: np.dtype,
              keep_reduced: bool = False) -> np.ndarray:
    """A real array of exactly ``shape`` (a gradient's inputs), in the computation
    dtype (bfloat16 and float16 kept as they are with ``keep_reduced``, when the
    computation is float32: the backward reads them in place); else ValueError
    naming it, its shape and ``what`` it must be."""
    a = as_real(a, name)
    if a.shape != tuple(shape):
        raise ValueError(
            f"{name} has shape {a.shape} but must have {what} {tuple(shape)}")
    if keep_reduced and is_reduced(a.dtype) and computation == np.float32:
        return a
    return a.astype(computation, copy=False)


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
    q: np.ndarray              # in storage_dtype(result), shapes as given
    k: np.ndarray
    v: Optional[np.ndarray]
    mask: Optional[np.ndarray]         # bool, shape as given
    bias: Optional[np.ndarray]         # computation dtype, shape as given
    causal: Optional[str]              # None, "top_left" or "bottom_right"
    scale: float
    shapes: AttentionShapes
    result: np.dtype
    computation: np.dtype
    k_scale: Optional[np.ndarray] = None   # float32, broadcastable to k.shape[:-1]:
    v_scale: Optional[np.ndarray] = None   # with k, v 8-bit codes (a quantized cache)


def attention_args(q, k, v=None, *, mask=None, bias=None, causal=False, scale=None,
                   enable_gqa=False, with_v=True, k_scale=None, v_scale=None,
                   codes=False) -> AttentionArgs:
    """Everything ``attention``/``scores`` check, in the order a user would want it;
    with ``codes`` (the forward pass), k and v may be a quantized cache
    (:func:`quantized_kv`); elsewhere float8 arrays are a ``TypeError``."""
    codes = quantized_kv(k, v, k_scale, v_scale) if with_v and codes else None
    if codes is not None:
        q = as_query_of_codes(q)
        k, v, k_scale, v_scale = codes
        arrays = [q]
    else:
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
    data = storage_dtype(res)
    if codes is not None:
        k_scale = check_scale_shape(k_scale, "k_scale", k.shape[:-1])
        v_scale = check_scale_shape(v_scale, "v_scale", v.shape[:-1])
        return AttentionArgs(q, k, v, mask, bias, causal_kind, scale, shapes, res, comp,
                             k_scale, v_scale)
    return AttentionArgs(
        q.astype(data, copy=False), k.astype(data, copy=False),
        None if v is None else v.astype(data, copy=False),
        mask, bias, causal_kind, scale, shapes, res, comp)


# ------------------------------------------------------------------ quantized caches

def quantized_kv(k, v, k_scale, v_scale):
    """``(k, v, k_scale, v_scale)`` when k and v are a quantized cache, else None.

    A quantized cache: int8 k and v with both scales, or float8 k and v
    (``ml_dtypes.float8_e4m3fn``/``float8_e5m2``) with optional scales (1 without);
    the scales real, taken as float32 (checked against k's and v's shapes later: see
    :func:`check_scale_shape`). int8 k and v without scales are integer values (as
    any integer array). A scale with float k or v, one scale alone with int8 codes,
    or codes beside floats is a ``ValueError``."""
    k, v = np.asarray(k), np.asarray(v)
    if k_scale is None and v_scale is None and not (is_float8(k.dtype)
                                                    or is_float8(v.dtype)):
        return None
    for name, a in (("k", k), ("v", v)):
        if not is_code(a.dtype):
            raise ValueError(
                f"k_scale and v_scale are for a quantized cache (k and v int8 or "
                f"float8 codes), but {name} has dtype {a.dtype}"
                if k_scale is not None or v_scale is not None else
                f"k and v must both be 8-bit codes (int8 with scales, or float8), got "
                f"k {k.dtype} and v {v.dtype}")
    scales = []
    for name, a, sc in (("k", k, k_scale), ("v", v, v_scale)):
        if sc is None:
            if a.dtype == np.int8:
                raise ValueError(
                    f"an int8 cache needs both k_scale and v_scale ({name}_scale is "
                    f"missing): a value is float(code) * scale")
            scales.append(None)
            continue
        sc = as_real(sc, f"{name}_scale")
        scales.append(sc.astype(np.float32, copy=False))
    k, v = (a if a.flags.aligned and a.dtype.isnative else a.copy() for a in (k, v))
    return k, v, scales[0], scales[1]


def as_query_of_codes(q) -> np.ndarray:
    """q beside a quantized cache: float32, bfloat16 or float16 (the result's dtype)."""
    q = as_real(q, "q")
    if not (q.dtype == np.float32 or is_reduced(q.dtype)):
        raise TypeError(
            f"with a quantized k and v, q must be float32, bfloat16 or float16 (the "
            f"result's dtype), got {q.dtype}")
    return q


def check_scale_shape(scale, name: str, target) -> Optional[np.ndarray]:
    """A quantized cache's scale: broadcastable to ``target`` (its codes' shape without
    the last axis: per token and head, per head, or one scalar)."""
    if scale is None:
        return None
    check_broadcasts_to(scale, target, name, f"{name[0]}.shape[:-1]")
    return scale


def query_offset(kind: Optional[str], Lq: int, Lk: int) -> int:
    """The position of query row 0 among the keys: query ``i`` sits at key position
    ``i + d``. ``d = Lk - Lq`` for ``"bottom_right"`` (the key-value-cache convention),
    0 otherwise. The causal rule is ``j <= i + d``. This is the one place that says so.
    """
    return Lk - Lq if kind == "bottom_right" else 0


# ------------------------------------------------------------------ attention variants
# The keywords of the attention variants. Each check returns the normalised value
# (what a kernel wants), so the compiled API and the reference read them the same way.

def check_window(window) -> Tuple[Optional[int], Optional[int]]:
    """``window=(left, right)`` -> ``(left, right)``; ``None`` (unbounded) on either side.

    ``window=None`` is ``(None, None)``: no window. A side is None or an integer >= 0
    (Python or NumPy; bool raises ``TypeError``).
    """
    if window is None:
        return (None, None)
    if isinstance(window, (str, bytes)) or not isinstance(window, (tuple, list)):
        raise TypeError(
            f"window must be a pair (left, right) of ints >= 0 or None, got {window!r}")
    if len(window) != 2:
        raise ValueError(
            f"window must be a pair (left, right), got {len(window)} values: {window!r}")
    sides = []
    for side, value in zip(("left", "right"), window):
        if value is None:
            sides.append(None)
            continue
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
            raise TypeError(
                f"window's {side} side must be an int >= 0 or None, got {value!r}")
        if value < 0:
            raise ValueError(f"window's {side} side must be >= 0, got {value}")
        sides.append(int(value))
    return (sides[0], sides[1])


def softcap_range(computation) -> Tuple[float, float]:
    """The softcaps ``c`` the kernels compute exactly in ``computation``: ``c`` and
    ``1 / c`` both normal numbers of that dtype (float32 for 16-bit inputs), so that
    ``c * tanh(s / c)`` neither overflows nor loses the score to a subnormal."""
    info = np.finfo(np.dtype(computation))
    tiny = float(info.tiny)
    return tiny, 1.0 / tiny


def check_softcap(softcap, computation=np.float64) -> Optional[float]:
    """``softcap=c``: None (no cap) or a real number > 0 in :func:`softcap_range` of
    the computation dtype, returned as a float."""
    if softcap is None:
        return None
    if isinstance(softcap, (bool, np.bool_)) or not isinstance(softcap, numbers.Real):
        raise TypeError(f"softcap must be a real number > 0 or None, got {softcap!r}")
    try:
        c = float(softcap)
    except OverflowError:       # an int beyond float range
        c = math.inf
    if not (math.isfinite(c) and c > 0):
        raise ValueError(f"softcap must be finite and > 0, got {softcap!r}")
    lo, hi = softcap_range(computation)
    if not lo <= c <= hi:
        raise ValueError(
            f"softcap={softcap!r} is outside the range fastattn computes in "
            f"{np.dtype(computation)}: [{lo:.4g}, {hi:.4g}] (the cap and its inverse "
            f"must be normal numbers of the computation dtype)")
    return c


def check_per_head(values, name: str, batch, q_shape,
                   computation) -> Optional[np.ndarray]:
    """One real value per slice, e.g. ``alibi_slopes`` or ``sinks``: an array
    broadcastable to the output's batch shape ``batch`` whose last axis is the query
    heads (``batch[-1]``), e.g. ``(Hq,)`` or ``(B, Hq)``; ``q`` (of shape ``q_shape``)
    must have a head axis. Returned in the computation dtype, shape as given.
    """
    if values is None:
        return None
    values = as_real(values, name)
    batch = tuple(batch)
    if len(q_shape) < 3:
        raise ValueError(
            f"{name} needs q with a head axis (..., Hq, Lq, E), got q of shape "
            f"{tuple(q_shape)}")
    ok = 1 <= values.ndim <= len(batch)
    if ok:
        try:
            ok = tuple(np.broadcast_shapes(values.shape, batch)) == batch
        except ValueError:
            ok = False
    if not ok:
        raise ValueError(
            f"{name} of shape {values.shape} does not broadcast to the output's "
            f"batch shape {batch} with its last axis on the query heads "
            f"(Hq = {batch[-1]}); expected e.g. ({batch[-1]},) or {batch}")
    return values.astype(computation, copy=False)


def check_alibi_slopes(slopes, batch, q_shape, computation) -> Optional[np.ndarray]:
    """ALiBi slopes: :func:`check_per_head` for ``alibi_slopes``."""
    return check_per_head(slopes, "alibi_slopes", batch, q_shape, computation)


def check_lengths_layout(name: str, shape, dtype, integer: bool, batch) -> None:
    """What :func:`check_lengths` says of lengths of ``shape`` and ``dtype``
    (``integer``: whether that dtype holds integers, bool excluded) without reading
    their values: for tensors that may not be read yet (``fastattn.torch``)."""
    if not integer:
        raise TypeError(f"{name} must hold integers, got dtype {dtype}")
    batch = tuple(batch)
    if not batch:
        raise ValueError(
            f"{name} needs at least one batch axis (B, ..., L, E); the output's batch "
            f"shape is ()")
    if tuple(shape) != batch[:1]:
        raise ValueError(
            f"{name} must have shape (B,) = {batch[:1]} (axis 0 of the output's batch "
            f"shape {batch}), got shape {tuple(shape)}")


def check_lengths(lengths, name: str, batch, L: int) -> Optional[np.ndarray]:
    """``q_lengths``/``kv_lengths``: integers of shape ``(B,)``, ``B = batch[0]``, each in
    ``[0, L]``; returned as int64. ``batch`` is the output's batch shape."""
    if lengths is None:
        return None
    a = np.asarray(lengths)
    check_lengths_layout(name, a.shape, a.dtype, a.dtype.kind in "iu", batch)
    if a.size and (a.min() < 0 or a.max() > L):
        raise ValueError(
            f"{name} must lie in [0, {L}] (the sequence length), got values from "
            f"{a.min()} to {a.max()}")
    return a.astype(np.int64)


def check_dropout(dropout_p, dropout_seed) -> Tuple[float, Optional[int]]:
    """``dropout_p`` in ``[0, 1)`` and ``dropout_seed`` (an int in ``[0, 2**64)``,
    required when ``dropout_p > 0``) -> ``(p, seed)``; seed is None if not given."""
    if isinstance(dropout_p, (bool, np.bool_)) or not isinstance(dropout_p, numbers.Real):
        raise TypeError(f"dropout_p must be a real number in [0, 1), got {dropout_p!r}")
    try:
        p = float(dropout_p)
    except OverflowError:       # an int beyond float range
        p = math.inf
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout_p must lie in [0, 1), got {dropout_p!r}")
    if dropout_seed is None:
        if p > 0:
            raise ValueError(
                f"dropout_p={p} needs dropout_seed=<int>: the dropout pattern is a "
                f"function of the seed")
        return p, None
    if (isinstance(dropout_seed, (bool, np.bool_))
            or not isinstance(dropout_seed, numbers.Integral)):
        raise TypeError(f"dropout_seed must be an int, got {dropout_seed!r}")
    if not 0 <= dropout_seed < 2 ** 64:
        raise ValueError(f"dropout_seed must lie in [0, 2**64), got {dropout_seed}")
    return p, int(dropout_seed)


class Variants(NamedTuple):
    window: Tuple[Optional[int], Optional[int]]    # None: unbounded side
    softcap: Optional[float]
    alibi_slopes: Optional[np.ndarray]             # computation dtype, shape as given
    q_lengths: Optional[np.ndarray]                # int64 (B,)
    kv_lengths: Optional[np.ndarray]               # int64 (B,)
    dropout_p: float
    dropout_seed: Optional[int]
    sinks: Optional[np.ndarray] = None             # computation dtype, shape as given


NO_VARIANTS = Variants((None, None), None, None, None, None, 0.0, None, None)


def variant_args(batch, Lq: int, Lk: int, q_shape, computation, *, window=None,
                 softcap=None, alibi_slopes=None, q_lengths=None, kv_lengths=None,
                 dropout_p=0.0, dropout_seed=None, sinks=None) -> Variants:
    """Every variant keyword of a call whose output has batch shape ``batch``.

    A window side of ``Lq + Lk`` or more restricts nothing (every ``|i + d - j|`` is
    smaller) and is returned as None, so that kernels never meet a huge side.
    """
    left, right = check_window(window)
    span = Lq + Lk
    window = tuple(None if w is None or w >= span else w for w in (left, right))
    return Variants(
        window, check_softcap(softcap, computation),
        check_alibi_slopes(alibi_slopes, batch, q_shape, computation),
        check_lengths(q_lengths, "q_lengths", batch, Lq),
        check_lengths(kv_lengths, "kv_lengths", batch, Lk),
        *check_dropout(dropout_p, dropout_seed),
        check_per_head(sinks, "sinks", batch, q_shape, computation))


def variants_of(args: AttentionArgs, window=None, softcap=None, alibi_slopes=None,
                q_lengths=None, kv_lengths=None, dropout_p=0.0, dropout_seed=None,
                sinks=None) -> Variants:
    """The checked variant keywords (window, softcap, ...) of a call whose other
    arguments ``attention_args`` checked (none: NO_VARIANTS, at once)."""
    if (window is None and softcap is None and alibi_slopes is None and q_lengths is None
            and kv_lengths is None and dropout_seed is None and sinks is None
            and type(dropout_p) in (float, int) and dropout_p == 0):
        return NO_VARIANTS
    s = args.shapes
    return variant_args(s.batch, s.Lq, s.Lk, args.q.shape, args.computation,
                        window=window, softcap=softcap, alibi_slopes=alibi_slopes,
                        q_lengths=q_lengths, kv_lengths=kv_lengths,
                        dropout_p=dropout_p, dropout_seed=dropout_seed, sinks=sinks)


def query_offsets(kind: Optional[str], Lq: int, Lk: int, q_lengths=None,
                  kv_lengths=None):
    """``query_offset`` per sequence: with ``q_lengths``/``kv_lengths`` (int arrays
    (B,)) the ``Lq``/``Lk`` of sequence ``b`` are its own lengths, and the result is an
    int64 array (B,); without lengths it is the int ``query_offset(kind, Lq, Lk)``."""
    if q_lengths is None and kv_lengths is None:
        return query_offset(kind, Lq, Lk)
    lq = Lq if q_lengths is None else np.asarray(q_lengths, dtype=np.int64)
    lk = Lk if kv_lengths is None else np.asarray(kv_lengths, dtype=np.int64)
    B = len(q_lengths if q_lengths is not None else kv_lengths)
    return np.broadcast_to(np.asarray(query_offset(kind, lq, lk), dtype=np.int64), (B,))


# ------------------------------------------------------------------------------ varlen

def check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, total_q: int, total_k: int):
    """The cumulative sequence lengths of a packed batch: 1-D int32/int64 arrays of the
    same length B + 1, non-decreasing, from 0 to ``total_q``/``total_k``. Returns them
    as int64 arrays; every violation is a ``ValueError``."""
    out = [check_cu_seqlens_one(cu_seqlens_q, "cu_seqlens_q", total_q),
           check_cu_seqlens_one(cu_seqlens_k, "cu_seqlens_k", total_k)]
    if out[0].shape != out[1].shape:
        raise ValueError(
            f"cu_seqlens_q and cu_seqlens_k must have the same length B + 1, got shapes "
            f"{out[0].shape} and {out[1].shape}")
    return out[0], out[1]


class VarlenArgs(NamedTuple):
    q: np.ndarray              # (total_q, Hq, E), computation dtype
    k: np.ndarray              # (total_k, Hkv, E)
    v: np.ndarray              # (total_k, Hkv, Ev)
    cu_seqlens_q: np.ndarray   # int64 (B + 1,)
    cu_seqlens_k: np.ndarray
    causal: Optional[str]
    scale: float
    Hq: int
    groups: int                # Hq // Hkv
    result: np.dtype
    computation: np.dtype
    k_scale: Optional[np.ndarray] = None   # float32, broadcastable to (total_k, Hkv):
    v_scale: Optional[np.ndarray] = None   # with k, v 8-bit codes (a quantized cache)


def varlen_args(q, k, v, cu_seqlens_q, cu_seqlens_k, *, causal=False, scale=None,
                k_scale=None, v_scale=None, codes=False) -> VarlenArgs:
    """What ``attention_varlen`` checks: q (total_q, Hq, E), k (total_k, Hkv, E),
    v (total_k, Hkv, Ev) with ``Hq % Hkv == 0``, and the cu_seqlens; with ``codes``
    (the forward pass) k and v may be a quantized cache (:func:`quantized_kv`)."""
    codes = quantized_kv(k, v, k_scale, v_scale) if codes else None
    if codes is not None:
        q = as_query_of_codes(q)
        k, v, k_scale, v_scale = codes
        res = q.dtype
    else:
        q, k, v = as_real(q, "q"), as_real(k, "k"), as_real(v, "v")
        res = result_dtype(q, k, v)
    comp = computation_dtype(res)
    causal_kind = parse_causal(causal)
    for name, a, axes in (("q", q, "(total_q, Hq, E)"), ("k", k, "(total_k, Hkv, E)"),
                          ("v", v, "(total_k, Hkv, Ev)")):
        if a.ndim != 3:
            raise ValueError(f"{name} must have shape {axes}, got shape {a.shape}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"q and k must have the same last axis E, got q {q.shape} and k {k.shape}")
    if k.shape[:2] != v.shape[:2]:
        raise ValueError(
            f"k and v must have the same rows and heads (total_k, Hkv), got k {k.shape} "
            f"and v {v.shape}")
    Hq, Hkv = q.shape[1], k.shape[1]
    if Hkv == 0 or Hq % Hkv != 0:
        raise ValueError(
            f"the query heads of q {q.shape} (axis 1: {Hq}) must be a multiple of the "
            f"key/value heads of k {k.shape} (axis 1: {Hkv})")
    cu_q, cu_k = check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0])
    scale = resolve_scale(scale, q.shape[-1])
    if codes is not None:
        return VarlenArgs(q, k, v, cu_q, cu_k, causal_kind, scale, Hq, Hq // Hkv, res,
                          comp, check_scale_shape(k_scale, "k_scale", k.shape[:-1]),
                          check_scale_shape(v_scale, "v_scale", v.shape[:-1]))
    data = storage_dtype(res)
    return VarlenArgs(q.astype(data, copy=False), k.astype(data, copy=False),
                      v.astype(data, copy=False), cu_q, cu_k, causal_kind, scale,
                      Hq, Hq // Hkv, res, comp)


# ----------------------------------------------------------------------- paged caches

class PagedArgs(NamedTuple):
    q: np.ndarray              # (B, Lq, Hq, E), or packed (total_q, Hq, E); stored
    k_cache: np.ndarray        # (num_blocks, block_size, Hkv, E), stored
    v_cache: np.ndarray        # (num_blocks, block_size, Hkv, Ev)
    block_table: np.ndarray    # intp, C-contiguous (B, max_blocks)
    kv_lengths: np.ndarray     # int64 (B,)
    cu_seqlens_q: Optional[np.ndarray]     # int64 (B + 1,), or None (q not packed)
    k_scale: Optional[np.ndarray]          # float32, broadcastable to the caches'
    v_scale: Optional[np.ndarray]          # first three axes (codes only)
    causal: bool
    scale: float
    Lq: int                    # query rows of the longest sequence
    Hq: int
    groups: int                # Hq // Hkv
    result: np.dtype           # q's dtype
    computation: np.dtype


def paged_args(q, k_cache, v_cache, block_table, kv_lengths, *, cu_seqlens_q=None,
               k_scale=None, v_scale=None, scale=None, causal=True) -> PagedArgs:
    """What ``attention_paged`` checks: the caches (float, or 8-bit codes with their
    scales), q beside them, the block table and lengths (every block a sequence needs
    inside the cache), and the packed queries' offsets."""
    codes = quantized_kv(k_cache, v_cache, k_scale, v_scale)
    if codes is not None:
        q = as_query_of_codes(q)
        k_cache, v_cache, k_scale, v_scale = codes
        comp = np.dtype(np.float32)
    else:
        q = as_real(q, "q")
        k_cache, v_cache = as_real(k_cache, "k_cache"), as_real(v_cache, "v_cache")
        wide = any(a.dtype == np.float64 for a in (q, k_cache, v_cache))
        comp = np.dtype(np.float64 if wide else np.float32)
        k_cache, v_cache = (a if a.dtype == comp or (is_reduced(a.dtype) and not wide)
                            else a.astype(comp) for a in (k_cache, v_cache))
    result = q.dtype
    if not (q.dtype == comp or (is_reduced(q.dtype) and comp == np.float32)):
        q = q.astype(comp)
    for name, a, axes in (("k_cache", k_cache, "(num_blocks, block_size, Hkv, E)"),
                          ("v_cache", v_cache, "(num_blocks, block_size, Hkv, Ev)")):
        if a.ndim != 4:
            raise ValueError(f"{name} must have shape {axes}, got shape {a.shape}")
    if v_cache.shape[:3] != k_cache.shape[:3]:
        raise ValueError(
            f"k_cache and v_cache must have the same blocks, block size and heads "
            f"(num_blocks, block_size, Hkv), got k_cache {k_cache.shape} and v_cache "
            f"{v_cache.shape}")
    num_blocks, block_size, Hkv, E = k_cache.shape
    if block_size == 0:
        raise ValueError(f"k_cache's block size (axis 1) must be at least 1, got shape "
                         f"{k_cache.shape}")
    packed = cu_seqlens_q is not None
    want = "(total_q, Hq, E) with cu_seqlens_q" if packed else "(B, Lq, Hq, E)"
    if q.ndim != (3 if packed else 4):
        raise ValueError(f"q must have shape {want}, got shape {q.shape}")
    if q.shape[-1] != E:
        raise ValueError(
            f"q and k_cache must have the same last axis E, got q {q.shape} and k_cache "
            f"{k_cache.shape}")
    Hq = q.shape[-2]
    if Hkv == 0 or Hq % Hkv != 0:
        raise ValueError(
            f"the query heads of q {q.shape} (axis -2: {Hq}) must be a multiple of the "
            f"key/value heads of k_cache {k_cache.shape} (axis 2: {Hkv})")
    table = np.asarray(block_table)
    if table.dtype.kind not in "iu":
        raise TypeError(f"block_table must hold integers, got dtype {table.dtype}")
    if table.ndim != 2:
        raise ValueError(f"block_table must have shape (B, max_blocks), got shape "
                         f"{table.shape}")
    B, max_blocks = table.shape
    lengths = np.asarray(kv_lengths)
    if lengths.dtype.kind not in "iu":
        raise TypeError(f"kv_lengths must hold integers, got dtype {lengths.dtype}")
    if lengths.shape != (B,):
        raise ValueError(f"kv_lengths must have shape (B,) = ({B},) (block_table's "
                         f"rows), got shape {lengths.shape}")
    if B and (lengths.min() < 0 or lengths.max() > max_blocks * block_size):
        raise ValueError(
            f"kv_lengths must lie in [0, max_blocks * block_size] = [0, "
            f"{max_blocks * block_size}], got {lengths.tolist()}")
    lengths = lengths.astype(np.int64)
    needed = np.arange(max_blocks) < ((lengths + block_size - 1) // block_size)[:, None]
    bad = needed & ((table < 0) | (table >= num_blocks))
    if bad.any():
        b, i = (int(x[0]) for x in np.nonzero(bad))
        raise ValueError(
            f"block_table[{b}, {i}] = {int(table[b, i])} is a block sequence {b} needs "
            f"(kv_lengths[{b}] = {int(lengths[b])}, block size {block_size}) but lies "
            f"outside the cache's [0, {num_blocks}) blocks")
    table = np.ascontiguousarray(np.where(needed, table, 0), dtype=np.intp)
    if packed:
        cu = check_cu_seqlens_one(cu_seqlens_q, "cu_seqlens_q", q.shape[0])
        if cu.shape != (B + 1,):
            raise ValueError(f"cu_seqlens_q must have shape (B + 1,) = ({B + 1},) "
                             f"(block_table's rows + 1), got shape {cu.shape}")
        Lq = int(np.diff(cu).max(initial=0))
    else:
        cu = None
        if q.shape[0] != B:
            raise ValueError(f"q's batch (axis 0: {q.shape[0]}) must match block_table's "
                             f"rows (B = {B}), got q {q.shape} and block_table "
                             f"{table.shape}")
        Lq = q.shape[1]
    if not isinstance(causal, (bool, np.bool_)):
        raise ValueError(f"causal must be True or False for a paged cache (its queries "
                         f"are the last positions of their sequence), got {causal!r}")
    shape3 = k_cache.shape[:3]
    return PagedArgs(q, k_cache, v_cache, table, lengths, cu,
                     check_scale_shape(k_scale, "k_scale", shape3),
                     check_scale_shape(v_scale, "v_scale", v_cache.shape[:3]),
                     bool(causal), resolve_scale(scale, E), Lq, Hq, Hq // Hkv, result,
                     comp)


def check_cu_seqlens_one(cu, name: str, total: int) -> np.ndarray:
    """One array of cumulative sequence lengths (see :func:`check_cu_seqlens`)."""
    a = np.asarray(cu)
    if a.dtype not in (np.int32, np.int64):
        raise ValueError(f"{name} must be int32 or int64, got dtype {a.dtype}")
    if a.ndim != 1 or a.size == 0:
        raise ValueError(f"{name} must be 1-D of length B + 1 >= 1, got shape {a.shape}")
    if a[0] != 0:
        raise ValueError(f"{name} must start at 0, got {a[0]}")
    if np.any(np.diff(a) < 0):
        raise ValueError(f"{name} must be non-decreasing, got {a.tolist()}")
    if a[-1] != total:
        raise ValueError(
            f"{name} must end at the number of packed rows {total}, got {a[-1]}")
    return a.astype(np.int64)
