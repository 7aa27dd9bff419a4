"""fastattn.torch's paged and quantized caches: the NumPy functions on tensors, read
and written in place, against fastattn.reference and PyTorch's SDPA."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
ml_dtypes = pytest.importorskip("ml_dtypes")

import fastattn  # noqa: E402
import fastattn.torch as ft  # noqa: E402
from fastattn import reference  # noqa: E402


def paged(seed=0, dtype=torch.bfloat16, code=None):
    g = torch.Generator().manual_seed(seed)
    kc = torch.randn(10, 16, 2, 32, generator=g)
    vc = torch.randn(10, 16, 2, 32, generator=g)
    ks = vs = None
    if code:
        (kc, ks), (vc, vs) = ft.quantize_kv(kc, code), ft.quantize_kv(vc, code)
    else:
        kc, vc = kc.to(dtype), vc.to(dtype)
    table = torch.tensor([[4, 9, 1], [7, 7, 0]], dtype=torch.int32)   # shared block 7
    lengths = torch.tensor([40, 20])
    q = torch.randn(2, 1, 4, 32, generator=g).to(torch.float32 if code else dtype)
    return q, kc, vc, table, lengths, ks, vs


def numpy_of(t):
    if t is None:
        return None
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    if t.dtype == torch.float8_e4m3fn:
        return t.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn)
    if t.dtype == torch.float8_e5m2:
        return t.view(torch.uint8).numpy().view(ml_dtypes.float8_e5m2)
    return t.numpy()


@pytest.mark.parametrize("code", [None, "int8", torch.float8_e4m3fn, "float8_e5m2"])
def test_attention_paged_on_tensors_is_the_numpy_call(code):
    q, kc, vc, table, lengths, ks, vs = paged(code=code)
    got, lse = ft.attention_paged(q, kc, vc, table, lengths, k_scale=ks, v_scale=vs,
                                  return_lse=True)
    assert got.dtype == q.dtype and got.shape == (2, 1, 4, 32)
    want, want_lse = fastattn.attention_paged(
        numpy_of(q), numpy_of(kc), numpy_of(vc), table.numpy(), lengths.numpy(),
        k_scale=numpy_of(ks), v_scale=numpy_of(vs), return_lse=True)
    np.testing.assert_array_equal(numpy_of(got), want)
    np.testing.assert_array_equal(lse.numpy(), want_lse)


@pytest.mark.parametrize("code", ["int8", torch.float8_e4m3fn, "float8_e5m2"])
@pytest.mark.parametrize("qdtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("variants", [{}, dict(causal="bottom_right", window=(20, 0)),
                                      dict(sinks=True, kv_lengths=[50, 7])])
def test_a_quantized_cache_takes_the_short_path(monkeypatch, code, qdtype, variants):
    """attention over a quantized cache of plain tensors goes straight to the NumPy
    API (no keyword scan, no per-tensor checks): the NumPy call's bits, the general
    path's bits."""
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 4, 3, 32, generator=g).to(qdtype)
    k, ks = ft.quantize_kv(torch.randn(2, 2, 50, 32, generator=g), code)
    v, vs = ft.quantize_kv(torch.randn(2, 2, 50, 16, generator=g), code)
    kw = dict(variants, enable_gqa=True)
    if kw.pop("sinks", False):
        kw["sinks"] = torch.randn(4, generator=g)
    if "kv_lengths" in kw:
        kw["kv_lengths"] = torch.tensor(kw["kv_lengths"])
    calls = []
    real = ft._plain_call
    monkeypatch.setattr(ft, "_plain_call", lambda *a: calls.append(1) or real(*a))
    got, lse = ft.attention(q, k, v, k_scale=ks, v_scale=vs, return_lse=True, **kw)
    assert calls == [1] and got.dtype == qdtype and got.shape == (2, 4, 3, 16)
    np_kw = {name: numpy_of(x) if isinstance(x, torch.Tensor) else x
             for name, x in kw.items()}
    want, want_lse = fastattn.attention(numpy_of(q), numpy_of(k), numpy_of(v),
                                        k_scale=ks.numpy(), v_scale=vs.numpy(),
                                        return_lse=True, **np_kw)
    np.testing.assert_array_equal(numpy_of(got), want)
    np.testing.assert_array_equal(lse.numpy(), want_lse)
    monkeypatch.setattr(ft, "_plain_codes", lambda *a: False)
    general = ft.attention(q, k, v, k_scale=ks, v_scale=vs, **kw)
    assert calls == [1]
    assert torch.equal(general.view(torch.int16 if qdtype != torch.float32
                                    else torch.int32),
                       got.view(torch.int16 if qdtype != torch.float32 else torch.int32))


def test_every_other_quantized_tensor_call_takes_the_general_path():
    """_plain_codes says False, and the general path checks and refuses or computes,
    for a cache that records a gradient (under grad mode), float k and v beside
    scales, a float64 q, codes of two dtypes and float64 scales."""
    g = torch.Generator().manual_seed(6)
    q = torch.randn(1, 2, 1, 16, generator=g)
    k, ks = ft.quantize_kv(torch.randn(1, 2, 30, 16, generator=g))
    v, vs = ft.quantize_kv(torch.randn(1, 2, 30, 16, generator=g))
    assert ft._plain_codes(q, k, v, ks, vs)
    graded = q.clone().requires_grad_()
    assert not ft._plain_codes(graded, k, v, ks, vs)
    with pytest.raises(TypeError, match="requires a gradient"):
        ft.attention(graded, k, v, k_scale=ks, v_scale=vs)
    with torch.no_grad():
        assert ft._plain_codes(graded, k, v, ks, vs)
        np.testing.assert_array_equal(ft.attention(graded, k, v, k_scale=ks,
                                                   v_scale=vs).numpy(),
                                      ft.attention(q, k, v, k_scale=ks, v_scale=vs).numpy())
    assert not ft._plain_codes(q, k.float(), v.float(), ks, vs)
    with pytest.raises(ValueError, match="k_scale and v_scale are for a quantized"):
        ft.attention(q, k.float(), v.float(), k_scale=ks, v_scale=vs)
    assert not ft._plain_codes(q.double(), k, v, ks, vs)
    with pytest.raises(TypeError, match="q must be float32, bfloat16 or float16"):
        ft.attention(q.double(), k, v, k_scale=ks, v_scale=vs)
    e4m3 = v.to(torch.float8_e4m3fn)
    assert not ft._plain_codes(q, k, e4m3, ks, vs)      # (the general path takes it)
    np.testing.assert_array_equal(
        ft.attention(q, k, e4m3, k_scale=ks, v_scale=vs).numpy(),
        fastattn.attention(q.numpy(), k.numpy(), numpy_of(e4m3), k_scale=ks.numpy(),
                           v_scale=vs.numpy()))
    assert not ft._plain_codes(q, k, v, ks.double(), vs)
    np.testing.assert_array_equal(
        ft.attention(q, k, v, k_scale=ks.double(), v_scale=vs).numpy(),
        ft.attention(q, k, v, k_scale=ks, v_scale=vs).numpy())


def test_quantized_cache_against_sdpa_on_the_dequantized_values():
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 4, 3, 32, generator=g)
    k, ks = ft.quantize_kv(torch.randn(1, 2, 50, 32, generator=g), torch.float8_e4m3fn)
    v, vs = ft.quantize_kv(torch.randn(1, 2, 50, 32, generator=g))
    got = ft.attention(q, k, v, k_scale=ks, v_scale=vs, enable_gqa=True,
                       causal="bottom_right")
    kd = k.float() * ks[..., None]
    vd = v.float() * vs[..., None]
    mask = torch.ones(3, 50, dtype=torch.bool).tril(diagonal=47)
    want = torch.nn.functional.scaled_dot_product_attention(
        q.double(), kd.double().repeat_interleave(2, 1), vd.double().repeat_interleave(2, 1),
        attn_mask=mask)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)


def test_store_kv_writes_the_tensors_in_place():
    kc = torch.full((4, 2, 1, 8), 7, dtype=torch.int8)
    vc = kc.clone()
    ks = torch.ones(4, 2, 1)
    vs = torch.ones(4, 2, 1)
    k = torch.randn(2, 1, 8)
    ft.store_kv(kc, vc, torch.tensor([3, -1]), k, k, k_scale=ks, v_scale=vs)
    codes, scale = reference.quantize_kv(k[:1].numpy(), "int8")
    np.testing.assert_array_equal(kc[1, 1].numpy(), codes[0])
    np.testing.assert_array_equal(ks[1, 1].numpy(), scale[0])
    untouched = torch.ones(4, 2, dtype=torch.bool)
    untouched[1, 1] = False
    assert (kc[untouched] == 7).all() and (ks[untouched] == 1).all()
    bf = torch.zeros(4, 2, 1, 8, dtype=torch.bfloat16)
    ft.store_kv(bf, bf.clone(), torch.tensor([0]), k[:1], k[:1])
    assert torch.equal(bf[0, 0], k[0].to(torch.bfloat16))


def test_caches_are_for_inference():
    q, kc, vc, table, lengths, _, _ = paged(dtype=torch.float32)
    q.requires_grad_(True)
    with pytest.raises(TypeError, match="for inference"):
        ft.attention_paged(q, kc, vc, table, lengths)
    with torch.no_grad():
        ft.attention_paged(q, kc, vc, table, lengths)
    k, ks = ft.quantize_kv(torch.randn(1, 2, 5, 32))
    with pytest.raises(TypeError, match="for inference"):
        ft.attention(torch.randn(1, 2, 1, 32, requires_grad=True), k, k, k_scale=ks,
                     v_scale=ks)
    with pytest.raises(ValueError, match="on the CPU"):
        ft.attention_paged(q.detach().to("meta"), kc, vc, table, lengths)
