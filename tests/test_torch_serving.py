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
