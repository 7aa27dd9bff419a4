"""The serving rows of ``fastattn bench``: decoding and chunked prefill over paged and
quantized key-value caches.

A :class:`ServingCase` is one row: ``B`` sequences of ``kv_lengths`` tokens each in a
key-value cache (bfloat16, or 8-bit codes with one float32 scale per token and head),
kept contiguous or in blocks of ``block_size`` tokens laid out in a random order (each
block token after token, ``(num_blocks, block_size, Hkv, E)``, or with
``heads_first`` head after head, ``(num_blocks, Hkv, block_size, E)`` seen through
``swapaxes(1, 2)``), and
``q_len`` new queries per sequence, the last positions of their sequences (one: a
decoding step; more: a chunk of prefill, causal). The queries are bfloat16 in every
row. The contenders of a row, in the order they run within a round:

- ``fastattn``: the row's call. A paged row: :func:`fastattn.attention_paged` through
  the block table. A contiguous row: the contiguous call on the cache as it is stored.
- ``contiguous`` (paged rows only): the same codes or values, laid out contiguously in
  the blocks' order of tokens and heads (token after token, or head after head for
  ``heads_first`` blocks), through the contiguous call, in the same rounds: what
  reading through a block table costs. (The contiguous rows keep one sequence's cache
  head after head, ``(1, Hkv, Lk, E)``: the layout a contiguous cache is read
  fastest in; a token-major cache, paged or not, costs more to read, see
  docs/performance.md.)
- ``numpy``: what a caller without a paged or quantized kernel writes today with
  NumPy: gather the sequence's tokens from the blocks into a contiguous copy
  (``numpy.take`` of their slots), dequantize it to bfloat16 (``float32(code) *
  scale``, rounded to bfloat16), then the contiguous fastattn call on the copy. Timed
  per step, the gather and the dequantization included. Not in the contiguous
  bfloat16 rows (nothing to gather or dequantize: the row is that call).
- ``torch``: the same with PyTorch: ``index_select`` of the slots, the same
  dequantization to bfloat16, then ``scaled_dot_product_attention`` with
  ``enable_gqa=True``, one call per sequence (SDPA takes no ragged batch).
- ``read``: the read probe of :func:`~fastattn.cli.bench.ceilings.read_probe`
  (decoding rows), for the row's share of the read bandwidth in the same rounds.

The contiguous call is ``fastattn.attention(q (1, Hq, Lq, E), k (1, Hkv, Lk, E), ...,
enable_gqa=True, causal="bottom_right")`` for one sequence (k head-major, or a
token-major view for the contender of a token-major paged row) and
:func:`fastattn.attention_varlen` on the packed tokens (``cu_seqlens_k``) for a batch.

Bytes and flops
---------------
A decoding row is bound by memory: its bytes are those of the cache it reads, each
key/value head once: ``sum(kv_lengths) * Hkv * 2 * E`` elements of 2 bytes (bfloat16)
or 1 byte (8-bit codes), plus for a quantized cache its scales, 4 bytes per token and
head for each of K and V. A prefill row counts ``2 * Hq * pairs * (E + Ev)`` flops,
``pairs`` the query-key pairs the bottom-right causal rule allows.

Correctness
-----------
Every contender's result is compared (maximum absolute difference) with
:func:`fastattn.reference.attention_paged` (float64, on the dequantized values) on a
subsample: every sequence, the query heads of the first and the last key/value head,
and for a prefill row the first, middle and last query of each sequence.

Examples
--------
>>> from fastattn.cli.bench.serving import ServingCase
>>> c = ServingCase((8192,), cache="int8", block_size=16)
>>> c.label
'decode (1,32:8,1,8192,128) int8 paged bs=16'
>>> c.kv_bytes() == 8192 * 8 * (2 * 128 * 1 + 2 * 4)
True
>>> ServingCase((8192,), block_size=16, heads_first=True).id
'serve-decode-1x32h8x1x8192x128-bfloat16-pagedh16'
>>> ServingCase((2048, 8192), q_len=512).id
'serve-prefill-2x32h8x512x2048_8192x128-bfloat16-paged16'
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

import fastattn
from ... import reference
from . import ceilings as _ceilings
from .contenders import Unavailable, _max_abs_diff
from .grid import numpy_dtype
from .timing import interleaved as _interleaved, summary as _summary

__all__ = ["ServingCase", "CACHES", "SERVING_CONTENDERS", "SERVING_GRID",
           "QUICK_SERVING_GRID", "RAGGED_DECODE_LENGTHS", "PREFILL_LENGTHS",
           "make_serving_inputs", "make_serving_callable", "serving_reference",
           "run_serving"]

#: The caches a row may keep: bfloat16 values, or 8-bit codes with float32 scales.
CACHES = ("bfloat16", "int8", "float8_e4m3fn", "float8_e5m2")

#: The contenders of a serving row, in the order they run within a round.
SERVING_CONTENDERS = ("fastattn", "contiguous", "numpy", "torch")


@dataclass(frozen=True)
class ServingCase:
    """One serving row: new queries over a key-value cache, as a server keeps it.

    Parameters
    ----------
    kv_lengths : tuple of int
        Tokens in each sequence's cache (one entry per sequence), each at least
        ``q_len``.
    q_len : int
        New queries per sequence, the last ``q_len`` positions of it: 1 is a decoding
        step, more a chunk of prefill (causal, bottom-right).
    H, Hkv, E : int
        Query heads, key/value heads (a divisor of ``H``) and head dimension (of keys
        and values).
    cache : str
        One of :data:`CACHES`: bfloat16 values, or 8-bit codes with one float32 scale
        per token and head (:func:`fastattn.quantize_kv`).
    block_size : int, optional
        Tokens per block of a paged cache, the blocks in a random order;
        ``None``: the contiguous cache.
    heads_first : bool
        Store each block head after head, ``(num_blocks, Hkv, block_size, E)``, and
        pass it seen through ``swapaxes(1, 2)`` (a paged row only); else token after
        token, ``(num_blocks, block_size, Hkv, E)``.
    quick : bool
        Whether the row belongs to the ``--quick`` grid.
    baselines : bool
        Time the ``numpy`` and ``torch`` contenders (what a caller writes today).
    """

    kv_lengths: Tuple[int, ...]
    q_len: int = 1
    H: int = 32
    Hkv: int = 8
    E: int = 128
    cache: str = "bfloat16"
    block_size: Optional[int] = 16
    heads_first: bool = False
    quick: bool = False
    baselines: bool = True

    def __post_init__(self):
        lengths = tuple(int(x) for x in self.kv_lengths)
        object.__setattr__(self, "kv_lengths", lengths)
        if self.cache not in CACHES:
            raise ValueError(f"cache must be one of {CACHES}, got {self.cache!r}")
        if self.q_len < 1 or not lengths or min(lengths) < self.q_len:
            raise ValueError(f"kv_lengths must be one or more lengths of at least "
                             f"q_len={self.q_len}, got {self.kv_lengths!r}")
        if self.H < 1 or self.Hkv < 1 or self.H % self.Hkv or self.E < 1:
            raise ValueError(f"H must be a multiple of Hkv (both >= 1) and E >= 1, got "
                             f"H={self.H}, Hkv={self.Hkv}, E={self.E}")
        if self.block_size is not None and self.block_size < 1:
            raise ValueError(f"block_size must be >= 1 or None, got {self.block_size}")
        if self.heads_first and self.block_size is None:
            raise ValueError("heads_first needs a paged cache (a block_size)")

    @property
    def B(self) -> int:
        """The number of sequences."""
        return len(self.kv_lengths)

    @property
    def decode(self) -> bool:
        """One query per sequence: a decoding step, bound by memory."""
        return self.q_len == 1

    @property
    def paged(self) -> bool:
        return self.block_size is not None

    @property
    def quantized(self) -> bool:
        return self.cache != "bfloat16"

    @property
    def kind(self) -> str:
        return "decode" if self.decode else "prefill"

    def _lengths_text(self, sep: str) -> str:
        lo, hi = min(self.kv_lengths), max(self.kv_lengths)
        return str(lo) if lo == hi else f"{lo}{sep}{hi}"

    @property
    def label(self) -> str:
        """E.g. ``"decode (1,32:8,1,8192,128) int8 paged bs=16"``: (B, Hq:Hkv, new
        queries per sequence, tokens per sequence (shortest..longest), E); blocks
        stored head after head end in ``"heads first"``."""
        heads = f"{self.H}:{self.Hkv}" if self.H != self.Hkv else f"{self.H}"
        layout = f"paged bs={self.block_size}" if self.paged else "contiguous"
        layout += " heads first" if self.heads_first else ""
        return (f"{self.kind} ({self.B},{heads},{self.q_len},"
                f"{self._lengths_text('..')},{self.E}) {self.cache} {layout}")

    @property
    def id(self) -> str:
        """An identifier without spaces, for pytest ids and ``--only``."""
        heads = f"{self.H}h{self.Hkv}" if self.H != self.Hkv else f"{self.H}"
        layout = (f"paged{'h' if self.heads_first else ''}{self.block_size}"
                  if self.paged else "contiguous")
        return (f"serve-{self.kind}-{self.B}x{heads}x{self.q_len}x"
                f"{self._lengths_text('_')}x{self.E}-{self.cache}-{layout}")

    @property
    def code_bytes(self) -> int:
        """Bytes of one stored element: 2 (bfloat16) or 1 (an 8-bit code)."""
        return 2 if self.cache == "bfloat16" else 1

    def kv_bytes(self) -> int:
        """Bytes a call reads from the cache: K and V of every token and key/value
        head, and for a quantized cache their scales (4 bytes per token and head,
        each of K and V)."""
        per_token_head = 2 * self.E * self.code_bytes + (8 if self.quantized else 0)
        return sum(self.kv_lengths) * self.Hkv * per_token_head

    def allowed_pairs(self) -> int:
        """Query-key pairs per query head, summed over the sequences: query ``i`` of a
        sequence of ``L`` tokens sits at position ``L - q_len + i`` and sees the keys
        up to it."""
        q = self.q_len
        return sum(q * (n - q) + q * (q + 1) // 2 for n in self.kv_lengths)

    def flops(self) -> float:
        """``2 * H * pairs * (E + Ev)``."""
        return 2.0 * self.H * self.allowed_pairs() * 2 * self.E


#: The lengths of the ragged decoding batch: 32 sequences, geometric from 256 to
#: 16384 tokens, in a fixed shuffled order (128718 tokens in all).
RAGGED_DECODE_LENGTHS = (335, 1120, 7325, 4283, 979, 438, 12528, 2190, 5602, 573, 2864,
                         8377, 383, 14327, 749, 256, 3275, 1281, 3746, 1464, 655, 501,
                         2505, 1675, 9580, 4898, 856, 10955, 6406, 293, 1915, 16384)

#: The caches of the chunked-prefill row: 4 sequences, each with 512 new queries.
PREFILL_LENGTHS = (2048, 4096, 6144, 8192)


def _decode_rows(lk: int) -> List[ServingCase]:
    rows = []
    for cache in ("bfloat16", "int8", "float8_e4m3fn"):
        for block_size in (None, 16, 64):
            rows.append(ServingCase((lk,), cache=cache, block_size=block_size,
                                    quick=(lk == 8192 and cache == "int8"
                                           and block_size == 16)))
    rows.append(ServingCase((lk,), cache="float8_e5m2", block_size=16))
    if lk == 8192:          # blocks stored head after head, beside the head-major call
        rows.extend(ServingCase((lk,), cache=cache, block_size=16, heads_first=True)
                    for cache in ("bfloat16", "int8"))
    return rows


#: The serving rows of a full run (``fastattn bench`` runs them after the attention
#: grid): decoding (1, 32:8, 1, Lk, 128) at 8192 and 32768 tokens for each cache,
#: contiguous and paged (blocks of 16 and 64; at 8192 tokens also bfloat16 and int8
#: blocks of 16 stored heads first); a ragged batch of 32 sequences, paged; a chunked
#: prefill beside ``attention_varlen``.
SERVING_GRID: List[ServingCase] = [
    *_decode_rows(8192),
    *_decode_rows(32768),
    ServingCase(RAGGED_DECODE_LENGTHS, cache="bfloat16", block_size=16),
    ServingCase(RAGGED_DECODE_LENGTHS, cache="int8", block_size=16),
    ServingCase(PREFILL_LENGTHS, q_len=512, cache="bfloat16", block_size=16,
                baselines=False),
]

#: The ``--quick`` subset of :data:`SERVING_GRID`.
QUICK_SERVING_GRID: List[ServingCase] = [c for c in SERVING_GRID if c.quick]


# ----------------------------------------------------------------------------- inputs

def _code_dtype(cache: str) -> np.dtype:
    if cache == "int8":
        return np.dtype(np.int8)
    if cache == "bfloat16":
        return numpy_dtype("bfloat16")
    import ml_dtypes
    return np.dtype(getattr(ml_dtypes, cache))


#: Tokens quantized at a time when the inputs are made.
_QUANTIZE_TOKENS = 8192


def _stored(case: ServingCase, seed: int) -> Dict[str, np.ndarray]:
    """The row's data, packed token after token: bfloat16 queries (total_q, H, E), the
    cache's codes (total_k, Hkv, E) and scales (total_k, Hkv), the offsets."""
    rng = np.random.default_rng(seed)
    bf16 = numpy_dtype("bfloat16")
    lengths = np.array(case.kv_lengths, dtype=np.int64)
    total = int(lengths.sum())
    out = {"lengths": lengths,
           "cu_seqlens_q": np.arange(case.B + 1, dtype=np.int64) * case.q_len,
           "cu_seqlens_k": np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)}
    for name in ("k", "v"):
        x = rng.standard_normal((total, case.Hkv, case.E), dtype=np.float32)
        if case.quantized:
            # one scale per token and head: quantized a slice of tokens at a time (the
            # same codes, less memory than the whole cache in float64 at once)
            codes = np.empty(x.shape, _code_dtype(case.cache))
            scales = np.empty(x.shape[:-1], np.float32)
            for s in range(0, total, _QUANTIZE_TOKENS):
                e = min(total, s + _QUANTIZE_TOKENS)
                codes[s:e], scales[s:e] = fastattn.quantize_kv(x[s:e], case.cache)
            out[f"{name}_packed"], out[f"{name}_scale_packed"] = codes, scales
        else:
            out[f"{name}_packed"], out[f"{name}_scale_packed"] = x.astype(bf16), None
        del x
    out["q_packed"] = rng.standard_normal((case.B * case.q_len, case.H, case.E),
                                          dtype=np.float32).astype(bf16)
    return out


def _as_heads(x: Optional[np.ndarray]) -> Optional[np.ndarray]:
    """Packed rows (total, H, ...) of one sequence seen as (1, H, total, ...), the
    layout of ``fastattn.attention`` (a view; None stays None)."""
    return None if x is None else x.swapaxes(0, 1)[None]


def _data_key(case: ServingCase, seed: int) -> tuple:
    """What :func:`_stored` depends on: rows with the same key share their data."""
    return (case.kv_lengths, case.q_len, case.H, case.Hkv, case.E, case.cache, seed)


def make_serving_inputs(case: ServingCase, seed: int = 0,
                        stored: Optional[Dict[str, np.ndarray]] = None
                        ) -> Dict[str, np.ndarray]:
    """The arrays of a serving row, C-contiguous.

    Parameters
    ----------
    case : ServingCase
    seed : int
        Seed of the random values (standard normal keys, values and queries, the
        block order); rows that differ only in their layout hold the same values.
    stored : dict, optional
        The packed data of an earlier call with the same case data and seed (the
        layouts are rebuilt from it, the random values and codes are not).

    Returns
    -------
    dict
        Always: ``lengths`` (B,), ``cu_seqlens_q``, ``cu_seqlens_k`` (B + 1,), the
        packed data token after token ``q_packed`` (total_q, H, E) bfloat16,
        ``k_packed``/``v_packed`` (total_k, Hkv, E) bfloat16 or codes,
        ``k_scale_packed``/``v_scale_packed`` (total_k, Hkv) float32 or None. For one
        sequence also ``q_heads`` (1, H, q_len, E), ``k_heads``/``v_heads``
        (1, Hkv, Lk, E) and ``k_scale_heads``/``v_scale_heads`` (1, Hkv, Lk) or None,
        the layout of ``fastattn.attention``. For a paged row also ``k_cache``/
        ``v_cache`` (num_blocks, block_size, Hkv, E), ``k_scale_cache``/
        ``v_scale_cache`` (num_blocks, block_size, Hkv) or None, ``block_table``
        (B, max_blocks) int32 (every block used once, in a random order; entries past
        a sequence's last block are 0), ``slots`` (total_k,) int64 (token ``t`` of
        sequence ``b`` lies at row ``slots[cu_seqlens_k[b] + t]`` of the cache seen
        as (num_blocks * block_size, Hkv, E)) and ``q_paged``: (B, 1, H, E) for a
        decoding row, else ``q_packed``. Unused rows of the last blocks hold code 0
        (scale 1). For ``heads_first`` the caches and their scales are views,
        ``swapaxes(1, 2)`` of C-contiguous (num_blocks, Hkv, block_size, E) and
        (num_blocks, Hkv, block_size) arrays.
    """
    arrays = dict(_stored(case, seed) if stored is None else stored)
    if case.B == 1:
        for name in ("q", "k", "v", "k_scale", "v_scale"):
            x = _as_heads(arrays[f"{name}_packed"])
            arrays[f"{name}_heads"] = None if x is None else np.ascontiguousarray(x)
    if not case.paged:
        return arrays
    rng = np.random.default_rng([seed, case.block_size])
    bs = case.block_size
    lengths = arrays["lengths"]
    counts = (lengths + bs - 1) // bs
    order = rng.permutation(int(counts.sum()))    # the physical block of each logical one
    table = np.zeros((case.B, int(counts.max())), dtype=np.int32)
    starts = np.concatenate([[0], np.cumsum(counts)])
    slots = []
    for b, n in enumerate(lengths):
        table[b, :counts[b]] = order[starts[b]:starts[b + 1]]
        t = np.arange(n)
        slots.append(table[b, t // bs].astype(np.int64) * bs + t % bs)
    slots = np.concatenate(slots)
    num_blocks = int(counts.sum())
    for name in ("k", "v"):
        codes = arrays[f"{name}_packed"]
        cache = np.zeros((num_blocks, bs, case.Hkv, case.E), codes.dtype)
        cache.reshape(-1, case.Hkv, case.E)[slots] = codes
        arrays[f"{name}_cache"] = cache
        sc = arrays[f"{name}_scale_packed"]
        if sc is None:
            arrays[f"{name}_scale_cache"] = None
        else:
            scales = np.ones((num_blocks, bs, case.Hkv), np.float32)
            scales.reshape(-1, case.Hkv)[slots] = sc
            arrays[f"{name}_scale_cache"] = scales
        if case.heads_first:
            for key in (f"{name}_cache", f"{name}_scale_cache"):
                if arrays[key] is not None:
                    arrays[key] = np.ascontiguousarray(
                        arrays[key].swapaxes(1, 2)).swapaxes(1, 2)
    arrays["block_table"] = table
    arrays["slots"] = slots
    arrays["q_paged"] = (arrays["q_packed"].reshape(case.B, 1, case.H, case.E)
                         if case.decode else arrays["q_packed"])
    return arrays


# -------------------------------------------------------------------------- contenders

def _packed_from_heads(x) -> np.ndarray:
    """(1, H, Lq, D) -> (Lq, H, D)."""
    return np.asarray(x)[0].swapaxes(0, 1)


def _contiguous_call(case: ServingCase, arrays, k, v, k_scale, v_scale, threads: int):
    """The contiguous call on k, v ((1, Hkv, Lk, E) for one sequence, head-major or a
    view of the packed tokens; packed (total_k, Hkv, E) for a batch); returns
    (zero-argument function, result -> packed rows)."""
    if case.B == 1:
        q = arrays["q_heads"]
        return (lambda: fastattn.attention(q, k, v, causal="bottom_right",
                                           enable_gqa=True, k_scale=k_scale,
                                           v_scale=v_scale, num_threads=threads)
                ), _packed_from_heads
    varlen = getattr(fastattn, "attention_varlen", None)
    if varlen is None:
        raise Unavailable("fastattn.attention_varlen is not available in this build")
    q, cu_q, cu_k = arrays["q_packed"], arrays["cu_seqlens_q"], arrays["cu_seqlens_k"]
    return (lambda: varlen(q, k, v, cu_q, cu_k, causal="bottom_right", k_scale=k_scale,
                           v_scale=v_scale, num_threads=threads)), np.asarray


def _stored_layout(case: ServingCase, arrays):
    """The cache as the contiguous call takes it: k, v, k_scale, v_scale."""
    tail = "_heads" if case.B == 1 else "_packed"
    return tuple(arrays[n + tail] for n in ("k", "v", "k_scale", "v_scale"))


def _blocks_layout(case: ServingCase, arrays):
    """The same cache for the contiguous call, its tokens and heads in the order of the
    paged row's blocks: head-major for ``heads_first`` blocks and for a batch (packed
    tokens), else for one sequence the packed tokens seen as (1, Hkv, Lk, E)."""
    if case.heads_first or case.B > 1:
        return _stored_layout(case, arrays)
    return tuple(_as_heads(arrays[n + "_packed"])
                 for n in ("k", "v", "k_scale", "v_scale"))


def _numpy_dequantize(codes: np.ndarray, scale: Optional[np.ndarray]) -> np.ndarray:
    """bfloat16 values of codes: ``float32(code) * scale`` rounded to bfloat16."""
    x = codes.astype(np.float32)
    if scale is not None:
        x *= scale[..., None]
    return x.astype(numpy_dtype("bfloat16"))


def _numpy_today(case: ServingCase, arrays, threads: int):
    """Gather (paged) and dequantize (quantized) with NumPy, then the contiguous
    call."""
    if not case.paged and not case.quantized:
        raise Unavailable("nothing to gather or dequantize: the row is fastattn on the "
                          "bfloat16 cache")
    quantized = case.quantized
    if case.paged:
        slots = arrays["slots"]
        flat = {}
        for name in ("k", "v"):
            flat[name] = arrays[f"{name}_cache"].reshape(-1, case.Hkv, case.E)
            sc = arrays[f"{name}_scale_cache"]
            flat[name + "_scale"] = None if sc is None else sc.reshape(-1, case.Hkv)

        def tokens(name):
            # the copy a caller makes: the sequence's tokens, in order, (total_k, Hkv, E)
            codes = np.take(flat[name], slots, axis=0)
            if not quantized:
                return codes
            return _numpy_dequantize(codes, np.take(flat[name + "_scale"], slots, axis=0))
        if case.B == 1:
            def layout(x):                   # (Lk, Hkv, E) -> (1, Hkv, Lk, E), a view
                return x.swapaxes(0, 1)[None]
        else:
            def layout(x):
                return x
    else:
        stored = dict(zip(("k", "v", "k_scale", "v_scale"), _stored_layout(case, arrays)))

        def tokens(name):
            return _numpy_dequantize(stored[name], stored[name + "_scale"])

        def layout(x):
            return x
    q = arrays["q_heads"] if case.B == 1 else arrays["q_packed"]
    cu_q, cu_k = arrays["cu_seqlens_q"], arrays["cu_seqlens_k"]
    if case.B > 1 and getattr(fastattn, "attention_varlen", None) is None:
        raise Unavailable("fastattn.attention_varlen is not available in this build")

    def numpy_today():
        k, v = layout(tokens("k")), layout(tokens("v"))
        if case.B == 1:
            return fastattn.attention(q, k, v, causal="bottom_right", enable_gqa=True,
                                      num_threads=threads)
        return fastattn.attention_varlen(q, k, v, cu_q, cu_k, causal="bottom_right",
                                         num_threads=threads)
    return numpy_today, (_packed_from_heads if case.B == 1 else np.asarray)


def _torch_codes(torch, a: np.ndarray, cache: str):
    """A tensor on the memory of a cache array: int8 as it is, bfloat16 and float8
    through their integer words (viewed back after any gather)."""
    if a.dtype == np.int8 or a.dtype == np.float32:
        return torch.from_numpy(a)
    if cache == "bfloat16":
        return torch.from_numpy(a.view(np.int16))
    return torch.from_numpy(a.view(np.uint8))


def _torch_today(torch, case: ServingCase, arrays):
    """Gather (``index_select``) and dequantize to bfloat16 with PyTorch, then SDPA per
    sequence."""
    sdpa = torch.nn.functional.scaled_dot_product_attention
    word = {"bfloat16": torch.bfloat16, "int8": torch.int8}.get(case.cache)
    if word is None:
        word = getattr(torch, case.cache, None)
        if word is None:
            raise Unavailable(f"this PyTorch has no torch.{case.cache}")
    if case.paged:
        names = ("k_cache", "v_cache", "k_scale_cache", "v_scale_cache")
        src = {}
        for n in names:
            a = arrays[n]
            if a is None:
                src[n] = None
                continue
            t = _torch_codes(torch, a, case.cache)
            src[n] = t.reshape((-1,) + tuple(t.shape[2:]))        # (slots, Hkv[, E])
        index = torch.from_numpy(arrays["slots"])
        keys = ("k_cache", "v_cache", "k_scale_cache", "v_scale_cache")
    else:
        keys = ("k", "v", "k_scale", "v_scale")
        stored = _stored_layout(case, arrays)
        src = {n: (None if a is None else _torch_codes(torch, a, case.cache))
               for n, a in zip(keys, stored)}
        index = None
    q = arrays["q_packed"]
    tq = torch.from_numpy(q.view(np.int16)).view(torch.bfloat16)
    cu_q, cu_k = arrays["cu_seqlens_q"], arrays["cu_seqlens_k"]
    Lq = case.q_len
    masks = []
    for n in case.kv_lengths:
        if Lq == 1:
            masks.append(None)                 # the last position sees every key
        else:                                  # bottom-right causal, as a boolean mask
            i = np.arange(Lq)[:, None] + (n - Lq)
            masks.append(torch.from_numpy(np.ascontiguousarray(i >= np.arange(n)[None])))
    heads_major = not case.paged and case.B == 1

    def values(name, scale_name):
        x = src[name] if index is None else src[name].index_select(0, index)
        x = x.view(word)
        if src[scale_name] is None:
            return x
        s = src[scale_name] if index is None else src[scale_name].index_select(0, index)
        return (x.to(torch.float32) * s.unsqueeze(-1)).to(torch.bfloat16)

    def torch_today():
        with torch.no_grad():
            k = values(keys[0], keys[2])
            v = values(keys[1], keys[3])
            if heads_major:
                return [sdpa(tq.permute(1, 0, 2).unsqueeze(0), k, v, enable_gqa=True,
                             attn_mask=masks[0])]
            out = []
            for b in range(case.B):
                s, e = int(cu_k[b]), int(cu_k[b + 1])
                qb = tq[int(cu_q[b]):int(cu_q[b + 1])].permute(1, 0, 2).unsqueeze(0)
                out.append(sdpa(qb, k[s:e].permute(1, 0, 2).unsqueeze(0),
                                v[s:e].permute(1, 0, 2).unsqueeze(0), enable_gqa=True,
                                attn_mask=masks[b]))
            return out

    def rows(result):
        return np.concatenate([t[0].permute(1, 0, 2).float().numpy() for t in result])
    return torch_today, rows


def make_serving_callable(case: ServingCase, contender: str, arrays, threads: int, *,
                          torch_module=None
                          ) -> Tuple[Callable[[], object],
                                     Callable[[object], np.ndarray]]:
    """One contender of a serving row (see the module's docstring).

    Parameters
    ----------
    case : ServingCase
    contender : {"fastattn", "contiguous", "numpy", "torch"}
    arrays : dict
        From :func:`make_serving_inputs`.
    threads : int
        ``num_threads=`` of every fastattn call; PyTorch's threads are set by
        :func:`~fastattn.cli.bench.threads.thread_limits`.
    torch_module : module, optional
        The imported ``torch``, for the ``"torch"`` contender.

    Returns
    -------
    (call, rows)
        ``call()`` runs the contender once; ``rows(call())`` is its result as packed
        rows (total_q, H, E), row ``cu_seqlens_q[b] + i`` query ``i`` of sequence
        ``b``.

    Raises
    ------
    Unavailable
        When the contender does not apply to the row or cannot run here.
    """
    if contender not in SERVING_CONTENDERS:
        raise ValueError(f"unknown contender {contender!r}; expected one of "
                         f"{SERVING_CONTENDERS}")
    if contender in ("numpy", "torch") and not case.baselines:
        raise Unavailable("left out of this row (the contiguous call is its comparison)")
    if contender == "fastattn" and case.paged:
        paged = getattr(fastattn, "attention_paged", None)
        if paged is None:
            raise Unavailable("fastattn.attention_paged is not available in this build")
        q, table, lengths = arrays["q_paged"], arrays["block_table"], arrays["lengths"]
        kc, vc = arrays["k_cache"], arrays["v_cache"]
        ks, vs = arrays["k_scale_cache"], arrays["v_scale_cache"]
        cu_q = None if case.decode else arrays["cu_seqlens_q"]

        def paged_call():
            return paged(q, kc, vc, table, lengths, cu_seqlens_q=cu_q, k_scale=ks,
                         v_scale=vs, causal=True, num_threads=threads)
        return paged_call, (lambda out: np.asarray(out).reshape(-1, case.H, case.E))
    if contender == "contiguous":
        if not case.paged:
            raise Unavailable("the row is the contiguous call")
        return _contiguous_call(case, arrays, *_blocks_layout(case, arrays), threads)
    if contender == "fastattn":
        return _contiguous_call(case, arrays, *_stored_layout(case, arrays), threads)
    if contender == "numpy":
        return _numpy_today(case, arrays, threads)
    if torch_module is None:
        raise Unavailable("PyTorch is not installed (pip install torch)")
    return _torch_today(torch_module, case, arrays)


# -------------------------------------------------------------------------- reference

def _reference_picks(case: ServingCase) -> List[Tuple[int, int]]:
    """(sequence, query) pairs the reference checks: every sequence; its one query,
    or the first, middle and last of a chunk."""
    queries = sorted({0, case.q_len // 2, case.q_len - 1})
    return [(b, i) for b in range(case.B) for i in queries]


def _reference_heads(case: ServingCase) -> Tuple[List[int], List[int]]:
    """The key/value heads checked (the first and the last) and their query heads."""
    kv = sorted({0, case.Hkv - 1})
    group = case.H // case.Hkv
    return kv, [g * group + j for g in kv for j in range(group)]


def serving_reference(case: ServingCase, arrays) -> Tuple[np.ndarray, List[int],
                                                          np.ndarray]:
    """The reference on the checked subsample (see the module's docstring).

    Returns
    -------
    rows : ndarray of int
        Packed query rows checked (``cu_seqlens_q[b] + i``).
    heads : list of int
        The query heads checked.
    want : ndarray of float64, shape (len(rows), len(heads), E)
        :func:`fastattn.reference.attention_paged` on those rows and heads (the query
        ``i`` of sequence ``b`` as a decoding step over its first
        ``L_b - q_len + i + 1`` tokens, which is what the causal rule lets it see).
    """
    kv, heads = _reference_heads(case)
    picks = _reference_picks(case)
    cu_q, lengths = arrays["cu_seqlens_q"], arrays["lengths"]
    rows = np.array([cu_q[b] + i for b, i in picks], dtype=np.int64)
    see = np.array([lengths[b] - case.q_len + i + 1 for b, i in picks], dtype=np.int64)
    q = arrays["q_packed"][rows][:, None][:, :, heads].astype(np.float64)
    if case.paged:
        kc, vc = arrays["k_cache"], arrays["v_cache"]
        ks, vs = arrays["k_scale_cache"], arrays["v_scale_cache"]
        table = arrays["block_table"][[b for b, _ in picks]]
    else:
        # the packed tokens as a cache of one-token blocks (a view)
        kc = arrays["k_packed"][:, None]
        vc = arrays["v_packed"][:, None]
        ks, vs = (None if arrays[n] is None else arrays[n][:, None]
                  for n in ("k_scale_packed", "v_scale_packed"))
        cu_k = arrays["cu_seqlens_k"]
        table = np.zeros((len(picks), int(see.max())), dtype=np.int64)
        for r, (b, _) in enumerate(picks):
            table[r, :see[r]] = cu_k[b] + np.arange(see[r])
    kc, vc = kc[:, :, kv], vc[:, :, kv]
    ks = None if ks is None else ks[:, :, kv]
    vs = None if vs is None else vs[:, :, kv]
    want = reference.attention_paged(q, kc, vc, table, see, k_scale=ks, v_scale=vs,
                                     causal=True)
    return rows, heads, np.asarray(want, np.float64)[:, 0]


# ------------------------------------------------------------------------------- runs

def _bench_serving_case(case: ServingCase, threads: int, *, torch_module,
                        use_numpy: bool, use_torch: bool, arrays, max_rounds: int,
                        min_rounds: int,
                        time_budget: float, min_sample_time: float,
                        ceilings: Optional[dict], read_probe) -> dict:
    calls: Dict[str, Callable[[], object]] = {}
    to_rows: Dict[str, Callable[[object], np.ndarray]] = {}
    skipped: Dict[str, str] = {}
    for name in SERVING_CONTENDERS:
        if name == "numpy" and not use_numpy and case.baselines:
            skipped[name] = "left out (--no-numpy)"
            continue
        if name == "torch" and not use_torch and case.baselines:
            skipped[name] = "left out (--no-torch)"
            continue
        try:
            calls[name], to_rows[name] = make_serving_callable(
                case, name, arrays, threads, torch_module=torch_module)
        except Unavailable as exc:
            skipped[name] = str(exc)
    if case.decode and read_probe is not None and "fastattn" in calls:
        calls["read"] = read_probe[0]
    samples, outputs, numbers, failed = _interleaved(
        calls, max_rounds=max_rounds, min_rounds=min_rounds, time_budget=time_budget,
        min_sample_time=min_sample_time, spinning=("read",))
    skipped.update(failed)
    rounds = min((len(s) for s in samples.values()), default=0)

    nbytes, flops = case.kv_bytes(), case.flops()
    times = {}
    for name, s in samples.items():
        med = _summary(s)["median"]
        times[name] = dict({k: x * 1e3 for k, x in _summary(s).items()},
                           samples=[x * 1e3 for x in s], number=numbers[name],
                           gbs=nbytes / med / 1e9, gflops=flops / med / 1e9)

    def per_round(num: str, den: str) -> Optional[dict]:
        if num not in samples or den not in samples:
            return None
        values = [a / b for a, b in zip(samples[num], samples[den])]
        return dict(_summary(values), per_round=values)
    speedups = {other: per_round(other, "fastattn") for other in ("numpy", "torch")}
    paged_cost = per_round("fastattn", "contiguous")

    bandwidth = None
    if "read" in samples and "fastattn" in samples:
        values = [100.0 * (nbytes / f) / (read_probe[1] / r)
                  for r, f in zip(samples["read"], samples["fastattn"])]
        bandwidth = dict(_summary(values), per_round=values, probe_bytes=read_probe[1])

    results = {name: to_rows[name](out) for name, out in outputs.items()
               if name in to_rows}
    diffs, max_ref = {}, None
    if results:
        ref_rows, heads, want = serving_reference(case, arrays)
        max_ref = float(np.max(np.abs(want))) if want.size else 0.0
        for name, got in results.items():
            diffs[name] = _max_abs_diff(np.asarray(got, np.float64)[ref_rows][:, heads],
                                        want)
    diff_contiguous = None
    if "fastattn" in results and "contiguous" in results:
        diff_contiguous = _max_abs_diff(results["fastattn"], results["contiguous"])

    fa = times.get("fastattn")
    row = {"label": case.label, "id": case.id, "kind": case.kind, "B": case.B,
           "H": case.H, "Hkv": case.Hkv, "q_len": case.q_len, "E": case.E,
           "kv_lengths": list(case.kv_lengths), "cache": case.cache,
           "block_size": case.block_size, "decode": case.decode,
           "kv_bytes": nbytes, "flops": flops, "rounds": rounds, "times_ms": times,
           "speedup": speedups, "paged_over_contiguous": paged_cost,
           "pct_of_bandwidth_same_rounds": bandwidth,
           "gbs": fa["gbs"] if fa and case.decode else None,
           "gflops": fa["gflops"] if fa else None,
           "max_abs_diff_vs_reference": diffs, "max_abs_reference": max_ref,
           "max_abs_diff_vs_contiguous": diff_contiguous,
           "reference_checked": {"sequences": case.B,
                                 "queries_per_sequence": len(_reference_picks(case))
                                 // case.B,
                                 "query_heads": _reference_heads(case)[1]},
           "skipped": skipped}
    row.update(serving_peak(row, ceilings))
    return row


def serving_peak(row: dict, ceilings: Optional[dict]) -> dict:
    """A decoding row's share of the read bandwidth: the median over rounds of its GB/s
    over the read probe's in the same round when the probe ran in its rounds, else of
    the run's best read bandwidth (``ceilings``); None for a prefill row."""
    out = {"pct_of_ceiling": None, "ceiling": None}
    if not row["decode"] or row["gbs"] is None:
        return out
    same = row.get("pct_of_bandwidth_same_rounds")
    if same:
        return {"pct_of_ceiling": same["median"], "ceiling": "read probe, same rounds"}
    if ceilings:
        return {"pct_of_ceiling": 100.0 * row["gbs"] / ceilings["bandwidth_gbs"],
                "ceiling": "bandwidth"}
    return out


def run_serving(cases: Optional[Sequence[ServingCase]] = None, threads: int = 1, *,
                torch_module=None, use_numpy: bool = True, use_torch: bool = True,
                seed: int = 0, read_probe: bool = False, ceilings: Optional[dict] = None,
                max_rounds: int = 11, min_rounds: int = 3, time_budget: float = 6.0,
                min_sample_time: float = 0.02, _progress=None) -> List[dict]:
    """Time the serving rows.

    Parameters
    ----------
    cases : sequence of ServingCase, optional
        Default :data:`SERVING_GRID`.
    threads : int
        Threads of every fastattn call (PyTorch's are set by the caller, e.g. with
        :func:`~fastattn.cli.bench.threads.thread_limits`).
    torch_module : module, optional
        The imported ``torch``: the ``torch`` contender runs when given.
    use_numpy, use_torch : bool
        Time the ``numpy`` contender; the ``torch`` contender (which also needs
        ``torch_module``).
    seed : int
        Seed of the random inputs.
    read_probe : bool
        Time the read probe in the rounds of each decoding row.
    ceilings : dict, optional
        From :func:`~fastattn.cli.bench.measure_ceilings`: the bandwidth a decoding
        row's share is taken of when the probe did not run.
    max_rounds, min_rounds, time_budget, min_sample_time
        As in :func:`~fastattn.cli.bench.run_benchmarks`.

    Returns
    -------
    list of dict
        One row per case: the shape, ``cache``, ``block_size``, ``kv_bytes``,
        ``flops``, ``rounds``, ``times_ms`` (per contender: median/min/max/samples in
        ms, ``gbs`` and ``gflops`` of the row's counts), ``speedup`` (``numpy``,
        ``torch``: median/min/max/per_round of their time over fastattn's, or None),
        ``paged_over_contiguous`` (fastattn's time over the contiguous call's, or
        None), ``gbs``, ``gflops``, ``pct_of_bandwidth_same_rounds``,
        ``pct_of_ceiling``, ``max_abs_diff_vs_reference`` (per contender),
        ``max_abs_reference`` (the largest magnitude of the reference: the scale of
        those differences), ``max_abs_diff_vs_contiguous`` (fastattn against the
        contiguous call, every row) and ``skipped`` (contender -> reason).
    """
    cases = list(SERVING_GRID if cases is None else cases)
    probe = (_ceilings.read_probe() if read_probe and any(c.decode for c in cases)
             else None)
    rows = []
    last_key, stored = None, None          # rows that differ in layout share their data
    try:
        for case in cases:
            if _progress is not None:
                _progress.start(case.label)
            key = _data_key(case, seed)
            if key != last_key:
                last_key, stored = None, None
                stored = _stored(case, seed)
                last_key = key
            arrays = make_serving_inputs(case, seed, stored=stored)
            rows.append(_bench_serving_case(
                case, threads, torch_module=torch_module if use_torch else None,
                use_numpy=use_numpy, use_torch=use_torch, arrays=arrays,
                max_rounds=max_rounds, min_rounds=min_rounds,
                time_budget=time_budget, min_sample_time=min_sample_time,
                ceilings=ceilings, read_probe=probe))
            del arrays
            if _progress is not None:
                _progress.advance()
    finally:
        del probe, stored
    return rows
