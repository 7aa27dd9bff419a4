"""A small typed program using fastattn; `mypy --strict` must accept it as it is."""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

import fastattn
from fastattn import reference


def self_attention(x: NDArray[np.float32], heads: int) -> NDArray[np.float32]:
    batch, length, width = x.shape
    q = x.reshape(batch, length, heads, width // heads).transpose(0, 2, 1, 3)
    out = fastattn.attention(q, q, q, causal="bottom_right", num_threads=2)
    merged: NDArray[np.float32] = out.transpose(0, 2, 1, 3).reshape(batch, length, width)
    return merged


def main() -> float:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 16, 32), dtype=np.float32)
    y = self_attention(x, heads=4)

    q = x[:, :, :8]
    out, lse = fastattn.attention(q, q, q, return_lse=True, causal=True)
    want, want_lse = reference.attention(q, q, q, return_lse=True, causal=True)
    dq, dk, dv = fastattn.attention_backward(np.ones_like(out), q, q, q, out, lse,
                                             causal=True, num_threads=1)
    merged, merged_lse = fastattn.merge_partials([out, out], [lse, lse])
    weights = fastattn.attention_weights(q, q, mask=np.tri(16, dtype=bool))
    scores = fastattn.scores(q, q, scale=0.5, enable_gqa=False)
    probs = fastattn.softmax(scores, axis=-1, out=np.empty_like(scores))
    mixed = fastattn.weighted_sum(probs, x)

    fastattn.set_num_threads(np.int64(2))
    threads: int = fastattn.get_num_threads()
    fastattn.set_num_threads(None)
    version: str = fastattn.__version__
    # a submodule loaded on first use is typed like the others
    variances = fastattn.explain.variance_table([1, 4], samples=200, seed=0)
    d_k: list[int] = variances["d_k"].tolist()

    errors = [np.abs(out - want).max(), np.abs(lse - want_lse).max(),
              np.abs(merged - out).max(), np.abs(merged_lse - lse - np.log(2)).max(),
              np.abs(weights - reference.attention_weights(q, q, causal=True)).max(),
              np.abs(mixed - reference.weighted_sum(probs, x)).max(),
              np.abs(dq + dk + dv - sum(reference.attention_backward(
                  np.ones_like(out), q, q, q, out, lse, causal=True))).max()]
    return float(max(errors)) + 0 * threads * len(version) * len(d_k) * float(y.sum())


if __name__ == "__main__":
    print(main())
