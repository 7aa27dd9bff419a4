"""The three kernels exposed (scores, softmax, weighted_sum) and attention_weights."""

import numpy as np
import pytest

import fastattn
from fastattn import reference

from helpers import assert_close, randn

DTYPES = [np.float32, np.float64]
THE_CAT_SAT = np.array([[1.0, 0, 1, 0], [0, 1, 0, 1], [1, 1, 1, 1]])


# ------------------------------------------------------------- worked examples

@pytest.mark.parametrize("x,expect", [([4, 5], [0.2689, 0.7311]),
                                      ([1, 10], [1.2e-4, 0.99988]),
                                      ([3, 2], [0.73, 0.27])])
def test_softmax_worked_examples(x, expect):
    got = fastattn.softmax(x)
    digits = len(str(expect[1]).split(".")[1])
    np.testing.assert_allclose(got, expect, atol=0.6 * 10.0 ** -digits)
    assert got.dtype == np.float64            # integers are taken as float64


def test_the_cat_sat():
    """Identity projections, scale 1/sqrt(4) = 1/2: the hand-computed numbers."""
    x = THE_CAT_SAT
    s = fastattn.scores(x, x)                 # default scale 1/sqrt(4)
    np.testing.assert_array_equal(s, [[1, 0, 1], [0, 1, 1], [1, 1, 2]])
    w = fastattn.attention_weights(x, x)
    e, one = np.e, 1.0
    the = np.array([e, one, e]) / (2 * e + 1)
    np.testing.assert_allclose(w[0], the, rtol=1e-12)
    np.testing.assert_allclose(w[0], [0.422, 0.155, 0.422], atol=5e-4)
    out = fastattn.attention(x, x, x)
    np.testing.assert_allclose(out[0], [0.845, 0.577, 0.845, 0.577], atol=1e-3)
    np.testing.assert_allclose(out[1], [0.577, 0.845, 0.577, 0.845], atol=1e-3)
    np.testing.assert_allclose(out[2], [0.788] * 4, atol=1e-3)
    np.testing.assert_allclose(out[0], the @ x, rtol=1e-12)


# --------------------------------------------------------------------- softmax

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,axis", [((7,), 0), ((3, 5), -1), ((3, 5), 0),
                                        ((2, 3, 4), 1), ((2, 3, 4), -3), ((4, 1000), 1)])
def test_softmax_any_axis(rng, dtype, shape, axis):
    x = randn(rng, shape, dtype) * 5
    got = fastattn.softmax(x, axis=axis)
    assert got.dtype == dtype and got.shape == x.shape
    assert_close(got, reference.softmax(x.astype(np.float64), axis=axis), dtype)
    np.testing.assert_allclose(got.sum(axis=axis), 1, rtol=10 * np.finfo(dtype).eps * 4)


def test_softmax_edge_cases():
    x = np.array([[-np.inf, -np.inf, -np.inf], [1e4, -1e4, 1e4], [0, np.nan, 1],
                  [-np.inf, 0, -np.inf]])
    got = fastattn.softmax(x)
    np.testing.assert_array_equal(got[0], 0)                # all -inf: zeros
    np.testing.assert_allclose(got[1], [0.5, 0, 0.5])       # huge logits: exact
    assert np.all(np.isnan(got[2]))                         # NaN: NaN
    np.testing.assert_array_equal(got[3], [0, 1, 0])
    assert fastattn.softmax(np.zeros((3, 0))).shape == (3, 0)
    assert fastattn.softmax(np.zeros((0, 4)), axis=0).shape == (0, 4)
    assert fastattn.softmax(np.float16([1, 2])).dtype == np.float16


@pytest.mark.parametrize("axis", [-1, 0])
def test_softmax_out(rng, axis):
    x = randn(rng, (4, 6), np.float32)
    out = np.empty_like(x)
    assert fastattn.softmax(x, axis=axis, out=out) is out
    np.testing.assert_array_equal(out, fastattn.softmax(x, axis=axis))
    with pytest.raises(ValueError, match="out"):
        fastattn.softmax(x, out=np.empty((4, 6), np.float64))


def test_softmax_bad_axis():
    with pytest.raises(ValueError, match="axis 2"):
        fastattn.softmax(np.zeros((2, 3)), axis=2)
    with pytest.raises(np.exceptions.AxisError):
        fastattn.softmax(np.zeros((2, 3)), axis=-3)
    with pytest.raises(TypeError, match="axis"):
        fastattn.softmax(np.zeros((2, 3)), axis=1.0)
    with pytest.raises(TypeError, match="x"):
        fastattn.softmax(np.array([True, False]))


# ---------------------------------------------------------------------- scores

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kw", [{}, {"causal": True}, {"causal": "bottom_right"},
                                {"scale": 0.3}, {"enable_gqa": True}])
def test_scores(rng, dtype, kw):
    q = randn(rng, (2, 4, 70, 12), dtype)
    k = randn(rng, (2, 2 if kw.get("enable_gqa") else 4, 90, 12), dtype)
    mask = rng.random((70, 90)) < 0.8
    bias = randn(rng, (4, 1, 90))
    got = fastattn.scores(q, k, mask=mask, bias=bias, **kw)
    expect = reference.scores(q.astype(np.float64), k.astype(np.float64), mask=mask,
                              bias=bias, **kw)
    assert got.dtype == dtype and got.shape == (2, 4, 70, 90)
    assert_close(got, expect, dtype, scale=float(np.abs(expect[np.isfinite(expect)]).max()))


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_weights(rng, dtype):
    q = randn(rng, (3, 50, 16), dtype)
    k = randn(rng, (3, 66, 16), dtype)
    mask = rng.random((50, 66)) < 0.5
    mask[7] = False
    got = fastattn.attention_weights(q, k, mask=mask, causal="bottom_right")
    expect = reference.attention_weights(q.astype(np.float64), k.astype(np.float64),
                                         mask=mask, causal="bottom_right")
    assert_close(got, expect, dtype)
    assert np.all(got[:, 7] == 0)
    rows = got.sum(-1)
    np.testing.assert_allclose(rows[rows > 0], 1, rtol=1e-5)
    # attention = weighted_sum(attention_weights, v)
    v = randn(rng, (3, 66, 5), dtype)
    assert_close(fastattn.weighted_sum(got, v),
                 fastattn.attention(q, k, v, mask=mask, causal="bottom_right"), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fn", [fastattn.scores, reference.scores])
def test_scores_take_sinks_and_are_the_keys_scores(rng, dtype, fn):
    """sinks= is checked as in attention, and leaves the scores as they are: the
    sink is an extra logit of no key (it joins the softmax, not the scores)."""
    q = randn(rng, (2, 4, 9, 8), dtype)
    k = randn(rng, (2, 2, 11, 8), dtype)
    kw = dict(causal="bottom_right", enable_gqa=True, window=(4, 0), softcap=3.0,
              alibi_slopes=np.array([0.5, 0.25, 0.125, 0.0625]), q_lengths=[9, 5],
              kv_lengths=[11, 7])
    without = fn(q, k, **kw)
    for sinks in (randn(rng, (4,), np.float64) * 3, randn(rng, (2, 4), np.float64)):
        np.testing.assert_array_equal(fn(q, k, sinks=sinks, **kw), without)
    want = reference.scores(q.astype(np.float64), k.astype(np.float64), **kw)
    finite = np.isfinite(want)
    np.testing.assert_array_equal(np.isfinite(without), finite)
    assert_close(without, want, dtype, scale=float(np.abs(want[finite]).max()))
    for bad, error in [(np.zeros(3), ValueError), (np.zeros((3, 2, 4)), ValueError),
                       (np.zeros((2, 4, 1)), ValueError), (np.array([True] * 4), TypeError)]:
        with pytest.raises(error, match="sinks"):
            fn(q, k, sinks=bad, **kw)
    with pytest.raises(ValueError, match=r"sinks of shape \(3,\) does not broadcast "
                                         r"to the output's batch shape \(2, 4\)"):
        fn(q, k, sinks=np.zeros(3), **kw)
    with pytest.raises(ValueError, match="sinks needs q with a head axis"):
        fn(q[0, 0], k[0, 0], sinks=np.zeros(1))


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_weights_with_sinks_against_the_reference(rng, dtype):
    """Each row leaves the sink's share out: it sums to 1 - exp(sink - lse), less
    than 1; padding rows and rows with no allowed key stay zeros."""
    q = randn(rng, (2, 3, 7, 8), dtype)
    k = randn(rng, (2, 3, 10, 8), dtype)
    v = randn(rng, (2, 3, 10, 4), dtype)
    sinks = np.array([1.5, -0.5, 0.0])
    mask = np.ones((7, 10), bool)
    mask[2] = False
    kw = dict(mask=mask, causal="bottom_right", sinks=sinks, q_lengths=[7, 5])
    got = fastattn.attention_weights(q, k, **kw)
    wide = [x.astype(np.float64) for x in (q, k, v)]
    want = reference.attention_weights(*wide[:2], **kw)
    assert got.dtype == dtype and got.shape == (2, 3, 7, 10)
    assert_close(got, want, dtype)
    _, lse = reference.attention(*wide, return_lse=True, **kw)
    rows = got.sum(-1)
    valid = np.isfinite(lse) & (np.arange(7) != 2)
    np.testing.assert_allclose(rows[valid], (1 - np.exp(sinks[:, None] - lse))[valid],
                               rtol=1e-5)
    assert (rows[valid] < 1).all()
    assert (got[:, :, 2] == 0).all() and (got[1, :, 5:] == 0).all()
    # the weights without sinks, scaled by the sink's share, are the weights with
    plain = reference.attention_weights(*wide[:2], mask=mask, causal="bottom_right",
                                        q_lengths=[7, 5])
    np.testing.assert_allclose(want[valid], (plain * (rows / np.where(
        plain.sum(-1) > 0, plain.sum(-1), 1))[..., None])[valid], rtol=1e-5, atol=1e-7)


# ---------------------------------------------------------------- weighted_sum

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("pb,vb", [((), ()), ((3,), (3,)), ((2, 3), (3,)), ((2, 1), (1, 4))])
def test_weighted_sum(rng, dtype, pb, vb):
    p = randn(rng, pb + (70, 33), dtype)
    v = randn(rng, vb + (33, 9), dtype)
    got = fastattn.weighted_sum(p, v)
    expect = np.matmul(p.astype(np.float64), v.astype(np.float64))
    assert got.dtype == dtype and got.shape == expect.shape
    assert_close(got, expect, dtype, scale=float(np.abs(p).sum(-1).max() * np.abs(v).max()))


def test_weighted_sum_out_and_errors(rng):
    p, v = randn(rng, (4, 5)), randn(rng, (5, 2))
    out = np.empty((4, 2))
    assert fastattn.weighted_sum(p, v, out=out) is out
    np.testing.assert_allclose(out, p @ v, rtol=1e-12)
    with pytest.raises(ValueError, match=r"p's last axis.*\(4, 5\).*\(6, 2\)"):
        fastattn.weighted_sum(p, randn(rng, (6, 2)))
    with pytest.raises(ValueError, match="at least 2"):
        fastattn.weighted_sum(p, np.ones(5))
    with pytest.raises(ValueError, match="do not broadcast"):
        fastattn.weighted_sum(randn(rng, (2, 4, 5)), randn(rng, (3, 5, 2)))
    with pytest.raises(TypeError, match="v"):
        fastattn.weighted_sum(p, np.ones((5, 2), complex))


def test_kernels_bit_identical_for_any_thread_count(rng):
    q, k = randn(rng, (3, 200, 16), np.float32), randn(rng, (3, 150, 16), np.float32)
    x = randn(rng, (500, 77), np.float32)
    results = []
    for n in (1, 2, 3):
        fastattn.set_num_threads(n)
        try:
            w = fastattn.attention_weights(q, k, causal=True)
            results.append((fastattn.scores(q, k), w, fastattn.softmax(x),
                            fastattn.weighted_sum(w, k)))
        finally:
            fastattn.set_num_threads(None)
    for other in results[1:]:
        for a, b in zip(results[0], other):
            np.testing.assert_array_equal(a, b)
