"""fastattn.torch: the operator against torch.nn.functional.scaled_dot_product_attention.

Skipped without PyTorch, and under the sanitizer build (PyTorch's native code does not
run with ASan preloaded into an uninstrumented interpreter).
"""

import os
import subprocess
import sys
import tempfile
import tracemalloc

import numpy as np
import pytest

import fastattn

if os.environ.get("FASTATTN_SANITIZED"):     # before anything imports torch
    pytest.skip("PyTorch is not run under the sanitizer build", allow_module_level=True)
torch = pytest.importorskip("torch")
ft = pytest.importorskip("fastattn.torch")

from helpers import assert_gil_released  # noqa: E402 (after the skips above)
F = torch.nn.functional

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
TOL = {torch.float32: 2e-6, torch.float64: 1e-13}


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(20261121)


def randn(gen, *shape, dtype=torch.float32):
    return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)


def check_like_torch(got, args, kwargs):
    """``got`` against PyTorch's SDPA on the same inputs: close in float32/float64;
    in bfloat16/float16 no further from a float64 recomputation than PyTorch's own
    result in that dtype (the accuracy contract)."""
    want = F.scaled_dot_product_attention(*args, **kwargs)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert got.is_contiguous()
    if got.dtype in TOL:
        torch.testing.assert_close(got, want, rtol=TOL[got.dtype], atol=TOL[got.dtype])
        return
    wide = [a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a
            for a in args]
    kw = {n: (a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a)
          for n, a in kwargs.items()}
    exact = F.scaled_dot_product_attention(*wide, **kw)
    ours = (got.double() - exact).abs().max().item()
    theirs = (want.double() - exact).abs().max().item()
    ulp = torch.finfo(got.dtype).eps * exact.abs().max().item()
    assert ours <= max(theirs, ulp), (ours, theirs)


# ------------------------------------------------------------------ the operator

CASES = {
    "plain": dict(q=(2, 3, 5, 16), k=(2, 3, 7, 16), v=(2, 3, 7, 8)),
    "no batch": dict(q=(5, 16), k=(7, 16), v=(7, 16)),
    "kv broadcast": dict(q=(2, 3, 5, 16), k=(3, 7, 16), v=(3, 7, 16)),
    "bool mask": dict(q=(2, 3, 5, 16), k=(2, 3, 7, 16), v=(2, 3, 7, 16), mask=(5, 7)),
    "bool mask per batch": dict(q=(2, 3, 5, 16), k=(2, 3, 7, 16), v=(2, 3, 7, 16),
                                mask=(2, 1, 5, 7)),
    "float mask per head": dict(q=(2, 3, 5, 16), k=(2, 3, 7, 16), v=(2, 3, 7, 16),
                                bias=(3, 5, 7)),
    "finfo.min mask": dict(q=(2, 3, 5, 16), k=(2, 3, 7, 16), v=(2, 3, 7, 16),
                           bias=(2, 1, 5, 7), big_negative=True),
    "causal Lq < Lk": dict(q=(2, 3, 5, 16), k=(2, 3, 9, 16), v=(2, 3, 9, 16), causal=True),
    "causal Lq > Lk": dict(q=(2, 3, 9, 16), k=(2, 3, 5, 16), v=(2, 3, 5, 16), causal=True),
    "causal and mask": dict(q=(1, 2, 6, 8), k=(1, 2, 6, 8), v=(1, 2, 6, 8), mask=(6, 6),
                            causal=True),
    "gqa": dict(q=(2, 8, 5, 16), k=(2, 2, 7, 16), v=(2, 2, 7, 16), gqa=True),
    "gqa causal mask": dict(q=(2, 4, 6, 16), k=(2, 2, 6, 16), v=(2, 2, 6, 16), gqa=True,
                            mask=(2, 1, 6, 6), causal=True),
    "scale": dict(q=(2, 3, 5, 16), k=(2, 3, 7, 16), v=(2, 3, 7, 16), scale=0.37),
}


def make_case(gen, dtype, case):
    q, k, v = (randn(gen, *case[n], dtype=dtype) for n in "qkv")
    kwargs = {}
    if "mask" in case:
        m = torch.rand(*case["mask"], generator=gen) > 0.3
        m[..., 0] = True                   # a row with no key differs in PyTorch's math
        kwargs["attn_mask"] = m
    if "bias" in case:
        b = randn(gen, *case["bias"], dtype=dtype)
        if case.get("big_negative"):
            b = b.masked_fill(torch.rand(*case["bias"], generator=gen) > 0.6,
                              torch.finfo(dtype).min)
        kwargs["attn_mask"] = b
    if case.get("causal"):
        kwargs["is_causal"] = True
    if case.get("gqa"):
        kwargs["enable_gqa"] = True
    if "scale" in case:
        kwargs["scale"] = case["scale"]
    return (q, k, v), kwargs


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", list(CASES))
def test_matches_pytorch(gen, dtype, name):
    args, kwargs = make_case(gen, dtype, CASES[name])
    got = ft.scaled_dot_product_attention(*args, **kwargs)
    check_like_torch(got, args, kwargs)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_non_contiguous_views(gen, dtype):
    # transformers' layout: (B, L, H, E) buffers seen as (B, H, L, E)
    q = randn(gen, 2, 5, 3, 16, dtype=dtype).transpose(1, 2)
    k = randn(gen, 2, 14, 3, 16, dtype=dtype).transpose(1, 2)[:, :, ::2]   # strided keys
    v = randn(gen, 2, 3, 16, 7, dtype=dtype).transpose(-1, -2)         # last axis strided
    m = (torch.rand(2, 7, 5, generator=gen) > 0.3).transpose(-1, -2)
    m[..., 0] = True
    check_like_torch(ft.scaled_dot_product_attention(q, k, v, attn_mask=m[:, None]),
                     (q, k, v), dict(attn_mask=m[:, None]))


def test_reads_tensors_in_place(gen):
    x = randn(gen, 1, 512, 8, 64)                   # (B, L, H, E), 1 MiB
    q = x.transpose(1, 2)                             # (B, H, L, E): not contiguous
    view = ft._array(q)
    assert view.__array_interface__["data"][0] == q.data_ptr()
    assert view.strides == tuple(s * 4 for s in q.stride())
    ft.scaled_dot_product_attention(q, q, q)          # warm up
    tracemalloc.start()
    try:
        out = ft.scaled_dot_product_attention(q, q, q)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # the output (NumPy's allocation, wrapped without a copy) and little else
    assert peak < 1.25 * out.numel() * out.element_size(), peak
    out_np = ft._attention_op._init_fn(q, q, q, None, None, 0, None, False, None,
                                       None, None, None, None, 0.0, None)[0]
    assert out_np.is_contiguous()


@pytest.fixture
def spy(monkeypatch):
    """Records the arrays the NumPy API receives and returns under fastattn.torch."""
    calls = []

    def recording(*args, **kwargs):
        result = np_attention(*args, **kwargs)
        calls.append((args, kwargs, result))
        return result

    np_attention = ft._np_attention
    monkeypatch.setattr(ft, "_np_attention", recording)
    return calls


def address(a):
    return a.__array_interface__["data"][0]


@pytest.mark.parametrize("grad", [False, True], ids=["direct", "dispatcher"])
def test_no_hidden_copies(gen, spy, grad):
    """The kernels read the tensors' own memory and write the result tensor's."""
    x = randn(gen, 2, 9, 4, 16)                                 # (B, L, H, E)
    q = x.transpose(1, 2)                                        # a transposed view
    k = x[:, ::2].transpose(1, 2)                                # strided keys
    bias = randn(gen, 4, 9, 5)
    mask = torch.rand(2, 1, 9, 5, generator=gen) > 0.3
    if grad:
        q = q.detach().requires_grad_()
    got = ft.attention(q, k, k, mask=mask, bias=bias, return_lse=True)
    (aq, ak, av), kw, (out, lse) = spy[-1]
    for array, tensor in ((aq, q), (ak, k), (kw["mask"], mask), (kw["bias"], bias)):
        assert address(array) == tensor.data_ptr()
        assert array.strides == tuple(s * tensor.element_size() for s in tensor.stride())
    assert address(av) == k.data_ptr()
    assert got[0].data_ptr() == address(out) and got[1].data_ptr() == address(lse)
    assert got[0].requires_grad == grad


@pytest.fixture
def short_path(monkeypatch):
    """Whether each call to the NumPy API's short path (``_plan.plain_plan``) took it,
    in call order."""
    from fastattn import _compute
    taken = []

    def spy(*args, _real=_compute.plain_plan, **kwargs):
        made = _real(*args, **kwargs)
        taken.append(made is not None)
        return made

    monkeypatch.setattr(_compute, "plain_plan", spy)
    return taken


def test_plain_calls_take_the_short_path(gen, short_path):
    """The plain operator calls (with or without is_causal, GQA, float32/float64) reach
    the NumPy API's short path (``_plan.plain_plan``) and give PyTorch's result."""
    taken = short_path
    q = randn(gen, 1, 8, 5, 16)
    kv = randn(gen, 1, 2, 9, 16)
    for dtype in (torch.float32, torch.float64):
        for causal in (False, True):
            args = [t.to(dtype) for t in (q, kv, kv)]
            got = ft.scaled_dot_product_attention(*args, is_causal=causal,
                                                  enable_gqa=True)
            assert taken.pop() is True
            want = torch.nn.functional.scaled_dot_product_attention(
                *args, is_causal=causal, enable_gqa=True)
            torch.testing.assert_close(got, want)


def test_windowed_calls_take_the_short_path(gen, short_path):
    """A sliding window (a pair of Python ints, as transformers passes it) and a
    float softcap keep the short path, with the operator's bits (the same call with a
    gradient to record goes through it) and PyTorch's result with the window as a
    mask."""
    taken = short_path
    q = randn(gen, 1, 8, 3, 16)
    kv = randn(gen, 1, 2, 40, 16)
    i = torch.arange(3)[:, None] + 37                   # bottom-right: query i at i + 37
    j = torch.arange(40)[None, :]
    for window in ((5, 0), [9, None], (None, 0), (2**70, 0)):
        got = ft.attention(q, kv, kv, causal="bottom_right", window=window,
                           enable_gqa=True)
        assert taken.pop() is True
        operator = ft.attention(q.clone().requires_grad_(), kv, kv,
                                causal="bottom_right", window=window, enable_gqa=True)
        assert torch.equal(got, operator.detach())
        left = 10**9 if window[0] is None else min(window[0], 10**9)
        want = F.scaled_dot_product_attention(q, kv, kv, attn_mask=(j <= i) & (j >= i - left),
                                              enable_gqa=True)
        torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)
    got = ft.scaled_dot_product_attention(q, q, q, window=(1, 1))
    assert taken.pop() is True
    ii = torch.arange(3)
    want = F.scaled_dot_product_attention(q, q, q, attn_mask=(ii[None] - ii[:, None]).abs() <= 1)
    torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)
    # Gemma 2's softcap (a Python float): the short path, the operator's bits
    for window in (None, (5, 0)):
        got = ft.scaled_dot_product_attention(q, kv, kv, enable_gqa=True, softcap=2.0,
                                              window=window)
        assert taken.pop() is True
        operator = ft.scaled_dot_product_attention(
            q.clone().requires_grad_(), kv, kv, enable_gqa=True, softcap=2.0,
            window=window)
        assert torch.equal(got, operator.detach())


def test_lengths_take_the_short_path(gen, short_path):
    """kv_lengths as an int32 or int64 CPU tensor keeps the short path, with the
    operator's bits; wrong lengths get the operator's messages."""
    q = randn(gen, 3, 4, 1, 16)
    kv = randn(gen, 3, 2, 40, 16)
    for lengths in (torch.tensor([40, 0, 7]), torch.tensor([1, 39, 16], dtype=torch.int32)):
        got = ft.attention(q, kv, kv, kv_lengths=lengths, causal="bottom_right",
                           enable_gqa=True)
        assert short_path.pop() is True
        operator = ft.attention(q.clone().requires_grad_(), kv, kv, kv_lengths=lengths,
                                causal="bottom_right", enable_gqa=True)
        assert torch.equal(got, operator.detach())
        want = fastattn.reference.attention(
            *(t.double().numpy() for t in (q, kv, kv)), kv_lengths=lengths.numpy(),
            causal="bottom_right", enable_gqa=True)
        np.testing.assert_allclose(got.numpy(), want, atol=1e-5, rtol=1e-5)
    for lengths, error in ((torch.tensor([41, 0, 7]), ValueError),
                           (torch.tensor([4, 0]), ValueError),
                           (torch.tensor([1.0, 2.0, 3.0]), TypeError)):
        with pytest.raises(error, match="kv_lengths") as plain:
            ft.attention(q, kv, kv, kv_lengths=lengths, enable_gqa=True)
        with pytest.raises(error) as through_operator:
            ft.attention(q.clone().requires_grad_(), kv, kv, kv_lengths=lengths,
                         enable_gqa=True)
        assert str(plain.value) == str(through_operator.value)


def test_sinks_take_the_short_path(gen, short_path):
    """Per-head sinks (gpt-oss's parameter, in evaluation) keep the short path, with
    the operator's bits (the same call with a gradient to record goes through it)
    and the reference's values; sinks with a gradient to record, or of another shape,
    take the operator."""
    taken = short_path
    q = randn(gen, 1, 8, 2, 16)
    kv = randn(gen, 1, 2, 30, 16)
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        sinks = torch.nn.Parameter(randn(gen, 8).to(dtype))
        args = [t.to(dtype) for t in (q, kv, kv)]
        for window in (None, (6, 0)):
            with torch.no_grad():
                got = ft.attention(*args, causal="bottom_right", window=window,
                                   enable_gqa=True, sinks=sinks)
            assert taken.pop() is True
            operator = ft.attention(args[0].clone().requires_grad_(), *args[1:],
                                    causal="bottom_right", window=window,
                                    enable_gqa=True, sinks=sinks)
            assert not taken
            assert torch.equal(got, operator.detach())
            wide = [t.double().numpy() for t in args]
            want = fastattn.reference.attention(
                *wide, causal="bottom_right", window=window, enable_gqa=True,
                sinks=sinks.detach().double().numpy())
            tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
            np.testing.assert_allclose(got.double().numpy(), want, atol=tol, rtol=tol)
    # a gradient to record (grad mode on) or sinks per (batch, head): the operator
    sinks = torch.nn.Parameter(randn(gen, 8))
    ft.attention(q, kv, kv, enable_gqa=True, sinks=sinks).sum().backward()
    assert not taken and sinks.grad is not None
    ft.attention(q, kv, kv, enable_gqa=True, sinks=randn(gen, 1, 8))
    assert True not in taken        # (the operator's NumPy call declines it too)


def test_the_direct_path_is_the_operator(gen, monkeypatch):
    """Calls with nothing for the dispatcher to do skip it, with the same results;
    the others (autograd, dispatch modes, vmap, the profiler) go through it."""
    decisions = []          # of _plain (plain calls) and _direct (the others)
    for name in ("_plain", "_direct"):
        monkeypatch.setattr(ft, name, lambda *a, _f=getattr(ft, name):
                            decisions.append(_f(*a)) or decisions[-1])

    def dispatched():
        return not decisions[-1]

    op = torch.ops.fastattn.attention
    q, k, v = (randn(gen, 2, 4, 6, 8) for _ in range(3))
    kv = randn(gen, 2, 2, 9, 8)
    bias = randn(gen, 2, 1, 6, 9)
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625])
    calls = [lambda: ft.scaled_dot_product_attention(q, k, v, is_causal=True),
             lambda: ft.attention(q, kv, kv, causal="bottom_right", enable_gqa=True,
                                  scale=0.3, return_lse=True),
             lambda: ft.attention(q, kv, kv, bias=bias, causal="bottom_right",
                                  enable_gqa=True, window=(3, 0), softcap=4.0,
                                  alibi_slopes=slopes, return_lse=True)]
    for call in calls:
        got = call()
        assert not dispatched()
        with torch.enable_grad():
            q.requires_grad_()
            want = call()
            q.requires_grad_(False)
        assert dispatched()
        for a, b in zip(*(x if isinstance(x, tuple) else (x,) for x in (got, want))):
            assert torch.equal(a, b.detach())
    torch.manual_seed(5)                                         # dropout: one seed
    got = ft.scaled_dot_product_attention(q, k, v, dropout_p=0.4)
    assert not dispatched()
    torch.manual_seed(5)
    want = op(q, k, v, None, None, 0, None, False, None,
              *ft._variant_args(q, None, None, None, 0.4))[0]
    assert torch.equal(got, want)
    with torch.no_grad():
        ft.scaled_dot_product_attention(q.requires_grad_(), k, v)
        assert not dispatched()
    q.requires_grad_(False)                         # from here on, the modes decide
    from torch.utils.flop_counter import FlopCounterMode
    with FlopCounterMode(display=False):
        ft.scaled_dot_product_attention(q, k, v)
    assert dispatched()
    decisions.append(True)
    torch.vmap(lambda q: ft.scaled_dot_product_attention(q, k[0], v[0]))(q)
    assert dispatched()
    decisions.append(True)
    with torch.profiler.profile() as prof:
        ft.scaled_dot_product_attention(q, k, v)
    assert dispatched()
    assert any(e.name == "fastattn::attention" for e in prof.events())
    assert not ft._direct((torch.nn.Parameter(q.detach(), requires_grad=False),))
    assert not ft._plain(*(torch.nn.Parameter(q.detach(), requires_grad=False),) * 3)
    assert not ft._direct((q.detach().to("meta"),))


def test_rows_with_no_allowed_key_are_zero(gen):
    q, k, v = (randn(gen, 1, 2, 4, 8) for _ in range(3))
    m = torch.ones(4, 4, dtype=torch.bool)
    m[2] = False
    out = ft.scaled_dot_product_attention(q, k, v, attn_mask=m)
    assert torch.equal(out[..., 2, :], torch.zeros(1, 2, 8))
    bias = torch.zeros(4, 4).masked_fill(~m, float("-inf"))
    assert torch.equal(ft.scaled_dot_product_attention(q, k, v, attn_mask=bias), out)
    empty = ft.scaled_dot_product_attention(q, k[..., :0, :], v[..., :0, :])
    assert torch.equal(empty, torch.zeros(1, 2, 4, 8))
    assert ft.scaled_dot_product_attention(q[..., :0, :], k, v).shape == (1, 2, 0, 8)


def test_errors(gen):
    q = randn(gen, 2, 3, 4, 8)
    with pytest.raises(TypeError, match="same dtype"):
        ft.scaled_dot_product_attention(q, q.double(), q)
    with pytest.raises(TypeError, match="torch.Tensor"):
        ft.scaled_dot_product_attention(q.numpy(), q, q)
    with pytest.raises(TypeError, match="float32, float64, bfloat16 or float16"):
        ft.scaled_dot_product_attention(q.to(torch.int64), q.to(torch.int64), q.to(torch.int64))
    with pytest.raises(ValueError, match="broadcast"):
        ft.scaled_dot_product_attention(q, randn(gen, 2, 2, 4, 8), randn(gen, 2, 2, 4, 8))
    with pytest.raises(ValueError, match="mask"):
        ft.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(5, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="softcap"):
        ft.scaled_dot_product_attention(q, q, q, softcap=-30.0)
    with pytest.raises(ValueError, match="dropout_p"):
        ft.scaled_dot_product_attention(q, q, q, dropout_p=1.5)
    with pytest.raises(ValueError, match="num_threads"):
        ft.scaled_dot_product_attention(q, q, q, num_threads=0)
    with pytest.raises(ValueError, match="window"):
        ft.scaled_dot_product_attention(q, q, q, window=(-1, 0))
    with pytest.raises(ValueError, match="causal"):
        ft.attention(q, q, q, causal="diagonal")
    with pytest.raises(TypeError, match="boolean"):
        ft.attention(q, q, q, mask=torch.ones(4, 4))


def test_num_threads_do_not_change_the_result(gen):
    q, k, v = (randn(gen, 2, 4, 70, 16) for _ in range(3))
    one = ft.scaled_dot_product_attention(q, k, v, is_causal=True, num_threads=1)
    two = ft.scaled_dot_product_attention(q, k, v, is_causal=True, num_threads=2)
    assert torch.equal(one, two)


def test_the_gil_is_released(gen):
    """Another Python thread keeps running while the operator is in the kernels."""
    q, k, v = (randn(gen, 1, 8, 1024, 64) for _ in range(3))
    assert_gil_released(
        lambda: ft.scaled_dot_product_attention(q, k, v, num_threads=1))


# ------------------------------------------------------------ variants (as masks)

def test_window_and_alibi_are_their_mask_and_bias(gen):
    q, k, v = (randn(gen, 2, 3, 6, 8) for _ in range(3))
    kv = randn(gen, 2, 3, 9, 8)
    i = torch.arange(6)[:, None] + 3                    # bottom-right: query i at i + 3
    j = torch.arange(9)[None, :]
    slopes = torch.tensor([0.5, 0.25, 0.125])
    got = ft.attention(q, kv, kv, causal="bottom_right", window=(2, None),
                       alibi_slopes=slopes)
    mask = (j >= i - 2) & (j <= i)
    bias = -slopes[:, None, None] * (i - j).abs()
    want = fastattn.attention(q.numpy(), kv.numpy(), kv.numpy(), mask=mask.numpy(),
                              bias=bias.numpy())
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-6, atol=1e-6)
    # top-left positions in the drop-in, both sides bounded
    got = ft.scaled_dot_product_attention(q, k, v, window=(1, 1))
    i = torch.arange(6)[:, None]
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=(j[:, :6] - i).abs() <= 1)
    torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)


# ---------------------------------------------------- fastattn.torch.attention

def test_attention_is_the_numpy_api_on_tensors(gen):
    q = randn(gen, 2, 4, 3, 16)
    k = randn(gen, 2, 2, 10, 16, dtype=torch.float64)
    v = randn(gen, 2, 2, 10, 8)
    out, lse = ft.attention(q, k, v, causal="bottom_right", enable_gqa=True,
                            return_lse=True)
    want, want_lse = fastattn.attention(q.numpy(), k.numpy(), v.numpy(),
                                        causal="bottom_right", enable_gqa=True,
                                        return_lse=True)
    assert out.dtype == torch.float64 and lse.dtype == torch.float64
    np.testing.assert_allclose(out.numpy(), want, rtol=1e-13, atol=1e-13)
    np.testing.assert_allclose(lse.numpy(), want_lse, rtol=1e-13, atol=1e-13)
    assert not lse.requires_grad


# ------------------------------------------------------------------- gradients

def test_gradcheck_float64(gen):
    q = randn(gen, 2, 4, 5, 8, dtype=torch.float64).requires_grad_()
    k = randn(gen, 2, 7, 8, dtype=torch.float64).requires_grad_()       # broadcast + GQA
    v = randn(gen, 2, 7, 6, dtype=torch.float64).requires_grad_()
    bias = randn(gen, 4, 5, 7, dtype=torch.float64).requires_grad_()
    mask = torch.rand(5, 7, generator=gen) > 0.3
    mask[3] = False                                                      # an empty row

    def f(q, k, v, bias):
        return ft.attention(q, k, v, mask=mask, bias=bias, causal="bottom_right",
                            enable_gqa=True, scale=0.4, num_threads=1)

    assert torch.autograd.gradcheck(f, (q, k, v, bias))
    assert torch.autograd.gradcheck(
        lambda q, k, v, b: ft.scaled_dot_product_attention(q, k, v, attn_mask=b,
                                                           is_causal=True, enable_gqa=True,
                                                           num_threads=1),
        (q[0], k, v, bias))


@pytest.mark.parametrize("E", [16, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_gradients_match_pytorch(gen, dtype, E):
    """Through autograd, against PyTorch's gradients (E = 64 in bfloat16: the gradient
    products on vdpbf16ps, where the CPU's scores use it)."""
    q = randn(gen, 2, 4, 6, E, dtype=dtype).requires_grad_()
    k = randn(gen, 2, 2, 9, E, dtype=dtype).requires_grad_()
    v = randn(gen, 2, 2, 9, E, dtype=dtype).requires_grad_()
    bias = randn(gen, 2, 1, 6, 9, dtype=dtype).requires_grad_()
    grad = randn(gen, 2, 4, 6, E, dtype=dtype)
    tol = 2e-5 if dtype == torch.float32 else 3e-2
    for kwargs, inputs in [(dict(attn_mask=bias), (q, k, v, bias)),
                           (dict(is_causal=True), (q, k, v))]:
        results = []
        for fn in (ft.scaled_dot_product_attention, F.scaled_dot_product_attention):
            out = fn(q, k, v, enable_gqa=True, **kwargs)
            results.append(torch.autograd.grad(out, inputs, grad))
        for ours, theirs in zip(*results):
            assert ours.dtype == theirs.dtype and ours.shape == theirs.shape
            torch.testing.assert_close(ours.float(), theirs.float(), rtol=tol, atol=tol)


# ------------------------------------------------------- torch.library and compile

def test_opcheck(gen):
    q = randn(gen, 2, 4, 5, 8).requires_grad_()
    k = randn(gen, 2, 2, 7, 8).requires_grad_()
    v = randn(gen, 2, 2, 7, 6).requires_grad_()
    mask = torch.rand(5, 7, generator=gen) > 0.2
    bias = randn(gen, 4, 5, 7)
    none = (None, None, None, None, 0.0, None)
    variants = (3, 0, 5.0, torch.tensor([0.5, 0.25, 0.125, 0.0625]), 0.2,
                torch.tensor([77]))
    for args in [(q, k, v, None, None, 1, None, True, None) + none,
                 (q, k, v, mask, bias, 2, 0.3, True, 2) + none,
                 (q, k, v, mask, None, 1, None, True, None) + variants,
                 (q[:, :2].detach().half(), k.detach().half(), v.detach().half(),
                  None, None, 0, None, False, None) + none]:
        torch.library.opcheck(torch.ops.fastattn.attention.default, args)
    grad = randn(gen, 2, 4, 5, 6)
    for extra in (none, variants):
        out, lse = torch.ops.fastattn.attention(q, k, v, mask, None, 1, None, True, None,
                                                *extra)
        torch.library.opcheck(torch.ops.fastattn.attention_backward.default,
                              (grad, q.detach(), k.detach(), v.detach(), out.detach(),
                               lse, mask, None, 1, None, True, None) + extra)


def test_compiles_without_graph_breaks(gen):
    q, k, v = (randn(gen, 2, 4, 6, 8).requires_grad_() for _ in range(3))

    def f(q, k, v):
        out = ft.scaled_dot_product_attention(q.sin(), k, v, is_causal=True, window=(3, 0))
        return out.square().sum()

    assert torch._dynamo.explain(f)(q, k, v).graph_break_count == 0
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    got = compiled(q, k, v)
    want = f(q, k, v)
    torch.testing.assert_close(got, want)
    got_grads = torch.autograd.grad(got, (q, k, v))
    want_grads = torch.autograd.grad(want, (q, k, v))
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b)
    torch._dynamo.reset()


# --------------------------------------------------------------- optional imports

def run_python(code):
    # outside the source tree, whose fastattn/ (not built) would shadow the installed one
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, cwd=tempfile.gettempdir())


def test_import_fastattn_does_not_import_torch():
    res = run_python("import sys, fastattn; "
                     "assert not [m for m in sys.modules if m.split('.')[0] in "
                     "('torch', 'transformers')], 'torch was imported'")
    assert res.returncode == 0, res.stderr


@pytest.mark.parametrize("module", ["fastattn.torch", "fastattn.integrations.transformers"])
def test_a_missing_torch_says_what_to_install(module):
    res = run_python(f"import sys; sys.modules['torch'] = None\n"
                     f"try:\n    import {module}\n"
                     f"except ImportError as e:\n    print(e)\n")
    assert res.returncode == 0, res.stderr
    assert 'pip install "fastattn[torch]"' in res.stdout


# ------------------------------------------------------ the variants, in the kernels

def test_softcap_and_alibi_match_pytorch_arithmetic(gen):
    q, k, v = (randn(gen, 2, 4, 9, 8) for _ in range(3))
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625])
    got = ft.scaled_dot_product_attention(q, k, v, is_causal=True, softcap=3.0,
                                          alibi_slopes=slopes)
    i = torch.arange(9)
    alibi = -slopes[:, None, None] * (i[:, None] - i[None, :]).abs()
    want = ft._unfused_attention(q.double(), k.double(), v.double(),
                                 bias=alibi.double(), is_causal=True, softcap=3.0)
    torch.testing.assert_close(got, want.float(), atol=2e-6, rtol=2e-5)


def test_dropout_is_reproducible_and_differentiable(gen):
    q, k, v = (randn(gen, 1, 2, 16, 8, dtype=torch.float64).requires_grad_()
               for _ in range(3))
    torch.manual_seed(3)
    first = ft.scaled_dot_product_attention(q, k, v, dropout_p=0.3)
    torch.manual_seed(3)
    again = ft.scaled_dot_product_attention(q, k, v, dropout_p=0.3)
    torch.testing.assert_close(first, again, atol=0, rtol=0)
    other = ft.scaled_dot_product_attention(q, k, v, dropout_p=0.3)
    assert not torch.equal(first, other)
    # with the seed fixed, the operator is a smooth function of q, k, v
    seed = torch.tensor([12345])
    def f(q, k, v):
        return torch.ops.fastattn.attention(q, k, v, None, None, 0, None, False, None,
                                            None, None, None, None, 0.3, seed)[0]
    assert torch.autograd.gradcheck(f, (q, k, v))


def test_bfloat16_tensors_are_read_in_place():
    """A bfloat16 tensor reaches the kernels as an ml_dtypes view of its own memory,
    and the result comes back as a bfloat16 tensor without a float32 round trip."""
    pytest.importorskip("ml_dtypes")
    from fastattn import torch as ftorch
    q = torch.randn(2, 3, 40, 16).bfloat16().transpose(1, 2)    # strided, (B, L, H, E)
    a = ftorch._array(q)
    assert a.dtype.name == "bfloat16" and a.ctypes.data == q.data_ptr()
    out = ftorch.scaled_dot_product_attention(q, q, q, is_causal=True)
    assert out.dtype == torch.bfloat16
    exact = torch.nn.functional.scaled_dot_product_attention(
        q.double(), q.double(), q.double(), is_causal=True)
    theirs = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
    assert (out.double() - exact).abs().max() <= (theirs.double() - exact).abs().max()
