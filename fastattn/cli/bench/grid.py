"""The benchmark grid: :class:`Case`, one shape, and the grids of ``fastattn bench``.

A case counts its own work: :meth:`Case.flops` (forward, or forward + backward) and
:meth:`Case.kv_bytes` (what a memory-bound decode step reads); the counting conventions
are those of :mod:`fastattn.cli.bench`. A case may carry attention variants (a sliding
window, a softcap, ALiBi, attention sinks, a ragged batch of real lengths); the
contenders then pass them on, and the flops count only the query-key pairs the variants
allow.

Examples
--------
>>> from fastattn.cli.bench.grid import Case, QUICK_GRID
>>> [c.label for c in QUICK_GRID][:2]
['(1,8,512,512,64)', '(4,8,256,256,64)']
>>> Case(1, 1, 2, 5, 2, causal="bottom_right").allowed_pairs()
9
>>> Case(1, 1, 6, 6, 2, causal=True, window=(2, 0)).allowed_pairs()   # 1+2+3+3+3+3
15
>>> Case(2, 4, 8, 8, 16, lengths=(8, 3), ragged="varlen").label
'(2,4,8,8,16) ragged 3..8 varlen'
>>> Case(1, 8, 512, 512, 64, causal=True, sinks=True).label
'(1,8,512,512,64) causal sinks'
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import List, Optional, Tuple, Union

import numpy as np

from ... import _validation as _v

__all__ = ["Case", "GRID", "QUICK_GRID", "BACKWARD_FLOP_FACTOR", "RAGGED_FLAVOURS",
           "DTYPES", "numpy_dtype", "with_dtype"]

#: Backward work counted as this multiple of the forward flops (FlashAttention-2).
BACKWARD_FLOP_FACTOR = 2.5

#: How a ragged batch (``Case.lengths``) is handed to fastattn and the NumPy baseline:
#: ``"lengths"``: the padded arrays with ``q_lengths=`` and ``kv_lengths=``;
#: ``"mask"``: the same padded arrays with a boolean key-padding mask of shape
#: (B, 1, 1, Lk) (what a caller without length arguments writes);
#: ``"varlen"``: the real rows packed without padding, :func:`fastattn.attention_varlen`.
RAGGED_FLAVOURS = ("lengths", "mask", "varlen")


def _side(x: Optional[int]) -> str:
    return "None" if x is None else str(x)


@dataclass(frozen=True)
class Case:
    """One benchmark shape: q (B, H, Lq, E) against k (B, Hkv, Lk, E), v (B, Hkv, Lk, Ev).

    Parameters
    ----------
    B, H, Lq, Lk, E : int
        Batch, query heads, query length, key length and head dimension.
    Hkv : int, optional
        Key/value heads; ``None`` means ``H``. Fewer than ``H`` is grouped-query
        attention (``enable_gqa=True``).
    Ev : int, optional
        Value head dimension; ``None`` means ``E``.
    dtype : str
        One of :data:`DTYPES`; ``"bfloat16"`` needs ``ml_dtypes``.
    causal : bool or str
        As in :func:`fastattn.attention`.
    quick : bool
        Whether the case belongs to the ``--quick`` grid.
    window : (left, right), optional
        A local-attention window, as ``window=`` of :func:`fastattn.attention`.
    softcap : float, optional
        As ``softcap=`` of :func:`fastattn.attention`.
    alibi : bool
        Add ALiBi biases, with the usual slopes ``2 ** (-8 (h + 1) / H)``.
    sinks : bool
        Attention sinks (gpt-oss's ``s_aux``): one extra logit per query head in every
        row's softmax, ``sinks=`` of :func:`fastattn.attention` (the values are drawn
        by :func:`~fastattn.cli.bench.contenders.make_inputs`). They change no flop
        count.
    lengths : tuple of int, optional
        A ragged self-attention batch (needs ``Lq == Lk``): the real length of each of
        the ``B`` sequences, padded to ``Lq``. Each length serves as both the query and
        the key/value length.
    ragged : {"lengths", "mask", "varlen"}
        How the ragged batch is handed to fastattn and the NumPy baseline (see
        :data:`RAGGED_FLAVOURS`). All three do the same useful work and count the
        same flops: the padded rows of ``"mask"`` are waste, not work.
    baseline : bool
        Time the NumPy baseline. False for shapes where it would take tens of
        seconds a call (it forms the whole Lq x Lk score matrix); fastattn's result is
        then checked against PyTorch's only.
    """

    B: int
    H: int
    Lq: int
    Lk: int
    E: int
    Hkv: Optional[int] = None
    Ev: Optional[int] = None
    dtype: str = "float32"
    causal: Union[bool, str] = False
    quick: bool = False
    window: Optional[Tuple[Optional[int], Optional[int]]] = None
    softcap: Optional[float] = None
    alibi: bool = False
    sinks: bool = False
    lengths: Optional[Tuple[int, ...]] = None
    ragged: str = "lengths"
    baseline: bool = True

    def __post_init__(self):
        if self.window is not None:
            window = _v.check_window(self.window)
            object.__setattr__(self, "window", None if window == (None, None) else window)
        if self.softcap is not None:
            object.__setattr__(self, "softcap", _v.check_softcap(self.softcap))
        if self.ragged not in RAGGED_FLAVOURS:
            raise ValueError(f"ragged must be one of {RAGGED_FLAVOURS}, got "
                             f"{self.ragged!r}")
        if self.lengths is None:
            if self.ragged != "lengths":
                raise ValueError(f"ragged={self.ragged!r} needs lengths")
            return
        lengths = tuple(int(x) for x in self.lengths)
        if self.Lq != self.Lk:
            raise ValueError(f"lengths need a self-attention batch (Lq == Lk), got "
                             f"Lq={self.Lq}, Lk={self.Lk}")
        if len(lengths) != self.B or any(not 0 <= x <= self.Lq for x in lengths):
            raise ValueError(f"lengths must be {self.B} integers in [0, {self.Lq}], got "
                             f"{self.lengths!r}")
        object.__setattr__(self, "lengths", lengths)

    @property
    def kv_heads(self) -> int:
        return self.H if self.Hkv is None else self.Hkv

    @property
    def ev(self) -> int:
        return self.E if self.Ev is None else self.Ev

    @property
    def gqa(self) -> bool:
        return self.kv_heads != self.H

    @property
    def decode(self) -> bool:
        """One query row against a key/value cache: a memory-bound shape."""
        return self.Lq == 1

    @property
    def causal_kind(self) -> Optional[str]:
        return _v.parse_causal(self.causal)

    @property
    def ragged_flavour(self) -> Optional[str]:
        """``None`` for a dense batch, else one of :data:`RAGGED_FLAVOURS`."""
        return None if self.lengths is None else self.ragged

    @property
    def variant(self) -> bool:
        """Whether the case uses a variant (window, softcap, ALiBi, sinks, ragged
        batch)."""
        return (self.window is not None or self.softcap is not None or self.alibi
                or self.sinks or self.lengths is not None)

    @property
    def label(self) -> str:
        """A short human label, e.g. ``"(1,8,2048,2048,64) causal window=(256,0)"``."""
        heads = f"{self.H}:{self.kv_heads}" if self.gqa else f"{self.H}"
        dims = f"{self.E}" if self.Ev is None else f"{self.E}/{self.ev}"
        text = f"({self.B},{heads},{self.Lq},{self.Lk},{dims})"
        tags = []
        if self.decode:
            tags.append("decode")
        if self.gqa:
            tags.append("gqa")
        kind = self.causal_kind
        if kind == "top_left":
            tags.append("causal")
        elif kind == "bottom_right":
            tags.append("causal=bottom_right")
        if self.window is not None:
            tags.append(f"window=({_side(self.window[0])},{_side(self.window[1])})")
        if self.softcap is not None:
            tags.append(f"softcap={self.softcap:g}")
        if self.alibi:
            tags.append("alibi")
        if self.sinks:
            tags.append("sinks")
        if self.lengths is not None:
            tags.append(f"ragged {min(self.lengths)}..{max(self.lengths)} "
                        + {"lengths": "q/kv_lengths", "mask": "padding-mask",
                           "varlen": "varlen"}[self.ragged])
        if self.dtype != "float32":
            tags.append(self.dtype)
        return " ".join([text] + tags)

    @property
    def id(self) -> str:
        """An identifier without spaces, for pytest ids and ``--only``."""
        heads = f"{self.H}h{self.kv_heads}" if self.gqa else f"{self.H}"
        parts = [f"{self.B}x{heads}x{self.Lq}x{self.Lk}x{self.E}", self.dtype]
        if self.Ev is not None:
            parts.insert(1, f"ev{self.ev}")
        kind = self.causal_kind
        if kind:
            parts.append("causal" if kind == "top_left" else "causal_br")
        if self.decode:
            parts.append("decode")
        if self.window is not None:
            parts.append(f"window{_side(self.window[0])}_{_side(self.window[1])}")
        if self.softcap is not None:
            parts.append(f"softcap{self.softcap:g}")
        if self.alibi:
            parts.append("alibi")
        if self.sinks:
            parts.append("sinks")
        if self.lengths is not None:
            parts.append(f"ragged_{self.ragged}")
        return "-".join(parts)

    def counterpart(self) -> Optional["Case"]:
        """The call a variant case is measured against, or None: the same call without
        its window; else without its softcap, ALiBi and sinks; for a ragged batch given
        as lengths, the same batch as a padding mask; as varlen, the same batch as
        lengths.

        ``fastattn bench`` times fastattn on both in the same rounds (the arrays of
        :func:`make_inputs` serve both).
        """
        if self.lengths is not None and self.ragged != "mask":
            return replace(self, quick=False,
                           ragged="mask" if self.ragged == "lengths" else "lengths")
        if self.window is not None:
            return replace(self, window=None, quick=False)
        if self.softcap is not None or self.alibi or self.sinks:
            return replace(self, softcap=None, alibi=False, sinks=False, quick=False)
        return None

    def real_lengths(self) -> Tuple[Tuple[int, int], ...]:
        """``(Lq_b, Lk_b)`` of each batch entry: its real lengths (``Lq, Lk`` unless
        :attr:`lengths` is set)."""
        if self.lengths is None:
            return ((self.Lq, self.Lk),) * self.B
        return tuple((n, n) for n in self.lengths)

    def sequence_pairs(self, lq: int, lk: int) -> int:
        """Query-key pairs that may attend in one head of a sequence of ``lq`` query and
        ``lk`` key rows, under the case's causal rule and window (positions as in
        :func:`fastattn.attention`: query ``i`` at ``i + d``, ``d`` from
        :func:`fastattn._validation.query_offset` of the sequence's own lengths)."""
        kind = self.causal_kind
        if lq <= 0 or lk <= 0:
            return 0
        if kind is None and self.window is None:
            return lq * lk
        pos = np.arange(lq, dtype=np.int64) + _v.query_offset(kind, lq, lk)
        lo = np.zeros(lq, np.int64)
        hi = np.full(lq, lk - 1, np.int64)
        if kind is not None:
            hi = np.minimum(hi, pos)
        left, right = self.window if self.window is not None else (None, None)
        if left is not None:
            lo = np.maximum(lo, pos - left)
        if right is not None:
            hi = np.minimum(hi, pos + right)
        return int(np.clip(hi - lo + 1, 0, None).sum())

    def allowed_pairs(self) -> int:
        """Query-key pairs that may attend, per head, summed over the batch entries
        (each with its real lengths)."""
        counts = {}
        for lens in self.real_lengths():
            if lens not in counts:
                counts[lens] = self.sequence_pairs(*lens)
        return sum(counts[lens] for lens in self.real_lengths())

    def flops(self, backward: bool = False) -> float:
        """Floating-point operations of one call (see :mod:`fastattn.cli.bench`)."""
        f = 2.0 * self.H * self.allowed_pairs() * (self.E + self.ev)
        return f * (1.0 + BACKWARD_FLOP_FACTOR) if backward else f

    def kv_bytes(self) -> int:
        """Bytes of the real rows of K and V, each key/value head counted once."""
        item = numpy_dtype(self.dtype).itemsize
        rows = sum(lk for _, lk in self.real_lengths())
        return self.kv_heads * rows * (self.E + self.ev) * item


#: The dtypes a case may have (``fastattn bench --dtype``).
DTYPES = ("float32", "float64", "bfloat16", "float16")


def numpy_dtype(name: str) -> np.dtype:
    """The NumPy dtype of a case's dtype name (bfloat16: ``ml_dtypes.bfloat16``;
    ImportError when ml_dtypes is not installed)."""
    if name == "bfloat16":
        try:
            import ml_dtypes
        except ImportError:
            raise ImportError("bfloat16 cases need ml_dtypes "
                              "(pip install \"fastattn[bf16]\")") from None
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def with_dtype(grid: List[Case], dtype: str) -> List[Case]:
    """Every case of ``grid`` in ``dtype`` (cases that become alike are kept once)."""
    out, seen = [], set()
    for case in grid:
        c = replace(case, dtype=dtype)
        if c.id not in seen:
            seen.add(c.id)
            out.append(c)
    return out


#: Real lengths of the ragged batch of the grid: 8 sequences spread over 256..2048.
RAGGED_LENGTHS = (2048, 256, 1536, 768, 1792, 512, 1280, 1024)

#: The full grid: used by ``fastattn bench`` and by ``benchmarks/``.
GRID: List[Case] = [
    Case(1, 8, 512, 512, 64, quick=True),
    Case(1, 8, 2048, 2048, 64),
    Case(1, 12, 1024, 1024, 64),
    Case(4, 8, 256, 256, 64, quick=True),
    Case(16, 12, 128, 128, 64, quick=True),
    Case(1, 8, 4096, 4096, 128),
    Case(1, 8, 2048, 2048, 64, causal=True, quick=True),
    Case(1, 32, 1, 4096, 128, quick=True),
    Case(1, 32, 1, 4096, 128, Hkv=8, causal="bottom_right", quick=True),
    Case(1, 8, 1024, 1024, 64, dtype="float64", quick=True),
    # bfloat16 and float16 (PyTorch in the same dtype; bfloat16 needs ml_dtypes)
    Case(1, 8, 1024, 1024, 64, dtype="bfloat16", quick=True),
    Case(1, 8, 2048, 2048, 128, dtype="bfloat16"),
    Case(1, 8, 2048, 2048, 64, causal=True, dtype="bfloat16"),
    Case(1, 32, 1, 4096, 128, Hkv=8, causal="bottom_right", dtype="bfloat16", quick=True),
    Case(1, 8, 1024, 1024, 64, dtype="float16"),
    # attention variants, each beside the plain call it should be compared with
    Case(1, 8, 2048, 2048, 64, causal=True, window=(256, 0), quick=True),
    # (the NumPy baseline, which forms every 8192 x 8192 matrix, takes tens of seconds
    # a call here: left out)
    Case(1, 4, 8192, 8192, 64, causal=True, baseline=False),
    Case(1, 4, 8192, 8192, 64, causal=True, window=(256, 0), baseline=False),
    Case(1, 8, 2048, 2048, 64, softcap=50.0),
    Case(1, 8, 2048, 2048, 64, alibi=True),
    # attention sinks (gpt-oss's s_aux), each beside the same causal call without them
    # (for 2048, the causal row above); --quick runs the small one, with fastattn on
    # its counterpart in the same rounds
    Case(1, 8, 2048, 2048, 64, causal=True, sinks=True),
    Case(1, 8, 512, 512, 64, causal=True, sinks=True, quick=True),
    Case(1, 8, 512, 512, 64, causal=True),
    Case(8, 4, 2048, 2048, 64, lengths=RAGGED_LENGTHS, ragged="lengths"),
    Case(8, 4, 2048, 2048, 64, lengths=RAGGED_LENGTHS, ragged="mask"),
    Case(8, 4, 2048, 2048, 64, lengths=RAGGED_LENGTHS, ragged="varlen"),
]

#: The ``--quick`` subset of :data:`GRID`.
QUICK_GRID: List[Case] = [c for c in GRID if c.quick]
