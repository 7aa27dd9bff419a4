"""merge_partials against one-shot attention over the union of the keys."""

import numpy as np
import pytest

import fastattn
from fastattn import merge_partials, reference

RTOL = {np.float32: 2e-5, np.float64: 1e-12}
ATOL = {np.float32: 2e-6, np.float64: 1e-13}


@pytest.fixture
def attention():
    """The function whose partial results users merge: the fused ``attention``."""
    return fastattn.attention


def random_split(rng, n, pieces, shuffle):
    """``pieces`` disjoint index arrays covering range(n), uneven, some maybe empty."""
    idx = rng.permutation(n) if shuffle else np.arange(n)
    cuts = np.sort(rng.integers(0, n + 1, size=pieces - 1))
    return np.split(idx, cuts)


def split_attention(attention, q, k, v, parts, mask=None):
    outs, lses = [], []
    for p in parts:
        m = None if mask is None else mask[..., p]
        o, s = attention(q, k[..., p, :], v[..., p, :], mask=m, return_lse=True)
        outs.append(o)
        lses.append(s)
    return outs, lses


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("pieces", [2, 3, 4, 5, 6, 7])
@pytest.mark.parametrize("shuffle", [False, True])
def test_matches_one_shot(attention, dtype, pieces, shuffle):
    rng = np.random.default_rng(100 * pieces + shuffle)
    B, H, Lq, Lk, E, Ev = 2, 3, 9, 23, 8, 5
    q = rng.standard_normal((B, H, Lq, E)).astype(dtype)
    k = rng.standard_normal((B, H, Lk, E)).astype(dtype)
    v = rng.standard_normal((B, H, Lk, Ev)).astype(dtype)
    parts = random_split(rng, Lk, pieces, shuffle)
    out, lse = merge_partials(*split_attention(attention, q, k, v, parts))
    want, want_lse = reference.attention(q, k, v, return_lse=True)
    assert out.dtype == dtype and lse.dtype == dtype
    np.testing.assert_allclose(out, want, rtol=RTOL[dtype], atol=ATOL[dtype])
    np.testing.assert_allclose(lse, want_lse, rtol=RTOL[dtype], atol=ATOL[dtype])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("pieces", [2, 4, 7])
def test_masks_and_fully_masked_pieces(attention, dtype, pieces):
    rng = np.random.default_rng(pieces)
    H, Lq, Lk, E = 2, 11, 30, 6
    q = rng.standard_normal((H, Lq, E)).astype(dtype)
    k = rng.standard_normal((H, Lk, E)).astype(dtype)
    v = rng.standard_normal((H, Lk, E)).astype(dtype)
    parts = random_split(rng, Lk, pieces, shuffle=True)
    mask = rng.random((H, Lq, Lk)) < 0.5
    mask[:, 3, :] = False                       # a row with no key anywhere
    mask[..., parts[0]] = False                 # a piece with no allowed key at all
    mask[0, 5, parts[-1]] = False               # a row blocked in one piece only
    out, lse = merge_partials(*split_attention(attention, q, k, v, parts, mask))
    want, want_lse = reference.attention(q, k, v, mask=mask, return_lse=True)
    np.testing.assert_allclose(out, want, rtol=RTOL[dtype], atol=ATOL[dtype])
    np.testing.assert_allclose(lse, want_lse, rtol=RTOL[dtype], atol=ATOL[dtype])
    assert np.all(out[:, 3] == 0) and np.all(lse[:, 3] == -np.inf)


def test_causal_split_with_global_mask(attention):
    rng = np.random.default_rng(7)
    Lq, Lk, E = 10, 16, 4
    q, k, v = (rng.standard_normal((L, E)) for L in (Lq, Lk, Lk))
    allowed = np.arange(Lk)[None, :] <= np.arange(Lq)[:, None] + (Lk - Lq)
    parts = [np.arange(0, 5), np.arange(5, 13), np.arange(13, 16)]
    out, lse = merge_partials(*split_attention(attention, q, k, v, parts, allowed))
    want, want_lse = reference.attention(q, k, v, causal="bottom_right", return_lse=True)
    np.testing.assert_allclose(out, want, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-12, atol=1e-13)


def test_all_pieces_blocked_gives_zeros():
    outs = [np.full((2, 3, 4), np.nan), np.ones((2, 3, 4))]
    lses = [np.full((2, 3), -np.inf), np.full((2, 3), -np.inf)]
    out, lse = merge_partials(outs, lses)
    assert np.all(out == 0) and np.all(lse == -np.inf)


def test_blocked_piece_contributes_nothing():
    rng = np.random.default_rng(1)
    o = rng.standard_normal((3, 4))
    s = rng.standard_normal(3)
    out, lse = merge_partials([np.full((3, 4), np.nan), o, np.full((3, 4), 1e300)],
                              [np.full(3, -np.inf), s, np.full(3, -np.inf)])
    np.testing.assert_array_equal(out, o)
    np.testing.assert_array_equal(lse, s)


def test_single_piece_is_returned():
    rng = np.random.default_rng(2)
    o = rng.standard_normal((2, 5, 3)).astype(np.float32)
    s = rng.standard_normal((2, 5)).astype(np.float32)
    out, lse = merge_partials([o], [s])
    np.testing.assert_array_equal(out, o)
    np.testing.assert_array_equal(lse, s)


def test_nan_propagates_to_its_rows():
    o = np.ones((3, 2))
    s = np.zeros(3)
    s_nan = s.copy()
    s_nan[1] = np.nan
    out, lse = merge_partials([o, o], [s, s_nan])
    assert np.isnan(out[1]).all() and np.isnan(lse[1])
    assert np.isfinite(out[[0, 2]]).all() and np.isfinite(lse[[0, 2]]).all()


def test_huge_lse_differences_do_not_overflow():
    o1, o2 = np.full((1, 2), 1.0), np.full((1, 2), 2.0)
    out, lse = merge_partials([o1, o2], [np.array([1000.0]), np.array([-1000.0])])
    np.testing.assert_array_equal(out, o1)
    np.testing.assert_allclose(lse, [1000.0])


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_piece_whose_weight_underflows_adds_nothing(bad, dtype):
    # rows 0, 1: the second piece's weight exp(-800), exp(-746) underflows to 0 in
    # float64 and its NaN/inf is dropped (not 0 * nan); rows 2, 3: exp(-700), exp(-1)
    # does not, and the NaN/inf reaches the row
    rng = np.random.default_rng(4)
    o1 = rng.standard_normal((4, 3)).astype(dtype)
    o2 = np.full((4, 3), bad, dtype)
    s1 = np.full(4, 10.0, dtype)
    s2 = (10.0 - np.array([800.0, 746.0, 700.0, 1.0])).astype(dtype)
    out, lse = merge_partials([o1, o2], [s1, s2])
    np.testing.assert_array_equal(out[:2], o1[:2])
    np.testing.assert_array_equal(lse[:2], s1[:2])
    assert not np.isfinite(out[2:]).any()
    np.testing.assert_allclose(lse[2:], [10.0, 10.0 + np.log1p(np.exp(-1.0))],
                               rtol=1e-6)
    # the order of the pieces does not matter
    out_r, lse_r = merge_partials([o2, o1], [s2, s1])
    np.testing.assert_array_equal(out_r[:2], o1[:2])
    assert not np.isfinite(out_r[2:]).any()


def test_nan_that_reaches_the_one_shot_row_reaches_the_merged_row(attention):
    # float32: key 100's weight against the row's maximum is exp(-85) > the smallest
    # normal float32 (exp(-87.3)), so its NaN value reaches the one-shot row. Its
    # piece's merge weight is exp(-85 - log(100)) < that: it must still count (a
    # threshold at the computation dtype's smallest normal would drop the NaN).
    q = np.zeros((1, 2, 4), np.float32)
    k = np.random.default_rng(5).standard_normal((1, 101, 4)).astype(np.float32)
    v = np.ones((1, 101, 3), np.float32)
    v[0, 100, 1] = np.nan
    bias = np.zeros((2, 101), np.float32)
    bias[:, 100] = [-85.0, -95.0]          # row 1: exp(-95) underflows, no NaN
    want, want_lse = attention(q, k, v, bias=bias, return_lse=True)
    assert np.isnan(want[0, 0, 1]) and np.isfinite(want[0, 1]).all()
    parts = [np.arange(100), np.arange(100, 101)]
    outs, lses = [], []
    for p in parts:
        o, s = attention(q, k[:, p], v[:, p], bias=bias[:, p], return_lse=True)
        outs.append(o)
        lses.append(s)
    assert np.isnan(outs[1][..., 1]).all()   # in its own piece both rows meet the NaN
    out, lse = merge_partials(outs, lses)
    assert np.isnan(out[0, 0, 1])
    # (row 1 is NaN too: its piece's weight exp(-95 - log(100)) does not underflow
    # in float64; fastattn.dask recomputes such rows)
    np.testing.assert_allclose(lse, want_lse, rtol=2e-6)


def test_fixed_order_and_tree_merge(attention):
    rng = np.random.default_rng(3)
    q = rng.standard_normal((4, 7, 8)).astype(np.float32)
    k = rng.standard_normal((4, 40, 8)).astype(np.float32)
    v = rng.standard_normal((4, 40, 8)).astype(np.float32)
    parts = random_split(rng, 40, 6, shuffle=False)
    outs, lses = split_attention(attention, q, k, v, parts)
    a = merge_partials(outs, lses)
    b = merge_partials(list(outs), tuple(lses))
    np.testing.assert_array_equal(a[0], b[0])           # bitwise reproducible
    np.testing.assert_array_equal(a[1], b[1])
    left = merge_partials(outs[:3], lses[:3])
    right = merge_partials(outs[3:], lses[3:])
    tree = merge_partials([left[0], right[0]], [left[1], right[1]])
    np.testing.assert_allclose(tree[0], a[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(tree[1], a[1], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtypes, out_dtype, lse_dtype", [
    ((np.float16, np.float16), np.float16, np.float32),
    ((np.float32, np.float64), np.float64, np.float64),
    ((np.int64, np.float32), np.float64, np.float64),
    ((np.float32, np.float32), np.float32, np.float32),
])
def test_dtypes(dtypes, out_dtype, lse_dtype):
    outs = [np.ones((2, 3), dt) for dt in dtypes]
    lses = [np.zeros(2, np.float64), np.zeros(2, np.float16)]
    out, lse = merge_partials(outs, lses)
    assert out.dtype == out_dtype and lse.dtype == lse_dtype
    np.testing.assert_allclose(out, 1.0)
    np.testing.assert_allclose(lse, np.log(2.0), rtol=1e-3)


def test_non_contiguous_and_list_inputs():
    rng = np.random.default_rng(4)
    o = rng.standard_normal((3, 8, 6))[:, ::2, ::-1]
    s = rng.standard_normal((8, 3)).T[:, ::2]
    out, lse = merge_partials([o, o.tolist()], [s, s])
    np.testing.assert_allclose(out, o, rtol=1e-12)
    np.testing.assert_allclose(lse, s + np.log(2.0), rtol=1e-12)


def test_empty_query_axis():
    out, lse = merge_partials([np.zeros((2, 0, 4))] * 3, [np.zeros((2, 0))] * 3)
    assert out.shape == (2, 0, 4) and lse.shape == (2, 0)


@pytest.mark.parametrize("outs, lses, match", [
    ([], [], "at least one"),
    ([np.zeros((2, 3))], [np.zeros(2), np.zeros(2)], "same length"),
    ([np.zeros((2, 3)), np.zeros((2, 4))], [np.zeros(2)] * 2,
     r"outs\[1\] has shape \(2, 4\).*outs\[0\] \(2, 3\)"),
    ([np.zeros((2, 3))] * 2, [np.zeros(2), np.zeros(3)],
     r"lses\[1\] has shape \(3,\).*\(2,\)"),
    ([np.zeros(())], [np.zeros(())], "at least 1 dimension"),
])
def test_shape_errors(outs, lses, match):
    with pytest.raises(ValueError, match=match):
        merge_partials(outs, lses)


def test_type_errors():
    with pytest.raises(TypeError, match=r"outs\[1\]"):
        merge_partials([np.zeros((2, 3)), np.zeros((2, 3), bool)], [np.zeros(2)] * 2)
    with pytest.raises(TypeError, match=r"lses\[0\]"):
        merge_partials([np.zeros((2, 3))], [np.zeros(2, complex)])
    with pytest.raises(TypeError, match="sequence"):
        merge_partials(3, [np.zeros(2)])
