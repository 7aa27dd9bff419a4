"""Bad input raises ValueError/TypeError naming the argument and the shapes."""

import numpy as np
import pytest

import fastattn

Q, K, V = np.ones((2, 3, 5, 8)), np.ones((2, 3, 7, 8)), np.ones((2, 3, 7, 4))


@pytest.mark.parametrize("kw,exc,pattern", [
    (dict(k=np.ones((2, 3, 7, 9))), ValueError, r"same last axis E.*\(2, 3, 5, 8\).*\(2, 3, 7, 9\)"),
    (dict(v=np.ones((2, 3, 6, 4))), ValueError, r"number of keys.*\(2, 3, 7, 8\).*\(2, 3, 6, 4\)"),
    (dict(v=np.ones((1, 3, 7, 4))), ValueError, r"same batch shape"),
    (dict(k=np.ones((4, 3, 7, 8)), v=np.ones((4, 3, 7, 4))), ValueError,
     r"batch axes of q \(2, 3, 5, 8\) and k \(4, 3, 7, 8\) do not broadcast"),
    (dict(q=np.ones(8)), ValueError, r"q must have at least 2 dimensions"),
    (dict(mask=np.ones((5, 6), bool)), ValueError, r"mask of shape \(5, 6\).*\(2, 3, 5, 7\)"),
    (dict(mask=np.ones((1, 2, 3, 5, 7), bool)), ValueError, r"mask of shape \(1, 2, 3, 5, 7\)"),
    (dict(mask=np.ones((5, 7))), TypeError, r"mask must be boolean.*float64.*bias="),
    (dict(bias=np.ones((3, 1, 5, 7))), ValueError, r"bias of shape \(3, 1, 5, 7\)"),
    (dict(bias=np.ones((5, 7), bool)), TypeError, r"bias must hold real numbers.*bool"),
    (dict(q=np.ones((2, 3, 5, 8), bool)), TypeError, r"q must hold real numbers.*bool"),
    (dict(k=np.ones((2, 3, 7, 8), complex)), TypeError, r"k must hold real numbers.*complex"),
    (dict(v=np.array([["a"] * 4] * 7)), TypeError, r"v must hold real numbers"),
    (dict(v=np.ones((2, 3, 7, 4), object)), TypeError, r"v must hold real numbers.*object"),
    (dict(q=np.ones((2, 3, 5, 8), np.longdouble)), TypeError, r"q has dtype"),
    (dict(causal="diagonal"), ValueError, r"causal must be.*'diagonal'"),
    (dict(causal=None), ValueError, r"causal must be.*None"),
    (dict(causal=2), ValueError, r"causal must be"),
    (dict(num_threads=0), ValueError, r"num_threads must be >= 1, got 0"),
    (dict(num_threads=-2), ValueError, r"num_threads must be >= 1"),
    (dict(num_threads=1.5), TypeError, r"num_threads must be an integer"),
    (dict(num_threads=True), TypeError, r"num_threads must be an integer"),
    (dict(scale="x"), TypeError, r"scale must be a real number"),
    (dict(out=np.empty((2, 3, 5, 5))), ValueError, r"out must have shape \(2, 3, 5, 4\) and dtype float64, got shape \(2, 3, 5, 5\)"),
    (dict(out=np.empty((2, 3, 5, 4), np.float32)), ValueError, r"dtype float64.*float32"),
    (dict(out=np.empty((2, 3, 4, 5)).swapaxes(-1, -2)), ValueError, r"C-contiguous"),
    (dict(out=[[0.0]]), ValueError, r"numpy.ndarray"),
    (dict(enable_gqa=True, q=np.ones((2, 5, 5, 8))), ValueError,
     r"query heads of q \(2, 5, 5, 8\) \(axis -3: 5\) must be a multiple.*\(2, 3, 7, 8\) \(axis -3: 3\)"),
    (dict(enable_gqa=True, q=np.ones((5, 8)), k=np.ones((7, 8)), v=np.ones((7, 4))),
     ValueError, r"enable_gqa needs.*head axis"),
])
def test_attention_errors(kw, exc, pattern):
    args = dict(q=Q, k=K, v=V)
    args.update(kw)
    with pytest.raises(exc, match=pattern):
        fastattn.attention(args.pop("q"), args.pop("k"), args.pop("v"), **args)


def test_heads_without_gqa_must_broadcast():
    with pytest.raises(ValueError, match="do not broadcast"):
        fastattn.attention(np.ones((8, 5, 4)), np.ones((2, 5, 4)), np.ones((2, 5, 4)))


def test_numpy_integers_and_bools_for_options():
    out = fastattn.attention(Q, K, V, num_threads=np.int64(2), causal=np.bool_(True))
    np.testing.assert_array_equal(out, fastattn.attention(Q, K, V, causal=True))


@pytest.mark.parametrize("fn", [fastattn.scores, fastattn.attention_weights])
def test_scores_errors(fn):
    with pytest.raises(ValueError, match="same last axis E"):
        fn(np.ones((3, 4)), np.ones((3, 5)))
    with pytest.raises(TypeError, match="mask must be boolean"):
        fn(np.ones((3, 4)), np.ones((3, 4)), mask=np.ones((3, 3), int))
    with pytest.raises(ValueError, match="causal"):
        fn(np.ones((3, 4)), np.ones((3, 4)), causal="yes")
