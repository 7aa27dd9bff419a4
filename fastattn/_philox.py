"""The dropout generator: counter-based Philox-4x32-10, vectorised in NumPy.

Dropout in fastattn is a pure function of ``(dropout_seed, slice, i, j)``, so that the
kernels can draw it in any order on any number of threads, and ``attention_backward``
can regenerate the pattern of the forward pass instead of storing it. ``slice`` is the
C-order flat index of the (Lq, Lk) weight matrix in the output's ``*batch``
(``b * Hq + h`` in ``attention_varlen``); ``i`` and ``j`` are the query row and key
column in that matrix (0-based; ``i`` is the row index, not the position ``i + d``).

The mapping, which ``fastattn/src/philox.h`` implements identically in C:

- key     = (seed mod 2**32, seed div 2**32)                 seed: 0 <= seed < 2**64
- counter = (j div 4, i, slice mod 2**32, slice div 2**32)
- u       = word (j mod 4) of Philox4x32-10(counter, key)    (words numbered 0..3)
- threshold = floor(dropout_p * 2**32)                        (0 <= dropout_p < 1)
- the weight (i, j) is kept iff u >= threshold, and then scaled by 1 / (1 - dropout_p)

so a weight is dropped with probability ``threshold / 2**32`` (``dropout_p`` to within
2**-32). One Philox call decides four neighbouring keys of a row, which is what a kernel
walking a row of keys wants. ``i`` and ``j`` are below 2**32.

Philox4x32-10 is that of Salmon, Moraes, Dror and Shaw, "Parallel random numbers: as
easy as 1, 2, 3" (SC 2011), as implemented in Random123: ten rounds of

    (c0, c1, c2, c3) -> (hi(M1*c2) ^ c1 ^ k0, lo(M1*c2), hi(M0*c0) ^ c3 ^ k1, lo(M0*c0))

with the key bumped by the Weyl constants (W0, W1) before every round but the first.
The tests check it against Random123's published known-answer vectors.

Examples
--------
>>> from fastattn import _philox
>>> [hex(int(w)) for w in _philox.philox4x32((0, 0, 0, 0), (0, 0))]
['0x6627e8d5', '0xe169c58d', '0xbc57ac4c', '0x9b00dbd8']
"""

from __future__ import annotations

import numpy as np

# The Philox4x32 multipliers and Weyl key increments (Salmon et al. 2011, Random123).
M0, M1 = 0xD2511F53, 0xCD9E8D57
W0, W1 = 0x9E3779B9, 0xBB67AE85
_MASK32 = 0xFFFFFFFF


def philox4x32(counter, key, rounds: int = 10):
    """Philox4x32-``rounds`` of ``counter`` (four uint32 arrays or ints, broadcast
    together) under ``key`` (two Python ints below 2**32).

    Returns the four output words as uint32 arrays of the broadcast counter shape.
    Every element is computed independently: no Python loop runs over elements.
    """
    # uint32 values held in uint64, so that the 32x32 -> 64-bit product is exact
    c0, c1, c2, c3 = (np.asarray(c).astype(np.uint64) & np.uint64(_MASK32)
                      for c in counter)
    k0, k1 = int(key[0]) & _MASK32, int(key[1]) & _MASK32
    m0, m1, low = np.uint64(M0), np.uint64(M1), np.uint64(_MASK32)
    shift = np.uint64(32)
    for r in range(rounds):
        if r:
            k0, k1 = (k0 + W0) & _MASK32, (k1 + W1) & _MASK32
        p0 = c0 * m0
        p1 = c2 * m1
        c0, c1, c2, c3 = ((p1 >> shift) ^ c1 ^ np.uint64(k0), p1 & low,
                          (p0 >> shift) ^ c3 ^ np.uint64(k1), p0 & low)
    return tuple(np.broadcast_arrays(*(c.astype(np.uint32) for c in (c0, c1, c2, c3))))


def dropout_threshold(dropout_p: float) -> int:
    """``floor(dropout_p * 2**32)``: a word ``u`` is kept iff ``u >= threshold``."""
    return int(np.floor(float(dropout_p) * 2.0 ** 32))


def dropout_keep(seed: int, dropout_p: float, slices, Lq: int, Lk: int) -> np.ndarray:
    """The kept/dropped pattern: a boolean array ``slices.shape + (Lq, Lk)``.

    ``slices`` holds the slice index of every (Lq, Lk) matrix; element ``[..., i, j]``
    is True iff weight (i, j) of that slice is kept (see the module docstring).
    """
    slices = np.asarray(slices, dtype=np.uint64)
    seed = int(seed)
    blocks = -(-Lk // 4)                                    # ceil(Lk / 4)
    s = slices[..., None, None]
    words = philox4x32(
        (np.arange(blocks, dtype=np.uint64)[None, :],       # j div 4
         np.arange(Lq, dtype=np.uint64)[:, None],           # i
         s & np.uint64(_MASK32), s >> np.uint64(32)),
        (seed & _MASK32, (seed >> 32) & _MASK32))
    # (..., Lq, blocks, 4) -> (..., Lq, 4 * blocks): word t of block jb is key 4*jb + t
    u = np.stack(words, axis=-1).reshape(slices.shape + (Lq, 4 * blocks))[..., :Lk]
    return u >= np.uint32(dropout_threshold(dropout_p))
