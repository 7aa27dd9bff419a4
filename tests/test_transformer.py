"""positional_encoding and MultiHeadAttention.

Oracles: the encoding's formula and hand values; for the layer, the projections
written out in NumPy around ``fastattn.reference.attention``; PyTorch's
``nn.MultiheadAttention`` when torch is importable.
"""

import math

import numpy as np
import pytest

import fastattn
from fastattn import MultiHeadAttention, positional_encoding, reference

from helpers import assert_close, randn

DTYPES = [np.float32, np.float64]


# ------------------------------------------------------------- positional encoding

def test_positional_encoding_hand_values():
    pe = positional_encoding(2, 4, dtype=np.float64)
    assert pe.shape == (2, 4) and pe.dtype == np.float64
    np.testing.assert_array_equal(pe[0], [0.0, 1.0, 0.0, 1.0])
    assert pe[1, 0] == math.sin(1.0)
    assert pe[1, 1] == math.cos(1.0)
    np.testing.assert_allclose(pe[1, 2:], [math.sin(0.01), math.cos(0.01)], rtol=1e-15)


@pytest.mark.parametrize("d_model", [1, 2, 6, 7, 64, 65])
def test_positional_encoding_formula_even_and_odd(d_model):
    length, base = 50, 10000.0
    pe = positional_encoding(length, d_model, dtype=np.float64)
    want = np.empty((length, d_model))
    for pos in range(length):
        for j in range(d_model):
            angle = pos / base ** ((j - j % 2) / d_model)
            want[pos, j] = math.sin(angle) if j % 2 == 0 else math.cos(angle)
    np.testing.assert_allclose(pe, want, rtol=0, atol=1e-13)     # float64 accuracy


def test_positional_encoding_odd_width_ends_with_a_sine():
    pe = positional_encoding(5, 3, dtype=np.float64)
    np.testing.assert_allclose(pe[:, 2], np.sin(np.arange(5) / 10000.0 ** (2 / 3)),
                               rtol=1e-15)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_positional_encoding_is_float64_rounded_once(dtype):
    pe = positional_encoding(100, 32, base=100.0, dtype=dtype)
    assert pe.dtype == dtype
    exact = positional_encoding(100, 32, base=100.0, dtype=np.float64)
    np.testing.assert_array_equal(pe, exact.astype(dtype))


def test_positional_encoding_default_dtype_and_empty():
    assert positional_encoding(3, 4).dtype == np.float32
    assert positional_encoding(0, 4).shape == (0, 4)
    assert positional_encoding(3, 0).shape == (3, 0)


@pytest.mark.parametrize("args, kwargs, error, pattern", [
    ((2.0, 4), {}, TypeError, "length"),
    ((-1, 4), {}, ValueError, "length"),
    ((3, True), {}, TypeError, "d_model"),
    ((3, 4), {"base": 0.0}, ValueError, "base"),
    ((3, 4), {"base": "10000"}, TypeError, "base"),
    ((3, 4), {"dtype": np.int32}, TypeError, "dtype"),
])
def test_positional_encoding_errors(args, kwargs, error, pattern):
    with pytest.raises(error, match=pattern):
        positional_encoding(*args, **kwargs)


# ------------------------------------------------------------ multi-head attention

def _f64(a):
    return None if a is None else np.asarray(a, dtype=np.float64)


def numpy_mha(mha, query, key, value, mask=None, causal=False, **variants):
    """The layer's maths in NumPy around fastattn.reference, in float64; ``variants``
    (window, softcap, alibi_slopes, sinks, lengths, dropout) go to the reference's
    attention, and all but dropout to its weights."""
    H = mha.num_heads

    def linear(x, w, b):
        y = _f64(x) @ _f64(w).T
        return y if b is None else y + _f64(b)

    def split(y):
        B, L, E = y.shape
        return y.reshape(B, L, H, E // H).transpose(0, 2, 1, 3)

    q = split(linear(query, mha.w_q, mha.b_q))
    k = split(linear(key, mha.w_k, mha.b_k))
    v = split(linear(value, mha.w_v, mha.b_v))
    heads = reference.attention(q, k, v, mask=mask, causal=causal, **variants)
    B, _, Lq, _ = heads.shape
    merged = heads.transpose(0, 2, 1, 3).reshape(B, Lq, -1)
    rules = {n: x for n, x in variants.items() if n not in ("dropout_p", "dropout_seed")}
    weights = reference.attention_weights(q, k, mask=mask, causal=causal, **rules)
    return linear(merged, mha.w_o, mha.b_o), weights


def _random_biases(mha, rng):
    """The initial biases are zero; give them values so that they are tested."""
    for name in ("b_q", "b_k", "b_v", "b_o"):
        b = getattr(mha, name)
        setattr(mha, name, randn(rng, b.shape, b.dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True, "bottom_right"])
def test_self_attention_matches_numpy(rng, dtype, causal):
    mha = MultiHeadAttention(12, 3, dtype=dtype, seed=1)
    _random_biases(mha, rng)
    x = randn(rng, (2, 7, 12), dtype)
    out, w = mha(x, causal=causal, need_weights=True)
    assert out.shape == (2, 7, 12) and out.dtype == dtype
    assert w.shape == (2, 3, 7, 7) and w.dtype == dtype
    want, want_w = numpy_mha(mha, x, x, x, causal=causal)
    assert_close(out, want, dtype, 100.0)
    assert_close(w, want_w, dtype, 10.0)
    assert_close(mha(x, causal=causal), out, dtype, 10.0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_cross_attention_with_kdim_vdim_and_mask(rng, dtype):
    mha = MultiHeadAttention(8, 2, kdim=5, vdim=3, dtype=dtype, seed=2)
    _random_biases(mha, rng)
    assert mha.w_q.shape == (8, 8) and mha.w_k.shape == (8, 5)
    assert mha.w_v.shape == (8, 3) and mha.w_o.shape == (8, 8)
    q = randn(rng, (3, 4, 8), dtype)
    k, v = randn(rng, (3, 6, 5), dtype), randn(rng, (3, 6, 3), dtype)
    mask = rng.random((3, 1, 4, 6)) < 0.6          # per batch, shared by the heads
    out, w = mha(q, k, v, mask=mask, need_weights=True)
    want, want_w = numpy_mha(mha, q, k, v, mask=mask)
    assert_close(out, want, dtype, 100.0)
    assert_close(w, want_w, dtype, 10.0)
    assert w.shape == (3, 2, 4, 6)
    assert not np.any(w * ~mask)                   # blocked keys get no weight


VARIANTS = {
    "window": dict(window=(2, 1)),
    "softcap": dict(softcap=1.5),
    "alibi_slopes": dict(alibi_slopes=np.array([0.5, 0.25, 0.125])),
    "sinks": dict(sinks=np.array([1.0, -0.5, 2.0])),
    "sinks per batch": dict(sinks=np.array([[1.0, -0.5, 2.0], [0.0, 3.0, -1.0]])),
    "lengths": dict(q_lengths=[7, 4], kv_lengths=[6, 3]),
    "dropout": dict(dropout_p=0.3, dropout_seed=99),
    "all": dict(window=(3, 0), softcap=2.0, alibi_slopes=np.array([0.3, 0.2, 0.1]),
                sinks=np.array([0.5, 0.0, -1.0]), q_lengths=[7, 5], kv_lengths=[6, 4],
                dropout_p=0.25, dropout_seed=7),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, "bottom_right"])
@pytest.mark.parametrize("name", list(VARIANTS))
def test_every_variant_keyword_is_passed_through(rng, dtype, causal, name):
    """window, softcap, alibi_slopes, sinks, the lengths and dropout reach the fused
    attention: the layer against its projections around fastattn.reference.attention
    with the same keywords (the weights: all but dropout)."""
    variants = VARIANTS[name]
    mha = MultiHeadAttention(12, 3, kdim=5, vdim=5, dtype=dtype, seed=6)
    _random_biases(mha, rng)
    q = randn(rng, (2, 7, 12), dtype)
    kv = randn(rng, (2, 6, 5), dtype)
    out, w = mha(q, kv, mask=None, causal=causal, need_weights=True, **variants)
    want, want_w = numpy_mha(mha, q, kv, kv, causal=causal, **variants)
    assert out.shape == (2, 7, 12) and out.dtype == dtype and w.shape == (2, 3, 7, 6)
    assert_close(out, want, dtype, 100.0)
    assert_close(w, want_w, dtype, 10.0)
    # each keyword matters: the layer without it differs
    plain, plain_w = numpy_mha(mha, q, kv, kv, causal=causal)
    assert not np.allclose(want, plain, atol=1e-3)
    if "sinks" in variants:
        rows = w.sum(-1)
        assert (rows[rows > 0] < 1 - 1e-3).all()


def test_sinks_of_an_unbatched_query(rng):
    mha = MultiHeadAttention(4, 2, dtype=np.float64, seed=7)
    x = randn(rng, (3, 4))
    sinks = np.array([0.5, -1.0])
    out, w = mha(x, causal=True, sinks=sinks, need_weights=True)
    want, want_w = numpy_mha(mha, x[None], x[None], x[None], causal=True, sinks=sinks)
    assert out.shape == (3, 4) and w.shape == (2, 3, 3)
    assert_close(out, want[0], np.float64, 10.0)
    assert_close(w, want_w[0], np.float64)
    with pytest.raises(ValueError, match="sinks"):
        mha(x, sinks=np.zeros(3))


def test_per_head_mask_and_key_padding(rng):
    mha = MultiHeadAttention(6, 3, dtype=np.float64, seed=3)
    x = randn(rng, (2, 5, 6))
    per_head = rng.random((2, 3, 5, 5)) < 0.7
    want, _ = numpy_mha(mha, x, x, x, mask=per_head)
    assert_close(mha(x, mask=per_head), want, np.float64, 10.0)
    padding = np.array([[True] * 5, [True] * 3 + [False] * 2])     # (batch, Lk)
    out, w = mha(x, mask=padding[:, None, None, :], need_weights=True)
    assert not w[1, :, :, 3:].any()
    want, _ = numpy_mha(mha, x, x, x, mask=padding[:, None, None, :])
    assert_close(out, want, np.float64, 10.0)


def test_fully_masked_rows_give_the_output_bias(rng):
    mha = MultiHeadAttention(4, 2, dtype=np.float64, seed=4)
    _random_biases(mha, rng)
    x = randn(rng, (1, 3, 4))
    mask = np.ones((3, 3), bool)
    mask[1] = False                                # query 1 sees nothing
    out, w = mha(x, mask=mask, need_weights=True)
    np.testing.assert_array_equal(w[0, :, 1], 0.0)
    np.testing.assert_allclose(out[0, 1], mha.b_o, rtol=1e-15)
    assert np.isfinite(out).all()


def test_unbatched_input(rng):
    mha = MultiHeadAttention(4, 2, dtype=np.float64, seed=5)
    x = randn(rng, (3, 4))
    out, w = mha(x, need_weights=True, causal=True)
    assert out.shape == (3, 4) and w.shape == (2, 3, 3)
    want, want_w = numpy_mha(mha, x[None], x[None], x[None], causal=True)
    assert_close(out, want[0], np.float64, 10.0)
    assert_close(w, want_w[0], np.float64)


def test_dtype_promotion():
    mha = MultiHeadAttention(4, 1, seed=0)                    # float32 weights
    assert mha.w_q.dtype == np.float32
    assert mha(np.ones((1, 2, 4), np.float32)).dtype == np.float32
    assert mha(np.ones((1, 2, 4), np.float64)).dtype == np.float64
    assert mha(np.ones((1, 2, 4), np.int64)).dtype == np.float64


def test_seeded_initialisation():
    a = MultiHeadAttention(16, 4, seed=7)
    b = MultiHeadAttention(16, 4, seed=7)
    c = MultiHeadAttention(16, 4, seed=8)
    for name in ("w_q", "w_k", "w_v", "w_o", "b_q", "b_o"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
    assert not np.array_equal(a.w_q, c.w_q)
    d = MultiHeadAttention(16, 4, seed=7, dtype=np.float64)
    np.testing.assert_array_equal(d.w_q.astype(np.float32), a.w_q)
    # Xavier-uniform bound over the packed (3E, E) matrix; out_proj 1/sqrt(E)
    assert np.abs(d.w_q).max() <= math.sqrt(6 / (16 + 48))
    assert np.abs(d.w_o).max() <= 1 / 4
    assert not np.any(d.b_q) and not np.any(d.b_o)


def test_no_bias():
    mha = MultiHeadAttention(4, 2, bias=False, seed=0)
    assert mha.b_q is None and mha.b_o is None
    x = np.zeros((1, 2, 4), np.float32)
    np.testing.assert_array_equal(mha(x), 0.0)


@pytest.mark.parametrize("call, error, pattern", [
    (lambda: MultiHeadAttention(10, 3), ValueError, "divisible"),
    (lambda: MultiHeadAttention(0, 1), ValueError, "embed_dim"),
    (lambda: MultiHeadAttention(4.0, 1), TypeError, "embed_dim"),
    (lambda: MultiHeadAttention(4, 2, dtype=np.int32), TypeError, "dtype"),
    (lambda: MultiHeadAttention(4, 2, seed=0)(np.ones((1, 2, 5))), ValueError, "query"),
    (lambda: MultiHeadAttention(4, 2, seed=0)(np.ones((1, 2, 4)), np.ones((1, 3, 4)),
                                              np.ones((1, 2, 4))), ValueError, "key"),
    (lambda: MultiHeadAttention(4, 2, seed=0)(np.ones((1, 2, 4)), mask=np.ones((2, 2))),
     TypeError, "mask"),
    (lambda: MultiHeadAttention(4, 2, seed=0)(np.ones((1, 2, 4)),
                                              mask=np.ones((3, 2, 2), bool)),
     ValueError, "mask"),
    (lambda: MultiHeadAttention(4, 2, seed=0)(np.ones((1, 2, 4)), causal="diagonal"),
     ValueError, "causal"),
])
def test_errors(call, error, pattern):
    with pytest.raises(error, match=pattern):
        call()


# ------------------------------------------------------------------ state dicts

def _torch_like_state(rng, E, kdim=None, vdim=None, bias=True):
    """A dict with nn.MultiheadAttention's keys and shapes, random values."""
    if kdim is None and vdim is None:
        state = {"in_proj_weight": rng.standard_normal((3 * E, E))}
    else:
        state = {"q_proj_weight": rng.standard_normal((E, E)),
                 "k_proj_weight": rng.standard_normal((E, kdim or E)),
                 "v_proj_weight": rng.standard_normal((E, vdim or E))}
    state["out_proj.weight"] = rng.standard_normal((E, E))
    if bias:
        state["in_proj_bias"] = rng.standard_normal(3 * E)
        state["out_proj.bias"] = rng.standard_normal(E)
    return state


@pytest.mark.parametrize("kdim, vdim", [(None, None), (5, 3)])
@pytest.mark.parametrize("bias", [True, False])
def test_from_state_dict_round_trip(rng, kdim, vdim, bias):
    E = 8
    state = _torch_like_state(rng, E, kdim, vdim, bias)
    mha = MultiHeadAttention.from_state_dict(state, num_heads=2)
    assert (mha.embed_dim, mha.num_heads, mha.kdim, mha.vdim) == (E, 2, kdim or E, vdim or E)
    assert mha.w_q.dtype == np.float64
    if kdim is None:
        np.testing.assert_array_equal(mha.w_q, state["in_proj_weight"][:E])
        np.testing.assert_array_equal(mha.w_k, state["in_proj_weight"][E:2 * E])
        np.testing.assert_array_equal(mha.w_v, state["in_proj_weight"][2 * E:])
    else:
        np.testing.assert_array_equal(mha.w_k, state["k_proj_weight"])
        np.testing.assert_array_equal(mha.w_v, state["v_proj_weight"])
    np.testing.assert_array_equal(mha.w_o, state["out_proj.weight"])
    if bias:
        np.testing.assert_array_equal(mha.b_v, state["in_proj_bias"][2 * E:])
        np.testing.assert_array_equal(mha.b_o, state["out_proj.bias"])
    else:
        assert mha.b_q is None and mha.b_o is None
    back = mha.state_dict()
    assert sorted(back) == sorted(state)
    for name in state:
        np.testing.assert_array_equal(back[name], state[name])
    q = randn(rng, (2, 3, E))
    k = randn(rng, (2, 4, kdim or E))
    v = randn(rng, (2, 4, vdim or E))
    want, _ = numpy_mha(mha, q, k, v)
    assert_close(mha(q, k, v), want, np.float64, 1e3)


def test_from_state_dict_dtype_and_copies(rng):
    state = _torch_like_state(rng, 4)
    mha = MultiHeadAttention.from_state_dict(state, 2, dtype=np.float32)
    assert mha.w_q.dtype == np.float32 and mha.b_o.dtype == np.float32
    state32 = {k: v.astype(np.float32) for k, v in state.items()}
    assert MultiHeadAttention.from_state_dict(state32, 1).w_o.dtype == np.float32
    mha = MultiHeadAttention.from_state_dict(state, 2)
    state["out_proj.weight"][:] = 0                # the layer holds copies
    assert np.any(mha.w_o)


@pytest.mark.parametrize("change, error, pattern", [
    (lambda s: s.pop("out_proj.weight"), ValueError, "missing"),
    (lambda s: s.pop("in_proj_bias"), ValueError, "missing"),
    (lambda s: s.update(extra=np.ones(3)), ValueError, "unexpected"),
    (lambda s: s.update(bias_k=np.ones((1, 1, 4))), ValueError, "add_bias_kv"),
    (lambda s: s.update(in_proj_weight=np.ones((12, 5))), ValueError, "in_proj_weight"),
    (lambda s: s.update(in_proj_bias=np.ones(8)), ValueError, "in_proj_bias"),
    (lambda s: s.update(in_proj_weight=np.ones((12, 4), bool)), TypeError, "in_proj_weight"),
])
def test_from_state_dict_errors(rng, change, error, pattern):
    state = _torch_like_state(rng, 4)
    change(state)
    with pytest.raises(error, match=pattern):
        MultiHeadAttention.from_state_dict(state, 2)


def test_from_state_dict_heads_must_divide(rng):
    with pytest.raises(ValueError, match="divisible"):
        MultiHeadAttention.from_state_dict(_torch_like_state(rng, 4), 3)
    with pytest.raises(TypeError, match="mapping"):
        MultiHeadAttention.from_state_dict([("in_proj_weight", np.ones((12, 4)))], 2)


# --------------------------------------------------------------------- PyTorch

@pytest.mark.parametrize("kdim, vdim", [(None, None), (5, 3)])
@pytest.mark.parametrize("bias", [True, False])
def test_matches_pytorch(rng, kdim, vdim, bias):
    torch = pytest.importorskip("torch")
    E, H = 8, 2
    torch.manual_seed(0)
    module = torch.nn.MultiheadAttention(E, H, kdim=kdim, vdim=vdim, bias=bias,
                                         batch_first=True).double()
    with torch.no_grad():
        for p in module.parameters():
            p.normal_()                    # non-zero biases too
    state = {name: t.detach().numpy() for name, t in module.state_dict().items()}
    mha = MultiHeadAttention.from_state_dict(state, H)
    q = randn(rng, (2, 4, E))
    k = randn(rng, (2, 6, kdim or E))
    v = randn(rng, (2, 6, vdim or E))
    allowed = rng.random((4, 6)) < 0.7
    allowed[:, 0] = True                   # PyTorch gives NaN for a row with no key
    t_out, t_w = module(torch.from_numpy(q), torch.from_numpy(k), torch.from_numpy(v),
                        attn_mask=torch.from_numpy(~allowed),   # PyTorch: True = blocked
                        average_attn_weights=False)
    out, w = mha(q, k, v, mask=allowed, need_weights=True)
    assert_close(out, t_out.detach().numpy(), np.float64, 1e3)
    assert_close(w, t_w.detach().numpy(), np.float64)
    # and fastattn's own initialisation loads into PyTorch unchanged
    ours = MultiHeadAttention(E, H, kdim=kdim, vdim=vdim, bias=bias, dtype=np.float64,
                              seed=3)
    module.load_state_dict({n: torch.from_numpy(a) for n, a in ours.state_dict().items()})
    t_out, _ = module(torch.from_numpy(q), torch.from_numpy(k), torch.from_numpy(v),
                      need_weights=False)
    assert_close(ours(q, k, v), t_out.detach().numpy(), np.float64, 10.0)


def test_exported():
    assert "MultiHeadAttention" in fastattn.__all__
    assert "positional_encoding" in fastattn.__all__
