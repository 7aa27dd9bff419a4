"""fastattn.attention against the NumPy reference recomputed in float64."""

import threading

import numpy as np
import pytest

import fastattn
from fastattn import reference

from helpers import assert_close, assert_gil_released, randn

DTYPES = [np.float32, np.float64]


def oracle(q, k, v, **kw):
    """The reference in float64 on float64 copies of the inputs."""
    f64 = lambda a: None if a is None else np.asarray(a, dtype=np.float64)  # noqa: E731
    for name in ("bias",):
        if kw.get(name) is not None:
            kw[name] = f64(kw[name])
    return reference.attention(f64(q), f64(k), f64(v), **kw)


def check(q, k, v, dtype, **kw):
    out, lse = fastattn.attention(q, k, v, return_lse=True, **kw)
    ref_out, ref_lse = oracle(q, k, v, return_lse=True, **kw)
    assert out.dtype == dtype and out.shape == ref_out.shape
    assert lse.shape == ref_lse.shape
    scale = max(1.0, float(np.max(np.abs(v), initial=0.0)))
    assert_close(out, ref_out, dtype, scale)
    assert_close(lse, ref_lse, dtype)
    return out, lse


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("Lq,Lk", [(1, 1), (1, 7), (7, 1), (13, 13), (64, 64), (65, 130),
                                   (131, 67), (3, 200)])
@pytest.mark.parametrize("E", [1, 16, 33])
def test_shapes(rng, dtype, Lq, Lk, E):
    q = randn(rng, (2, 3, Lq, E), dtype)
    k = randn(rng, (2, 3, Lk, E), dtype)
    v = randn(rng, (2, 3, Lk, 5), dtype)
    check(q, k, v, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("E,Ev", [(64, 64), (128, 32), (256, 256), (3, 70)])
def test_head_sizes(rng, dtype, E, Ev):
    q = randn(rng, (2, 70, E), dtype)
    k = randn(rng, (2, 90, E), dtype)
    v = randn(rng, (2, 90, Ev), dtype)
    check(q, k, v, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_plain_matrices(rng, dtype):
    q, k, v = randn(rng, (9, 8), dtype), randn(rng, (11, 8), dtype), randn(rng, (11, 3), dtype)
    out, _ = check(q, k, v, dtype)
    assert out.shape == (9, 3)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [True, "top_left", "bottom_right"])
@pytest.mark.parametrize("Lq,Lk", [(70, 70), (30, 100), (100, 30), (1, 64), (130, 129)])
def test_causal(rng, dtype, causal, Lq, Lk):
    q = randn(rng, (2, Lq, 16), dtype)
    k = randn(rng, (2, Lk, 16), dtype)
    v = randn(rng, (2, Lk, 8), dtype)
    out, lse = check(q, k, v, dtype, causal=causal)
    if causal == "bottom_right" and Lq > Lk:
        # the first Lq - Lk queries see no key at all
        assert np.all(out[:, : Lq - Lk] == 0)
        assert np.all(lse[:, : Lq - Lk] == -np.inf)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mask_shape", [(67, 90), (1, 90), (67, 1), (4, 1, 1, 90),
                                        (3, 67, 90), (4, 3, 67, 90), (1, 1, 1, 1)])
def test_mask_broadcasting(rng, dtype, mask_shape):
    q = randn(rng, (4, 3, 67, 16), dtype)
    k = randn(rng, (4, 3, 90, 16), dtype)
    v = randn(rng, (4, 3, 90, 8), dtype)
    mask = rng.random(mask_shape) < 0.6
    check(q, k, v, dtype, mask=mask)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias_dtype", [np.float32, np.float64, np.int64])
def test_bias_and_mask_and_causal(rng, dtype, bias_dtype):
    q = randn(rng, (2, 3, 70, 16), dtype)
    k = randn(rng, (2, 3, 80, 16), dtype)
    v = randn(rng, (2, 3, 80, 8), dtype)
    bias = (rng.standard_normal((3, 70, 80)) * 3).astype(bias_dtype)
    mask = rng.random((2, 1, 70, 80)) < 0.7
    out, _ = check(q, k, v, dtype, bias=bias, mask=mask, causal="bottom_right")
    assert out.dtype == dtype      # the bias does not take part in promotion


def test_bias_minus_inf_blocks_like_a_mask(rng):
    q, k, v = randn(rng, (5, 8)), randn(rng, (6, 8)), randn(rng, (6, 4))
    mask = rng.random((5, 6)) < 0.5
    mask[:, 0] = True
    bias = np.where(mask, 0.0, -np.inf)
    np.testing.assert_array_equal(fastattn.attention(q, k, v, bias=bias),
                                  fastattn.attention(q, k, v, mask=mask))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv", [(8, 2), (6, 3), (4, 1), (4, 4)])
def test_gqa(rng, dtype, hq, hkv):
    q = randn(rng, (2, hq, 33, 16), dtype)
    k = randn(rng, (2, hkv, 40, 16), dtype)
    v = randn(rng, (2, hkv, 40, 8), dtype)
    check(q, k, v, dtype, enable_gqa=True, causal="bottom_right")
    # the definition: query head h uses key/value head h // (hq // hkv)
    g = hq // hkv
    expect = fastattn.attention(q, np.repeat(k, g, axis=1), np.repeat(v, g, axis=1),
                                causal="bottom_right")
    np.testing.assert_array_equal(
        fastattn.attention(q, k, v, enable_gqa=True, causal="bottom_right"), expect)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gqa_with_broadcast_outer_batch(rng, dtype):
    q = randn(rng, (3, 4, 9, 8), dtype)
    k = randn(rng, (1, 2, 12, 8), dtype)
    v = randn(rng, (1, 2, 12, 5), dtype)
    out, _ = check(q, k, v, dtype, enable_gqa=True, mask=rng.random((4, 9, 12)) < 0.8)
    assert out.shape == (3, 4, 9, 5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qb,kb", [((2, 3), (3,)), ((1, 3), (2, 1)), ((5,), ()),
                                   ((), (4,)), ((2, 1), (1, 3))])
def test_batch_broadcasting(rng, dtype, qb, kb):
    q = randn(rng, qb + (10, 8), dtype)
    k = randn(rng, kb + (12, 8), dtype)
    v = randn(rng, kb + (12, 6), dtype)
    out, lse = check(q, k, v, dtype)
    batch = np.broadcast_shapes(qb, kb)
    assert out.shape == batch + (10, 6) and lse.shape == batch + (10,)


@pytest.mark.parametrize("dtype", DTYPES)
def test_non_contiguous_and_read_only(rng, dtype):
    base_q = randn(rng, (3, 40, 2 * 16), dtype)
    q = base_q[:, ::-2, ::2]                                 # negative and step strides
    k = np.swapaxes(randn(rng, (3, 16, 50), dtype), -1, -2)  # a transpose
    v = np.asfortranarray(randn(rng, (3, 50, 7), dtype))
    for a in (q, k, v):
        a.flags.writeable = False
    assert not q.flags.c_contiguous and not k.flags.c_contiguous
    check(q, k, v, dtype)


def test_float16_is_computed_in_float32_and_rounded_once(rng):
    q, k, v = (randn(rng, (2, 20, 8), np.float16) for _ in range(3))
    out, lse = fastattn.attention(q, k, v, return_lse=True)
    assert out.dtype == np.float16 and lse.dtype == np.float32
    expect = fastattn.attention(q.astype(np.float32), k.astype(np.float32),
                                v.astype(np.float32))
    np.testing.assert_array_equal(out, expect.astype(np.float16))
    assert_close(out, oracle(q, k, v), np.float16)


@pytest.mark.parametrize("types,expect", [
    ((np.float32, np.float32, np.float32), np.float32),
    ((np.float32, np.float64, np.float32), np.float64),
    ((np.float16, np.float32, np.float16), np.float32),
    ((np.int32, np.float32, np.float32), np.float64),
    ((np.int64, np.int64, np.int64), np.float64),
    ((np.float16, np.float16, np.float16), np.float16),
])
def test_dtype_promotion(rng, types, expect):
    arrays = [(rng.standard_normal((4, 6)) * 3).astype(t) for t in types]
    out, lse = fastattn.attention(*arrays, return_lse=True)
    assert out.dtype == expect
    assert lse.dtype == (np.float64 if expect == np.float64 else np.float32)


def test_lists_are_accepted():
    out = fastattn.attention([[1, 0], [0, 1]], [[1, 0], [0, 1]], [[1, 2], [3, 4]])
    assert out.dtype == np.float64
    assert_close(out, oracle([[1, 0], [0, 1]], [[1, 0], [0, 1]], [[1, 2], [3, 4]]),
                 np.float64)


@pytest.mark.parametrize("dtype", DTYPES)
def test_out_argument(rng, dtype):
    q, k, v = (randn(rng, (2, 30, 8), dtype) for _ in range(3))
    out = np.empty((2, 30, 8), dtype)
    res = fastattn.attention(q, k, v, out=out)
    assert res is out
    np.testing.assert_array_equal(out, fastattn.attention(q, k, v))


def test_out_float16(rng):
    q, k, v = (randn(rng, (2, 30, 8), np.float16) for _ in range(3))
    out = np.empty((2, 30, 8), np.float16)
    assert fastattn.attention(q, k, v, out=out) is out
    np.testing.assert_array_equal(out, fastattn.attention(q, k, v))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kw", [{}, {"causal": True}, {"causal": "bottom_right"},
                                {"enable_gqa": True}])
def test_bit_identical_for_any_thread_count(rng, dtype, kw):
    q = randn(rng, (2, 4, 300, 24), dtype)
    k = randn(rng, (2, 2 if kw.get("enable_gqa") else 4, 260, 24), dtype)
    v = randn(rng, k.shape[:-1] + (16,), dtype)
    mask = rng.random((300, 260)) < 0.9
    results = [fastattn.attention(q, k, v, mask=mask, return_lse=True, num_threads=n, **kw)
               for n in (1, 2, 3)]
    for out, lse in results[1:]:
        np.testing.assert_array_equal(out, results[0][0])
        np.testing.assert_array_equal(lse, results[0][1])


@pytest.mark.parametrize("kw", [{}, {"causal": True}, {"window": (70, 5)},
                                {"kv_lengths": "ragged"}, {"enable_gqa": True}])
def test_many_work_items_match_the_reference_at_any_thread_count(rng, kw):
    """60 query tiles: 16 or more per thread at 1-3 threads, so that a thread takes
    consecutive tiles and asks for the next one's rows while it computes one (the
    rows of a slice's tiles, a new slice's first key block); every tile's rows must
    still be computed once, as the reference computes them."""
    kw = dict(kw)
    q = randn(rng, (3, 4, 300, 24), np.float32)
    k = randn(rng, (3, 2 if kw.get("enable_gqa") else 4, 270, 24), np.float32)
    v = randn(rng, k.shape[:-1] + (16,), np.float32)
    if kw.get("kv_lengths") == "ragged":
        kw["kv_lengths"] = np.array([270, 1, 131])
    results = [fastattn.attention(q, k, v, return_lse=True, num_threads=n, **kw)
               for n in (1, 2, 3)]
    ref_out, ref_lse = oracle(q, k, v, return_lse=True, **kw)
    assert_close(results[0][0], ref_out, np.float32, max(1.0, float(np.abs(v).max())))
    assert_close(results[0][1], ref_lse, np.float32)
    for out, lse in results[1:]:
        np.testing.assert_array_equal(out, results[0][0])
        np.testing.assert_array_equal(lse, results[0][1])


def test_many_work_items_of_a_packed_batch(rng):
    """attention_varlen over sequences of 1-290 rows: the packed batch's tiles past a
    sequence's rows hold no work, between tiles that do, in the runs a thread takes."""
    lengths = [290, 1, 64, 65, 200, 3, 129, 250]
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    q = randn(rng, (cu[-1], 6, 32), np.float32)
    k = randn(rng, (cu[-1], 3, 32), np.float32)
    v = randn(rng, (cu[-1], 3, 16), np.float32)
    results = [fastattn.attention_varlen(q, k, v, cu, cu, causal=True, return_lse=True,
                                         num_threads=n) for n in (1, 2, 3)]
    f64 = lambda a: a.astype(np.float64)  # noqa: E731
    ref_out, ref_lse = reference.attention_varlen(f64(q), f64(k), f64(v), cu, cu,
                                                  causal=True, return_lse=True)
    assert_close(results[0][0], ref_out, np.float32, max(1.0, float(np.abs(v).max())))
    assert_close(results[0][1], ref_lse, np.float32)
    for out, lse in results[1:]:
        np.testing.assert_array_equal(out, results[0][0])
        np.testing.assert_array_equal(lse, results[0][1])


# ------------------------------------------------------------------- edge cases

@pytest.mark.parametrize("dtype", DTYPES)
def test_fully_masked_rows_give_zeros_and_minus_inf_lse(rng, dtype):
    q, k, v = randn(rng, (6, 8), dtype), randn(rng, (9, 8), dtype), randn(rng, (9, 4), dtype)
    mask = rng.random((6, 9)) < 0.5
    mask[2] = False
    mask[4] = False
    out, lse = check(q, k, v, dtype, mask=mask)
    assert np.all(out[[2, 4]] == 0) and np.all(lse[[2, 4]] == -np.inf)
    assert np.all(np.isfinite(out))


@pytest.mark.parametrize("dtype", DTYPES)
def test_empty_axes(rng, dtype):
    q, k, v = randn(rng, (3, 0, 8), dtype), randn(rng, (3, 5, 8), dtype), randn(rng, (3, 5, 4), dtype)
    out, lse = fastattn.attention(q, k, v, return_lse=True)
    assert out.shape == (3, 0, 4) and lse.shape == (3, 0)
    # Lk == 0: nothing to attend to
    q = randn(rng, (3, 6, 8), dtype)
    out, lse = fastattn.attention(q, k[:, :0], v[:, :0], return_lse=True)
    assert out.shape == (3, 6, 4) and np.all(out == 0) and np.all(lse == -np.inf)
    # empty batch, Ev == 0
    assert fastattn.attention(q[:0], k[:0], v[:0]).shape == (0, 6, 4)
    out, lse = fastattn.attention(q, k, v[..., :0], return_lse=True)
    assert out.shape == (3, 6, 0)
    assert_close(lse, oracle(q, k, v, return_lse=True)[1], dtype)


def test_zero_head_size_needs_explicit_scale(rng):
    q, k, v = np.zeros((3, 0)), np.zeros((4, 0)), randn(rng, (4, 2))
    with pytest.raises(ValueError, match="E == 0"):
        fastattn.attention(q, k, v)
    # with a scale every score is 0: the mean of the values
    np.testing.assert_allclose(fastattn.attention(q, k, v, scale=1.0),
                               np.broadcast_to(v.mean(axis=0), (3, 2)), rtol=1e-12)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("size", [1e4, -1e4])
def test_huge_logits_are_finite_and_exact(rng, dtype, size):
    q = randn(rng, (5, 4), dtype)
    k = randn(rng, (7, 4), dtype)
    v = randn(rng, (7, 3), dtype)
    bias = np.zeros((5, 7))
    bias[:, 3] = size            # a logit of +-1e4 on key 3
    out, lse = check(q, k, v, dtype, bias=bias)
    assert np.all(np.isfinite(out)) and np.all(np.isfinite(lse))
    if size > 0:                 # all weight on key 3
        np.testing.assert_allclose(out, np.broadcast_to(v[3], out.shape), rtol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_reaches_only_the_affected_rows(rng, dtype):
    q, k, v = randn(rng, (6, 8), dtype), randn(rng, (9, 8), dtype), randn(rng, (9, 4), dtype)
    q[1, 3] = np.nan
    out, lse = fastattn.attention(q, k, v, return_lse=True)
    assert np.all(np.isnan(out[1])) and np.isnan(lse[1])
    rows = [0, 2, 3, 4, 5]
    assert np.all(np.isfinite(out[rows]))
    assert_close(out[rows], oracle(q[rows], k, v), dtype)
    # a NaN in a key every row attends to reaches every row
    k[4, 0] = np.nan
    assert np.all(np.isnan(fastattn.attention(q, k, v)))


def test_inf_input_gives_nan_rows_not_a_crash(rng):
    q, k, v = randn(rng, (4, 8)), randn(rng, (5, 8)), randn(rng, (5, 3))
    q[2, 0] = np.inf
    out = fastattn.attention(q, k, v)
    assert np.all(np.isnan(out[2])) and np.all(np.isfinite(out[[0, 1, 3]]))


def test_gil_is_released_during_a_call(rng):
    """Another Python thread keeps running while a long call is in the kernels."""
    q, k, v = (randn(rng, (1, 8, 2048, 64), np.float32) for _ in range(3))
    assert_gil_released(lambda: fastattn.attention(q, k, v, num_threads=1))
