"""What an LLM server keeps between decoding steps: paged and quantized key-value caches.

``attention_paged`` reads a cache kept in fixed-size blocks through a block table (as
vLLM, SGLang and FlashAttention's ``flash_attn_with_kvcache`` keep it), in place and in
any block order; ``store_kv`` writes new tokens into it at vLLM-style slots;
``quantize_kv`` makes the 8-bit codes and scales of a quantized cache, which
``attention``, ``attention_varlen`` and ``attention_paged`` read (widened block by
block, never written out as floats).
"""

from __future__ import annotations

import math

import numpy as np

from . import _compute
from . import _validation as _v
from ._config import resolve_num_threads
from ._dispatch import drivers

__all__ = ["attention_paged", "store_kv", "quantize_kv"]

#: The largest magnitude of each code dtype (int8 codes are kept in [-127, 127]).
CODE_LIMITS = {"int8": 127.0, "float8_e4m3fn": 448.0, "float8_e5m2": 57344.0}


def attention_paged(q, k_cache, v_cache, block_table, kv_lengths, *, cu_seqlens_q=None,
                    k_scale=None, v_scale=None, scale=None, causal=True, window=None,
                    softcap=None, alibi_slopes=None, sinks=None, return_lse=False,
                    out=None, num_threads=None):
    """Attention of new queries over a paged key-value cache, read in place.

    Sequence b's token t lives in block ``block_table[b, t // block_size]`` at row
    ``t % block_size``; its keys are its first ``kv_lengths[b]`` tokens, and its
    queries are its last tokens: query i of a sequence of ``Lq_b`` queries sits at
    position ``kv_lengths[b] - Lq_b + i`` (bottom-right).

    Parameters
    ----------
    q : array_like of shape (B, Lq, Hq, E), or (total_q, Hq, E) with cu_seqlens_q
        Decoding: ``Lq = 1`` (a few for speculative decoding). Packed with
        ``cu_seqlens_q``: sequences of different query counts (chunked prefill).
    k_cache : array_like of shape (num_blocks, block_size, Hkv, E)
    v_cache : array_like of shape (num_blocks, block_size, Hkv, Ev)
        float32, float64, bfloat16 or float16, or 8-bit codes (int8 with scales,
        ``ml_dtypes.float8_e4m3fn``/``float8_e5m2``); any strides (a
        ``(num_blocks, Hkv, block_size, E)`` buffer seen through ``swapaxes(1, 2)``
        too). ``Hq`` must be a multiple of ``Hkv`` (grouped-query attention).
    block_table : array_like of int of shape (B, max_blocks)
        The blocks of each sequence, in order; blocks may repeat across sequences
        (shared prefixes). Entries past a sequence's last block are not read; a
        needed entry outside ``[0, num_blocks)`` is a ``ValueError``.
    kv_lengths : array_like of int of shape (B,)
        Tokens in each sequence's cache, in ``[0, max_blocks * block_size]``.
    cu_seqlens_q : array_like of int32 or int64 of shape (B + 1,), optional
        With packed q: sequence b owns rows ``cu_seqlens_q[b]:cu_seqlens_q[b + 1]``.
    k_scale, v_scale : array_like broadcastable to (num_blocks, block_size, Hkv), optional
        The scales of a quantized cache (see :func:`fastattn.attention`): one per
        token and head, per head, or one for all.
    scale : float, optional
        Factor applied to ``q @ k^T``; default ``1 / sqrt(E)``.
    causal : bool, default True
        Query i sees keys up to its own position; False: every key of its sequence
        (the positions stay bottom-right for ``window`` and ALiBi).
    window, softcap : optional
        As in :func:`fastattn.attention`.
    alibi_slopes, sinks : array_like broadcastable to (B, Hq), optional
        As in :func:`fastattn.attention`, per sequence and query head.
    return_lse : bool, default False
    out : ndarray of q's shape with E replaced by Ev, optional
        C-contiguous, of q's dtype; filled and returned.
    num_threads : int, optional

    Returns
    -------
    out : ndarray of shape (B, Lq, Hq, Ev) or (total_q, Hq, Ev)
        In q's dtype (computed in float64 when an input is float64, else float32).
    lse : ndarray of shape (B, Hq, Lq) or (Hq, total_q)
        Only with ``return_lse`` (float32, or float64 for a float64 computation).

    Notes
    -----
    The blocks are read where they lie: the decoding path reads each block's rows
    for its grouped query heads once, block after block, with the rows ahead asked
    for across block boundaries; the work is split over sequences, key/value heads
    and pieces of long sequences so that a batch of ragged lengths keeps every thread
    busy, with the same bits for any thread count. A block of 8-bit codes is widened
    in registers; its scales multiply the scores (keys) and the weights (values).

    Examples
    --------
    >>> import numpy as np, fastattn
    >>> rng = np.random.default_rng(0)
    >>> k_cache = rng.standard_normal((8, 4, 2, 16)).astype(np.float32)
    >>> v_cache = rng.standard_normal((8, 4, 2, 16)).astype(np.float32)
    >>> table = np.array([[5, 2, 7], [1, 0, 0]], np.int32)   # blocks in any order
    >>> lengths = np.array([10, 3])                          # tokens per sequence
    >>> q = rng.standard_normal((2, 1, 4, 16)).astype(np.float32)   # one new query
    >>> out = fastattn.attention_paged(q, k_cache, v_cache, table, lengths)
    >>> keys = k_cache[[5, 2, 7]].reshape(12, 2, 16)[:10]    # sequence 0, gathered
    >>> values = v_cache[[5, 2, 7]].reshape(12, 2, 16)[:10]
    >>> want = fastattn.attention(q[0].swapaxes(0, 1), keys.swapaxes(0, 1),
    ...                           values.swapaxes(0, 1), enable_gqa=True)
    >>> bool(np.allclose(out[0], want.swapaxes(0, 1), atol=1e-6))
    True
    """
    if alibi_slopes is None and return_lse is False and out is None:
        # a decoding step's call or packed queries' (plain ndarrays, a quantized
        # cache's scales one per token and head, a window of Python ints, a float
        # softcap) with fewer steps, the same plan and the same bits; None for any
        # other call
        res = _compute.attend_paged_plain(q, k_cache, v_cache, block_table, kv_lengths,
                                          k_scale, v_scale, causal, scale, sinks,
                                          num_threads, window, softcap, cu_seqlens_q)
        if res is not None:
            return res
    a = _v.paged_args(q, k_cache, v_cache, block_table, kv_lengths,
                      cu_seqlens_q=cu_seqlens_q, k_scale=k_scale, v_scale=v_scale,
                      scale=scale, causal=causal)
    B = a.block_table.shape[0]
    Lk = int(a.kv_lengths.max(initial=0))
    var = _v.variant_args((B, a.Hq), a.Lq, Lk, (B, a.Hq, a.Lq, a.q.shape[-1]),
                          a.computation, window=window, softcap=softcap,
                          alibi_slopes=alibi_slopes, sinks=sinks)
    return _compute.attend_paged(a, var, bool(return_lse), out,
                                 resolve_num_threads(num_threads))


def quantize_kv(x, dtype="int8", *, axis_scale="token"):
    """Symmetric 8-bit quantization of keys or values: ``(codes, scale)``.

    Parameters
    ----------
    x : array_like of shape (..., L, H, D)
        Real values; the last axis is the head dimension. Must be finite.
    dtype : {"int8", "float8_e4m3fn", "float8_e5m2"}, default "int8"
        The codes' dtype (the float8 ones need ``ml_dtypes``).
    axis_scale : {"token", "head"}, default "token"
        "token": one scale per row of the last axis (per token and head), shape
        ``x.shape[:-1]``. "head": one per head over every token (axis -2 the heads,
        axis -3 the tokens), shape ``x.shape[:-3] + (1, H)``.

    Returns
    -------
    codes : ndarray of x's shape, of ``dtype``
        ``x / scale`` rounded to the nearest code (ties to even).
    scale : ndarray of float32
        The largest magnitude of its row (or head) over the code's largest value
        (127, 448 or 57344); 1 for an all-zero row, and the smallest float32 above 0
        (2**-149) where that ratio rounds to 0 in float32. ``float(code) * scale`` is
        within half a code step of x.

    Examples
    --------
    >>> import numpy as np, fastattn
    >>> codes, scale = fastattn.quantize_kv(np.array([[1.0, -0.5, 0.25]]))
    >>> codes, scale
    (array([[ 127,  -64,   32]], dtype=int8), array([0.00787402], dtype=float32))
    """
    name = _code_name(dtype, "dtype")
    if axis_scale not in ("token", "head"):
        raise ValueError(f"axis_scale must be 'token' or 'head', got {axis_scale!r}")
    x = _v.as_real(x, "x")
    if x.ndim < (3 if axis_scale == "head" else 1):
        raise ValueError(
            f"x must have shape (..., L, H, D) for axis_scale={axis_scale!r}, got "
            f"shape {x.shape}")
    if axis_scale == "token":
        return _per_token(x, name)
    x = x.astype(np.float64)                # one scale per head over every token
    if not np.isfinite(x).all():
        raise ValueError(_NOT_FINITE)
    limit = CODE_LIMITS[name]
    amax = np.abs(x).max(axis=(-3, -1), initial=0.0)[..., None, :]
    scale = np.where(amax > 0, amax / limit, 1.0).astype(np.float32)
    scale = np.where(scale == 0, _SMALLEST_SCALE, scale)     # (amax / limit underflowed)
    return _codes(x / scale[..., None].astype(np.float64), name, limit), scale


_NOT_FINITE = "x must be finite to be quantized (it holds inf or NaN)"
#: The scale of a row whose largest magnitude over the codes' limit rounds to 0 in
#: float32: its codes then stay within the limit (|x| / scale <= limit / 2).
_SMALLEST_SCALE = np.float32(2.0 ** -149)


def _per_token(x: np.ndarray, name: str):
    """quantize_kv(x, name) per token, by the compiled rows of
    ``drivers.quantize_codes`` on the call's threads: bit for bit the codes and scales
    of ``fastattn.reference.quantize_kv`` (whose float8 codes are ml_dtypes' rounding
    of the same float64 quotients)."""
    if x.dtype != np.float32 and x.dtype != np.float64:
        x = x.astype(np.float64)            # (exactly: 16-bit floats and integers)
    rows = np.ascontiguousarray(x).reshape(math.prod(x.shape[:-1]), x.shape[-1])
    codes = np.empty(rows.shape, _code_dtype(name))
    scale = np.empty(rows.shape[0], np.float32)
    if not drivers.quantize_codes(rows, codes.view(np.uint8), scale, name,
                                  resolve_num_threads()):
        raise ValueError(_NOT_FINITE)
    return codes.reshape(x.shape), scale.reshape(x.shape[:-1])


def _code_name(dtype, what: str) -> str:
    """The name of a code dtype given as a name, a NumPy dtype or an ml_dtypes type."""
    try:
        name = dtype if isinstance(dtype, str) else np.dtype(dtype).name
    except TypeError:
        name = None
    if name not in CODE_LIMITS:
        raise ValueError(f"{what} must be one of {', '.join(map(repr, CODE_LIMITS))}, "
                         f"got {dtype!r}")
    return name


def _code_dtype(name: str) -> np.dtype:
    """The NumPy dtype of the codes called `name` (the float8 ones from ml_dtypes)."""
    if name == "int8":
        return np.dtype(np.int8)
    import ml_dtypes
    return np.dtype(getattr(ml_dtypes, name))


def _codes(y: np.ndarray, name: str, limit: float) -> np.ndarray:
    """y, already in units of its scale (|y| <= limit up to rounding), as codes."""
    y = np.clip(y, -limit, limit)
    return (np.rint(y) if name == "int8" else y).astype(_code_dtype(name))


def store_kv(k_cache, v_cache, slots, k, v, *, k_scale=None, v_scale=None):
    """Write new tokens' keys and values into a paged cache, in place.

    Parameters
    ----------
    k_cache : ndarray of shape (num_blocks, block_size, Hkv, E)
    v_cache : ndarray of shape (num_blocks, block_size, Hkv, Ev)
        Writeable; float (the rows are rounded to its dtype) or 8-bit codes.
    slots : array_like of int of shape (n,)
        Where token i goes: slot ``block * block_size + row`` (vLLM's
        ``slot_mapping``); a negative slot skips its token. Distinct, below
        ``num_blocks * block_size``.
    k : array_like of shape (n, Hkv, E)
    v : array_like of shape (n, Hkv, Ev)
    k_scale, v_scale : ndarray, optional
        A quantized cache's scales (required with int8 codes). Of the full shape
        (num_blocks, block_size, Hkv) and writeable: each token and head is
        quantized with its own scale (:func:`quantize_kv`), written beside its codes.
        Any other shape (per head, one for all) is a fixed scale: the tokens are
        divided by it, and a value beyond the codes' range is a ``ValueError``
        (nothing is clipped).

    Raises
    ------
    ValueError, TypeError
        For any bad argument, before anything is written: only the given slots of
        the caches (and their scales) ever change.

    Examples
    --------
    >>> import numpy as np, fastattn
    >>> k_cache = np.zeros((4, 2, 1, 3), np.int8)          # 4 blocks of 2 tokens
    >>> v_cache = np.zeros((4, 2, 1, 3), np.int8)
    >>> k_scale = np.ones((4, 2, 1), np.float32)
    >>> v_scale = np.ones((4, 2, 1), np.float32)
    >>> k = np.array([[[0.5, -1.0, 0.25]]])                # one token
    >>> fastattn.store_kv(k_cache, v_cache, [5], k, k, k_scale=k_scale, v_scale=v_scale)
    >>> k_cache[2, 1], k_scale[2, 1]                       # slot 5: block 2, row 1
    (array([[  64, -127,   32]], dtype=int8), array([0.00787402], dtype=float32))
    """
    if k_scale is None and v_scale is None and _store_plain(k_cache, v_cache, slots, k,
                                                            v):
        return
    kept, blocks, rows = _check_slots(k_cache, v_cache, slots)
    writes = []
    for name, cache, x, sc in (("k", k_cache, k, k_scale), ("v", v_cache, v, v_scale)):
        x = _v.as_real(x, name)
        want = (kept.size,) + cache.shape[2:]
        if x.shape != want:
            raise ValueError(f"{name} must have shape (n, Hkv, {'E' if name == 'k' else 'Ev'})"
                             f" = {want} (n = len(slots)), got shape {x.shape}")
        keep = x if kept.all() else x[kept]
        writes.append(_rows_to_store(name, cache, keep, sc, blocks, rows))
    for cache, codes, sc, new_scales in writes:
        cache[blocks, rows] = codes
        if new_scales is not None:
            sc[blocks, rows] = new_scales


_NDARRAY = np.ndarray
_SLOT_DTYPES = (np.dtype(np.int64), np.dtype(np.int32))


def _float_cache(dtype) -> bool:
    """float16/32/64 or bfloat16 in native byte order: the rows ``as_real`` passes
    through unchanged."""
    return dtype.isnative and ((dtype.kind == "f" and dtype.itemsize in (2, 4, 8))
                               or _v.is_bfloat16(dtype))


def _store_plain(k_cache, v_cache, slots, k, v) -> bool:
    """The commonest store (a decoding step's new tokens into a float cache), written
    with fewer steps, or False, writing nothing, for any other call (which the general
    path then checks and writes): writeable float caches of one block shape, int32 or
    int64 slots of shape (n,), every one in [0, num_blocks * block_size) and distinct,
    and k and v ndarrays of their cache's dtype (:func:`_float_cache`) and shape (n,
    Hkv, E / Ev), so that nothing is rounded. The same entries as the general
    path's."""
    if not (type(k_cache) is _NDARRAY and type(v_cache) is _NDARRAY
            and type(slots) is _NDARRAY and type(k) is _NDARRAY and type(v) is _NDARRAY
            and k_cache.ndim == 4 and v_cache.ndim == 4 and slots.ndim == 1
            and slots.dtype in _SLOT_DTYPES and k.dtype == k_cache.dtype
            and v.dtype == v_cache.dtype and _float_cache(k_cache.dtype)
            and _float_cache(v_cache.dtype) and k_cache.flags.writeable
            and v_cache.flags.writeable and k_cache.shape[:3] == v_cache.shape[:3]):
        return False
    n = slots.shape[0]
    if k.shape != (n,) + k_cache.shape[2:] or v.shape != (n,) + v_cache.shape[2:]:
        return False
    num_blocks, block_size = k_cache.shape[:2]
    at = slots.tolist()
    if n:   # (a decoding step's few slots: Python's min and max cost less than NumPy's)
        lo, hi = (min(at), max(at)) if n <= 64 else (int(slots.min()), int(slots.max()))
        if lo < 0 or hi >= num_blocks * block_size:
            return False
    if len(set(at)) != n:
        return False
    if n == 1:
        block, row = divmod(at[0], block_size)
        k_cache[block, row] = k[0]
        v_cache[block, row] = v[0]
        return True
    blocks, rows = np.divmod(slots, block_size)
    k_cache[blocks, rows] = k
    v_cache[blocks, rows] = v
    return True


def _check_slots(k_cache, v_cache, slots):
    """The caches (writeable ndarrays of matching blocks) and the slots: (which
    tokens are stored, their blocks, their rows)."""
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(cache, np.ndarray):
            raise TypeError(f"{name} must be a numpy.ndarray (written in place), got "
                            f"{type(cache).__name__}")
        if cache.ndim != 4:
            raise ValueError(f"{name} must have shape (num_blocks, block_size, Hkv, "
                             f"cols), got shape {cache.shape}")
        if not cache.flags.writeable:
            raise ValueError(f"{name} must be writeable")
    if k_cache.shape[:3] != v_cache.shape[:3]:
        raise ValueError(
            f"k_cache and v_cache must have the same blocks, block size and heads, got "
            f"k_cache {k_cache.shape} and v_cache {v_cache.shape}")
    s = np.asarray(slots)
    if s.dtype.kind not in "iu":
        raise TypeError(f"slots must hold integers, got dtype {s.dtype}")
    if s.ndim != 1:
        raise ValueError(f"slots must have shape (n,), got shape {s.shape}")
    num_blocks, block_size = k_cache.shape[:2]
    size = num_blocks * block_size
    kept = s >= 0
    used = s[kept].astype(np.int64)
    if used.size and used.max() >= size:
        raise ValueError(
            f"slots must lie below num_blocks * block_size = {size} (negative: "
            f"skipped), got {int(used.max())}")
    if np.unique(used).size != used.size:
        raise ValueError("slots must be distinct (two tokens cannot share a slot)")
    return kept, used // block_size, used % block_size


def _rows_to_store(name, cache, keep, scale, blocks, rows):
    """(cache, the rows to write, the scale array, its new entries or None) for the
    tokens `keep` stored at the given blocks and rows (checked: nothing is written
    yet)."""
    if not _v.is_code(cache.dtype):
        if scale is not None:
            raise ValueError(f"{name}_scale is for a quantized cache, but {name}_cache "
                             f"has dtype {cache.dtype}")
        return cache, keep.astype(cache.dtype), None, None
    code = cache.dtype.name
    if scale is None:
        if cache.dtype == np.int8:
            raise ValueError(f"an int8 cache needs {name}_scale: a value is "
                             f"float(code) * scale")
        scale_now = np.float32(1)
    elif (isinstance(scale, np.ndarray) and scale.shape == cache.shape[:3]
          and scale.flags.writeable):
        if scale.dtype != np.float32:
            raise TypeError(f"{name}_scale must be float32, got dtype {scale.dtype}")
        codes, new = quantize_kv(keep, code)
        return cache, codes, scale, new
    else:
        scale_now = np.broadcast_to(np.asarray(scale, np.float32),
                                    cache.shape[:3])[blocks, rows]
    y = keep.astype(np.float64) / np.asarray(scale_now, np.float64)[..., None]
    limit = CODE_LIMITS[code]
    if not np.isfinite(y).all() or np.abs(y).max(initial=0.0) > limit:
        raise ValueError(
            f"{name} holds values that its fixed scale cannot represent (|value| / "
            f"scale up to {float(np.abs(y).max(initial=0.0)):.6g}, the codes reach "
            f"{limit:g}); give {name}_scale of the cache's full shape to quantize each "
            f"token with its own scale")
    return cache, _codes(y, code, limit), None, None

