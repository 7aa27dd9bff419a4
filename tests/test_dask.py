"""fastattn.dask.attention against fastattn.attention on the whole arrays."""

import os
import subprocess
import sys

import numpy as np
import pytest

import fastattn

dask = pytest.importorskip("dask")
da = pytest.importorskip("dask.array")
fdask = pytest.importorskip("fastattn.dask")

RTOL = {np.float16: 2e-3, np.float32: 2e-5, np.float64: 1e-12}
ATOL = {np.float16: 2e-3, np.float32: 2e-6, np.float64: 1e-13}


def oracle(q, k, v, **kw):
    """``fastattn.attention`` on the whole (NumPy) arrays."""
    def np_(x):
        return x.compute() if isinstance(x, da.Array) else x
    kw = {n: np_(x) for n, x in kw.items()}
    return fastattn.attention(np_(q), np_(k), np_(v), return_lse=True, **kw)


def check(q, k, v, scheduler="threads", **kw):
    out, lse = fdask.attention(q, k, v, return_lse=True, **kw)
    assert isinstance(out, da.Array) and isinstance(lse, da.Array)
    got, got_lse = dask.compute(out, lse, scheduler=scheduler)
    want, want_lse = oracle(q, k, v, **kw)
    assert got.shape == want.shape == out.shape and got.dtype == want.dtype == out.dtype
    assert got_lse.shape == want_lse.shape and got_lse.dtype == want_lse.dtype == lse.dtype
    dt = np.dtype(want.dtype).type
    np.testing.assert_allclose(got, want, rtol=RTOL[dt], atol=ATOL[dt])
    lt = np.dtype(want_lse.dtype).type
    np.testing.assert_allclose(got_lse, want_lse, rtol=RTOL[lt], atol=ATOL[lt])
    return got


def data(shape_q, shape_k, Ev=None, dtype=np.float64, seed=0):
    rng = np.random.default_rng(seed)
    Ev = shape_k[-1] if Ev is None else Ev
    q = rng.standard_normal(shape_q).astype(dtype)
    k = rng.standard_normal(shape_k).astype(dtype)
    v = rng.standard_normal(shape_k[:-1] + (Ev,)).astype(dtype)
    return q, k, v


# (B, H, Lq, Lk, E) = (2, 4, 12, 17, 8); chunks of q and of k/v (v: Ev = 6 whole)
CHUNKINGS = {
    "none": (-1, -1),
    "batch": ((1, 4, 12, 8), (1, 4, 17, 8)),
    "heads": ((2, (1, 3), 12, 8), (2, (2, 2), 17, 8)),
    "lq": ((2, 4, (5, 7), 8), -1),
    "lk": (-1, (2, 4, (3, 9, 5), 8)),
    "lk-many": (-1, (2, 4, 2, 8)),
    "lk-ones": (-1, (2, 4, 1, 8)),
    "lq-lk": ((2, 4, 4, 8), (2, 4, 5, 8)),
    "all": ((1, 2, (7, 5), 8), (1, (1, 3), (6, 6, 5), 8)),
    "e-split": ((2, 4, 12, 3), (2, 4, 17, 5)),
}


@pytest.mark.parametrize("chunking", list(CHUNKINGS))
@pytest.mark.parametrize("causal", [False, True, "bottom_right"])
def test_chunkings(chunking, causal):
    cq, ck = CHUNKINGS[chunking]
    q, k, v = data((2, 4, 12, 8), (2, 4, 17, 8), Ev=6)
    ck_v = ck if ck == -1 else ck[:-1] + (6,)
    check(da.from_array(q, cq), da.from_array(k, ck), da.from_array(v, ck_v),
          causal=causal)


def test_k_and_v_chunked_differently():
    q, k, v = data((3, 10, 4), (3, 20, 4))
    check(da.from_array(q, (1, 5, 4)), da.from_array(k, (2, (7, 13), 4)),
          da.from_array(v, (3, (4, 4, 12), 2)), causal="bottom_right")


@pytest.mark.parametrize("Lq, Lk", [(16, 16), (20, 9), (9, 20), (1, 13), (13, 1)])
@pytest.mark.parametrize("causal", ["top_left", "bottom_right"])
@pytest.mark.parametrize("chunk", [1, 4, 7])
def test_causal_global_positions(Lq, Lk, causal, chunk):
    q, k, v = data((2, Lq, 4), (2, Lk, 4), seed=Lq * Lk)
    check(da.from_array(q, (1, chunk, 4)), da.from_array(k, (2, chunk, 4)),
          da.from_array(v, (2, chunk + 1, 4)), causal=causal)


def partial_tasks(x):
    return [key for key in dict(x.__dask_graph__()) if key[0].startswith("fastattn-partial")]


@pytest.mark.parametrize("causal, expected", [(False, 16), ("top_left", 10),
                                               ("bottom_right", 10)])
def test_future_chunks_are_skipped(causal, expected):
    q, k, v = data((2, 16, 4), (2, 16, 4))
    out = fdask.attention(*(da.from_array(a, (2, 4, 4)) for a in (q, k, v)), causal=causal)
    assert len(partial_tasks(out)) == expected


def test_query_block_with_no_key_at_all():
    # bottom_right with Lq > Lk: the first Lq - Lk queries see nothing
    q, k, v = data((2, 12, 4), (2, 5, 4))
    got = check(da.from_array(q, (2, 3, 4)), da.from_array(k, (2, 2, 4)),
                da.from_array(v, (2, 2, 4)), causal="bottom_right")
    assert np.all(got[:, :7] == 0)


@pytest.mark.parametrize("mask_shape", [(2, 4, 12, 17), (4, 12, 17), (1, 1, 17),
                                        (12, 1), (2, 1, 12, 17), (17,)])
@pytest.mark.parametrize("causal", [False, "bottom_right"])
def test_masks_broadcast_and_chunked(mask_shape, causal):
    rng = np.random.default_rng(1)
    q, k, v = data((2, 4, 12, 8), (2, 4, 17, 8))
    mask = rng.random(mask_shape) < 0.6
    mchunks = tuple(max(1, n // 2) for n in mask_shape)
    cq, ck = CHUNKINGS["all"]
    check(da.from_array(q, cq), da.from_array(k, ck), da.from_array(v, ck),
          mask=da.from_array(mask, mchunks), causal=causal)


def test_mask_and_bias_together_with_fully_masked_rows():
    rng = np.random.default_rng(2)
    q, k, v = data((2, 3, 10, 4), (2, 3, 14, 4))
    mask = rng.random((3, 10, 14)) < 0.5
    mask[:, 2] = False
    mask[1, :, 5:9] = False                  # a key chunk fully masked in one head
    bias = rng.standard_normal((2, 1, 10, 14))
    bias[0, 0, 4, :] = -np.inf
    got = check(da.from_array(q, (1, 2, 5, 4)), da.from_array(k, (2, 1, 4, 4)),
                da.from_array(v, (2, 1, (5, 9), 4)), mask=mask,
                bias=da.from_array(bias, (1, 1, 3, 7)), causal=True)
    assert np.all(got[:, :, 2] == 0) and np.all(got[0, :, 4] == 0)


def test_integer_bias_and_numpy_inputs():
    q, k, v = data((5, 4), (9, 4))
    bias = np.arange(45).reshape(5, 9) % 3
    out = check(q, k, v, bias=bias, scale=0.5)
    assert out.dtype == np.float64


@pytest.mark.parametrize("Hq, Hkv, head_chunks", [
    (6, 2, (1, 4, 1)), (6, 2, (2, 3, 1)), (6, 2, 3), (8, 2, 1), (6, 1, (2, 4)),
    (4, 4, 1), (6, 3, 6)])
@pytest.mark.parametrize("causal", [False, "top_left"])
def test_gqa(Hq, Hkv, head_chunks, causal):
    q, k, v = data((2, Hq, 6, 4), (2, Hkv, 9, 4))
    mask = np.random.default_rng(3).random((Hq, 6, 9)) < 0.7
    check(da.from_array(q, (1, head_chunks, 3, 4)), da.from_array(k, (2, 1, 4, 4)),
          da.from_array(v, (1, Hkv, 5, 4)), mask=mask, causal=causal, enable_gqa=True)


@pytest.mark.parametrize("shape_q, shape_k", [
    ((1, 4, 6, 8), (3, 1, 7, 8)),      # batch and heads broadcast both ways
    ((6, 8), (3, 2, 7, 8)),            # a plain matrix of queries
    ((3, 2, 6, 8), (7, 8)),            # shared keys
])
def test_batch_broadcasting(shape_q, shape_k):
    q, k, v = data(shape_q, shape_k)
    chunk = lambda a: da.from_array(a, tuple(max(1, n // 2) for n in a.shape))  # noqa: E731
    check(chunk(q), chunk(k), chunk(v), causal="bottom_right")


@pytest.mark.parametrize("dtypes", [(np.float32,) * 3, (np.float16,) * 3,
                                    (np.float32, np.float64, np.float32),
                                    (np.int64, np.float32, np.float32)])
def test_dtypes(dtypes):
    rng = np.random.default_rng(4)
    q, k, v = (rng.standard_normal(s).astype(dt) if dt != np.int64 else
               rng.integers(-2, 3, s) for s, dt in zip(((2, 8, 4), (2, 11, 4),
                                                         (2, 11, 4)), dtypes))
    check(da.from_array(q, (1, 4, 4)), da.from_array(k, (2, 3, 4)),
          da.from_array(v, (2, 3, 4)), causal=True)


@pytest.mark.parametrize("shape_q, shape_k", [((2, 0, 4), (2, 5, 4)),
                                              ((2, 6, 4), (2, 0, 4)),
                                              ((0, 6, 4), (0, 5, 4))])
def test_zero_size_axes(shape_q, shape_k):
    q, k, v = data(shape_q, shape_k)
    check(da.from_array(q), da.from_array(k), da.from_array(v), causal="bottom_right")


def test_results_are_lazy_and_reproducible():
    calls = []

    def load(x):
        calls.append(1)
        return x

    q, k, v = data((2, 3, 8, 4), (2, 3, 13, 4))
    dq, dk, dv = (da.from_array(a, (1, 1, 4, 4)).map_blocks(load, dtype=a.dtype)
                  for a in (q, k, v))
    calls.clear()                             # map_blocks may probe ``load`` for its meta
    out = fdask.attention(dq, dk, dv, causal="bottom_right")
    assert calls == []
    a = out.compute(scheduler="threads")
    assert calls
    b = out.compute(scheduler="sync")
    np.testing.assert_array_equal(a, b)       # a fixed merge order: bitwise equal
    assert fdask.attention(dq, dk, dv).name == fdask.attention(dq, dk, dv).name


def exploding(shape, dtype=np.float64):
    """A dask array that raises if it is ever computed."""
    def boom():
        raise AssertionError("computed")
    return da.from_delayed(dask.delayed(boom)(), shape, dtype=dtype)


@pytest.mark.parametrize("kw, error, match", [
    (dict(k=(2, 7, 5)), ValueError, r"q and k"),
    (dict(v=(2, 8, 4)), ValueError, r"k and v"),
    (dict(q=(3, 6, 4)), ValueError, r"do not broadcast"),
    (dict(q_dtype=np.bool_), TypeError, r"\bq\b"),
    (dict(v_dtype=np.complex128), TypeError, r"\bv\b"),
    (dict(mask=((2, 6, 7), np.float64)), TypeError, r"mask must be boolean"),
    (dict(mask=((1, 2, 6, 7), np.bool_)), ValueError, r"mask of shape"),
    (dict(bias=((2, 6, 8), np.float32)), ValueError, r"bias of shape"),
    (dict(bias=((6, 7), np.bool_)), TypeError, r"bias"),
    (dict(causal="diagonal"), ValueError, r"causal"),
    (dict(q=(2, 6, 0), k=(2, 7, 0)), ValueError, r"scale"),
    (dict(q=(6, 4), k=(7, 4), v=(7, 5), enable_gqa=True), ValueError, r"enable_gqa"),
])
def test_errors_when_called(kw, error, match):
    shapes = dict(q=(2, 6, 4), k=(2, 7, 4), v=(2, 7, 5))
    args = {n: exploding(kw.get(n, s), kw.get(n + "_dtype", np.float64))
            for n, s in shapes.items()}
    extra = {n: exploding(*kw[n]) for n in ("mask", "bias") if n in kw}
    for n in ("causal", "enable_gqa"):
        if n in kw:
            extra[n] = kw[n]
    with pytest.raises(error, match=match):
        fdask.attention(args["q"], args["k"], args["v"], **extra)


def test_gqa_heads_not_a_multiple():
    with pytest.raises(ValueError, match="multiple"):
        fdask.attention(exploding((5, 6, 4)), exploding((2, 7, 4)), exploding((2, 7, 4)),
                        enable_gqa=True)


def test_unknown_chunk_sizes_raise():
    x = da.from_array(np.ones((4, 4)), 2)
    x = x[x[:, 0] > 0]
    with pytest.raises(ValueError, match="unknown chunk sizes"):
        fdask.attention(x, x, x)


def test_import_fastattn_does_not_import_dask(tmp_path):
    code = ("import sys, fastattn; fastattn.merge_partials; "
            "assert not [m for m in sys.modules if m == 'dask' or m.startswith('dask.') "
            "or m == 'distributed' or m.startswith('distributed.')], sorted(sys.modules)")
    root = os.path.dirname(os.path.dirname(os.path.abspath(fastattn.__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [root] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    # run outside the source tree, so that the fastattn under test is the one imported
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=60,
                   cwd=tmp_path)


# ------------------------------------------------------------------ variants

# (B, H, Lq, Lk) = (3, 4, 12, 17); each entry: the variant keywords
VARIANTS = {
    "window": dict(window=(3, 2)),
    "window-left": dict(window=(4, None)),
    "window-right": dict(window=(None, 0)),
    "softcap": dict(softcap=1.5),
    "alibi-heads": dict(alibi_slopes=[0.5, 0.25, 0.125, 1.0]),
    "alibi-batch": dict(alibi_slopes=np.linspace(0.1, 1.2, 12).reshape(3, 4)),
    "q-lengths": dict(q_lengths=[12, 0, 5]),
    "kv-lengths": dict(kv_lengths=[1, 17, 8]),
    "lengths": dict(q_lengths=[3, 12, 7], kv_lengths=[17, 0, 10]),
    "all": dict(window=(5, 1), softcap=2.0, alibi_slopes=[0.3, 0.1, 0.6, 0.2],
                q_lengths=[12, 9, 4], kv_lengths=[13, 17, 2]),
}
VARIANT_CHUNKINGS = {
    "lq-lk": ((1, 2, 5, 8), (1, 2, 6, 8)),
    "heads": ((3, (1, 3), 12, 8), (2, (3, 1), 17, 8)),
    "uneven": ((2, 4, (4, 8), 8), ((1, 2), 4, (7, 3, 7), 8)),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("causal", [False, True, "bottom_right"])
@pytest.mark.parametrize("chunking", list(VARIANT_CHUNKINGS))
def test_variants(variant, causal, chunking):
    cq, ck = VARIANT_CHUNKINGS[chunking]
    q, k, v = data((3, 4, 12, 8), (3, 4, 17, 8), seed=6)
    check(da.from_array(q, cq), da.from_array(k, ck), da.from_array(v, ck),
          scheduler="sync", causal=causal, **VARIANTS[variant])


@pytest.mark.parametrize("causal", [False, "top_left", "bottom_right"])
def test_variants_with_gqa_mask_and_bias(causal):
    rng = np.random.default_rng(7)
    q, k, v = data((2, 6, 10, 4), (2, 2, 15, 4), seed=7)
    mask = rng.random((6, 10, 15)) < 0.8
    bias = rng.standard_normal((2, 1, 10, 15))
    check(da.from_array(q, (1, (1, 2, 3), 4, 4)), da.from_array(k, (2, 1, 6, 4)),
          da.from_array(v, (1, 2, 5, 4)), mask=da.from_array(mask, (3, 5, 5)),
          bias=bias, causal=causal, enable_gqa=True, window=(4, 3), softcap=3.0,
          alibi_slopes=rng.random((2, 6)), q_lengths=[10, 6], kv_lengths=[9, 15],
          scheduler="sync")


def test_variants_against_the_reference():
    q, k, v = data((2, 3, 9, 4), (2, 3, 11, 4), seed=8)
    kw = dict(causal="bottom_right", window=(2, 0), softcap=1.0,
              alibi_slopes=[0.2, 0.4, 0.8], q_lengths=[9, 4], kv_lengths=[6, 11])
    out, lse = fdask.attention(da.from_array(q, (1, 2, 4, 4)),
                               da.from_array(k, (2, 1, 5, 4)),
                               da.from_array(v, (2, 1, 5, 4)), return_lse=True, **kw)
    want, want_lse = fastattn.reference.attention(q, k, v, return_lse=True, **kw)
    np.testing.assert_allclose(out.compute(scheduler="sync"), want, rtol=1e-12,
                               atol=1e-13)
    np.testing.assert_allclose(lse.compute(scheduler="sync"), want_lse, rtol=1e-12,
                               atol=1e-13)


@pytest.mark.parametrize("kw, expected", [
    (dict(window=(4, 0), causal=True), 7),          # the diagonal and one block left
    (dict(window=(0, 3)), 7),                       # the diagonal and one block right
    (dict(window=(None, 0)), 10),                   # the causal triangle
    (dict(kv_lengths=[4, 5]), 8),                   # keys past 8 never attended
    (dict(q_lengths=[3, 4]), 4),                    # queries past 4 are zeros
    (dict(q_lengths=[0, 0]), 0),                    # nothing at all
    (dict(kv_lengths=[9, 2], window=(1, 1)), 7),
])
def test_blocks_outside_the_window_or_lengths_are_skipped(kw, expected):
    q, k, v = data((2, 16, 4), (2, 16, 4))
    out = fdask.attention(*(da.from_array(a, (2, 4, 4)) for a in (q, k, v)), **kw)
    assert len(partial_tasks(out)) == expected
    np.testing.assert_allclose(out.compute(scheduler="sync"),
                               fastattn.attention(q, k, v, **kw), rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("shape_q, shape_k, cq, ck", [
    ((3, 4, 12, 8), (3, 4, 17, 8), (1, 4, 5, 8), (3, 2, 6, 8)),       # batch blocks
    ((3, 4, 12, 8), (3, 4, 17, 8), (2, (1, 3), 12, 8), (3, 4, 17, 8)),  # not consecutive
    ((2, 6, 12, 8), (2, 2, 17, 8), (1, (1, 2, 3), 6, 8), (2, 1, 17, 8)),  # GQA
    ((1, 4, 12, 8), (3, 1, 17, 8), (1, 1, 5, 8), (1, 1, 6, 8)),       # broadcast
    ((12, 8), (17, 8), (5, 8), (6, 8)),                               # no batch axis
])
def test_dropout_draws_the_pattern_of_the_whole_call(shape_q, shape_k, cq, ck):
    q, k, v = data(shape_q, shape_k, seed=9)
    gqa = len(shape_q) == 4 and shape_q[1] != shape_k[1]
    kw = dict(dropout_p=0.3, dropout_seed=2**40 + 11, causal="bottom_right",
              enable_gqa=gqa)
    if len(shape_q) > 2:
        kw.update(window=(6, 0), alibi_slopes=np.linspace(0.1, 0.4, shape_q[-3]))
    dq = da.from_array(q, cq)
    out, lse = fdask.attention(dq, da.from_array(k, ck), da.from_array(v, ck),
                               return_lse=True, **kw)
    assert out.chunks[-2] == (shape_q[-2],)         # the query axis is used whole
    check(dq, da.from_array(k, ck), da.from_array(v, ck), scheduler="sync", **kw)
    want = fastattn.reference.attention(q, k, v, **kw)
    np.testing.assert_allclose(out.compute(scheduler="sync"), want, rtol=1e-12,
                               atol=1e-13)
    # a different seed draws another pattern
    other = fdask.attention(dq, k, v, **dict(kw, dropout_seed=12)).compute()
    assert not np.allclose(other, want)


def test_dropout_with_lengths_and_mask():
    rng = np.random.default_rng(10)
    q, k, v = data((3, 2, 7, 4), (3, 2, 9, 4), seed=10)
    mask = rng.random((3, 1, 7, 9)) < 0.8
    check(da.from_array(q, (1, 1, 3, 4)), da.from_array(k, (2, 2, 4, 4)),
          da.from_array(v, (3, 1, 9, 4)), mask=da.from_array(mask, (2, 1, 7, 3)),
          q_lengths=[7, 2, 5], kv_lengths=[9, 4, 0], causal="bottom_right",
          dropout_p=0.5, dropout_seed=3, scheduler="sync")


def test_lengths_and_slopes_may_be_dask_arrays():
    q, k, v = data((2, 3, 6, 4), (2, 3, 8, 4))
    kw = dict(q_lengths=np.array([6, 2]), kv_lengths=np.array([3, 8]),
              alibi_slopes=np.array([0.1, 0.2, 0.3]))
    out = fdask.attention(q, k, v, **{n: da.from_array(x, 1) for n, x in kw.items()})
    np.testing.assert_allclose(out.compute(), fastattn.attention(q, k, v, **kw),
                               rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("kw, error, match", [
    (dict(window=(-1, 0)), ValueError, r"window"),
    (dict(window=(1.5, 0)), TypeError, r"window"),
    (dict(window=3), TypeError, r"window"),
    (dict(softcap=0.0), ValueError, r"softcap"),
    (dict(softcap=float("nan")), ValueError, r"softcap"),
    (dict(alibi_slopes=np.ones(5)), ValueError, r"alibi_slopes"),
    (dict(alibi_slopes=np.ones((4, 3))), ValueError, r"alibi_slopes"),
    (dict(q_lengths=[1, 2]), ValueError, r"q_lengths"),
    (dict(kv_lengths=[1, 2, 8]), ValueError, r"kv_lengths"),
    (dict(kv_lengths=[1.0, 2.0, 3.0]), TypeError, r"kv_lengths"),
    (dict(dropout_p=1.0, dropout_seed=1), ValueError, r"dropout_p"),
    (dict(dropout_p=0.1), ValueError, r"dropout_seed"),
    (dict(dropout_p=0.1, dropout_seed=-1), ValueError, r"dropout_seed"),
])
def test_variant_errors_when_called(kw, error, match):
    q, k, v = (exploding(s) for s in ((3, 4, 6, 4), (3, 4, 7, 4), (3, 4, 7, 5)))
    with pytest.raises(error, match=match):
        fdask.attention(q, k, v, **kw)


def test_alibi_needs_a_head_axis():
    with pytest.raises(ValueError, match="alibi_slopes"):
        fdask.attention(exploding((6, 4)), exploding((7, 4)), exploding((7, 4)),
                        alibi_slopes=[1.0])


# ------------------------------------------------------------- dask.distributed

@pytest.fixture(scope="module")
def client():
    distributed = pytest.importorskip("distributed")
    root = os.path.dirname(os.path.dirname(os.path.abspath(fastattn.__file__)))
    with pytest.MonkeyPatch.context() as mp:
        # worker processes must import this fastattn, and run one thread each
        mp.setenv("PYTHONPATH", os.pathsep.join(
            [root] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
        mp.setenv("OMP_NUM_THREADS", "1")
        with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                                      host="127.0.0.1", dashboard_address=None,
                                      worker_dashboard_address=None,
                                      silence_logs=40, death_timeout=60) as cluster, \
                distributed.Client(cluster, timeout=60) as c:
            yield c


@pytest.mark.parametrize("causal, gqa", [(False, False), ("bottom_right", True),
                                         (True, False)])
def test_local_cluster(client, causal, gqa):
    rng = np.random.default_rng(5)
    q, k, v = data((2, 4, 24, 8), (2, 2 if gqa else 4, 40, 8), dtype=np.float32)
    mask = rng.random((4, 24, 40)) < 0.8
    dq = da.from_array(q, (1, 2, 12, 8))
    dk = da.from_array(k, (2, 1, 10, 8))
    dv = da.from_array(v, (1, 2, 10, 8))
    out, lse = fdask.attention(dq, dk, dv, mask=da.from_array(mask, (2, 12, 10)),
                               causal=causal, enable_gqa=gqa, return_lse=True)
    got, got_lse = client.compute([out, lse], sync=False)
    got, got_lse = got.result(timeout=60), got_lse.result(timeout=60)
    workers = client.run(os.getpid)
    assert len(set(workers.values())) == 2 and os.getpid() not in workers.values()
    want, want_lse = oracle(q, k, v, mask=mask, causal=causal, enable_gqa=gqa)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(got_lse, want_lse, rtol=2e-5, atol=2e-6)


def test_local_cluster_with_variants(client):
    q, k, v = data((2, 4, 24, 8), (2, 2, 40, 8), dtype=np.float32, seed=11)
    kw = dict(causal="bottom_right", enable_gqa=True, window=(9, 0), softcap=4.0,
              alibi_slopes=[0.1, 0.2, 0.3, 0.4], q_lengths=[24, 13],
              kv_lengths=[30, 40])
    for extra, cq in ((dict(), (1, 2, 12, 8)),
                      (dict(dropout_p=0.2, dropout_seed=5), (1, (1, 3), 24, 8))):
        out = fdask.attention(da.from_array(q, cq), da.from_array(k, (2, 1, 10, 8)),
                              da.from_array(v, (1, 2, 10, 8)), **kw, **extra)
        got = client.compute(out, sync=False).result(timeout=60)
        want = fastattn.attention(q, k, v, **kw, **extra)
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)


# --------------------------------------------------------- random chunkings

def _random_chunks(draw, st, n):
    """Chunks of an axis of size n: uneven, drawn by hypothesis."""
    if n <= 1:
        return (n,)
    cuts = draw(st.sets(st.integers(1, n - 1), max_size=3))
    b = [0] + sorted(cuts) + [n]
    return tuple(y - x for x, y in zip(b[:-1], b[1:]))


def variant_keywords(st, B, H, Lq, Lk):
    """A strategy: some of the variant keywords for a (B, H, Lq, Lk) call."""
    side = st.none() | st.integers(0, max(Lq, Lk) + 1)
    lengths = lambda n: st.lists(st.integers(0, n), min_size=B, max_size=B)  # noqa: E731
    slopes = st.lists(st.floats(0, 2), min_size=H, max_size=H)
    return st.fixed_dictionaries({}, optional={
        "window": st.tuples(side, side), "softcap": st.floats(0.25, 8),
        "alibi_slopes": slopes | st.lists(slopes, min_size=B, max_size=B),
        "q_lengths": lengths(Lq), "kv_lengths": lengths(Lk),
        "sinks": st.lists(st.floats(-3, 3), min_size=H, max_size=H),
        "dropout_p": st.sampled_from([0.0, 0.25, 0.9])}).map(
        lambda kw: dict(kw, dropout_seed=7) if kw.get("dropout_p") else kw)


def test_random_chunkings():
    hypothesis = pytest.importorskip("hypothesis")
    st = hypothesis.strategies

    @hypothesis.settings(max_examples=40, deadline=None, derandomize=True)
    @hypothesis.given(st.data())
    def run(draw_data):
        draw = draw_data.draw
        B, hkv = draw(st.integers(1, 2)), draw(st.integers(1, 3))
        gqa = draw(st.booleans())
        hq = hkv * draw(st.integers(1, 3)) if gqa else hkv
        Lq, Lk, E = draw(st.integers(1, 9)), draw(st.integers(1, 12)), 3
        causal = draw(st.sampled_from([False, "top_left", "bottom_right"]))
        q, k, v = data((B, hq, Lq, E), (B, hkv, Lk, E), seed=draw(st.integers(0, 99)))
        dq, dk, dv = (da.from_array(a, tuple(_random_chunks(draw, st, n) for n in a.shape))
                      for a in (q, k, v))
        kw = dict(causal=causal, enable_gqa=gqa)
        if draw(st.booleans()):
            shape = tuple(n if draw(st.booleans()) else 1 for n in (B, hq, Lq, Lk))
            mask = np.random.default_rng(Lq).random(shape) < 0.7
            kw["mask"] = da.from_array(
                mask, tuple(_random_chunks(draw, st, n) for n in shape))
        kw.update(draw(variant_keywords(st, B, hq, Lq, Lk)))
        check(dq, dk, dv, scheduler="sync", **kw)

    run()


# ----------------------------------------------------- NaN and inf in the values

# The rule: a NaN or inf in v[j] reaches row i exactly when row i may attend to key j
# and the weight of key j against the row's maximum over all keys (the sink's
# included) does not underflow in the computation dtype. Gaps below the row's maximum:
# one past the underflow, one well within range.
GAPS = {np.float32: (90.0, 60.0), np.float64: (720.0, 600.0)}
NAN_KEY_CHUNKS = {"1-63": (1, 63), "32-32": (32, 32), "64": (64,),
                  "uneven": (1, 4, 27, 1, 1, 29, 1), "ones": 1}
NAN_VARIANTS = {
    "plain": dict(),
    "causal": dict(causal=True),
    "window": dict(causal="bottom_right", window=(30, 2)),
    "alibi-softcap": dict(alibi_slopes=[0.01, 0.02], softcap=2.0),
    "lengths-gqa": dict(causal="bottom_right", q_lengths=[24, 13], kv_lengths=[64, 40],
                        enable_gqa=True),
}


def values_with_nan(dtype, seed=0, Hkv=2):
    """(2, 2, 24, 8) queries and (2, Hkv, 64, 8) keys and values, with NaN and inf at
    some keys' values, and a bias that puts those keys ``GAPS`` below the rest: far in
    rows i % 3 != 0, near in the others."""
    rng = np.random.default_rng(seed)
    q, k, v = data((2, 2, 24, 8), (2, Hkv, 64, 8), dtype=dtype, seed=seed)
    v[:, :, 0, 2] = np.nan
    v[:, :, 1, :] = np.inf
    v[0, :, 33, 0] = np.nan
    v[1, -1, 63, 3] = -np.inf
    far, near = GAPS[dtype]
    bias = (0.1 * rng.standard_normal((2, 2, 24, 64))).astype(dtype)
    gap = np.where(np.arange(24) % 3 == 0, near, far).astype(dtype)
    bias[..., [0, 1, 33, 63]] -= gap[:, None]
    return q, k, v, bias


def assert_same_values(got, want, rtol, atol):
    """NaN and inf at the same places, finite values close."""
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_array_equal(np.isposinf(got), np.isposinf(want))
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))
    fin = np.isfinite(want)
    np.testing.assert_allclose(got[fin], want[fin], rtol=rtol, atol=atol)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("variant", list(NAN_VARIANTS))
@pytest.mark.parametrize("key_chunks", list(NAN_KEY_CHUNKS))
def test_nan_values_follow_the_rule_whatever_the_key_chunks(dtype, variant, key_chunks):
    kw = NAN_VARIANTS[variant]
    q, k, v, bias = values_with_nan(dtype, Hkv=1 if kw.get("enable_gqa") else 2)
    ck = NAN_KEY_CHUNKS[key_chunks]
    out, lse = fdask.attention(
        da.from_array(q, (1, 1, (10, 14), 8)), da.from_array(k, (2, 1, ck, 8)),
        da.from_array(v, (1, 1, ck, 8)), bias=da.from_array(bias, (2, 2, 24, ck)),
        return_lse=True, **kw)
    got, got_lse = dask.compute(out, lse, scheduler="sync")
    want, want_lse = fastattn.attention(q, k, v, bias=bias, return_lse=True, **kw)
    # the case is not vacuous: values reach some rows and not others
    assert np.isnan(want).any() and np.isfinite(want[..., 2]).sum() > 10
    rtol, atol = RTOL[dtype], ATOL[dtype]
    assert_same_values(got, want, rtol, atol)
    assert_same_values(got_lse, want_lse, rtol, atol)
    ref, ref_lse = fastattn.reference.attention(q, k, v, bias=bias, return_lse=True, **kw)
    assert_same_values(got, ref, 10 * rtol, 10 * atol)
    assert_same_values(got_lse, ref_lse, 10 * rtol, 10 * atol)


def test_nan_in_queries_and_keys():
    # NaN in q[i] or k[j] reaches the rows it reaches in one call (rows that the
    # recomputation gives NaN again)
    q, k, v = data((2, 12, 4), (2, 20, 4), seed=12)
    q[0, 3, 1] = np.nan
    k[1, 7, 0] = np.nan
    kw = dict(causal=True)
    got = check(da.from_array(q, (1, 5, 4)), da.from_array(k, (2, 6, 4)),
                da.from_array(v, (2, 6, 4)), **kw)
    assert np.isnan(got[0, 3]).all() and np.isnan(got[1, 7:]).all()
    assert np.isfinite(got[1, :7]).all() and np.isfinite(np.delete(got[0], 3, 0)).all()


def test_nan_values_random_chunkings():
    hypothesis = pytest.importorskip("hypothesis")
    st = hypothesis.strategies

    @hypothesis.settings(max_examples=25, deadline=None, derandomize=True)
    @hypothesis.given(st.data())
    def run(draw_data):
        draw = draw_data.draw
        dtype = draw(st.sampled_from([np.float32, np.float64]))
        kw = dict(NAN_VARIANTS[draw(st.sampled_from(list(NAN_VARIANTS)))])
        q, k, v, bias = values_with_nan(dtype, seed=draw(st.integers(0, 9)),
                                        Hkv=1 if kw.get("enable_gqa") else 2)
        cq, ck = _random_chunks(draw, st, 24), _random_chunks(draw, st, 64)
        got = fdask.attention(da.from_array(q, (1, 2, cq, 8)),
                              da.from_array(k, (2, 1, ck, 8)),
                              da.from_array(v, (1, 1, ck, 8)), bias=bias,
                              **kw).compute(scheduler="sync")
        want = fastattn.attention(q, k, v, bias=bias, **kw)
        assert_same_values(got, want, RTOL[dtype], ATOL[dtype])

    run()


# ------------------------------------------------------------------------ sinks

def reference_check(q, k, v, chunks_q, chunks_k, **kw):
    """fastattn.dask.attention against fastattn.reference.attention and
    fastattn.attention, out and lse."""
    out, lse = fdask.attention(da.from_array(q, chunks_q), da.from_array(k, chunks_k),
                               da.from_array(v, chunks_k), return_lse=True, **kw)
    got, got_lse = dask.compute(out, lse, scheduler="sync")
    for f in (fastattn.reference.attention, fastattn.attention):
        want, want_lse = f(q, k, v, return_lse=True, **kw)
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-13)
        np.testing.assert_allclose(got_lse, want_lse, rtol=1e-12, atol=1e-13)
    return got, got_lse


# (B, Hq, Lq, Lk) = (2, 4, 12, 17); chunks of q and of k/v
SINK_CHUNKINGS = {
    "none": ((2, 4, 12, 4), (2, 4, 17, 4)),
    "lq": ((2, 4, (5, 7), 4), (2, 4, 17, 4)),
    "lk": ((2, 4, 12, 4), (2, 4, (3, 9, 5), 4)),
    "lk-ones": ((2, 4, 12, 4), (2, 4, 1, 4)),
    "all": ((1, (1, 3), (4, 1, 7), 4), (1, 2, (6, 6, 5), 4)),
}
SINK_VARIANTS = {
    "plain": dict(),
    "window": dict(window=(3, 1)),
    "lengths": dict(q_lengths=[12, 5], kv_lengths=[0, 11]),
    "window-lengths": dict(window=(2, 0), q_lengths=[7, 0], kv_lengths=[17, 9]),
    "alibi-softcap": dict(alibi_slopes=[0.1, 0.2, 0.3, 0.4], softcap=2.0),
}


@pytest.mark.parametrize("chunking", list(SINK_CHUNKINGS))
@pytest.mark.parametrize("variant", list(SINK_VARIANTS))
@pytest.mark.parametrize("causal", [False, True, "bottom_right"])
def test_sinks_against_the_reference(chunking, variant, causal):
    cq, ck = SINK_CHUNKINGS[chunking]
    q, k, v = data((2, 4, 12, 4), (2, 4, 17, 4), seed=14)
    sinks = np.array([[0.5, -1.0, 2.0, 0.0], [1.5, 3.0, -0.5, -2.0]])
    kw = dict(SINK_VARIANTS[variant], causal=causal)
    for s in (sinks, sinks[0]):           # (B, Hq) and (Hq,)
        reference_check(q, k, v, cq, ck, sinks=s, **kw)


@pytest.mark.parametrize("causal", [False, "top_left", "bottom_right"])
def test_sinks_with_gqa_mask_and_bias(causal):
    rng = np.random.default_rng(15)
    q, k, v = data((2, 6, 10, 4), (2, 2, 15, 4), seed=15)
    mask = rng.random((6, 10, 15)) < 0.6
    mask[:, 3] = False                       # a row with no allowed key: lse = sink
    bias = rng.standard_normal((2, 1, 10, 15))
    kw = dict(mask=mask, bias=bias, causal=causal, enable_gqa=True, window=(5, 2),
              sinks=rng.standard_normal(6), q_lengths=[10, 6], kv_lengths=[9, 15])
    got, got_lse = reference_check(q, k, v, (1, (1, 2, 3), 4, 4), (2, 1, (4, 6, 5), 4),
                                   **kw)
    np.testing.assert_array_equal(got[:, :, 3], 0)
    np.testing.assert_array_equal(got_lse[:, :, 3], np.broadcast_to(kw["sinks"], (2, 6)))


def test_sink_counted_once_when_key_blocks_are_skipped():
    # a sliding window: each query block computes only the key blocks near the
    # diagonal, and most never meet key block 0; every row's sink is counted once
    q, k, v = data((1, 2, 32, 4), (1, 2, 32, 4), seed=16)
    sinks = np.array([1.0, -0.5])
    kw = dict(causal=True, window=(5, 0), sinks=sinks)
    out = fdask.attention(da.from_array(q, (1, 2, 4, 4)), q, v, **kw)
    assert 0 < len(partial_tasks(out)) < 8 * 8 / 2
    got, lse = reference_check(q, k, v, (1, 2, 4, 4), (1, 2, 4, 4), **kw)
    # the weights of every row add up to 1 - exp(sink - lse): sink counted once
    p = fastattn.reference.attention_weights(q, k, causal=True, window=(5, 0),
                                             sinks=sinks)
    np.testing.assert_allclose(p.sum(-1), 1 - np.exp(sinks[:, None] - lse), atol=1e-12)


def test_sinks_on_query_blocks_with_no_key_and_padding_rows():
    # bottom_right with Lq > Lk: the first 7 rows see no key (their query blocks
    # compute nothing): zeros and lse = sink; padding rows: zeros and lse = -inf
    q, k, v = data((2, 3, 12, 4), (2, 3, 5, 4), seed=17)
    sinks = np.array([0.25, -1.0, 3.0])
    for kw in (dict(), dict(q_lengths=[12, 4], kv_lengths=[5, 0])):
        got, lse = reference_check(q, k, v, (1, 3, 3, 4), (2, 3, 2, 4),
                                   causal="bottom_right", sinks=sinks, **kw)
        np.testing.assert_array_equal(got[0, :, :7], 0)
        np.testing.assert_array_equal(lse[0, :, :7], np.broadcast_to(
            sinks[:, None], (3, 7)))
    np.testing.assert_array_equal(got[1], 0)
    np.testing.assert_array_equal(lse[1, :, :4], np.broadcast_to(sinks[:, None], (3, 4)))
    np.testing.assert_array_equal(lse[1, :, 4:], -np.inf)
    # no key at all
    got, lse = reference_check(q, k[:, :, :0], v[:, :, :0], (1, 3, 3, 4), (2, 3, 0, 4),
                               sinks=sinks)
    np.testing.assert_array_equal(got, 0)
    np.testing.assert_array_equal(lse, np.broadcast_to(sinks[:, None], (2, 3, 12)))


def test_sinks_with_dropout_and_dask_sinks():
    q, k, v = data((2, 4, 9, 4), (2, 4, 13, 4), seed=18)
    sinks = np.linspace(-1, 1, 4)
    kw = dict(causal="bottom_right", dropout_p=0.3, dropout_seed=4, q_lengths=[9, 5])
    check(da.from_array(q, (1, 2, 4, 4)), da.from_array(k, (2, 1, 5, 4)),
          da.from_array(v, (2, 1, 5, 4)), sinks=sinks, scheduler="sync", **kw)
    out = fdask.attention(q, da.from_array(k, (2, 4, 5, 4)), v,
                          sinks=da.from_array(sinks, 2), causal=True)
    np.testing.assert_allclose(out.compute(scheduler="sync"),
                               fastattn.attention(q, k, v, sinks=sinks, causal=True),
                               rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_sinks_take_part_in_the_rule_for_nan_values(dtype):
    # a sink far above every score: against it every key's weight underflows, so no
    # NaN or inf value reaches any row, though each key block alone lets them through
    q, k, v, bias = values_with_nan(dtype)
    far, near = GAPS[dtype]
    for sink, reached in ((far + 10, False), (near, True)):   # (scores within +-10)
        sinks = np.full(2, sink, dtype)
        got, lse = dask.compute(*fdask.attention(
            da.from_array(q, (1, 1, 12, 8)), da.from_array(k, (2, 2, 16, 8)),
            da.from_array(v, (2, 2, 16, 8)), sinks=sinks, return_lse=True),
            scheduler="sync")
        want, want_lse = fastattn.attention(q, k, v, sinks=sinks, return_lse=True)
        assert np.isnan(want).any() == reached
        assert_same_values(got, want, RTOL[dtype], ATOL[dtype])
        assert_same_values(lse, want_lse, RTOL[dtype], ATOL[dtype])
        ref = fastattn.reference.attention(q, k, v, sinks=sinks)
        assert_same_values(got, ref, 10 * RTOL[dtype], 10 * ATOL[dtype])


@pytest.mark.parametrize("kw, error, match", [
    (dict(sinks=np.ones(5)), ValueError, r"sinks"),
    (dict(sinks=np.ones((4, 3))), ValueError, r"sinks"),
    (dict(sinks=np.ones(4, complex)), TypeError, r"sinks"),
    (dict(sinks=np.ones(4, bool)), TypeError, r"sinks"),
])
def test_sink_errors_when_called(kw, error, match):
    q, k, v = (exploding(s) for s in ((3, 4, 6, 4), (3, 4, 7, 4), (3, 4, 7, 5)))
    with pytest.raises(error, match=match):
        fdask.attention(q, k, v, **kw)
    with pytest.raises(ValueError, match="sinks"):      # needs a head axis
        fdask.attention(exploding((6, 4)), exploding((7, 4)), exploding((7, 4)),
                        sinks=[1.0])
