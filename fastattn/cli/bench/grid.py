"""The benchmark grid: :class:`Case`, one shape, and the grids of ``fastattn bench``.

A case counts its own work: :meth:`Case.flops` (forward, or forward + backward) and
:meth:`Case.kv_bytes` (what a memory-bound decode step reads); the counting conventions
are those of :mod:`fastattn.cli.bench`.

Examples
--------
>>> from fastattn.cli.bench.grid import Case, QUICK_GRID
>>> [c.label for c in QUICK_GRID][:2]
['(1,8,512,512,64)', '(4,8,256,256,64)']
>>> Case(1, 1, 2, 5, 2, causal="bottom_right").allowed_pairs()
9
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Union

import numpy as np

from ... import _validation as _v

__all__ = ["Case", "GRID", "QUICK_GRID", "BACKWARD_FLOP_FACTOR"]

#: Backward work counted as this multiple of the forward flops (FlashAttention-2).
BACKWARD_FLOP_FACTOR = 2.5


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
        ``"float32"`` or ``"float64"``.
    causal : bool or str
        As in :func:`fastattn.attention`.
    quick : bool
        Whether the case belongs to the ``--quick`` grid.
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
    def label(self) -> str:
        """A short human label, e.g. ``"(1,8,2048,2048,64) causal"``."""
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
        return "-".join(parts)

    def allowed_pairs(self) -> int:
        """Query-key pairs that may attend, per (batch, head)."""
        kind = self.causal_kind
        if kind is None:
            return self.Lq * self.Lk
        # query i may attend to keys 0 .. i + d (the rule of fastattn.attention)
        d = _v.query_offset(kind, self.Lq, self.Lk)
        i = np.arange(self.Lq, dtype=np.int64)
        return int(np.clip(i + 1 + d, 0, self.Lk).sum())

    def flops(self, backward: bool = False) -> float:
        """Floating-point operations of one call (see :mod:`fastattn.cli.bench`)."""
        f = 2.0 * self.B * self.H * self.allowed_pairs() * (self.E + self.ev)
        return f * (1.0 + BACKWARD_FLOP_FACTOR) if backward else f

    def kv_bytes(self) -> int:
        """Bytes of K and V, each key/value head counted once."""
        item = np.dtype(self.dtype).itemsize
        return self.B * self.kv_heads * self.Lk * (self.E + self.ev) * item


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
]

#: The ``--quick`` subset of :data:`GRID`.
QUICK_GRID: List[Case] = [c for c in GRID if c.quick]
