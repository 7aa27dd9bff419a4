"""fastattn.attention_backward against the NumPy reference (in float64) and against
central finite differences of reference.attention."""

import doctest
import importlib

import numpy as np
import pytest

import fastattn
from fastattn import reference

from helpers import randn

DTYPES = [np.float32, np.float64]
# Relative to the largest entry of each expected gradient (at least 1): an entry is a sum
# over up to Lq (or Lk) products, so float32 gets a little more room than the forward.
GRAD_RTOL = {np.float16: 5e-3, np.float32: 2e-5, np.float64: 1e-11}
FD_RTOL = 1e-6


def f64(a):
    return None if a is None else np.asarray(a, dtype=np.float64)


def assert_grad_close(actual, expected, dtype):
    """|actual - expected| <= rtol(dtype) * max(1, max|expected|); NaN where expected
    has NaN. (The floor of 1 is the size of the terms with unit-normal inputs: a
    gradient that is exactly zero in theory, e.g. dq with one key, is rounding noise.)"""
    actual = np.asarray(actual, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert (np.isnan(actual) == np.isnan(expected)).all(), "NaN pattern differs"
    finite = np.isfinite(expected)
    scale = max(1.0, float(np.max(np.abs(expected[finite]), initial=0.0)))
    err = float(np.max(np.abs(actual[finite] - expected[finite]), initial=0.0))
    rtol = GRAD_RTOL[np.dtype(dtype).type]
    assert err <= rtol * scale, f"max error {err:.3g} > {rtol} * {scale:.3g}"


def forward_backward(q, k, v, g, **kw):
    threads = kw.pop("num_threads", None)
    out, lse = fastattn.attention(q, k, v, return_lse=True, **kw)
    return fastattn.attention_backward(g, q, k, v, out, lse, num_threads=threads, **kw)


def oracle(q, k, v, g, **kw):
    """reference.attention_backward on float64 copies, with the reference's own forward."""
    kw = dict(kw)
    if kw.get("bias") is not None:
        kw["bias"] = f64(kw["bias"])
    q, k, v, g = f64(q), f64(k), f64(v), f64(g)
    out, lse = reference.attention(q, k, v, return_lse=True, **kw)
    return reference.attention_backward(g, q, k, v, out, lse, **kw)


def check(rng, q, k, v, dtype, **kw):
    """fastattn's gradients of sum(g * attention(...)) against the float64 oracle."""
    out_shape = fastattn.reference.attention(q, k, v, **kw).shape
    g = randn(rng, out_shape, dtype)
    grads = forward_backward(q, k, v, g, **kw)
    expected = oracle(q, k, v, g, **kw)
    for name, a, ref, x in zip("qkv", grads, expected, (q, k, v)):
        assert a.dtype == dtype, name
        assert a.shape == np.shape(x), name
        assert_grad_close(a, ref, dtype)
    return grads


def finite_differences(q, k, v, g, h=1e-5, **kw):
    """Central differences of sum(g * reference.attention(q, k, v)) in float64."""
    q, k, v = (np.array(a, dtype=np.float64) for a in (q, k, v))
    grads = []
    for a in (q, k, v):
        d = np.zeros_like(a)
        flat, dflat = a.reshape(-1), d.reshape(-1)
        for i in range(flat.size):
            x = flat[i]
            flat[i] = x + h
            up = np.sum(g * reference.attention(q, k, v, **kw))
            flat[i] = x - h
            down = np.sum(g * reference.attention(q, k, v, **kw))
            flat[i] = x
            dflat[i] = (up - down) / (2 * h)
        grads.append(d)
    return grads


def check_fd(rng, q, k, v, **kw):
    g = randn(rng, reference.attention(q, k, v, **kw).shape)
    grads = forward_backward(q, k, v, g, **kw)
    numeric = finite_differences(q, k, v, g, **kw)
    for name, a, d in zip("qkv", grads, numeric):
        scale = float(np.max(np.abs(d)))
        err = float(np.max(np.abs(a - d), initial=0.0))
        assert err <= FD_RTOL * max(scale, 1e-12), f"d{name}: {err:.3g} vs {scale:.3g}"
    return grads


# ------------------------------------------------------------- against the reference

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("Lq,Lk", [(1, 1), (1, 7), (7, 1), (13, 13), (65, 130),
                                   (131, 67), (3, 200)])
@pytest.mark.parametrize("E", [1, 16, 33])
def test_shapes(rng, dtype, Lq, Lk, E):
    q = randn(rng, (2, 3, Lq, E), dtype)
    k = randn(rng, (2, 3, Lk, E), dtype)
    v = randn(rng, (2, 3, Lk, 5), dtype)
    check(rng, q, k, v, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("E,Ev", [(64, 64), (128, 32), (3, 70), (65, 7)])
def test_head_sizes(rng, dtype, E, Ev):
    q = randn(rng, (2, 70, E), dtype)
    k = randn(rng, (2, 90, E), dtype)
    v = randn(rng, (2, 90, Ev), dtype)
    check(rng, q, k, v, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [True, "top_left", "bottom_right"])
@pytest.mark.parametrize("Lq,Lk", [(1, 7), (7, 1), (65, 130), (130, 65), (200, 200)])
def test_causal(rng, dtype, causal, Lq, Lk):
    q = randn(rng, (2, Lq, 16), dtype)
    k = randn(rng, (2, Lk, 16), dtype)
    v = randn(rng, (2, Lk, 9), dtype)
    check(rng, q, k, v, dtype, causal=causal)


@pytest.mark.parametrize("dtype", DTYPES)
def test_mask_and_bias(rng, dtype):
    q = randn(rng, (2, 3, 70, 8), dtype)
    k = randn(rng, (2, 3, 130, 8), dtype)
    v = randn(rng, (2, 3, 130, 4), dtype)
    mask = rng.random((3, 70, 130)) > 0.3
    bias = randn(rng, (2, 1, 70, 130))
    check(rng, q, k, v, dtype, mask=mask)
    check(rng, q, k, v, dtype, bias=bias)
    check(rng, q, k, v, dtype, mask=mask, bias=bias, causal="bottom_right")
    check(rng, q, k, v, dtype, mask=rng.random(130) > 0.5)          # one row for all
    check(rng, q, k, v, dtype, bias=randn(rng, (70, 1)))             # one column


@pytest.mark.parametrize("dtype", DTYPES)
def test_gqa(rng, dtype):
    q = randn(rng, (2, 6, 70, 16), dtype)
    k = randn(rng, (2, 2, 130, 16), dtype)
    v = randn(rng, (2, 2, 130, 8), dtype)
    dq, dk, dv = check(rng, q, k, v, dtype, enable_gqa=True)
    assert dk.shape == k.shape and dv.shape == v.shape
    check(rng, q, k, v, dtype, enable_gqa=True, causal=True, mask=rng.random((70, 130)) > 0.2)
    # one key/value head for all query heads, broadcast over the batch too
    check(rng, q, k[:1, :1], v[:1, :1], dtype, enable_gqa=True)


@pytest.mark.parametrize("dtype", DTYPES)
def test_broadcasting(rng, dtype):
    q = randn(rng, (3, 2, 65, 16), dtype)
    k = randn(rng, (1, 2, 600, 16), dtype)     # shared by the batch; several key chunks
    v = randn(rng, (1, 2, 600, 8), dtype)
    check(rng, q, k, v, dtype)
    check(rng, q, k[0, 0], v[0, 0], dtype, causal="bottom_right")   # a plain matrix
    check(rng, q[:1], k[:, :1].repeat(3, 0), v[:, :1].repeat(3, 0), dtype)  # q shared


def test_gradients_summed_over_uses(rng):
    """A broadcast k/v (or GQA head) gets the sum of the gradients of its copies."""
    q = randn(rng, (2, 4, 9, 8))
    k = randn(rng, (1, 2, 11, 8))
    v = randn(rng, (1, 2, 11, 5))
    g = randn(rng, (2, 4, 9, 5))
    kx = np.broadcast_to(np.repeat(k, 2, axis=1), (2, 4, 11, 8)).copy()
    vx = np.broadcast_to(np.repeat(v, 2, axis=1), (2, 4, 11, 5)).copy()
    dq, dk, dv = forward_backward(q, k, v, g, enable_gqa=True)
    dqx, dkx, dvx = forward_backward(q, kx, vx, g)
    np.testing.assert_allclose(dq, dqx, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(dk, dkx.reshape(2, 2, 2, 11, 8).sum(axis=(0, 2))[None],
                               rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(dv, dvx.reshape(2, 2, 2, 11, 5).sum(axis=(0, 2))[None],
                               rtol=1e-12, atol=1e-14)


# ----------------------------------------------------------- finite differences

def test_fd_plain(rng):
    check_fd(rng, randn(rng, (2, 5, 4)), randn(rng, (2, 7, 4)), randn(rng, (2, 7, 3)))


@pytest.mark.parametrize("causal", ["top_left", "bottom_right"])
def test_fd_causal(rng, causal):
    check_fd(rng, randn(rng, (6, 4)), randn(rng, (4, 4)), randn(rng, (4, 3)), causal=causal)
    check_fd(rng, randn(rng, (4, 4)), randn(rng, (6, 4)), randn(rng, (6, 3)), causal=causal)


def test_fd_mask_bias(rng):
    mask = rng.random((5, 7)) > 0.4
    mask[2] = False                                    # a row with no allowed key
    bias = randn(rng, (2, 1, 7))
    bias[0, 0, 3] = -np.inf
    check_fd(rng, randn(rng, (2, 5, 4)), randn(rng, (2, 7, 4)), randn(rng, (2, 7, 3)),
             mask=mask, bias=bias, scale=0.7)


def test_fd_gqa_broadcast(rng):
    check_fd(rng, randn(rng, (2, 4, 5, 3)), randn(rng, (1, 2, 6, 3)),
             randn(rng, (1, 2, 6, 2)), enable_gqa=True, causal=True)
    check_fd(rng, randn(rng, (1, 2, 5, 3)), randn(rng, (3, 2, 6, 3)),
             randn(rng, (3, 2, 6, 2)))                 # q broadcast over the batch


def test_fd_large_logits(rng):
    """Peaked but not saturated softmax: logits of a few tens."""
    check_fd(rng, 4 * randn(rng, (5, 4)), 4 * randn(rng, (7, 4)), randn(rng, (7, 3)))


# -------------------------------------------------------------------- edge cases

@pytest.mark.parametrize("dtype", DTYPES)
def test_fully_masked_rows(rng, dtype):
    q = randn(rng, (2, 70, 8), dtype)
    k = randn(rng, (2, 90, 8), dtype)
    v = randn(rng, (2, 90, 4), dtype)
    mask = rng.random((70, 90)) > 0.5
    mask[[0, 5, 64, 69]] = False
    dq, dk, dv = check(rng, q, k, v, dtype, mask=mask)
    assert np.isfinite(dq).all() and np.isfinite(dk).all() and np.isfinite(dv).all()
    assert not dq[:, [0, 5, 64, 69]].any()
    # bottom_right with Lq > Lk: the first Lq - Lk rows see no key
    dq, dk, dv = check(rng, q, k[:, :30], v[:, :30], dtype, causal="bottom_right")
    assert not dq[:, :40].any() and np.isfinite(dk).all()
    # every key blocked by bias
    bias = np.zeros((70, 90))
    bias[3] = -np.inf
    dq, _, _ = check(rng, q, k, v, dtype, bias=bias)
    assert not dq[:, 3].any()
    # nothing allowed anywhere: all gradients zero
    grads = forward_backward(q, k, v, randn(rng, (2, 70, 4), dtype),
                             mask=np.zeros((70, 90), bool))
    assert all(not g.any() for g in grads)


def test_huge_logits(rng):
    q = 100 * randn(rng, (2, 65, 16))
    k = 100 * randn(rng, (2, 80, 16))
    v = randn(rng, (2, 80, 4))
    check(rng, q, k, v, np.float64)
    check(rng, q, k, v, np.float64, causal=True)
    grads = forward_backward(q.astype(np.float32), k.astype(np.float32),
                             v.astype(np.float32), randn(rng, (2, 65, 4), np.float32))
    assert all(np.isfinite(g).all() for g in grads)


def test_empty_axes(rng):
    q, k, v = randn(rng, (2, 0, 4)), randn(rng, (2, 5, 4)), randn(rng, (2, 5, 3))
    dq, dk, dv = forward_backward(q, k, v, np.zeros((2, 0, 3)))
    assert dq.shape == (2, 0, 4) and not dk.any() and not dv.any()
    assert dk.shape == (2, 5, 4) and dv.shape == (2, 5, 3)
    q = randn(rng, (2, 6, 4))
    dq, dk, dv = forward_backward(q, k[:, :0], v[:, :0], randn(rng, (2, 6, 3)))
    assert dq.shape == (2, 6, 4) and not dq.any()
    assert dk.shape == (2, 0, 4) and dv.shape == (2, 0, 3)
    q, k = randn(rng, (2, 6, 0)), randn(rng, (2, 5, 0))     # E == 0 with a scale
    g = randn(rng, (2, 6, 3))
    dq, dk, dv = forward_backward(q, k, v, g, scale=1.0)
    assert dq.shape == (2, 6, 0) and dk.shape == (2, 5, 0)
    np.testing.assert_allclose(dv, oracle(q, k, v, g, scale=1.0)[2], rtol=1e-12)


def test_nan_gives_nan_not_a_crash(rng):
    q, k, v = randn(rng, (9, 4)), randn(rng, (11, 4)), randn(rng, (11, 3))
    q[2, 1] = np.nan
    dq, dk, dv = forward_backward(q, k, v, randn(rng, (9, 3)))
    assert np.isnan(dq[2]).all() and np.isnan(dk).any()


# ------------------------------------------------------------- dtypes and layout

def test_dtypes(rng):
    q, k, v = randn(rng, (2, 9, 8)), randn(rng, (2, 11, 8)), randn(rng, (2, 11, 4))
    g = randn(rng, (2, 9, 4))
    h = [a.astype(np.float16) for a in (q, k, v)]
    grads = forward_backward(*h, g.astype(np.float16))
    assert all(a.dtype == np.float16 for a in grads)
    for a, ref in zip(grads, oracle(*h, g.astype(np.float16))):
        assert_grad_close(a, ref, np.float16)
    # mixed: result_type of q, k, v; grad_out/out/lse are cast, never promote
    out, lse = fastattn.attention(q.astype(np.float32), k.astype(np.float32),
                                  v.astype(np.float32), return_lse=True)
    grads = fastattn.attention_backward(g, q.astype(np.float32), k.astype(np.float32),
                                        v.astype(np.float32), out.astype(np.float64),
                                        lse.astype(np.float64))
    assert all(a.dtype == np.float32 for a in grads)
    grads = forward_backward(q.astype(np.float32), k, v.astype(np.float16), g)
    assert all(a.dtype == np.float64 for a in grads)
    # integers are taken as float64
    qi, ki, vi = (np.arange(12).reshape(3, 4) % 3 for _ in range(3))
    grads = forward_backward(qi, ki, vi, np.ones((3, 4)))
    assert all(a.dtype == np.float64 for a in grads)
    for a, ref in zip(grads, oracle(qi, ki, vi, np.ones((3, 4)))):
        assert_grad_close(a, ref, np.float64)


@pytest.mark.parametrize("dtype", DTYPES)
def test_non_contiguous_and_read_only(rng, dtype):
    base_q = randn(rng, (3, 16, 70), dtype)
    q = base_q.transpose(0, 2, 1)[:, ::-1]          # (3, 70, 16), negative strides
    k = randn(rng, (3, 200, 32), dtype)[:, ::2, ::2]
    v = np.asfortranarray(randn(rng, (3, 100, 5), dtype))
    for a in (q, k, v):
        a.flags.writeable = False
    grads = check(rng, q, k, v, dtype, causal="bottom_right")
    out, lse = fastattn.attention(q, k, v, return_lse=True, causal="bottom_right")
    g = randn(rng, out.shape, dtype)
    nc = fastattn.attention_backward(np.asfortranarray(g), q, k, v, out[..., ::-1][..., ::-1],
                                     np.asfortranarray(lse), causal="bottom_right")
    ref = fastattn.attention_backward(g, np.ascontiguousarray(q), np.ascontiguousarray(k),
                                      np.ascontiguousarray(v), out, lse,
                                      causal="bottom_right")
    for a, b in zip(nc, ref):
        assert np.array_equal(a, b)
    assert len(grads) == 3


# --------------------------------------------------------------------- threads

@pytest.mark.parametrize("dtype", DTYPES)
def test_bit_identical_for_any_thread_count(rng, dtype):
    cases = [
        dict(q=(2, 4, 150, 16), k=(2, 2, 300, 16), v=(2, 2, 300, 8),
             kw=dict(enable_gqa=True, causal=True)),
        dict(q=(3, 1, 65, 8), k=(1, 2, 700, 8), v=(1, 2, 700, 8),
             kw=dict(causal="bottom_right")),
        dict(q=(1, 130, 33), k=(4, 90, 33), v=(4, 90, 7), kw={}),
    ]
    for case in cases:
        q, k, v = (randn(rng, case[n], dtype) for n in "qkv")
        kw = case["kw"]
        out, lse = fastattn.attention(q, k, v, return_lse=True, **kw)
        g = randn(rng, out.shape, dtype)
        results = [fastattn.attention_backward(g, q, k, v, out, lse, num_threads=n, **kw)
                   for n in (1, 2, 3)]
        for other in results[1:]:
            for a, b in zip(results[0], other):
                assert a.tobytes() == b.tobytes()


def test_default_threads(rng):
    q, k, v = randn(rng, (2, 70, 8)), randn(rng, (2, 90, 8)), randn(rng, (2, 90, 4))
    g = randn(rng, (2, 70, 4))
    expected = forward_backward(q, k, v, g, num_threads=1)
    try:
        fastattn.set_num_threads(2)
        got = forward_backward(q, k, v, g)
    finally:
        fastattn.set_num_threads(None)
    for a, b in zip(expected, got):
        assert np.array_equal(a, b)


# ---------------------------------------------------------------------- errors

def _args(rng):
    q, k, v = randn(rng, (2, 3, 5, 4)), randn(rng, (2, 3, 6, 4)), randn(rng, (2, 3, 6, 2))
    out, lse = fastattn.attention(q, k, v, return_lse=True)
    return dict(grad_out=np.ones_like(out), q=q, k=k, v=v, out=out, lse=lse)


@pytest.mark.parametrize("name,shape", [("grad_out", (2, 3, 5, 3)), ("grad_out", (3, 5, 2)),
                                        ("out", (2, 3, 4, 2)), ("lse", (2, 3, 5, 1)),
                                        ("lse", (2, 3))])
def test_wrong_shapes(rng, name, shape):
    a = _args(rng)
    good = a[name].shape
    a[name] = np.zeros(shape)
    with pytest.raises(ValueError) as info:
        fastattn.attention_backward(**a)
    message = str(info.value)
    assert name in message and str(shape) in message and str(good) in message


def test_errors(rng):
    a = _args(rng)
    with pytest.raises(TypeError, match="grad_out"):
        fastattn.attention_backward(**{**a, "grad_out": a["grad_out"] > 0})
    with pytest.raises(TypeError, match="lse"):
        fastattn.attention_backward(**{**a, "lse": a["lse"].astype(complex)})
    with pytest.raises(TypeError, match="mask"):
        fastattn.attention_backward(**a, mask=np.ones((5, 6)))
    with pytest.raises(ValueError, match="causal"):
        fastattn.attention_backward(**a, causal="diagonal")
    with pytest.raises(ValueError, match="num_threads"):
        fastattn.attention_backward(**a, num_threads=0)
    with pytest.raises(TypeError, match="num_threads"):
        fastattn.attention_backward(**a, num_threads=True)
    with pytest.raises(ValueError, match="k"):
        fastattn.attention_backward(**{**a, "k": a["k"][..., :3]})
    with pytest.raises(ValueError, match="multiple"):
        fastattn.attention_backward(**{**a, "k": a["k"][:, :2], "v": a["v"][:, :2]},
                                    enable_gqa=True)
    with pytest.raises(ValueError, match="mask"):
        fastattn.attention_backward(**a, mask=np.ones((1, 2, 3, 5, 6), bool))


def test_reference_rejects_wrong_shapes(rng):
    a = _args(rng)
    a["lse"] = a["lse"][..., :-1]
    with pytest.raises(ValueError, match="lse"):
        reference.attention_backward(**a)


def test_docstring_examples():
    module = importlib.import_module("fastattn._grad")
    result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0


@pytest.mark.parametrize("own, batch, groups", [
    ((2, 4), (2, 4), 1),            # nothing shared
    ((2, 2), (2, 4), 2),            # GQA: head h reads h // 2
    ((1, 4), (2, 4), 1),            # broadcast over the batch
    ((4,), (3, 4), 1),              # fewer batch axes
    ((1, 1), (2, 4), 4),            # one key/value head, broadcast batch
    ((), (), 1),                    # plain matrices
])
def test_readers_list_each_slices_users_in_order(own, batch, groups):
    """The backward's users/starts: output slice n (C order over batch) reads input
    slice index[n]; users[starts[u]:starts[u + 1]] are the n with index[n] == u,
    increasing."""
    from fastattn._compute import _readers
    users, starts = _readers(own, batch, groups)
    n_in = int(np.prod(own))
    index = []
    for n in np.ndindex(*batch):
        pos = list(n[len(n) - len(own):])
        if groups > 1:
            pos[-1] //= groups
        pos = [0 if size == 1 else p for p, size in zip(pos, own)]
        index.append(int(np.ravel_multi_index(pos, own)) if own else 0)
    want = [[n for n, i in enumerate(index) if i == u] for u in range(n_in)]
    assert users.dtype == starts.dtype == np.intp
    assert [list(users[starts[u]:starts[u + 1]]) for u in range(n_in)] == want


def test_backward_refuses_users_that_do_not_agree():
    """The driver checks the users/starts it is given (an internal error, never a read
    outside dq, dk or dv)."""
    from fastattn import _compute, _validation
    from fastattn._dispatch import drivers
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((2, 3, 8, 4)) for _ in range(3))
    out, lse = fastattn.attention(q, k, v, return_lse=True)
    args = _validation.attention_args(q, k, v)
    plan = _compute._plan(args, None, lse)
    grads = [np.empty_like(x) for x in (q, k, v)]
    good = (np.arange(6), np.arange(7))
    drivers.backward(plan, np.ones_like(out), out, *grads, *good, *good, 1)
    bad = {"users out of range": (np.array([0, 1, 2, 3, 4, 6]), np.arange(7)),
           "too few users": (np.arange(5), np.arange(7)),
           "starts not ending at the slices": (np.arange(6), np.arange(6)),
           "decreasing starts": (np.arange(6), np.array([0, 2, 1, 3, 4, 5, 6])),
           "starts not from 0": (np.arange(6), np.arange(1, 8))}
    for what, (users, starts) in bad.items():
        for pair in ((users, starts) + good, good + (users, starts)):
            with pytest.raises(ValueError, match="do not agree"):
                drivers.backward(plan, np.ones_like(out), out, *grads, *pair, 1)
