"""The oracle itself: fastattn.reference against hand values and a per-row loop."""

import math

import numpy as np
import pytest

from fastattn import reference


def loop_attention(q, k, v, mask=None, bias=None, causal=None, scale=None, groups=1):
    """Attention of (H, L, E) arrays one query row at a time, in Python floats."""
    H, Lq, E = q.shape
    Lk = k.shape[1]
    scale = 1 / math.sqrt(E) if scale is None else scale
    out = np.zeros((H, Lq, v.shape[2]))
    lse = np.full((H, Lq), -np.inf)
    for h in range(H):
        kh = h // groups
        for i in range(Lq):
            s = []
            for j in range(Lk):
                ok = (mask is None or mask[h, i, j]) and (
                    causal is None or j <= i + (Lk - Lq if causal == "bottom_right" else 0))
                b = 0.0 if bias is None else bias[h, i, j]
                s.append(scale * float(q[h, i] @ k[kh, j]) + b if ok else -math.inf)
            m = max(s)
            if m == -math.inf:
                continue
            w = [math.exp(x - m) for x in s]
            total = sum(w)
            out[h, i] = sum(wj * v[kh, j] for j, wj in enumerate(w)) / total
            lse[h, i] = m + math.log(total)
    return out, lse


def test_hand_values():
    np.testing.assert_allclose(reference.softmax([4, 5]), [0.26894142, 0.73105858])
    np.testing.assert_allclose(reference.softmax([3, 2]), [0.73105858, 0.26894142])
    x = np.array([[1.0, 0, 1, 0], [0, 1, 0, 1], [1, 1, 1, 1]])
    w = reference.attention_weights(x, x)
    np.testing.assert_allclose(w[0], np.array([math.e, 1, math.e]) / (2 * math.e + 1))
    np.testing.assert_allclose(reference.attention(x, x, x)[2], [0.788] * 4, atol=1e-3)
    assert reference.scores(x, x, causal=True)[0, 1] == -np.inf


@pytest.mark.parametrize("causal", [None, "top_left", "bottom_right"])
@pytest.mark.parametrize("Lq,Lk", [(4, 6), (6, 4), (5, 5)])
def test_against_a_loop(causal, Lq, Lk):
    rng = np.random.default_rng(7)
    q, k = rng.standard_normal((4, Lq, 3)), rng.standard_normal((2, Lk, 3))
    v = rng.standard_normal((2, Lk, 2))
    mask = rng.random((4, Lq, Lk)) < 0.7
    bias = rng.standard_normal((4, Lq, Lk))
    out, lse = reference.attention(q, k, v, mask=mask, bias=bias, causal=causal or False,
                                   enable_gqa=True, return_lse=True)
    want_out, want_lse = loop_attention(q, k, v, mask, bias, causal, groups=2)
    np.testing.assert_allclose(out, want_out, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-12)
