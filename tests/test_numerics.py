"""Numerics under stress: huge logits, subnormals, -inf/+inf, NaN in one key.

The behaviour tested here is documented in docs/robustness.md.
"""

import numpy as np
import pytest

import fastattn
from fastattn import reference

from helpers import assert_close

DTYPES = [np.float32, np.float64]
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def _data(rng, dtype, Lq=130, Lk=150, E=8, Ev=5, batch=(2,)):
    q = rng.standard_normal(batch + (Lq, E)).astype(dtype)
    k = rng.standard_normal(batch + (Lk, E)).astype(dtype)
    v = rng.standard_normal(batch + (Lk, Ev)).astype(dtype)
    return q, k, v


# ----------------------------------------------------------------- huge logits

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("big", [1e4, 1e30])
def test_huge_logits_pick_the_winner_exactly(rng, dtype, big):
    """Scores of +-big (scale 0: the bias alone), one winner per row: the output is
    that value row, exactly, and the log-sum-exp is big."""
    q, k, v = _data(rng, dtype, Lq=70, Lk=140)
    winner = rng.integers(0, 140, size=(2, 70))
    bias = np.full((2, 70, 140), -big, dtype)
    np.put_along_axis(bias, winner[..., None], big, axis=-1)
    out, lse = fastattn.attention(q, k, v, bias=bias, scale=0.0, return_lse=True)
    want = np.take_along_axis(v, winner[..., None], axis=-2)
    np.testing.assert_array_equal(out, want)
    # lse = big + log(1 + tiny): big to the precision of the dtype
    np.testing.assert_allclose(lse, big, rtol=np.finfo(dtype).eps * 4)
    w = fastattn.attention_weights(q, k, bias=bias, scale=0.0)
    np.testing.assert_array_equal(w, (bias == big).astype(dtype))
    # with the q.k scores added the winner still takes all
    np.testing.assert_array_equal(fastattn.attention(q, k, v, bias=bias), want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("big", [1e4, -1e4, 1e30, -1e30])
def test_huge_equal_logits_average(rng, dtype, big):
    """Every score the same huge (finite) value: a plain average; -1e30 is not -inf."""
    q, k, v = _data(rng, dtype, Lq=3, Lk=100)
    bias = np.full((3, 100), big, dtype)
    out, lse = fastattn.attention(q, k, v, bias=bias, scale=0.0, return_lse=True)
    assert_close(out, np.broadcast_to(v.astype(np.float64).mean(axis=-2, keepdims=True),
                                      out.shape), dtype)
    np.testing.assert_allclose(lse, big + np.log(100), rtol=4 * np.finfo(dtype).eps)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("magnitude", [1e2, 1e15])
def test_huge_logits_from_q_and_k(rng, dtype, magnitude):
    """Scores of +-1e4 / +-1e30 reached through q.k: matches the float64 reference."""
    q = (np.sign(rng.standard_normal((2, 65, 1))) * magnitude).astype(dtype)
    k = (rng.standard_normal((2, 70, 1)) * magnitude).astype(dtype)
    v = rng.standard_normal((2, 70, 3)).astype(dtype)
    out, lse = fastattn.attention(q, k, v, scale=1.0, return_lse=True)
    assert np.isfinite(out).all() and np.isfinite(lse).all()
    ref_out, ref_lse = reference.attention(*(a.astype(np.float64) for a in (q, k, v)),
                                           scale=1.0, return_lse=True)
    # softmax is a near-argmax here: compare where the float64 winner is clear
    s = reference.scores(*(a.astype(np.float64) for a in (q, k)), scale=1.0)
    top2 = np.sort(s, axis=-1)[..., -2:]
    clear = (top2[..., 1] - top2[..., 0]) > 1e-3 * np.abs(top2[..., 1]) + 50
    assert clear.sum() > 50
    assert_close(out[clear], ref_out[clear], dtype, 1.0)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-6 if dtype == np.float32 else 1e-14)


@pytest.mark.parametrize("fn", ["attention", "attention_weights", "scores"])
def test_float32_score_overflow_is_inf(fn):
    """A score beyond float32's range becomes +-inf: +inf gives a NaN row, -inf blocks."""
    q = np.array([[1e20], [-1e20], [1.0]], np.float32)
    k = np.array([[1e20], [0.0]], np.float32)
    v = np.array([[1.0], [2.0]], np.float32)
    args = (q, k, v) if fn == "attention" else (q, k)
    res = getattr(fastattn, fn)(*args, scale=1.0)
    assert np.isnan(res[0]).all() if fn != "scores" else res[0, 0] == np.inf
    if fn == "attention":
        np.testing.assert_array_equal(res[1:], [[2.0], [1.0]])  # row 1: key 0 blocked


# ------------------------------------------------------------------- subnormals

@pytest.mark.parametrize("dtype,tiny", [(np.float32, 1e-40), (np.float64, 1e-310)])
def test_subnormal_inputs_are_not_flushed(rng, dtype, tiny):
    q, k, v = (a * dtype(tiny) for a in _data(rng, dtype, Lq=5, Lk=70))
    assert (np.abs(v[v != 0]) < np.finfo(dtype).tiny).all()         # really subnormal
    out = fastattn.attention(q, k, v)                    # scores ~0: a plain average
    mean = v.astype(np.float64).mean(axis=-2, keepdims=True)
    spacing = np.finfo(dtype).smallest_subnormal
    np.testing.assert_allclose(out, np.broadcast_to(mean, out.shape), rtol=0,
                               atol=float(spacing) * 70 * 4)
    assert (out != 0).mean() > 0.9
    w = fastattn.softmax(np.array([tiny, 0.0], dtype))
    np.testing.assert_array_equal(w, np.array([0.5, 0.5], dtype))
    np.testing.assert_array_equal(fastattn.weighted_sum(np.eye(3, dtype=dtype), v[0, :3]),
                                  v[0, :3])


# -------------------------------------------------------------- -inf and +inf

@pytest.mark.parametrize("dtype", DTYPES)
def test_all_minus_inf_rows(rng, dtype):
    q, k, v = _data(rng, dtype)
    bias = rng.standard_normal((130, 150)).astype(dtype)
    bias[[0, 64, 129]] = -np.inf
    v[:, 3] = np.nan                          # reaches no row: every key is blocked there
    bias[:, 3] = -np.inf
    out, lse = fastattn.attention(q, k, v, bias=bias, return_lse=True)
    assert (out[:, [0, 64, 129]] == 0).all() and (lse[:, [0, 64, 129]] == -np.inf).all()
    assert np.isfinite(out).all()
    s = fastattn.scores(q, k, bias=bias)
    assert (s[:, [0, 64, 129]] == -np.inf).all()
    w = fastattn.attention_weights(q, k, bias=bias)
    assert (w[:, [0, 64, 129]] == 0).all()
    assert (fastattn.softmax(np.full((2, 3), -np.inf, dtype)) == 0).all()
    mask = np.ones((130, 150), bool)
    mask[5] = False
    out = fastattn.attention(q, k, v, mask=mask, bias=np.where(np.arange(150) == 3, -np.inf, 0))
    assert (out[:, 5] == 0).all() and np.isfinite(out).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_plus_inf_bias_gives_a_nan_row(rng, dtype):
    q, k, v = _data(rng, dtype)
    bias = np.zeros((130, 150), dtype)
    bias[7, 100] = np.inf
    out, lse = fastattn.attention(q, k, v, bias=bias, return_lse=True)
    assert np.isnan(out[:, 7]).all() and np.isnan(lse[:, 7]).all()
    rest = np.arange(130) != 7
    np.testing.assert_array_equal(out[:, rest], fastattn.attention(q, k, v)[:, rest])
    w = fastattn.attention_weights(q, k, bias=bias)
    assert np.isnan(w[:, 7]).all() and not np.isnan(w[:, rest]).any()
    assert np.isnan(fastattn.softmax(np.array([0.0, np.inf, 1.0], dtype))).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_inf_value_with_underflowed_weight_is_dropped(dtype):
    """Key 0 holds inf but its weight underflows to 0 once a later block (key 70) has a
    score 1e4 higher: it must not turn the row into NaN (0 * inf)."""
    q = np.ones((1, 1), dtype)
    k = np.zeros((71, 1), dtype)
    v = np.ones((71, 1), dtype)
    v[0] = np.inf
    bias = np.full((1, 71), -np.inf, dtype)
    bias[0, 0], bias[0, 70] = 0, 1e4
    out = fastattn.attention(q, k, v, bias=bias)
    np.testing.assert_array_equal(out, [[1.0]])
    assert_close(out, reference.attention(q, k, v, bias=bias), dtype)


# Every value width: the micro-GEMM's register tile has MR rows of value columns
# (8/5 with AVX-512 in float32/float64, 3/2 with AVX2, 3/3 otherwise); widths that
# leave one or two rows over take its plain loop, the others its micro-tiles.
VALUE_WIDTHS = [1, 2, 3, 5, 6, 7, 8, 9, 10, 11, 17, 33]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("Ev", VALUE_WIDTHS)
def test_running_sums_rescaled_in_every_value_width(rng, dtype, Ev):
    """The tiled pass rescales each row's running output sums by e^(m_old - m_new)
    when a block raises its maximum, inside the product of the block with V. A bias
    rising along the keys makes every block after the first raise it (factor ~e^-3);
    the result is the float64 recomputation's."""
    q, k, v = _data(rng, dtype, Lq=40, Lk=300, Ev=Ev)
    bias = (0.05 * np.arange(300)).astype(dtype)
    out = fastattn.attention(q, k, v, bias=bias)
    assert_close(out, reference.attention(q, k, v, bias=bias), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("Ev", VALUE_WIDTHS)
def test_overflowed_running_sum_is_dropped_when_its_weight_underflows(rng, dtype, Ev):
    """Keys 0 and 1 (first block) hold finite values whose sum overflows to inf in the
    running sums; key 150 (third block) scores 1e4 higher, so their factor
    e^(m_old - m_new) underflows to 0 and must drop the inf (0 * inf would be NaN):
    every row is value row 150, exactly. Without key 150 the row is their mean."""
    q, k, v = _data(rng, dtype, Lq=40, Lk=200, Ev=Ev)
    v[:, :2] = 0.75 * np.finfo(dtype).max
    bias = np.full(200, -np.inf, dtype)
    bias[:2], bias[150] = 0, 1e4
    out = fastattn.attention(q, k, v, bias=bias, scale=0.0)
    np.testing.assert_array_equal(out, np.broadcast_to(v[:, 150:151], out.shape))
    # without key 150 the running sum overflows, and the row is redone by the exact
    # (normalised) rule: the mean of the two values, as the float64 recomputation says
    bias[150] = -np.inf
    out = fastattn.attention(q, k, v, bias=bias, scale=0.0)
    assert np.isfinite(out).all()
    assert_close(out, reference.attention(q, k, v, bias=bias, scale=0.0), dtype,
                 scale=float(np.finfo(dtype).max))


# ------------------------------------------------------------- NaN in one key

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("where", ["k", "v"])
@pytest.mark.parametrize("blocking", ["causal", "mask", "bias"])
def test_nan_in_one_key_reaches_exactly_the_rows_that_may_attend(rng, dtype, where,
                                                                 blocking):
    q, k, v = _data(rng, dtype)
    j = 100
    clean_k, clean_v = k.copy(), v.copy()
    clean_k[:, j] = 0
    clean_v[:, j] = 0
    {"k": k, "v": v}[where][:, j] = np.nan
    kw = {}
    if blocking == "causal":
        kw["causal"] = True
        sees = np.arange(130) >= j              # query i sees keys <= i
    elif blocking == "mask":
        sees = rng.random(130) < 0.5
        mask = np.ones((130, 150), bool)
        mask[~sees, j] = False
        kw["mask"] = mask
    else:
        sees = rng.random(130) < 0.5
        bias = np.zeros((130, 150), dtype)
        bias[~sees, j] = -np.inf
        kw["bias"] = bias
    out, lse = fastattn.attention(q, k, v, return_lse=True, **kw)
    if blocking == "bias" and where == "k":
        # a bias of -inf is arithmetic: nan + -inf is nan, so it does not block a key
        # whose score is NaN (mask= does)
        sees = np.ones(130, bool)
    assert np.isnan(out[:, sees]).all()
    assert np.isnan(lse[:, sees]).all() == (where == "k")
    # the other rows are exactly what they are without the NaN
    ck, cv = (clean_k, v) if where == "k" else (k, clean_v)
    clean = fastattn.attention(q, ck, cv, **kw)
    assert not np.isnan(out[:, ~sees]).any()
    if where == "v":        # the blocked key is skipped: bit-identical
        np.testing.assert_array_equal(out[:, ~sees], clean[:, ~sees])
    else:                   # its score is -inf instead of 0: the same maths
        assert_close(out[:, ~sees], clean[:, ~sees], dtype)
    # and the reference agrees on the whole pattern
    ref = reference.attention(q.astype(np.float64), k.astype(np.float64),
                              v.astype(np.float64), **kw)
    assert_close(out, ref, dtype, max(1.0, float(np.nanmax(np.abs(v)))))
    # the kernels exposed one by one: NaN scores only where the key is allowed
    if where == "k" and (~sees).any():
        s = fastattn.scores(q, k, **kw)
        assert np.isnan(s[:, sees, j]).all() and (s[:, ~sees, j] == -np.inf).all()
        w = fastattn.attention_weights(q, k, **kw)
        assert np.isnan(w[:, sees]).all() and not np.isnan(w[:, ~sees]).any()


def test_nan_in_q_row_or_bias_entry_stays_in_its_row(rng):
    q, k, v = _data(rng, np.float64)
    q[0, 3, 2] = np.nan
    bias = np.zeros((130, 150))
    bias[77, 5] = np.nan
    out = fastattn.attention(q, k, v, bias=bias)
    bad = np.zeros((2, 130), bool)
    bad[0, 3] = bad[:, 77] = True
    assert np.isnan(out[bad]).all() and not np.isnan(out[~bad]).any()


def test_weighted_sum_is_a_plain_matrix_product_for_nan(rng):
    """weighted_sum is p @ v: a NaN in v reaches every row, even through weight 0."""
    p = np.zeros((3, 4))
    p[:, 0] = 1
    v = np.ones((4, 2))
    v[3] = np.nan
    assert np.isnan(fastattn.weighted_sum(p, v)).all()
    assert np.isnan(p @ v).all()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("bad", [np.nan, np.inf])
@pytest.mark.parametrize("Lq,Lk,groups", [(1, 3000, 1), (2, 700, 4), (4, 64, 1)])
def test_blocked_value_never_reaches_a_decoding_row(dtype, bad, Lq, Lk, groups):
    """The few-query-rows (decoding) path, split over keys or not, with GQA: a key that
    a row may not attend to leaves that row finite whatever its value row holds."""
    rng = np.random.default_rng(3)
    q = rng.standard_normal((1, 4 * groups, Lq, 16)).astype(dtype)
    k = rng.standard_normal((1, 4, Lk, 16)).astype(dtype)
    v = rng.standard_normal((1, 4, Lk, 8)).astype(dtype)
    mask = np.ones((Lq, Lk), bool)
    mask[0, Lk // 2] = False           # row 0 may not see key Lk // 2 ...
    v[:, :, Lk // 2] = bad             # ... whose values are NaN or inf
    out = fastattn.attention(q, k, v, mask=mask, enable_gqa=True)
    assert np.all(np.isfinite(out[..., 0, :]))
    if Lq > 1:                          # the other rows attend to it: not finite
        assert not np.any(np.isfinite(out[..., 1, :]))
    ref = fastattn.reference.attention(q[..., :1, :].astype(np.float64), k, v,
                                       mask=mask[:1], enable_gqa=True)
    np.testing.assert_allclose(out[..., :1, :], ref, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("Lq,groups", [(1, 1), (2, 1), (3, 1), (4, 1), (1, 3), (1, 8),
                                       (4, 5), (4, 16)])
@pytest.mark.parametrize("Ev", [8, 17, 64, 130, 200])
def test_decode_weighted_sum_on_every_edge(Lq, groups, Ev):
    """The decode path's P·V (float32: 4 rows by 64 columns, then 2 or 1 rows by 128,
    whole vectors unmasked, columns past Ev masked) against float64: rows per item 1
    to 64, Ev around and past the vector widths, key counts around the decode block,
    with and without a split;
    a NaN value row in the last, partial block reaches exactly the rows that see it
    (the others of its item: the same values, up to the rounding of the block's sum
    taken again without the fused path)."""
    rng = np.random.default_rng(Lq * 100 + groups * 10 + Ev)
    for Lk in (1, 255, 257, 1100):
        q = rng.standard_normal((2, 2 * groups, Lq, 16)).astype(np.float32)
        k = rng.standard_normal((2, 2, Lk, 16)).astype(np.float32)
        v = rng.standard_normal((2, 2, Lk, Ev)).astype(np.float32)
        out = fastattn.attention(q, k, v, enable_gqa=True, causal="bottom_right")
        ref = reference.attention(q.astype(np.float64), k.astype(np.float64),
                                  v.astype(np.float64), enable_gqa=True,
                                  causal="bottom_right")
        assert_close(out, ref, np.float32)
        if Lk > 1:      # the last key: only the last query row sees it (bottom-right)
            v[1, 0, Lk - 1, Ev // 2] = np.nan
            out2 = fastattn.attention(q, k, v, enable_gqa=True, causal="bottom_right")
            sees = np.zeros(out.shape[:-1], bool)
            sees[1, :groups, Lq - 1] = True
            assert np.isnan(out2[sees][:, Ev // 2]).all()
            assert np.isfinite(out2[~sees]).all()
            np.testing.assert_allclose(out2[~sees], out[~sees], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_with_empty_head_dims(dtype):
    """E = 0 (every score 0: the mean of the values) and Ev = 0 on the decode path,
    whose prefetch distance is counted in rows of E or Ev elements."""
    rng = np.random.default_rng(5)
    v = rng.standard_normal((2, 600, 5)).astype(dtype)
    out = fastattn.attention(np.zeros((2, 1, 0), dtype), np.zeros((2, 600, 0), dtype),
                             v, scale=1.0)
    np.testing.assert_allclose(out[:, 0], v.mean(axis=1), rtol=1e-5, atol=1e-6)
    q = rng.standard_normal((2, 1, 8)).astype(dtype)
    k = rng.standard_normal((2, 600, 8)).astype(dtype)
    assert fastattn.attention(q, k, np.zeros((2, 600, 0), dtype)).shape == (2, 1, 0)
