"""The attention variants in the compiled kernels (window, softcap, ALiBi, lengths,
dropout), alone and combined, against fastattn.reference recomputed in float64."""

import numpy as np
import pytest

import fastattn
from fastattn import reference

from helpers import assert_close

SLOPES = np.array([0.5, 0.25, 0.125])

VARIANTS = {
    "window": dict(window=(10, 5)),
    "window_left_only": dict(window=(7, None)),
    "sliding": dict(causal=True, window=(9, 0)),
    "sliding_bottom_right": dict(causal="bottom_right", window=(12, 0)),
    "softcap": dict(softcap=2.0),
    "alibi": dict(alibi_slopes=SLOPES),
    "alibi_per_batch": dict(alibi_slopes=np.stack([SLOPES, SLOPES[::-1]])),
    "lengths": dict(q_lengths=[50, 70], kv_lengths=[90, 33]),
    "lengths_bottom_right": dict(q_lengths=[50, 3], kv_lengths=[90, 33],
                                 causal="bottom_right"),
    "zero_lengths": dict(q_lengths=[0, 70], kv_lengths=[90, 0]),
    "dropout": dict(dropout_p=0.3, dropout_seed=7),
    "everything": dict(window=(4, 4), softcap=1.5, alibi_slopes=SLOPES, dropout_p=0.2,
                       dropout_seed=3, causal=True, kv_lengths=[80, 60]),
    "with_mask_and_bias": dict(window=(20, 3), softcap=3.0, alibi_slopes=SLOPES,
                               mask="mask", bias="bias", q_lengths=[64, 31]),
}


def no_dropout(kw):
    return {k: v for k, v in kw.items() if not k.startswith("dropout")}


def materialise(kw, rng, Lq, Lk):
    kw = dict(kw)
    if kw.get("mask") == "mask":
        kw["mask"] = rng.random((3, Lq, Lk)) < 0.8
    if kw.get("bias") == "bias":
        kw["bias"] = rng.standard_normal((Lq, Lk))
    return kw


def data(rng, dtype, Lq=70, Lk=90, E=16, Ev=8):
    q = rng.standard_normal((2, 3, Lq, E)).astype(dtype)
    k = rng.standard_normal((2, 3, Lk, E)).astype(dtype)
    v = rng.standard_normal((2, 3, Lk, Ev)).astype(dtype)
    return q, k, v


def f64(*arrays):
    return [a.astype(np.float64) for a in arrays]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_forward_backward_and_weights_match_the_reference(rng, dtype, name):
    q, k, v = data(rng, dtype)
    kw = materialise(VARIANTS[name], rng, 70, 90)
    out, lse = fastattn.attention(q, k, v, return_lse=True, **kw)
    ref, ref_lse = reference.attention(*f64(q, k, v), return_lse=True, **kw)
    assert_close(out, ref, dtype)
    finite = np.isfinite(ref_lse)
    assert (np.isfinite(lse) == finite).all()
    assert_close(lse[finite], ref_lse[finite], dtype,
                 max(1.0, np.abs(ref_lse[finite]).max(initial=0)))
    go = rng.standard_normal(out.shape).astype(dtype)
    got = fastattn.attention_backward(go, q, k, v, out, lse, **kw)
    want = reference.attention_backward(*f64(go, q, k, v), ref, ref_lse, **kw)
    for g, w in zip(got, want):
        assert g.dtype == dtype
        assert_close(g, w, dtype, max(1.0, np.abs(w).max()))
    kws = no_dropout(kw)
    assert_close(fastattn.attention_weights(q, k, **kws),
                 reference.attention_weights(*f64(q, k), **kws), dtype)
    s, r = fastattn.scores(q, k, **kws), reference.scores(*f64(q, k), **kws)
    assert (np.isneginf(s) == np.isneginf(r)).all()
    assert_close(np.where(np.isneginf(r), 0, s), np.where(np.isneginf(r), 0, r), dtype,
                 max(1.0, np.abs(r[np.isfinite(r)]).max(initial=0)))


@pytest.mark.parametrize("name", sorted(VARIANTS))
@pytest.mark.parametrize("Lq", [1, 3])
def test_the_decoding_path(rng, name, Lq):
    """One or a few query rows (split-KV over a long cache) with every variant."""
    q, k, v = data(rng, np.float64, Lq=Lq, Lk=700)
    kw = materialise(VARIANTS[name], rng, Lq, 700)
    kw.pop("q_lengths", None)
    if "kv_lengths" in kw:
        kw["kv_lengths"] = [700, 333]
    out, lse = fastattn.attention(q, k, v, return_lse=True, **kw)
    ref, ref_lse = reference.attention(q, k, v, return_lse=True, **kw)
    assert_close(out, ref, np.float64)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-12)


def test_grouped_query_heads_broadcasting_and_strided_views(rng):
    qb = rng.standard_normal((2, 75, 6, 16))             # (B, L, H, E) seen via swapaxes
    kb = rng.standard_normal((1, 90, 2, 16))             # broadcast batch, 2 kv heads
    q, k = qb.swapaxes(1, 2), kb.swapaxes(1, 2)
    v = rng.standard_normal((1, 2, 90, 8))
    kw = dict(enable_gqa=True, window=(30, 2), softcap=5.0,
              alibi_slopes=np.linspace(0.1, 0.6, 6), q_lengths=[75, 40],
              kv_lengths=[90, 50], dropout_p=0.1, dropout_seed=11)
    out, lse = fastattn.attention(q, k, v, return_lse=True, **kw)
    ref, ref_lse = reference.attention(q, k, v, return_lse=True, **kw)
    assert_close(out, ref, np.float64)
    go = rng.standard_normal(out.shape)
    for g, w in zip(fastattn.attention_backward(go, q, k, v, out, lse, **kw),
                    reference.attention_backward(go, q, k, v, ref, ref_lse, **kw)):
        assert_close(g, w, np.float64, max(1.0, np.abs(w).max()))


@pytest.mark.parametrize("name", ["everything", "with_mask_and_bias", "lengths"])
def test_bit_identical_for_any_thread_count(rng, name):
    q, k, v = data(rng, np.float32, Lq=200, Lk=300)
    kw = materialise(VARIANTS[name], rng, 200, 300)
    outs = [fastattn.attention(q, k, v, num_threads=t, return_lse=True, **kw)
            for t in (1, 2, 3)]
    for o, l in outs[1:]:
        np.testing.assert_array_equal(o, outs[0][0])
        np.testing.assert_array_equal(l, outs[0][1])
    go = np.ones_like(outs[0][0])
    grads = [fastattn.attention_backward(go, q, k, v, *outs[0], num_threads=t, **kw)
             for t in (1, 3)]
    for a, b in zip(*grads):
        np.testing.assert_array_equal(a, b)


def test_float16_is_rounded_once(rng):
    q, k, v = data(rng, np.float16)
    kw = dict(window=(8, 8), softcap=4.0, alibi_slopes=SLOPES)
    out = fastattn.attention(q, k, v, **kw)
    assert out.dtype == np.float16
    ref = reference.attention(*f64(q, k, v), **kw)
    np.testing.assert_allclose(out.astype(np.float64), ref, atol=2e-3, rtol=2e-3)


# ------------------------------------------------------------------------- dropout

def test_dropout_pattern_is_the_references_and_depends_on_the_seed(rng):
    q, k, v = data(rng, np.float64, Lq=130, Lk=150)
    w = fastattn.attention_weights(q, k)
    eye = np.broadcast_to(np.eye(150), (2, 3, 150, 150))
    # with v = identity the output is the dropped, rescaled weights themselves
    out = fastattn.attention(q, k, eye, dropout_p=0.25, dropout_seed=42)
    kept = out != 0
    np.testing.assert_allclose(out[kept], w[kept] / 0.75, rtol=1e-12)
    assert abs(kept.mean() - 0.75) < 0.01
    ref = reference.attention(q, k, eye, dropout_p=0.25, dropout_seed=42)
    np.testing.assert_array_equal(out != 0, ref != 0)
    other = fastattn.attention(q, k, eye, dropout_p=0.25, dropout_seed=43)
    assert ((other != 0) != kept).mean() > 0.2
    # lse is that of the weights before dropout
    _, lse = fastattn.attention(q, k, v, dropout_p=0.25, dropout_seed=42, return_lse=True)
    np.testing.assert_allclose(lse, fastattn.attention(q, k, v, return_lse=True)[1])


def test_dropout_zero_is_no_dropout(rng):
    q, k, v = data(rng, np.float32)
    np.testing.assert_array_equal(fastattn.attention(q, k, v, dropout_p=0.0,
                                                     dropout_seed=5),
                                  fastattn.attention(q, k, v))


# ---------------------------------------------------------- cost grows with the window

def test_a_sliding_window_sees_only_its_keys():
    """causal=True, window=(63, 0): row i sees keys i-63..i only, so NaN values in
    keys 0..511 reach exactly rows 0..574 (key ranges are cut per row, blocks outside
    every row's window are skipped)."""
    Lq = Lk = 1024
    q = np.ones((Lq, 8))
    k = np.ones((Lk, 8))
    v = np.ones((Lk, 8))
    v[:512] = np.nan
    out = fastattn.attention(q, k, v, causal=True, window=(63, 0))
    assert np.isnan(out[:512 + 63]).all()
    np.testing.assert_array_equal(out[512 + 63:], 1.0)


# ------------------------------------------------------------------------- errors

@pytest.mark.parametrize("kw,error,words", [
    (dict(window=(-1, 0)), ValueError, "window"),
    (dict(window=(1.5, 0)), TypeError, "window"),
    (dict(window=3), TypeError, "window"),
    (dict(softcap=0.0), ValueError, "softcap"),
    (dict(softcap=float("inf")), ValueError, "softcap"),
    (dict(alibi_slopes=np.ones(4)), ValueError, "alibi_slopes"),
    (dict(q_lengths=[1, 2, 3]), ValueError, "q_lengths"),
    (dict(kv_lengths=[1, 91]), ValueError, "kv_lengths"),
    (dict(kv_lengths=[1.0, 2.0]), TypeError, "kv_lengths"),
    (dict(dropout_p=1.0, dropout_seed=1), ValueError, "dropout_p"),
    (dict(dropout_p=0.5), ValueError, "dropout_seed"),
])
def test_bad_variant_arguments(rng, kw, error, words):
    q, k, v = data(rng, np.float64)
    with pytest.raises(error, match=words):
        fastattn.attention(q, k, v, **kw)
    if not any(key.startswith("dropout") for key in kw):
        with pytest.raises(error, match=words):
            fastattn.scores(q, k, **kw)


# ------------------------------------------------------------------ packed batches

@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("kw", [dict(), dict(causal=True),
                                dict(causal="bottom_right", window=(10, 0), softcap=3.0,
                                     alibi_slopes=np.linspace(0.1, 0.6, 6),
                                     dropout_p=0.2, dropout_seed=5)])
def test_varlen_matches_the_reference(rng, dtype, kw):
    cu_q = np.array([0, 5, 5, 80, 200], np.int32)       # an empty sequence too
    cu_k = np.array([0, 7, 30, 100, 250], np.int64)
    q = rng.standard_normal((200, 6, 16)).astype(dtype)
    k = rng.standard_normal((250, 2, 16)).astype(dtype)
    v = rng.standard_normal((250, 2, 8)).astype(dtype)
    out, lse = fastattn.attention_varlen(q, k, v, cu_q, cu_k, return_lse=True, **kw)
    ref, ref_lse = reference.attention_varlen(*f64(q, k, v), cu_q, cu_k, return_lse=True,
                                              **kw)
    assert out.shape == (200, 6, 8) and lse.shape == (6, 200)
    assert_close(out, ref, dtype)
    go = rng.standard_normal(out.shape).astype(dtype)
    got = fastattn.attention_varlen_backward(go, q, k, v, out, lse, cu_q, cu_k, **kw)
    want = reference.attention_varlen_backward(*f64(go, q, k, v), ref, ref_lse, cu_q,
                                               cu_k, **kw)
    for g, w in zip(got, want):
        assert_close(g, w, dtype, max(1.0, np.abs(w).max()))


def test_varlen_equals_a_padded_batch_with_lengths(rng):
    """The same sequences packed, or padded with q_lengths/kv_lengths: the same
    outputs, and the same dropout pattern (slice index b * Hq + h in both)."""
    lens = [37, 64, 5]
    L, H, E = 64, 2, 8
    q = rng.standard_normal((3, H, L, E))
    kw = dict(causal=True, dropout_p=0.3, dropout_seed=9)
    padded = fastattn.attention(q, q, q, q_lengths=lens, kv_lengths=lens, **kw)
    packed_q = np.concatenate([q[b, :, :n].swapaxes(0, 1) for b, n in enumerate(lens)])
    cu = np.concatenate([[0], np.cumsum(lens)])
    packed = fastattn.attention_varlen(packed_q, packed_q, packed_q, cu, cu, **kw)
    for b, n in enumerate(lens):
        np.testing.assert_allclose(packed[cu[b]:cu[b + 1]].swapaxes(0, 1),
                                   padded[b, :, :n], rtol=1e-12, atol=1e-14)


def test_varlen_errors(rng):
    q = rng.standard_normal((10, 2, 4))
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        fastattn.attention_varlen(q, q, q, [0, 5, 9], [0, 5, 10])
    with pytest.raises(ValueError, match="cu_seqlens_k"):
        fastattn.attention_varlen(q, q, q, np.array([0, 5, 10]), np.array([0, 6, 5]))
    with pytest.raises(ValueError, match="multiple"):
        fastattn.attention_varlen(q, rng.standard_normal((10, 3, 4)),
                                  rng.standard_normal((10, 3, 4)), [0, 10], [0, 10])


def test_multi_head_attention_passes_the_variants_through(rng):
    mha = fastattn.MultiHeadAttention(16, 4, seed=0)
    x = rng.standard_normal((2, 40, 16))
    kw = dict(causal=True, window=(5, 0), softcap=4.0, alibi_slopes=SLOPES[:1].repeat(4),
              kv_lengths=[40, 23])
    out, weights = mha(x, need_weights=True, **kw)
    # the same layer by hand: projections, reference attention, output projection
    def proj(y, w, b):
        return y @ w.T + b
    split = [proj(x, w, b).reshape(2, 40, 4, 4).transpose(0, 2, 1, 3)
             for w, b in ((mha.w_q, mha.b_q), (mha.w_k, mha.b_k), (mha.w_v, mha.b_v))]
    heads = reference.attention(*split, **kw)
    want = proj(heads.transpose(0, 2, 1, 3).reshape(2, 40, 16), mha.w_o, mha.b_o)
    assert_close(out, want, np.float32)
    assert_close(weights, reference.attention_weights(*split[:2], **kw), np.float32)
