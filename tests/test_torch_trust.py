"""fastattn.torch: attention sinks, and what the operator must never do silently.

- sinks on the operator, ``attention`` and the drop-in, with a gradient, under
  ``torch.compile`` and ``gradcheck``;
- a tensor argument on another device (``meta``) or with another layout (sparse)
  raises an error naming it (it used to give a CPU tensor of uninitialised memory);
- window sides and ``num_threads`` beyond 64 bits and a huge int ``scale`` behave alike
  with and without autograd;
- the gradient of a floating mask (bias) and of ALiBi slopes with window, softcap,
  ALiBi, sinks and dropout (it used to raise NotImplementedError in the backward);
- forward-mode AD (``torch.func.jvp``, ``jacfwd``, dual tensors) gives the tangent of
  PyTorch's own arithmetic (it used to give zeros).

The oracles: ``fastattn.reference`` and :func:`math_attention` below, attention
written out in float64 PyTorch arithmetic, differentiated by PyTorch's autograd.
"""

import math
import os

import numpy as np
import pytest

from fastattn import _philox, reference

if os.environ.get("FASTATTN_SANITIZED"):     # before anything imports torch
    pytest.skip("PyTorch is not run under the sanitizer build", allow_module_level=True)
torch = pytest.importorskip("torch")
ft = pytest.importorskip("fastattn.torch")

F = torch.nn.functional
D = torch.float64
fwad = torch.autograd.forward_ad


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(20260512)


def randn(gen, *shape, dtype=D):
    return torch.randn(*shape, generator=gen, dtype=D).to(dtype)


def math_attention(q, k, v, *, mask=None, bias=None, causal=False, scale=None,
                   window=None, softcap=None, alibi=None, sinks=None, keep=None,
                   dropout_p=0.0):
    """softmax(S, with the sink as one more column) @ v in PyTorch arithmetic, the
    attention matrix formed. k and v have q's heads already (GQA repeated by the
    caller). ``causal``: False, "top_left" or "bottom_right". ``keep``: the dropout
    pattern (bool, (*batch, Lq, Lk)). Rows with no allowed key and no sink: zeros."""
    Lq, Lk = q.shape[-2], k.shape[-2]
    if scale is None:
        scale = 1 / math.sqrt(q.shape[-1])
    s = q @ k.transpose(-1, -2) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    if bias is not None:
        s = s + bias
    d = Lk - Lq if causal == "bottom_right" else 0
    i = torch.arange(Lq)[:, None] + d
    j = torch.arange(Lk)[None, :]
    if alibi is not None:
        s = s - alibi[..., None, None] * (i - j).abs()
    allowed = torch.ones(Lq, Lk, dtype=torch.bool)
    if causal:
        allowed = allowed & (j <= i)
    if window is not None:
        left, right = window
        if left is not None:
            allowed = allowed & (j >= i - left)
        if right is not None:
            allowed = allowed & (j <= i + right)
    if mask is not None:
        allowed = allowed & mask
    s = s.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        col = sinks[..., None, None].expand(*s.shape[:-1], 1)
        s = torch.cat([s, col], dim=-1)
    m = s.amax(-1, keepdim=True).detach()
    m = torch.where(torch.isfinite(m), m, torch.zeros((), dtype=s.dtype))
    e = torch.exp(s - m)
    total = e.sum(-1, keepdim=True)
    p = e / torch.where(total > 0, total, torch.ones((), dtype=s.dtype))
    if sinks is not None:
        p = p[..., :-1]
    if keep is not None:
        p = p * keep / (1 - dropout_p)
    return p @ v


def gqa(x, groups):
    return x.repeat_interleave(groups, dim=-3)


# ---------------------------------------------------------------------------- sinks

@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("extra", [{}, dict(causal="bottom_right", window=(3, 1)),
                                   dict(softcap=2.0, alibi=True, bias=True)],
                         ids=["plain", "bottom-right window", "softcap alibi bias"])
def test_sinks_forward_matches_the_reference(gen, dtype, extra):
    q = randn(gen, 2, 4, 5, 16, dtype=dtype)
    k = randn(gen, 2, 2, 9, 16, dtype=dtype)
    v = randn(gen, 2, 2, 9, 8, dtype=dtype)
    sinks = randn(gen, 4) * 2
    kw = dict(causal=extra.get("causal", False), window=extra.get("window"),
              softcap=extra.get("softcap"))
    if extra.get("alibi"):
        kw["alibi_slopes"] = torch.tensor([0.5, 0.25, 0.125, 0.0625])
    if extra.get("bias"):
        kw["bias"] = randn(gen, 4, 5, 9, dtype=dtype)
    out, lse = ft.attention(q, k, v, enable_gqa=True, sinks=sinks, return_lse=True, **kw)
    np_kw = {n: (a.numpy() if isinstance(a, torch.Tensor) else a) for n, a in kw.items()}
    want, want_lse = reference.attention(q.numpy(), k.numpy(), v.numpy(), enable_gqa=True,
                                         sinks=sinks.numpy(), return_lse=True, **np_kw)
    tol = 1e-12 if dtype == torch.float64 else 2e-6
    np.testing.assert_allclose(out.numpy(), want, rtol=tol, atol=tol)
    np.testing.assert_allclose(lse.numpy(), want_lse, rtol=tol, atol=tol)
    # the same through the dispatcher (q requires a gradient) and the drop-in
    got = ft.attention(q.clone().requires_grad_(), k, v, enable_gqa=True, sinks=sinks,
                       **kw)
    torch.testing.assert_close(got.detach(), out, rtol=0, atol=0)
    if not extra:
        got = ft.scaled_dot_product_attention(q, k, v, enable_gqa=True, sinks=sinks)
        torch.testing.assert_close(got, out, rtol=0, atol=0)


def test_sinks_change_the_result_and_a_row_with_no_key_is_zeros(gen):
    q, k, v = (randn(gen, 1, 2, 4, 8) for _ in range(3))
    sinks = torch.tensor([1.5, -0.5], dtype=D)
    assert not torch.allclose(ft.attention(q, k, v, sinks=sinks), ft.attention(q, k, v))
    mask = torch.ones(4, 4, dtype=torch.bool)
    mask[1] = False
    out, lse = ft.attention(q, k, v, mask=mask, sinks=sinks, return_lse=True)
    assert torch.equal(out[..., 1, :], torch.zeros(1, 2, 8, dtype=D))
    assert torch.equal(lse[..., 1], sinks[None])


def test_sinks_gradcheck_float64(gen):
    q = randn(gen, 2, 4, 5, 8).requires_grad_()
    k = randn(gen, 2, 7, 8).requires_grad_()                 # broadcast + GQA
    v = randn(gen, 2, 7, 6).requires_grad_()
    sinks = randn(gen, 2, 4).requires_grad_()                # per batch and head
    bias = randn(gen, 4, 5, 7).requires_grad_()

    def f(q, k, v, sinks, bias):
        return ft.attention(q, k, v, bias=bias, sinks=sinks, causal="bottom_right",
                            enable_gqa=True, num_threads=1)

    assert torch.autograd.gradcheck(f, (q, k, v, sinks, bias))
    assert torch.autograd.gradcheck(
        lambda q, k, v, s: ft.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=True, sinks=s), (q, k, v, sinks[0]))


@pytest.mark.parametrize("sink_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_sinks_gradient_matches_pytorch_autograd(gen, sink_dtype):
    """float32 q, k, v; the sinks' gradient has the sinks' shape and dtype and is
    that of the float64 formula differentiated by PyTorch."""
    q = randn(gen, 2, 4, 6, 16, dtype=torch.float32).requires_grad_()
    k = randn(gen, 2, 2, 9, 16, dtype=torch.float32).requires_grad_()
    v = randn(gen, 2, 2, 9, 16, dtype=torch.float32).requires_grad_()
    sinks = (randn(gen, 4) * 2).to(sink_dtype).requires_grad_()
    grad = randn(gen, 2, 4, 6, 16, dtype=torch.float32)
    out = ft.attention(q, k, v, sinks=sinks, causal=True, enable_gqa=True)
    got = torch.autograd.grad(out, (q, k, v, sinks), grad)
    wide = [t.detach().double().requires_grad_() for t in (q, k, v, sinks)]
    want_out = math_attention(wide[0], gqa(wide[1], 2), gqa(wide[2], 2), causal=True,
                              sinks=wide[3])
    want = torch.autograd.grad(want_out, wide, grad.double())
    torch.testing.assert_close(out.double(), want_out.detach(), rtol=2e-6, atol=2e-6)
    assert got[3].dtype == sink_dtype and got[3].shape == sinks.shape
    for a, b in zip(got, want):
        tol = 2e-5 if a.dtype == torch.float32 else 1e-2
        torch.testing.assert_close(a.double(), b, rtol=tol, atol=tol)
    assert got[3].abs().max() > 0.01


def test_sinks_only_the_sinks_require_a_gradient(gen):
    q, k, v = (randn(gen, 1, 2, 4, 8) for _ in range(3))
    sinks = randn(gen, 2).requires_grad_()
    (ft.attention(q, k, v, sinks=sinks) ** 2).sum().backward()
    wide = sinks.detach().clone().requires_grad_()
    (math_attention(q, k, v, sinks=wide) ** 2).sum().backward()
    torch.testing.assert_close(sinks.grad, wide.grad, rtol=1e-12, atol=1e-12)


def test_sinks_opcheck_and_compile(gen):
    q = randn(gen, 2, 4, 5, 8, dtype=torch.float32).requires_grad_()
    k = randn(gen, 2, 2, 7, 8, dtype=torch.float32).requires_grad_()
    v = randn(gen, 2, 2, 7, 6, dtype=torch.float32).requires_grad_()
    sinks = randn(gen, 4, dtype=torch.float32).requires_grad_()
    variants = (3, 0, 5.0, None, 0.0, None, sinks)
    args = (q, k, v, None, None, 1, None, True, None) + variants
    torch.library.opcheck(torch.ops.fastattn.attention.default, args)
    out, lse = torch.ops.fastattn.attention(*args)
    grad = randn(gen, 2, 4, 5, 6, dtype=torch.float32)
    torch.library.opcheck(torch.ops.fastattn.attention_backward.default,
                          (grad, q.detach(), k.detach(), v.detach(), out.detach(), lse,
                           None, None, 1, None, True, None) + variants[:-1]
                          + (sinks.detach(),))

    def f(q, k, v, sinks):
        out = ft.attention(q.sin(), k, v, causal=True, enable_gqa=True, sinks=sinks,
                           window=(3, 0))
        return out.square().sum()

    assert torch._dynamo.explain(f)(q, k, v, sinks).graph_break_count == 0
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    got, want = compiled(q, k, v, sinks), f(q, k, v, sinks)
    torch.testing.assert_close(got, want)
    for a, b in zip(torch.autograd.grad(got, (q, k, v, sinks)),
                    torch.autograd.grad(want, (q, k, v, sinks))):
        torch.testing.assert_close(a, b)
    torch._dynamo.reset()


def test_sinks_take_the_direct_path_without_autograd(gen, monkeypatch):
    q, k, v = (randn(gen, 1, 2, 4, 8) for _ in range(3))
    sinks = randn(gen, 2)
    decisions = []          # of _plain (the short path) and _direct (the others)
    for name in ("_plain", "_direct"):
        monkeypatch.setattr(ft, name, lambda *a, _f=getattr(ft, name):
                            decisions.append(_f(*a)) or decisions[-1])
    got = ft.attention(q, k, v, sinks=sinks)
    assert decisions == [True]                        # the short path
    with torch.no_grad():
        ft.attention(q, k, v, sinks=sinks.clone().requires_grad_())
    assert decisions == [True, True]
    decisions.clear()
    want = ft.attention(q, k, v, sinks=sinks.clone().requires_grad_())
    assert decisions[-1] is False                     # autograd: the dispatcher
    assert torch.equal(got, want.detach())


# -------------------------------------- finding 1: other devices and layouts refused

def _sdpa_args(gen, name):
    q = randn(gen, 1, 2, 4, 8, dtype=torch.float32)
    args = dict(query=q, key=q.clone(), value=q.clone(),
                attn_mask=torch.ones(4, 4, dtype=torch.bool),
                alibi_slopes=torch.tensor([0.5, 0.25]))
    if name == "sinks":
        args["sinks"] = torch.zeros(2)
    return args


SDPA_ARGS = ["query", "key", "value", "attn_mask", "float attn_mask", "alibi_slopes",
             "sinks"]
ATTENTION_ARGS = ["q", "k", "v", "mask", "bias", "alibi_slopes", "sinks", "q_lengths",
                  "kv_lengths", "out"]


def _odd(t, kind):
    return t.to("meta") if kind == "meta" else t.to_sparse()


@pytest.mark.parametrize("grad", [False, True], ids=["no grad", "grad"])
@pytest.mark.parametrize("kind", ["meta", "sparse"])
@pytest.mark.parametrize("name", SDPA_ARGS)
def test_sdpa_refuses_a_tensor_on_another_device_or_layout(gen, name, kind, grad):
    args = _sdpa_args(gen, name)
    if name == "float attn_mask":
        args["attn_mask"] = torch.zeros(4, 4)
        name = "attn_mask"
    if grad:
        args["query"].requires_grad_()
    args[name] = _odd(args[name], kind)
    q, k, v = args.pop("query"), args.pop("key"), args.pop("value")
    with pytest.raises((ValueError, TypeError, RuntimeError),
                       match=rf"{name} (is on meta|has layout torch\.sparse)"):
        ft.scaled_dot_product_attention(q, k, v, **args)


@pytest.mark.parametrize("grad", [False, True], ids=["no grad", "grad"])
@pytest.mark.parametrize("kind", ["meta", "sparse"])
@pytest.mark.parametrize("name", ATTENTION_ARGS)
def test_attention_refuses_a_tensor_on_another_device_or_layout(gen, name, kind, grad):
    q = randn(gen, 1, 2, 4, 8, dtype=torch.float32)
    args = dict(q=q, k=q.clone(), v=q.clone(), mask=torch.ones(4, 4, dtype=torch.bool),
                bias=torch.zeros(4, 4), alibi_slopes=torch.tensor([0.5, 0.25]))
    if name in ("sinks", "q_lengths", "kv_lengths"):
        args[name] = torch.zeros(2, dtype=torch.int64 if "lengths" in name else None)
    if name == "out":
        args["out"] = torch.empty(1, 2, 4, 8)
        grad = False                        # out= under autograd: refused anyway
    if grad:
        args["k"].requires_grad_()
    args[name] = _odd(args[name], kind)
    q, k, v = args.pop("q"), args.pop("k"), args.pop("v")
    with pytest.raises((ValueError, TypeError, RuntimeError),
                       match=rf"{name} (is on meta|has layout torch\.sparse)"):
        ft.attention(q, k, v, **args)


def test_the_operator_refuses_mixed_devices_and_all_meta_still_infers_shapes(gen):
    q = randn(gen, 1, 2, 4, 8, dtype=torch.float32)
    none = (None,) * 4 + (0.0, None)
    op = torch.ops.fastattn.attention
    with pytest.raises(RuntimeError, match="k is on meta"):
        op(q, q.to("meta"), q, None, None, 0, None, False, None, *none)
    with pytest.raises(RuntimeError, match="bias is on meta"):
        op(q, q, q, None, torch.zeros(4, 4, device="meta"), 0, None, False, None, *none)
    meta = q.to("meta")
    out = ft.scaled_dot_product_attention(meta, meta, meta[..., :5], dropout_p=0.1)
    assert out.device.type == "meta" and out.shape == (1, 2, 4, 5)


# ----------------------------------- finding 12: huge ints alike on every path

@pytest.mark.parametrize("grad", [False, True], ids=["no grad", "grad"])
def test_a_window_side_beyond_64_bits_is_unbounded(gen, grad):
    q, k, v = (randn(gen, 1, 2, 6, 8, dtype=torch.float32) for _ in range(3))
    q.requires_grad_(grad)
    for window, same in [((2**63, 0), (None, 0)), ((1, 10**30), (1, None)),
                         ((2**64, 2**63), None)]:
        got = ft.attention(q, k, v, causal="bottom_right", window=window)
        want = ft.attention(q, k, v, causal="bottom_right", window=same)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        got = ft.scaled_dot_product_attention(q, k, v, window=window)
        i, j = torch.arange(6)[:, None], torch.arange(6)[None, :]
        allowed = torch.ones(6, 6, dtype=torch.bool)
        if same is not None and same[0] is not None:
            allowed = allowed & (j >= i - same[0])
        if same is not None and same[1] is not None:
            allowed = allowed & (j <= i + same[1])
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("grad", [False, True], ids=["no grad", "grad"])
def test_num_threads_beyond_64_bits_is_capped(gen, grad):
    q, k, v = (randn(gen, 1, 2, 6, 8, dtype=torch.float32) for _ in range(3))
    q.requires_grad_(grad)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    for n in (2**63, 2**70, np.uint64(2**64 - 1)):
        got = ft.scaled_dot_product_attention(q, k, v, is_causal=True, num_threads=n)
        torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)
        got = ft.attention(q, k, v, causal=True, num_threads=n, bias=torch.zeros(6, 6))
        torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("grad", [False, True], ids=["no grad", "grad"])
def test_a_huge_int_scale_is_a_value_error(gen, grad):
    q, k, v = (randn(gen, 1, 2, 6, 8, dtype=torch.float32) for _ in range(3))
    q.requires_grad_(grad)
    for call in (lambda: ft.scaled_dot_product_attention(q, k, v, scale=10**400),
                 lambda: ft.attention(q, k, v, scale=-10**400),
                 lambda: ft.attention(q, k, v, scale=10**400, bias=torch.zeros(6, 6)),
                 lambda: ft.scaled_dot_product_attention(q, k, v, scale=10**400,
                                                         softcap=5.0)):
        with pytest.raises(ValueError, match="scale"):
            call()


# -------------------- finding 11: the gradient of a bias with every variant

VARIANTS = {
    "window": dict(causal="bottom_right", window=(2, 1)),
    "softcap": dict(softcap=1.5),
    "alibi": dict(alibi=True),
    "sinks": dict(sinks=True),
    "dropout": dict(dropout_p=0.3),
    "all": dict(causal="top_left", window=(3, None), softcap=2.0, alibi=True,
                sinks=True, dropout_p=0.25),
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_bias_and_alibi_gradients_with_every_variant(gen, name):
    """dbias (and d alibi_slopes) against PyTorch autograd through the float64 formula,
    with the kernels' dropout pattern (fastattn._philox, from the same seed)."""
    case = VARIANTS[name]
    q = randn(gen, 2, 4, 6, 8).requires_grad_()
    k = randn(gen, 2, 2, 9, 8).requires_grad_()
    v = randn(gen, 2, 2, 9, 8).requires_grad_()
    bias = randn(gen, 4, 6, 9).requires_grad_()
    slopes = (torch.tensor([0.5, 0.25, 0.125, 0.0625], dtype=D).requires_grad_()
              if case.get("alibi") else None)
    sinks = randn(gen, 4).requires_grad_() if case.get("sinks") else None
    p = case.get("dropout_p", 0.0)
    seed = torch.tensor([4242])
    causal = {None: 0, "top_left": 1, "bottom_right": 2}[case.get("causal")]
    window = case.get("window", (None, None))
    args = (q, k, v, None, bias, causal, None, True, None, window[0], window[1],
            case.get("softcap"), slopes, p, seed if p else None)
    out = torch.ops.fastattn.attention(*args, *(() if sinks is None else (sinks,)))[0]
    keep = None
    if p:
        keep = torch.from_numpy(_philox.dropout_keep(4242, p, np.arange(8).reshape(2, 4),
                                                     6, 9))
    named = {n: t for n, t in zip(("q", "k", "v", "bias", "alibi", "sinks"),
                                  (q, k, v, bias, slopes, sinks)) if t is not None}
    inputs = list(named.values())
    named = {n: t.detach().clone().requires_grad_() for n, t in named.items()}
    wide = list(named.values())
    want_out = math_attention(named["q"], gqa(named["k"], 2), gqa(named["v"], 2),
                              bias=named["bias"], causal=case.get("causal", False),
                              window=case.get("window"), softcap=case.get("softcap"),
                              alibi=named.get("alibi"), sinks=named.get("sinks"),
                              keep=keep, dropout_p=p)
    torch.testing.assert_close(out.detach(), want_out.detach(), rtol=1e-12, atol=1e-12)
    grad = randn(gen, *out.shape)
    got = torch.autograd.grad(out, inputs, grad)
    want = torch.autograd.grad(want_out, wide, grad)
    for a, b in zip(got, want):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    assert got[3].abs().max() > 1e-3                      # dbias is not zero


def test_bias_gradcheck_with_variants_through_the_public_functions(gen):
    q = randn(gen, 1, 2, 5, 8).requires_grad_()
    k = randn(gen, 1, 2, 7, 8).requires_grad_()
    v = randn(gen, 1, 2, 7, 8).requires_grad_()
    bias = randn(gen, 2, 5, 7).requires_grad_()
    slopes = torch.tensor([0.3, 0.1], dtype=D).requires_grad_()
    assert torch.autograd.gradcheck(
        lambda q, k, v, b, s: ft.attention(q, k, v, bias=b, alibi_slopes=s,
                                           causal="bottom_right", window=(2, 0),
                                           softcap=3.0),
        (q, k, v, bias, slopes))
    assert torch.autograd.gradcheck(
        lambda b: ft.scaled_dot_product_attention(q, k, v, attn_mask=b, softcap=3.0,
                                                  window=(1, 1)), (bias,))


def test_a_float_attn_mask_with_dropout_trains(gen):
    """The call that raised NotImplementedError in the backward: a learned float mask
    with dropout, through the drop-in; the seed comes from torch's generator."""
    q, k, v = (randn(gen, 1, 2, 16, 8) for _ in range(3))
    bias = randn(gen, 2, 16, 16).requires_grad_()
    torch.manual_seed(7)
    out = ft.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=0.5)
    out.square().sum().backward()
    assert torch.isfinite(bias.grad).all() and bias.grad.abs().max() > 0


# ------------------------------------------------ finding 8: forward-mode AD

def _jvp_case(gen):
    q = randn(gen, 2, 4, 5, 8)
    k = randn(gen, 2, 2, 7, 8)
    v = randn(gen, 2, 2, 7, 6)
    bias = randn(gen, 4, 5, 7)
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625], dtype=D)
    sinks = randn(gen, 4)
    return q, k, v, bias, slopes, sinks


def _ours(q, k, v, bias, slopes, sinks):
    return ft.attention(q, k, v, bias=bias, alibi_slopes=slopes, sinks=sinks,
                        causal="bottom_right", window=(3, 1), softcap=2.5,
                        enable_gqa=True)


def _theirs(q, k, v, bias, slopes, sinks):
    return math_attention(q, gqa(k, 2), gqa(v, 2), bias=bias, alibi=slopes, sinks=sinks,
                          causal="bottom_right", window=(3, 1), softcap=2.5)


def test_jvp_matches_pytorch_math(gen):
    primals = _jvp_case(gen)
    tangents = tuple(randn(gen, *t.shape) for t in primals)
    out, t_out = torch.func.jvp(_ours, primals, tangents)
    want, t_want = torch.func.jvp(_theirs, primals, tangents)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    assert t_want.abs().max() > 0.1
    torch.testing.assert_close(t_out, t_want, rtol=1e-10, atol=1e-10)
    # one input at a time (the others' tangents zero)
    for i in range(6):
        f = (lambda x, i=i: _ours(*primals[:i], x, *primals[i + 1:]))
        g = (lambda x, i=i: _theirs(*primals[:i], x, *primals[i + 1:]))
        got = torch.func.jvp(f, (primals[i],), (tangents[i],))[1]
        want = torch.func.jvp(g, (primals[i],), (tangents[i],))[1]
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_jacfwd_matches_jacrev_and_pytorch_math(gen):
    q, k, v, bias, slopes, sinks = _jvp_case(gen)
    q, k, v = q[:1, :, :3], k[:1], v[:1]
    bias = bias[:, :3]
    args = (q, k, v, bias, slopes, sinks)
    got = torch.func.jacfwd(_ours, argnums=(0, 1, 2, 5))(*args)
    want = torch.func.jacfwd(_theirs, argnums=(0, 1, 2, 5))(*args)
    rev = torch.func.jacrev(_ours, argnums=(0, 1, 2, 5))(*args)
    for a, b, c in zip(got, want, rev):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(a, c, rtol=1e-10, atol=1e-10)


def test_dual_tensors_and_the_plain_path(gen):
    q, k, v = (randn(gen, 1, 2, 5, 8) for _ in range(3))
    tq, tv = randn(gen, 1, 2, 5, 8), randn(gen, 1, 2, 5, 8)
    with fwad.dual_level():
        out = ft.scaled_dot_product_attention(fwad.make_dual(q, tq), k,
                                              fwad.make_dual(v, tv), is_causal=True)
        got = fwad.unpack_dual(out).tangent
        # (PyTorch's own SDPA has no forward-mode formula on the CPU: the math)
        want = fwad.unpack_dual(math_attention(
            fwad.make_dual(q, tq), k, fwad.make_dual(v, tv), causal="top_left")).tangent
    assert got is not None
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    # the plain call (no mask, no variant) under torch.func.jvp
    got = torch.func.jvp(lambda q: ft.scaled_dot_product_attention(q, k, v), (q,), (tq,))
    want = torch.func.jvp(lambda q: math_attention(q, k, v), (q,), (tq,))
    torch.testing.assert_close(got[1], want[1], rtol=1e-10, atol=1e-10)


def test_the_bare_operators_refuse_forward_mode(gen):
    """torch.ops.fastattn.* have no forward formula of their own: an error, not the
    zero tangent the dispatcher would give."""
    q = randn(gen, 1, 2, 4, 8)
    none = (None,) * 4 + (0.0, None)
    op = torch.ops.fastattn.attention
    with pytest.raises(RuntimeError, match="no forward-mode AD formula"):
        torch.func.jvp(lambda q: op(q, q, q, None, None, 0, None, False, None,
                                    *none)[0], (q,), (q,))
    with fwad.dual_level(), pytest.raises(RuntimeError, match="no forward-mode AD"):
        op(fwad.make_dual(q, q), q, q, None, None, 0, None, False, None, *none)
    out, lse = op(q, q, q, None, None, 0, None, False, None, *none)
    with pytest.raises(RuntimeError, match="no forward-mode AD formula"):
        torch.func.jvp(lambda g: torch.ops.fastattn.attention_backward(
            g, q, q, q, out, lse, None, None, 0, None, False, None, *none)[0],
            (q,), (q,))


def test_the_func_transforms_in_reverse_mode(gen):
    """torch.func.grad and vjp (which refuse the operator's generated autograd
    function) give PyTorch's gradients."""
    q, k, v = (randn(gen, 1, 2, 4, 8) for _ in range(3))
    sinks = randn(gen, 2)
    got = torch.func.grad(lambda q, s: ft.attention(q, k, v, sinks=s).square().sum(),
                          argnums=(0, 1))(q, sinks)
    want = torch.func.grad(lambda q, s: math_attention(q, k, v, sinks=s).square().sum(),
                           argnums=(0, 1))(q, sinks)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    out, vjp = torch.func.vjp(lambda v: ft.scaled_dot_product_attention(q, k, v), v)
    want, want_vjp = torch.func.vjp(lambda v: math_attention(q, k, v), v)
    torch.testing.assert_close(vjp(out)[0], want_vjp(want)[0], rtol=1e-10, atol=1e-10)
    with pytest.raises(NotImplementedError, match="cannot be differentiated again"):
        torch.func.grad(lambda q: torch.func.grad(
            lambda q: ft.attention(q, k, v).sum())(q).sum())(q)


def test_jvp_with_dropout_follows_the_kernels_pattern(gen):
    """With the same seed (torch.manual_seed before each call), the forward-mode
    tangent and the reverse-mode gradient of the kernels (which regenerate the
    pattern) agree: <tO, g> = <tq, dq> + <tk, dk> + <tv, dv>. A tangent without the
    dropout factors would not."""
    q, k, v = (randn(gen, 1, 2, 16, 8) for _ in range(3))
    tq, tk, tv, g = (randn(gen, 1, 2, 16, 8) for _ in range(4))

    def f(q, k, v):
        return ft.scaled_dot_product_attention(q, k, v, dropout_p=0.4)

    torch.manual_seed(11)
    out, t_out = torch.func.jvp(f, (q, k, v), (tq, tk, tv))
    torch.manual_seed(11)
    qkv = [t.clone().requires_grad_() for t in (q, k, v)]
    again = f(*qkv)
    assert torch.equal(again.detach(), out)
    grads = torch.autograd.grad(again, qkv, g)
    lhs = (t_out * g).sum()
    rhs = sum((t * d).sum() for t, d in zip((tq, tk, tv), grads))
    torch.testing.assert_close(lhs, rhs, rtol=1e-10, atol=1e-10)
    torch.manual_seed(11)
    without = torch.func.jvp(lambda q, k, v: math_attention(q, k, v), (q, k, v),
                             (tq, tk, tv))[1]
    assert not torch.allclose(t_out, without, atol=1e-3)


def test_gradcheck_checks_forward_mode_too(gen):
    q = randn(gen, 1, 2, 4, 8).requires_grad_()
    k = randn(gen, 1, 2, 6, 8).requires_grad_()
    v = randn(gen, 1, 2, 6, 8).requires_grad_()
    sinks = randn(gen, 2).requires_grad_()
    bias = randn(gen, 4, 6).requires_grad_()
    assert torch.autograd.gradcheck(
        lambda q, k, v, s, b: ft.attention(q, k, v, sinks=s, bias=b, softcap=2.0,
                                           causal="bottom_right"),
        (q, k, v, sinks, bias), check_forward_ad=True)


def test_reverse_over_forward_and_forward_over_reverse(gen):
    q, k, v, bias, slopes, sinks = _jvp_case(gen)
    tq = randn(gen, *q.shape)

    def tangent_sum(f):
        return lambda q: torch.func.jvp(lambda q: f(q, k, v, bias, slopes, sinks),
                                        (q,), (tq,))[1].sum()

    got = torch.func.grad(tangent_sum(_ours))(q)
    want = torch.func.grad(tangent_sum(_theirs))(q)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    # the backward has no forward-mode formula: an error, never a zero tangent
    with pytest.raises(NotImplementedError, match="forward-mode AD over the backward"):
        torch.func.jvp(torch.func.grad(lambda q: _ours(q, k, v, bias, slopes,
                                                       sinks).sum()), (q,), (tq,))
    q = q.clone().requires_grad_()
    g, = torch.autograd.grad(_ours(q, k, v, bias, slopes, sinks).sum(), q,
                             create_graph=True)
    with pytest.raises(RuntimeError, match="no autograd formula"):
        g.sum().backward()


def test_parameter_sinks_keep_the_direct_path_in_evaluation(gen, monkeypatch):
    """gpt-oss's sinks are an nn.Parameter: under no_grad the call skips the
    dispatcher (as plain tensors do), with the same result; with grad it records."""
    q, k, v = (randn(gen, 1, 2, 4, 8) for _ in range(3))
    sinks = torch.nn.Parameter(randn(gen, 2))
    decisions = []          # of _plain (the short path) and _direct (the others)
    for name in ("_plain", "_direct"):
        monkeypatch.setattr(ft, name, lambda *a, _f=getattr(ft, name):
                            decisions.append(_f(*a)) or decisions[-1])
    with torch.no_grad():
        got = ft.attention(q, k, v, sinks=sinks)
    assert decisions == [True]                        # the short path
    decisions.clear()
    want = ft.attention(q, k, v, sinks=sinks)
    assert decisions[-1] is False and want.requires_grad
    assert torch.equal(got, want.detach())


def test_scales_beside_float_keys_are_refused_not_ignored(gen):
    """k_scale/v_scale belong to 8-bit codes: beside float k and v (which take the
    short path otherwise) they are refused with the NumPy API's message, never
    dropped."""
    q, k = randn(gen, 1, 2, 3, 8), randn(gen, 1, 2, 5, 8)
    scales = torch.full((1, 2, 5), 2.0)
    for kw in (dict(k_scale=scales, v_scale=scales), dict(k_scale=scales),
               dict(v_scale=scales)):
        with pytest.raises(ValueError, match="are for a quantized cache"):
            ft.attention(q, k, k, **kw)


def test_second_derivatives_of_the_bias_are_exact_or_refused(gen):
    """A bias's gradient taken with create_graph differentiates again correctly (the
    weights are rebuilt from the scores, not from the saved lse, which carries no
    gradient); through q, k, v the kernels' backward has no formula and says so."""
    q, k, v = (randn(gen, 1, 2, 4, 8) for _ in range(3))
    bias = randn(gen, 2, 4, 4).requires_grad_()
    sinks = randn(gen, 2)
    assert torch.autograd.gradgradcheck(
        lambda b: ft.attention(q, k, v, bias=b, sinks=sinks, softcap=2.0,
                               causal=True), (bias,))
    q.requires_grad_()
    g, = torch.autograd.grad(ft.attention(q, k, v, bias=bias).sum(), q,
                             create_graph=True)
    with pytest.raises(RuntimeError, match="no autograd formula"):
        g.sum().backward()
