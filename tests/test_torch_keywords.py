"""fastattn.torch.attention takes every keyword of the NumPy API: q_lengths and
kv_lengths (through the operators, autograd, forward mode and torch.compile),
dropout_seed, precision and out.

Oracles: ``fastattn.reference`` (attention and attention_backward, the NumPy
baseline), PyTorch's own SDPA with the equivalent explicit mask, attention written
out in float64 PyTorch arithmetic (``math_attention`` of test_torch_trust, through
PyTorch's autograd) and ``torch.autograd.gradcheck`` in float64; for dropout_seed and
precision, the NumPy API called on the same arrays.
"""

import inspect
import os

import numpy as np
import pytest

import fastattn
from fastattn import _validation, reference

if os.environ.get("FASTATTN_SANITIZED"):     # before anything imports torch
    pytest.skip("PyTorch is not run under the sanitizer build", allow_module_level=True)
torch = pytest.importorskip("torch")
ft = pytest.importorskip("fastattn.torch")

from test_torch_trust import gqa, math_attention  # noqa: E402 (after the skips)

F = torch.nn.functional
D = torch.float64
fwad = torch.autograd.forward_ad


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(20260613)


def randn(gen, *shape, dtype=D):
    return torch.randn(*shape, generator=gen, dtype=D).to(dtype)


def np_kw(kw):
    """The keywords as the NumPy API takes them (tensors as arrays)."""
    return {n: (a.detach().numpy() if isinstance(a, torch.Tensor) else a)
            for n, a in kw.items()}


def lengths_mask(Lq, Lk, q_lengths, kv_lengths, causal=False):
    """(B, 1, Lq, Lk) bool: the keys each query row may attend to, per sequence, as
    the contract says: rows i < q_lengths[b], keys j < kv_lengths[b], and with
    "bottom_right" j <= i + kv_lengths[b] - q_lengths[b]."""
    i = torch.arange(Lq)[:, None]
    j = torch.arange(Lk)[None, :]
    rows = []
    for lq, lk in zip(q_lengths.tolist(), kv_lengths.tolist()):
        m = (i < lq) & (j < lk)
        if causal == "bottom_right":
            m = m & (j <= i + lk - lq)
        elif causal:
            m = m & (j <= i)
        rows.append(m)
    return torch.stack(rows)[:, None]


def test_every_keyword_of_the_numpy_api():
    ours = inspect.signature(ft.attention).parameters
    theirs = inspect.signature(fastattn.attention).parameters
    assert set(ours) == set(theirs)
    for name, p in theirs.items():
        assert ours[name].kind == p.kind and ours[name].default == p.default, name


# ------------------------------------------------------------------ q_lengths, kv_lengths

LENGTH_CASES = {
    "plain": {},
    "top-left": dict(causal=True),
    "bottom-right": dict(causal="bottom_right"),
    "bottom-right window alibi": dict(causal="bottom_right", window=(2, 1),
                                      alibi_slopes=torch.tensor([0.5, 0.25, 0.125, 0.0625],
                                                                dtype=D)),
    "sinks softcap bias": dict(sinks=torch.tensor([1.0, -0.5, 2.0, 0.0], dtype=D),
                               softcap=2.0, bias=True),
}


def _lengths_case(gen, dtype, extra):
    q = randn(gen, 3, 4, 7, 16, dtype=dtype)
    k = randn(gen, 3, 2, 9, 16, dtype=dtype)
    v = randn(gen, 3, 2, 9, 8, dtype=dtype)
    kw = dict(enable_gqa=True, q_lengths=torch.tensor([7, 4, 0]),
              kv_lengths=torch.tensor([9, 3, 5]))
    kw.update({n: a for n, a in extra.items() if n != "bias"})
    if extra.get("bias"):
        kw["bias"] = randn(gen, 4, 7, 9, dtype=dtype)
    return q, k, v, kw


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("name", list(LENGTH_CASES))
def test_lengths_forward_matches_the_reference(gen, dtype, name):
    q, k, v, kw = _lengths_case(gen, dtype, LENGTH_CASES[name])
    out, lse = ft.attention(q, k, v, return_lse=True, **kw)
    want, want_lse = reference.attention(q.numpy(), k.numpy(), v.numpy(),
                                         return_lse=True, **np_kw(kw))
    tol = 1e-12 if dtype == torch.float64 else 2e-6
    assert out.dtype == dtype and out.shape == (3, 4, 7, 8)
    np.testing.assert_allclose(out.numpy(), want, rtol=tol, atol=tol)
    np.testing.assert_allclose(lse.numpy(), want_lse, rtol=tol, atol=tol)
    # the rows past q_lengths: zeros with lse -inf (sequence 2 has none at all)
    assert torch.equal(out[1, :, 4:], torch.zeros(4, 3, 8, dtype=dtype))
    assert torch.equal(out[2], torch.zeros(4, 7, 8, dtype=dtype))
    assert torch.isneginf(lse[1, :, 4:]).all() and torch.isneginf(lse[2]).all()
    # the same through the dispatcher (q requires a gradient), and with the lengths as
    # lists and as int32 arrays
    got = ft.attention(q.clone().requires_grad_(), k, v, **kw)
    torch.testing.assert_close(got.detach(), out, rtol=0, atol=0)
    for convert in (lambda t: t.tolist(), lambda t: t.numpy().astype(np.int32),
                    lambda t: t.to(torch.int32)):
        again = dict(kw, q_lengths=convert(kw["q_lengths"]),
                     kv_lengths=convert(kw["kv_lengths"]))
        torch.testing.assert_close(ft.attention(q, k, v, **again), out, rtol=0, atol=0)


@pytest.mark.parametrize("causal", [False, True, "bottom_right"])
def test_lengths_match_pytorch_sdpa_with_the_explicit_mask(gen, causal):
    """The lengths are the mask they stand for: PyTorch's SDPA given that mask, on
    every row with an allowed key; the others are zeros here."""
    q = randn(gen, 3, 2, 6, 16, dtype=torch.float32)
    k = randn(gen, 3, 2, 8, 16, dtype=torch.float32)
    v = randn(gen, 3, 2, 8, 16, dtype=torch.float32)
    q_lengths, kv_lengths = torch.tensor([6, 2, 5]), torch.tensor([8, 7, 3])
    got = ft.attention(q, k, v, causal=causal, q_lengths=q_lengths,
                       kv_lengths=kv_lengths)
    mask = lengths_mask(6, 8, q_lengths, kv_lengths, causal)
    rows = mask.any(-1, keepdim=True)                     # (B, 1, Lq, 1)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask | ~rows)
    rows = rows.expand(3, 2, 6, 1).squeeze(-1)
    assert not rows.all() and rows.sum() > 10
    torch.testing.assert_close(got[rows], want[rows], rtol=2e-6, atol=2e-6)
    assert torch.equal(got[~rows], torch.zeros_like(got[~rows]))


def test_lengths_gradients_match_the_reference(gen):
    """dq, dk, dv and dsinks by autograd against reference.attention_backward; the
    rows past q_lengths and the keys past kv_lengths get zero gradients."""
    q, k, v, kw = _lengths_case(gen, D, LENGTH_CASES["sinks softcap bias"])
    kw["causal"] = "bottom_right"
    sinks = kw.pop("sinks").clone().requires_grad_()
    qkv = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = ft.attention(*qkv, sinks=sinks, return_lse=True, **kw)
    grad = randn(gen, *out.shape)
    got = torch.autograd.grad(out, qkv + [sinks], grad)
    want = reference.attention_backward(grad.numpy(), q.numpy(), k.numpy(), v.numpy(),
                                        out.detach().numpy(), lse.numpy(),
                                        sinks=sinks.detach().numpy(), **np_kw(kw))
    assert len(want) == 4
    for a, b in zip(got, want):
        assert a.shape == b.shape
        np.testing.assert_allclose(a.numpy(), b, rtol=1e-10, atol=1e-10)
    dq, dk, dv, dsinks = got
    assert dq.abs().max() > 1e-3 and dsinks.abs().max() > 1e-3
    assert torch.equal(dq[1, :, 4:], torch.zeros_like(dq[1, :, 4:]))
    assert torch.equal(dq[2], torch.zeros_like(dq[2]))
    for g in (dk, dv):
        assert torch.equal(g[1, :, 3:], torch.zeros_like(g[1, :, 3:]))
        assert torch.equal(g[2], torch.zeros_like(g[2]))    # no query row in sequence 2


def test_lengths_gradcheck_float64_reverse_and_forward_mode(gen):
    """Every differentiable input with lengths (the bias and ALiBi gradients and the
    forward-mode tangent come from PyTorch's arithmetic, which must block the padding
    and place each sequence's positions as the kernels do)."""
    q = randn(gen, 2, 2, 4, 8).requires_grad_()
    k = randn(gen, 2, 2, 6, 8).requires_grad_()
    v = randn(gen, 2, 2, 6, 5).requires_grad_()
    bias = randn(gen, 2, 4, 6).requires_grad_()
    slopes = torch.tensor([0.4, 0.2], dtype=D).requires_grad_()
    sinks = randn(gen, 2).requires_grad_()
    q_lengths, kv_lengths = torch.tensor([3, 4]), torch.tensor([6, 2])

    def f(q, k, v, bias, slopes, sinks):
        return ft.attention(q, k, v, bias=bias, alibi_slopes=slopes, sinks=sinks,
                            causal="bottom_right", window=(3, 1), softcap=2.5,
                            q_lengths=q_lengths, kv_lengths=kv_lengths)

    assert torch.autograd.gradcheck(f, (q, k, v, bias, slopes, sinks),
                                    check_forward_ad=True)


def test_lengths_tangents_and_score_gradients_match_pytorch_math(gen):
    """torch.func.jvp and the bias and ALiBi gradients with lengths against the math
    written out in PyTorch (the lengths as their explicit mask)."""
    q = randn(gen, 2, 4, 5, 8)
    k = randn(gen, 2, 2, 7, 8)
    v = randn(gen, 2, 2, 7, 6)
    bias = randn(gen, 4, 5, 7)
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625], dtype=D)
    sinks = randn(gen, 4)
    q_lengths, kv_lengths = torch.tensor([5, 3]), torch.tensor([4, 7])
    allowed = lengths_mask(5, 7, q_lengths, kv_lengths, "bottom_right")
    # ALiBi's distance |i + d_b - j| with each sequence's own d_b = kv_b - q_b
    d = (kv_lengths - q_lengths)[:, None, None, None]
    dist = (torch.arange(5)[:, None] + d - torch.arange(7)[None, :]).abs().to(D)

    def ours(q, k, v, bias, slopes, sinks):
        return ft.attention(q, k, v, bias=bias, alibi_slopes=slopes, sinks=sinks,
                            causal="bottom_right", enable_gqa=True,
                            q_lengths=q_lengths, kv_lengths=kv_lengths)

    def theirs(q, k, v, bias, slopes, sinks):
        out = math_attention(q, gqa(k, 2), gqa(v, 2), mask=allowed,
                             bias=bias - slopes[:, None, None] * dist, sinks=sinks)
        return out * allowed.any(-1, keepdim=True)     # padding rows: no sink either

    primals = (q, k, v, bias, slopes, sinks)
    tangents = tuple(randn(gen, *t.shape) for t in primals)
    out, t_out = torch.func.jvp(ours, primals, tangents)
    want, t_want = torch.func.jvp(theirs, primals, tangents)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    assert t_want.abs().max() > 0.1
    torch.testing.assert_close(t_out, t_want, rtol=1e-10, atol=1e-10)
    inputs = [t.clone().requires_grad_() for t in primals]
    wide = [t.clone().requires_grad_() for t in primals]
    grad = randn(gen, *out.shape)
    got = torch.autograd.grad(ours(*inputs), inputs, grad)
    want = torch.autograd.grad(theirs(*wide), wide, grad)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    assert got[3].abs().max() > 1e-3 and got[4].abs().max() > 1e-3


def test_lengths_compile_without_graph_breaks(gen):
    q, k, v = (randn(gen, 2, 4, 6, 8, dtype=torch.float32).requires_grad_()
               for _ in range(3))
    sinks = randn(gen, 4, dtype=torch.float32).requires_grad_()
    q_lengths, kv_lengths = torch.tensor([6, 3]), torch.tensor([5, 6])

    def f(q, k, v, sinks, q_lengths, kv_lengths):
        out = ft.attention(q.sin(), k, v, causal="bottom_right", sinks=sinks,
                           q_lengths=q_lengths, kv_lengths=kv_lengths, window=(3, 0))
        return out.square().sum()

    args = (q, k, v, sinks, q_lengths, kv_lengths)
    assert torch._dynamo.explain(f)(*args).graph_break_count == 0
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    got, want = compiled(*args), f(*args)
    torch.testing.assert_close(got, want)
    for a, b in zip(torch.autograd.grad(got, (q, k, v, sinks)),
                    torch.autograd.grad(want, (q, k, v, sinks))):
        torch.testing.assert_close(a, b)
    # lengths written as lists inside the compiled function
    lists = torch.compile(lambda q: ft.attention(q, q, q, causal="bottom_right",
                                                 q_lengths=[6, 3], kv_lengths=[5, 6]),
                          backend="aot_eager", fullgraph=True)
    x = q.detach()
    torch.testing.assert_close(lists(x), ft.attention(x, x, x, causal="bottom_right",
                                                      q_lengths=q_lengths,
                                                      kv_lengths=kv_lengths),
                               rtol=0, atol=0)
    torch._dynamo.reset()


def test_lengths_opcheck_and_older_operator_calls(gen):
    """The operators with lengths and precision pass torch.library.opcheck (schema,
    fake implementation, autograd registration); a call written before those
    arguments existed (positional, 15 or 16 arguments) means what it meant."""
    q = randn(gen, 2, 4, 5, 8, dtype=torch.float32).requires_grad_()
    k = randn(gen, 2, 2, 7, 8, dtype=torch.float32).requires_grad_()
    v = randn(gen, 2, 2, 7, 6, dtype=torch.float32).requires_grad_()
    sinks = randn(gen, 4, dtype=torch.float32).requires_grad_()
    lengths = (torch.tensor([5, 2]), torch.tensor([7, 4]))
    head = (q, k, v, None, None, 2, None, True, None)
    variants = (3, 0, 5.0, None, 0.2, torch.tensor([77]), sinks) + lengths + ("highest",)
    torch.library.opcheck(torch.ops.fastattn.attention.default, head + variants)
    out, lse = torch.ops.fastattn.attention(*head, *variants)
    grad = randn(gen, 2, 4, 5, 6, dtype=torch.float32)
    torch.library.opcheck(torch.ops.fastattn.attention_backward.default,
                          (grad, q.detach(), k.detach(), v.detach(), out.detach(), lse,
                           None, None, 2, None, True, None) + variants[:6]
                          + (sinks.detach(),) + variants[7:])
    op = torch.ops.fastattn.attention
    old = op(*head, None, None, None, None, 0.0, None)
    new = op(*head, None, None, None, None, 0.0, None, None, None, None, None)
    for a, b in zip(old, new):
        assert torch.equal(a, b)
    with_sinks = op(*head, None, None, None, None, 0.0, None, sinks)
    assert not torch.equal(with_sinks[0], old[0])


def test_lengths_errors_name_the_argument(gen):
    q = randn(gen, 2, 3, 4, 8, dtype=torch.float32)
    for grad in (False, True):
        x = q.clone().requires_grad_(grad)
        with pytest.raises(TypeError, match="q_lengths must hold integers, got dtype "
                                            "torch.float32"):
            ft.attention(x, x, x, q_lengths=torch.tensor([1.0, 2.0]))
        with pytest.raises(TypeError, match="kv_lengths must hold integers"):
            ft.attention(x, x, x, kv_lengths=torch.tensor([True, False]))
        with pytest.raises(TypeError, match="kv_lengths must hold integers"):
            ft.attention(x, x, x, kv_lengths=[1.5, 2.0])
        with pytest.raises(ValueError, match=r"q_lengths must have shape \(B,\) = "
                                             r"\(2,\).*got shape \(3,\)"):
            ft.attention(x, x, x, q_lengths=torch.tensor([1, 2, 3]))
        with pytest.raises(ValueError, match=r"kv_lengths must have shape \(B,\)"):
            ft.attention(x, x, x, kv_lengths=torch.tensor([[1, 2]]))
        with pytest.raises(ValueError, match=r"kv_lengths must lie in \[0, 4\]"):
            ft.attention(x, x, x, kv_lengths=torch.tensor([4, 5]))
        with pytest.raises(ValueError, match=r"q_lengths must lie in \[0, 4\]"):
            ft.attention(x, x, x, q_lengths=torch.tensor([-1, 2]))
        with pytest.raises(ValueError, match=r"q_lengths must lie in \[0, 4\]"):
            ft.attention(x, x, x, q_lengths=[-1, 2])
        with pytest.raises(ValueError, match="q_lengths needs at least one batch axis"):
            ft.attention(x[0, 0], x[0, 0], x[0, 0], q_lengths=torch.tensor([1]))
        with pytest.raises(ValueError, match="kv_lengths is on meta"):
            ft.attention(x, x, x, kv_lengths=torch.tensor([1, 2], device="meta"))
        # the shapes of q, k, v are checked first, as the NumPy API checks them
        with pytest.raises(ValueError, match="do not broadcast"):
            ft.attention(x, x[:, :2], x[:, :2], q_lengths=torch.tensor([1, 2]))
    meta = q.to("meta")
    got = ft.attention(meta, meta, meta[..., :5], q_lengths=torch.tensor([1, 2],
                                                                         device="meta"))
    assert got.device.type == "meta" and got.shape == (2, 3, 4, 5)
    with pytest.raises(RuntimeError, match="q_lengths is on meta"):
        torch.ops.fastattn.attention(q, q, q, None, None, 0, None, False, None, None,
                                     None, None, None, 0.0, None, None,
                                     torch.tensor([1, 2], device="meta"))


# ------------------------------------------------------------------------ dropout_seed

@pytest.mark.parametrize("seed", [0, 12345, 2**63 - 1, 2**63 + 5, 2**64 - 1])
def test_dropout_seed_is_the_numpy_apis_pattern(gen, seed):
    """The output is the NumPy API's for the same seed (bit for bit: the same kernels
    on the same memory), through the dispatcher too; the backward regenerates the
    pattern (the gradients are the reference's for that seed); torch's generator plays
    no part."""
    q = randn(gen, 2, 2, 9, 8)
    k = randn(gen, 2, 2, 11, 8)
    v = randn(gen, 2, 2, 11, 8)
    kw = dict(causal="bottom_right", dropout_p=0.3, dropout_seed=seed)
    got = ft.attention(q, k, v, **kw)
    want = fastattn.attention(q.numpy(), k.numpy(), v.numpy(), **kw)
    np.testing.assert_array_equal(got.numpy(), want)
    torch.manual_seed(1)
    again = ft.attention(q, k, v, **kw)
    torch.manual_seed(2)
    assert torch.equal(ft.attention(q, k, v, **kw), again)
    assert torch.equal(again, got)
    ref, ref_lse = reference.attention(q.numpy(), k.numpy(), v.numpy(), return_lse=True,
                                       **kw)
    np.testing.assert_allclose(got.numpy(), ref, rtol=1e-12, atol=1e-12)
    qkv = [t.clone().requires_grad_() for t in (q, k, v)]
    out = ft.attention(*qkv, **kw)
    np.testing.assert_array_equal(out.detach().numpy(), want)
    grad = randn(gen, *out.shape)
    grads = torch.autograd.grad(out, qkv, grad)
    want_grads = reference.attention_backward(grad.numpy(), q.numpy(), k.numpy(),
                                              v.numpy(), ref, ref_lse, **kw)
    for a, b in zip(grads, want_grads):
        np.testing.assert_allclose(a.numpy(), b, rtol=1e-10, atol=1e-10)
    # another seed, another pattern
    other = ft.attention(q, k, v, **dict(kw, dropout_seed=(seed + 1) % 2**64))
    assert not torch.allclose(other, got)


def test_dropout_seed_gradcheck_and_compile(gen):
    q, k, v = (randn(gen, 1, 2, 8, 8).requires_grad_() for _ in range(3))
    bias = randn(gen, 2, 8, 8).requires_grad_()
    assert torch.autograd.gradcheck(
        lambda q, k, v, b: ft.attention(q, k, v, bias=b, dropout_p=0.4,
                                        dropout_seed=2**63 + 17, causal=True),
        (q, k, v, bias))

    def f(q, k, v):
        return ft.attention(q.sin(), k, v, dropout_p=0.25, dropout_seed=99).sum()

    assert torch._dynamo.explain(f)(q, k, v).graph_break_count == 0
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    got, want = compiled(q, k, v), f(q, k, v)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for a, b in zip(torch.autograd.grad(got, (q, k, v)),
                    torch.autograd.grad(want, (q, k, v))):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    torch._dynamo.reset()


def test_dropout_seed_errors_and_without_dropout(gen):
    q = randn(gen, 1, 2, 4, 8)
    for bad, error in [(-1, ValueError), (2**64, ValueError), (1.5, TypeError),
                       (True, TypeError), ("7", TypeError)]:
        for grad in (False, True):
            with pytest.raises(error, match="dropout_seed"):
                ft.attention(q.clone().requires_grad_(grad), q, q, dropout_p=0.1,
                             dropout_seed=bad)
        with pytest.raises(error, match="dropout_seed"):      # checked as NumPy does
            ft.attention(q, q, q, dropout_seed=bad)
    # a seed without dropout changes nothing, as in the NumPy API
    assert torch.equal(ft.attention(q, q, q, dropout_seed=5), ft.attention(q, q, q))
    assert torch.equal(ft.attention(q, q, q, dropout_seed=np.uint64(2**64 - 1),
                                    dropout_p=0.2),
                       torch.from_numpy(fastattn.attention(q.numpy(), q.numpy(),
                                                           q.numpy(), dropout_p=0.2,
                                                           dropout_seed=2**64 - 1)))


# --------------------------------------------------------------------------- precision

def test_precision_is_the_numpy_apis(gen, monkeypatch):
    """precision reaches the NumPy API on every path, which accepts its values and
    raises its errors (the same messages); torch.py keeps no list of its own."""
    q = randn(gen, 2, 4, 70, 64, dtype=torch.float32)
    k = randn(gen, 2, 4, 90, 64, dtype=torch.float32)
    arrays = (q.numpy(), k.numpy(), k.numpy())
    seen = []
    real = ft._np_attention
    monkeypatch.setattr(ft, "_np_attention",
                        lambda *a, **kw: seen.append(kw.get("precision"))
                        or real(*a, **kw))
    for precision in _validation.PRECISIONS:
        want = fastattn.attention(*arrays, causal=True, precision=precision)
        got = ft.attention(q, k, k, causal=True, precision=precision)
        assert seen.pop() == precision
        np.testing.assert_array_equal(got.numpy(), want)
        x = q.clone().requires_grad_()
        got = ft.attention(x, k, k, causal=True, precision=precision)
        assert seen.pop() == precision
        np.testing.assert_array_equal(got.detach().numpy(), want)
        dq, = torch.autograd.grad(got.sum(), x)
        out, lse = fastattn.attention(*arrays, causal=True, return_lse=True,
                                      precision=precision)
        want_dq = fastattn.attention_backward(np.ones(got.shape, np.float32), *arrays,
                                              out, lse, causal=True,
                                              precision=precision)[0]
        np.testing.assert_array_equal(dq.numpy(), want_dq)
    for bad in ("fp8", "HIGHEST", "bf16x3", 3, b"highest"):
        with pytest.raises((TypeError, ValueError)) as numpy_error:
            fastattn.attention(*arrays, precision=bad)
        for x in (q, q.clone().requires_grad_()):
            with pytest.raises(numpy_error.type) as error:
                ft.attention(x, k, k, precision=bad)
            assert str(error.value) == str(numpy_error.value)
            assert "precision" in str(error.value)
    # a value the NumPy API comes to accept is accepted here too
    monkeypatch.setattr(_validation, "PRECISIONS", _validation.PRECISIONS + ("newer",))
    got = ft.attention(q, k, k, precision="newer")
    assert seen.pop() == "newer"
    np.testing.assert_array_equal(got.numpy(), fastattn.attention(*arrays))


# --------------------------------------------------------------------------------- out

@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16,
                                   torch.float16], ids=str)
def test_out_is_filled_and_returned(gen, dtype):
    q = randn(gen, 2, 4, 5, 16, dtype=dtype)
    k = randn(gen, 2, 2, 7, 16, dtype=dtype)
    v = randn(gen, 2, 2, 7, 8, dtype=dtype)
    kw = dict(causal="bottom_right", enable_gqa=True, sinks=torch.tensor([1., 0, -1, 2]),
              q_lengths=torch.tensor([5, 3]))
    want, want_lse = ft.attention(q, k, v, return_lse=True, **kw)
    out = torch.full((2, 4, 5, 8), float("nan"), dtype=dtype)
    address = out.data_ptr()
    got = ft.attention(q, k, v, out=out, **kw)
    assert got is out and out.data_ptr() == address
    assert torch.equal(out, want)
    out.fill_(7)
    got, lse = ft.attention(q, k, v, out=out, return_lse=True, **kw)
    assert got is out and torch.equal(out, want) and torch.equal(lse, want_lse)
    # through the dispatcher (a dispatch mode is active), and under no_grad with
    # inputs that require a gradient
    from torch.utils.flop_counter import FlopCounterMode
    out.fill_(7)
    with FlopCounterMode(display=False):
        got = ft.attention(q, k, v, out=out, **kw)
    assert got is out and torch.equal(out, want)
    out.fill_(7)
    with torch.no_grad():
        got = ft.attention(q.clone().requires_grad_(), k, v, out=out, **kw)
    assert got is out and torch.equal(out, want) and not out.requires_grad
    # against the reference
    np_q, np_k, np_v = (t.double().numpy() for t in (q, k, v))
    ref = reference.attention(np_q, np_k, np_v, **np_kw(kw))
    tol = {torch.float32: 2e-6, torch.float64: 1e-12}.get(dtype, 1e-2)
    np.testing.assert_allclose(out.double().numpy(), ref, rtol=tol, atol=tol)


def test_out_may_be_an_input(gen):
    """out= the query tensor itself: the result is that of a separate buffer (the
    kernels never write over what they still read), as in the NumPy API."""
    q, k, v = (randn(gen, 2, 3, 64, 16) for _ in range(3))
    want = ft.attention(q, k, v, causal=True)
    got = ft.attention(q, k, v, causal=True, out=q)
    assert got is q and torch.equal(q, want)


def test_out_under_compile(gen):
    q, k, v = (randn(gen, 2, 4, 6, 8, dtype=torch.float32) for _ in range(3))
    lengths = torch.tensor([6, 2])

    def f(q, k, v, lengths, out):
        ft.attention(q.sin(), k, v, causal=True, q_lengths=lengths, out=out)
        return out * 2

    out = torch.zeros(2, 4, 6, 8)
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    got = compiled(q, k, v, lengths, out)
    want = ft.attention(q.sin(), k, v, causal=True, q_lengths=lengths)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    torch.testing.assert_close(got, 2 * want, rtol=0, atol=0)
    torch._dynamo.reset()


def test_out_errors_name_it(gen):
    q = randn(gen, 2, 3, 4, 8, dtype=torch.float32)
    v = randn(gen, 2, 3, 4, 5, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"out must have shape \(2, 3, 4, 5\) and "
                                         r"dtype torch.float32.*got shape \(2, 3, 4, 8\)"):
        ft.attention(q, q, v, out=torch.empty(2, 3, 4, 8))
    with pytest.raises(ValueError, match=r"out must have .*dtype torch.float64"):
        ft.attention(q, q, v, out=torch.empty(2, 3, 4, 5, dtype=D))
    with pytest.raises(ValueError, match="out must be C-contiguous"):
        ft.attention(q, q, v, out=torch.empty(2, 3, 5, 4).transpose(-1, -2))
    with pytest.raises(TypeError, match="out must be a torch.Tensor, got ndarray"):
        ft.attention(q, q, v, out=np.empty((2, 3, 4, 5), np.float32))
    with pytest.raises(ValueError, match="out is on meta"):
        ft.attention(q, q, v, out=torch.empty(2, 3, 4, 5, device="meta"))
    with pytest.raises(TypeError, match="out has layout torch.sparse"):
        ft.attention(q, q, v, out=torch.zeros(2, 3, 4, 5).to_sparse())
    # mixed dtypes promote: the result (and out) is float64
    out = torch.empty(2, 3, 4, 5, dtype=D)
    assert ft.attention(q, q, v.double(), out=out) is out
    torch.testing.assert_close(out, ft.attention(q.double(), q.double(), v.double()))


def test_out_is_refused_under_autograd(gen):
    """out= writes in place where autograd cannot see it: refused whenever a gradient
    would be dropped, as PyTorch refuses its own out= functions."""
    q, k, v = (randn(gen, 1, 2, 4, 8) for _ in range(3))
    sinks = randn(gen, 2)
    bias = randn(gen, 4, 4)
    out = torch.empty(1, 2, 4, 8, dtype=D)
    for name, kw in [("q", dict(q=q.clone().requires_grad_())),
                     ("k", dict(k=k.clone().requires_grad_())),
                     ("v", dict(v=v.clone().requires_grad_())),
                     ("bias", dict(bias=bias.clone().requires_grad_())),
                     ("sinks", dict(sinks=sinks.clone().requires_grad_())),
                     ("alibi_slopes", dict(alibi_slopes=torch.tensor(
                         [0.5, 0.25], dtype=D, requires_grad=True)))]:
        args = dict(q=q, k=k, v=v)
        args.update(kw)
        with pytest.raises(RuntimeError, match=rf"out=.*automatic differentiation, "
                                               rf"but {name} requires grad"):
            ft.attention(args.pop("q"), args.pop("k"), args.pop("v"), out=out, **args)
    with pytest.raises(RuntimeError, match="but out requires grad"):
        ft.attention(q, k, v, out=out.clone().requires_grad_())
    with pytest.raises(RuntimeError, match="out=.*but q requires grad"):
        torch.func.grad(lambda q: ft.attention(q, k, v, out=out).sum())(q)
    with pytest.raises(RuntimeError, match="torch.func transforms"):
        torch.vmap(lambda q: ft.attention(q, k[0], v[0], out=out[0]))(q)
    with fwad.dual_level(), pytest.raises(RuntimeError, match="forward-mode"):
        ft.attention(fwad.make_dual(q, q), k, v, out=out)
