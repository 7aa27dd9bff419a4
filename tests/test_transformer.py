"""positional_encoding and MultiHeadAttention.

Oracles: the encoding formula evaluated in float64 with the math module, a NumPy
composition of the projections around fastattn.reference.attention, and (when it is
installed) PyTorch's nn.MultiheadAttention.
"""

import doctest
import math

import numpy as np
import pytest

import fastattn
from fastattn import MultiHeadAttention, positional_encoding, reference
import fastattn.transformer

RTOL = {np.float32: 2e-5, np.float64: 1e-12}
ATOL = {np.float32: 2e-5, np.float64: 1e-12}


def test_doctests():
    result = doctest.testmod(fastattn.transformer, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0


# ------------------------------------------------------------------ positional encoding

def formula(length, d_model, base=10000.0):
    pe = np.empty((length, d_model))
    for pos in range(length):
        for j in range(d_model):
            angle = pos / base ** ((j - j % 2) / d_model)
            pe[pos, j] = math.sin(angle) if j % 2 == 0 else math.cos(angle)
    return pe


def test_positional_encoding_spot_values():
    pe = positional_encoding(4, 6, dtype=np.float64)
    assert pe[1, 0] == pytest.approx(math.sin(1.0), abs=1e-15)
    assert pe[1, 1] == pytest.approx(math.cos(1.0), abs=1e-15)
    assert np.all(pe[0, 0::2] == 0) and np.all(pe[0, 1::2] == 1)
    # column 2 is sin(pos / 10000**(2/6))
    assert pe[3, 2] == pytest.approx(math.sin(3 / 10000 ** (1 / 3)), abs=1e-15)


@pytest.mark.parametrize("d_model", [1, 2, 5, 8, 17, 64])
@pytest.mark.parametrize("length", [0, 1, 9, 50])
def test_positional_encoding_matches_formula(length, d_model):
    pe = positional_encoding(length, d_model, dtype=np.float64)
    assert pe.shape == (length, d_model) and pe.dtype == np.float64
    np.testing.assert_allclose(pe, formula(length, d_model), rtol=0, atol=1e-13)


def test_positional_encoding_odd_width_ends_with_sine():
    pe = positional_encoding(7, 5, dtype=np.float64)
    expect = [math.sin(p / 10000 ** (4 / 5)) for p in range(7)]
    np.testing.assert_allclose(pe[:, 4], expect, rtol=0, atol=1e-15)


def test_positional_encoding_base_and_dtype():
    pe32 = positional_encoding(10, 8, base=100.0)
    assert pe32.dtype == np.float32
    pe64 = positional_encoding(10, 8, base=100.0, dtype=np.float64)
    np.testing.assert_allclose(pe64, formula(10, 8, base=100.0), atol=1e-13)
    np.testing.assert_array_equal(pe32, pe64.astype(np.float32))    # rounded once
    assert positional_encoding(3, 4, dtype="float16").dtype == np.float16


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(length=-1, d_model=4), ValueError, "length"),
    (dict(length=3, d_model=-2), ValueError, "d_model"),
    (dict(length=3.0, d_model=4), TypeError, "length"),
    (dict(length=True, d_model=4), TypeError, "length"),
    (dict(length=3, d_model=4, base=0.0), ValueError, "base"),
    (dict(length=3, d_model=4, base="10"), TypeError, "base"),
    (dict(length=3, d_model=4, dtype=np.int32), TypeError, "dtype"),
    (dict(length=3, d_model=4, dtype=np.complex64), TypeError, "dtype"),
])
def test_positional_encoding_errors(kwargs, error, match):
    with pytest.raises(error, match=match):
        positional_encoding(**kwargs)


# ------------------------------------------------------------------ multi-head attention

def mha_oracle(m, query, key, value, mask=None, causal=False):
    """The layer written out in NumPy around the reference attention."""
    H, D = m.num_heads, m.head_dim

    def lin(x, w, b):
        y = x.astype(np.float64) @ w.astype(np.float64).T
        return y if b is None else y + b

    def split(y):
        return y.reshape(y.shape[0], y.shape[1], H, D).transpose(0, 2, 1, 3)

    q, k, v = (split(lin(x, w, b)) for x, w, b in ((query, m.w_q, m.b_q),
                                                   (key, m.w_k, m.b_k),
                                                   (value, m.w_v, m.b_v)))
    heads = reference.attention(q, k, v, mask=mask, causal=causal)
    weights = reference.attention_weights(q, k, mask=mask, causal=causal)
    B, Lq = query.shape[:2]
    out = lin(heads.transpose(0, 2, 1, 3).reshape(B, Lq, H * D), m.w_o, m.b_o)
    return out, weights


def randomize_biases(m, rng):
    for name in ("b_q", "b_k", "b_v", "b_o"):
        setattr(m, name, rng.standard_normal(m.embed_dim).astype(m.w_q.dtype))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("heads", [1, 2, 4])
def test_self_attention_matches_oracle(dtype, heads, rng):
    m = MultiHeadAttention(8, heads, dtype=dtype, seed=1)
    randomize_biases(m, rng)
    x = rng.standard_normal((3, 5, 8)).astype(dtype)
    out, w = m(x, need_weights=True)
    ref_out, ref_w = mha_oracle(m, x, x, x)
    assert out.dtype == dtype and w.dtype == dtype
    assert out.shape == (3, 5, 8) and w.shape == (3, heads, 5, 5)
    np.testing.assert_allclose(out, ref_out, rtol=RTOL[dtype], atol=ATOL[dtype])
    np.testing.assert_allclose(w, ref_w, rtol=RTOL[dtype], atol=ATOL[dtype])
    np.testing.assert_array_equal(m(x), out)


@pytest.mark.parametrize("causal", [False, True, "bottom_right"])
def test_cross_attention_kdim_vdim_mask_causal(causal, rng):
    m = MultiHeadAttention(6, 3, kdim=5, vdim=7, dtype=np.float64, seed=2)
    randomize_biases(m, rng)
    q = rng.standard_normal((2, 4, 6))
    k = rng.standard_normal((2, 9, 5))
    v = rng.standard_normal((2, 9, 7))
    mask = rng.random((2, 1, 4, 9)) < 0.7
    mask[..., 0] = True
    out, w = m(q, k, v, mask=mask, causal=causal, need_weights=True)
    ref_out, ref_w = mha_oracle(m, q, k, v, mask=mask, causal=causal)
    np.testing.assert_allclose(out, ref_out, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(w, ref_w, rtol=1e-12, atol=1e-12)
    assert np.all(w[np.broadcast_to(~mask, w.shape)] == 0)


def test_key_defaults_and_value_defaults_to_key(rng):
    m = MultiHeadAttention(4, 2, dtype=np.float64, seed=3)
    x = rng.standard_normal((1, 3, 4))
    y = rng.standard_normal((1, 6, 4))
    np.testing.assert_array_equal(m(x), m(x, x, x))
    np.testing.assert_array_equal(m(x, y), m(x, y, y))


def test_unbatched_input(rng):
    m = MultiHeadAttention(4, 2, dtype=np.float64, seed=3)
    x = rng.standard_normal((3, 4))
    out, w = m(x, need_weights=True, mask=np.tril(np.ones((3, 3), bool)))
    out_b, w_b = m(x[None], need_weights=True, mask=np.tril(np.ones((3, 3), bool)))
    assert out.shape == (3, 4) and w.shape == (2, 3, 3)
    np.testing.assert_array_equal(out, out_b[0])
    np.testing.assert_array_equal(w, w_b[0])


def test_fully_masked_row_gives_output_bias(rng):
    m = MultiHeadAttention(4, 2, dtype=np.float64, seed=4)
    randomize_biases(m, rng)
    x = rng.standard_normal((1, 3, 4))
    mask = np.ones((3, 3), bool)
    mask[1] = False
    out, w = m(x, mask=mask, need_weights=True)
    np.testing.assert_allclose(out[0, 1], m.b_o, rtol=0, atol=1e-15)
    assert np.all(w[0, :, 1] == 0)


def test_dtype_promotion(rng):
    m32 = MultiHeadAttention(4, 2, seed=0)
    assert m32(rng.standard_normal((1, 2, 4)).astype(np.float32)).dtype == np.float32
    assert m32(rng.standard_normal((1, 2, 4))).dtype == np.float64
    assert m32(np.ones((1, 2, 4), dtype=np.int64)).dtype == np.float64   # ints as float64
    m64 = MultiHeadAttention(4, 2, dtype=np.float64, seed=0)
    assert m64(rng.standard_normal((1, 2, 4)).astype(np.float32)).dtype == np.float64


def test_seeded_initialisation():
    a = MultiHeadAttention(8, 2, seed=7)
    b = MultiHeadAttention(8, 2, seed=7)
    c = MultiHeadAttention(8, 2, seed=8)
    d = MultiHeadAttention(8, 2, seed=7, dtype=np.float64)
    for name in ("w_q", "w_k", "w_v", "w_o", "b_q", "b_o"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
        np.testing.assert_array_equal(getattr(a, name), getattr(d, name).astype(np.float32))
    assert not np.array_equal(a.w_q, c.w_q)
    assert a.w_q.dtype == np.float32 and d.w_q.dtype == np.float64
    bound = math.sqrt(6 / (8 + 3 * 8))                 # Xavier over the packed (24, 8)
    assert np.abs(a.w_q).max() <= bound and np.abs(a.w_o).max() <= 1 / math.sqrt(8)
    assert np.all(a.b_q == 0)


def test_shapes_and_attributes():
    m = MultiHeadAttention(12, 3, kdim=5, vdim=7, seed=0)
    assert (m.embed_dim, m.num_heads, m.head_dim, m.kdim, m.vdim) == (12, 3, 4, 5, 7)
    assert m.w_q.shape == (12, 12) and m.w_k.shape == (12, 5)
    assert m.w_v.shape == (12, 7) and m.w_o.shape == (12, 12)
    assert m.b_q.shape == (12,) and m.bias
    n = MultiHeadAttention(4, 1, bias=False)
    assert not n.bias and n.b_q is None and n.b_o is None
    assert "bias=False" in repr(n) and "kdim=5" in repr(m)


@pytest.mark.parametrize("args, kwargs, error, match", [
    ((10, 3), {}, ValueError, "divisible"),
    ((0, 1), {}, ValueError, "embed_dim"),
    ((4, 0), {}, ValueError, "num_heads"),
    ((4.0, 2), {}, TypeError, "embed_dim"),
    ((4, 2), {"kdim": 0}, ValueError, "kdim"),
    ((4, 2), {"dtype": np.int32}, TypeError, "dtype"),
])
def test_constructor_errors(args, kwargs, error, match):
    with pytest.raises(error, match=match):
        MultiHeadAttention(*args, **kwargs)


def test_call_errors():
    m = MultiHeadAttention(4, 2, kdim=3, vdim=5, seed=0)
    q = np.zeros((2, 3, 4))
    k = np.zeros((2, 6, 3))
    v = np.zeros((2, 6, 5))
    with pytest.raises(ValueError, match=r"query must have shape .*\(3, 4, 2, 4\)"):
        m(np.zeros((3, 4, 2, 4)), k, v)
    with pytest.raises(ValueError, match=r"last axis of query \(2, 3, 5\) must be embed_dim"):
        m(np.zeros((2, 3, 5)), k, v)
    with pytest.raises(ValueError, match="kdim = 3"):
        m(q, np.zeros((2, 6, 4)), v)
    with pytest.raises(ValueError, match="vdim = 5"):
        m(q, k, np.zeros((2, 6, 3)))
    with pytest.raises(ValueError, match="same number of keys"):
        m(q, k, np.zeros((2, 5, 5)))
    with pytest.raises(ValueError, match="same batch size"):
        m(q, np.zeros((1, 6, 3)), np.zeros((1, 6, 5)))
    with pytest.raises(ValueError, match="same number of dimensions"):
        m(q, k[0], v[0])
    with pytest.raises(ValueError, match="mask"):
        m(q, k, v, mask=np.ones((3, 3), bool))
    with pytest.raises(TypeError, match="mask"):
        m(q, k, v, mask=np.ones((3, 6)))
    with pytest.raises(TypeError, match="query"):
        m(q.astype(complex), k, v)
    with pytest.raises(ValueError, match="causal"):
        m(q, k, v, causal="diagonal")


# ------------------------------------------------------------------ state dicts

def torch_like_state(rng, E, kdim=None, vdim=None, bias=True):
    """A state dict laid out as nn.MultiheadAttention's, with random values."""
    state = {}
    if kdim is None and vdim is None:
        state["in_proj_weight"] = rng.standard_normal((3 * E, E))
    else:
        state["q_proj_weight"] = rng.standard_normal((E, E))
        state["k_proj_weight"] = rng.standard_normal((E, kdim or E))
        state["v_proj_weight"] = rng.standard_normal((E, vdim or E))
    if bias:
        state["in_proj_bias"] = rng.standard_normal(3 * E)
    state["out_proj.weight"] = rng.standard_normal((E, E))
    if bias:
        state["out_proj.bias"] = rng.standard_normal(E)
    return state


@pytest.mark.parametrize("kdim, vdim, bias", [(None, None, True), (None, None, False),
                                              (3, 5, True), (3, None, False)])
def test_state_dict_round_trip(kdim, vdim, bias, rng):
    state = torch_like_state(rng, 6, kdim, vdim, bias)
    m = MultiHeadAttention.from_state_dict(state, num_heads=2)
    assert (m.kdim, m.vdim, m.bias) == (kdim or 6, vdim or 6, bias)
    assert m.w_q.dtype == np.float64
    back = m.state_dict()
    assert sorted(back) == sorted(state)
    for name in state:
        np.testing.assert_array_equal(back[name], state[name])
    w = state.get("in_proj_weight")
    if w is not None:
        np.testing.assert_array_equal(m.w_k, w[6:12])
    if bias:
        np.testing.assert_array_equal(m.b_v, state["in_proj_bias"][12:])
        np.testing.assert_array_equal(m.b_o, state["out_proj.bias"])
    # the arrays are copied
    for a in state.values():
        a[...] = 0
    assert np.any(m.w_q != 0)


def test_from_state_dict_output_matches_oracle(rng):
    state = torch_like_state(rng, 8, 3, 5)
    m = MultiHeadAttention.from_state_dict(state, 4)
    q, k, v = (rng.standard_normal(s) for s in ((2, 3, 8), (2, 4, 3), (2, 4, 5)))
    out = m(q, k, v)
    ref, _ = mha_oracle(m, q, k, v)
    np.testing.assert_allclose(out, ref, rtol=1e-12, atol=1e-12)


def test_from_state_dict_dtype(rng):
    state = {k: v.astype(np.float32) for k, v in torch_like_state(rng, 4).items()}
    assert MultiHeadAttention.from_state_dict(state, 2).dtype == np.float32
    m = MultiHeadAttention.from_state_dict(state, 2, dtype=np.float64)
    assert m.dtype == np.float64 and m.w_o.dtype == np.float64
    round_tripped = MultiHeadAttention(4, 2, seed=0).state_dict()
    assert MultiHeadAttention.from_state_dict(round_tripped, 2).dtype == np.float32


def test_from_state_dict_errors(rng):
    good = torch_like_state(rng, 4)
    with pytest.raises(TypeError, match="mapping"):
        MultiHeadAttention.from_state_dict([1, 2], 2)
    with pytest.raises(ValueError, match=r"missing \['out_proj.weight'\]"):
        MultiHeadAttention.from_state_dict(
            {k: v for k, v in good.items() if k != "out_proj.weight"}, 2)
    with pytest.raises(ValueError, match=r"missing \['out_proj.bias'\]"):
        MultiHeadAttention.from_state_dict(
            {k: v for k, v in good.items() if k != "out_proj.bias"}, 2)
    with pytest.raises(ValueError, match="k_proj_weight"):
        MultiHeadAttention.from_state_dict({"q_proj_weight": good["out_proj.weight"],
                                            "out_proj.weight": good["out_proj.weight"]}, 2)
    with pytest.raises(ValueError, match="add_bias_kv"):
        MultiHeadAttention.from_state_dict(dict(good, bias_k=np.zeros((1, 1, 4))), 2)
    with pytest.raises(ValueError, match="unexpected keys"):
        MultiHeadAttention.from_state_dict(dict(good, extra=np.zeros(1)), 2)
    with pytest.raises(ValueError, match=r"in_proj_weight.*\(9, 4\).*\(12, 4\)"):
        MultiHeadAttention.from_state_dict(dict(good, in_proj_weight=np.zeros((9, 4))), 2)
    with pytest.raises(ValueError, match="in_proj_bias"):
        MultiHeadAttention.from_state_dict(dict(good, in_proj_bias=np.zeros(4)), 2)
    with pytest.raises(ValueError, match="divisible"):
        MultiHeadAttention.from_state_dict(good, 3)
    with pytest.raises(TypeError, match="in_proj_weight"):
        MultiHeadAttention.from_state_dict(
            dict(good, in_proj_weight=good["in_proj_weight"].astype(complex)), 2)


# ------------------------------------------------------------------ PyTorch, if present

@pytest.mark.parametrize("kdim, vdim, bias", [(None, None, True), (3, 5, True),
                                              (None, None, False)])
def test_matches_torch_multihead_attention(kdim, vdim, bias, rng):
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    E, H = 8, 2
    t = torch.nn.MultiheadAttention(E, H, kdim=kdim, vdim=vdim, bias=bias,
                                    batch_first=True).double()
    with torch.no_grad():
        for p in t.parameters():          # non-zero biases too
            p.normal_()
    state = {k: v.numpy() for k, v in t.state_dict().items()}
    m = MultiHeadAttention.from_state_dict(state, H)
    q = rng.standard_normal((2, 4, E))
    k = rng.standard_normal((2, 6, kdim or E))
    v = rng.standard_normal((2, 6, vdim or E))
    blocked = rng.random((4, 6)) < 0.3            # PyTorch: True = may NOT attend
    blocked[:, 0] = False
    padding = np.zeros((2, 6), bool)
    padding[1, 5] = True                          # key_padding_mask: True = padding
    with torch.no_grad():
        t_out, t_w = t(torch.from_numpy(q), torch.from_numpy(k), torch.from_numpy(v),
                       attn_mask=torch.from_numpy(blocked),
                       key_padding_mask=torch.from_numpy(padding),
                       need_weights=True, average_attn_weights=False)
    mask = ~blocked & ~padding[:, None, None, :]
    out, w = m(q, k, v, mask=mask, need_weights=True)
    np.testing.assert_allclose(out, t_out.numpy(), rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(w, t_w.numpy(), rtol=1e-10, atol=1e-12)
    with torch.no_grad():
        t_causal, _ = t(torch.from_numpy(q), torch.from_numpy(k[:, :4]),
                        torch.from_numpy(v[:, :4]), is_causal=True,
                        attn_mask=torch.nn.Transformer.generate_square_subsequent_mask(
                            4, dtype=torch.float64))
    np.testing.assert_allclose(m(q, k[:, :4], v[:, :4], causal=True), t_causal.numpy(),
                               rtol=1e-10, atol=1e-10)
