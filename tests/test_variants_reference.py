"""The attention variants of fastattn.reference (the README's "Attention variants") against
independent oracles: hand values, a per-element loop written from the documented words,
finite differences, and the dropout generator against Random123's known answers (in
NumPy and in the C header the kernels include). Also every argument check."""

import ctypes
import math
import pathlib
import shutil
import subprocess
import sys

import numpy as np
import pytest

import fastattn
from fastattn import _philox, reference
from fastattn import _validation as _v

# ------------------------------------------------------------------ the dropout generator

# Random123 1.14, examples/kat_vectors: philox4x32 R, counter (4 words), key (2 words)
# -> the four output words.
KAT = [
    (7, (0, 0, 0, 0), (0, 0), (0x5F6FB709, 0x0D893F64, 0x4F121F81, 0x4F730A48)),
    (7, (0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2,
     (0x5207DDC2, 0x45165E59, 0x4D8EE751, 0x8C52F662)),
    (7, (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0x4DFCCABA, 0x190A87F0, 0xC47362BA, 0xB6B5242A)),
    (10, (0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    (10, (0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2,
     (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    (10, (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]
KAT10 = [case for case in KAT if case[0] == 10]


@pytest.mark.parametrize("rounds,ctr,key,want", KAT)
def test_philox_known_answers(rounds, ctr, key, want):
    got = _philox.philox4x32(ctr, key, rounds)
    assert [int(w) for w in got] == list(want)
    assert all(w.dtype == np.uint32 for w in got)


def test_philox_is_elementwise():
    """A vector of counters gives, element by element, what each gives alone."""
    ctrs = np.array([c for _, c, _, _ in KAT10] * 2, dtype=np.uint32).T   # (4, 6)
    words = _philox.philox4x32(tuple(ctrs), (0xA4093822, 0x299F31D0))
    for n in range(ctrs.shape[1]):
        alone = _philox.philox4x32(tuple(int(c) for c in ctrs[:, n]),
                                   (0xA4093822, 0x299F31D0))
        assert [int(w[n]) for w in words] == [int(w) for w in alone]


SEEDS_SLICES = [(0, 0), (12345, 3), (2**40 + 7, 2**33 + 5), (2**64 - 1, 2**64 - 1)]


@pytest.mark.parametrize("seed,slice_", SEEDS_SLICES)
def test_dropout_pattern_is_the_documented_mapping(seed, slice_):
    """Element (i, j) of slice s is kept iff word j%4 of Philox4x32-10 at counter
    (j//4, i, s lo, s hi) under key (seed lo, seed hi) is >= floor(p * 2**32)."""
    p, Lq, Lk = 0.37, 3, 11
    keep = _philox.dropout_keep(seed, p, np.array([slice_], dtype=np.uint64), Lq, Lk)[0]
    threshold = math.floor(p * 2**32)
    lo, hi = 0xFFFFFFFF, 32
    for i in range(Lq):
        for j in range(Lk):
            words = _philox.philox4x32((j // 4, i, slice_ & lo, slice_ >> hi),
                                       (seed & lo, seed >> hi))
            assert keep[i, j] == (int(words[j % 4]) >= threshold), (i, j)


def test_dropout_threshold():
    assert _philox.dropout_threshold(0.0) == 0
    assert _philox.dropout_threshold(0.5) == 2**31
    assert _philox.dropout_threshold(np.nextafter(1.0, 0.0)) == 2**32 - 1
    # p = 0 keeps every weight, even where the word is 0
    assert _philox.dropout_keep(1, 0.0, np.arange(2), 4, 9).all()


def _philox_header() -> pathlib.Path:
    for root in (pathlib.Path(__file__).resolve().parent.parent / "fastattn",
                 pathlib.Path(fastattn.__file__).resolve().parent):
        if (root / "src" / "philox.h").is_file():
            return root / "src" / "philox.h"
    pytest.skip("fastattn/src/philox.h is not in this source tree or installation")


_WRAPPER = r"""
#include <stdint.h>
#include "philox.h"
#ifdef _WIN32
#define EXPORT __declspec(dllexport)
#else
#define EXPORT
#endif
EXPORT void kat(const uint32_t *ctr, const uint32_t *key, uint32_t *out)
{ fastattn_philox4x32_10(ctr, key, out); }
EXPORT uint32_t threshold(double p) { return fastattn_dropout_threshold(p); }
EXPORT void keep_one(uint64_t seed, uint64_t slice, uint32_t lq, uint32_t lk,
                     uint32_t t, unsigned char *out)
{
    uint32_t i, j;
    for (i = 0; i < lq; i++)
        for (j = 0; j < lk; j++)
            out[i * lk + j] = (unsigned char)fastattn_dropout_keep(seed, slice, i, j, t);
}
EXPORT void keep_four(uint64_t seed, uint64_t slice, uint32_t lq, uint32_t lk,
                      uint32_t t, unsigned char *out)
{
    uint32_t i, jb, u;
    unsigned char k[4];
    for (i = 0; i < lq; i++)
        for (jb = 0; 4 * jb < lk; jb++) {
            fastattn_dropout_keep4(seed, slice, i, jb, t, k);
            for (u = 0; u < 4 && 4 * jb + u < lk; u++)
                out[i * lk + 4 * jb + u] = k[u];
        }
}
"""


@pytest.fixture(scope="module")
def philox_c(tmp_path_factory):
    """The C header, compiled into a tiny shared library and loaded with ctypes."""
    header = _philox_header()
    cc = shutil.which("cc")
    if cc is None or sys.platform == "win32":
        pytest.skip("no C compiler 'cc'")
    tmp = tmp_path_factory.mktemp("philox")
    (tmp / "wrapper.c").write_text(_WRAPPER)
    lib = tmp / "libphilox_test.so"
    cmd = [cc, "-std=c99", "-O2", "-Wall", "-Wextra", "-pedantic", "-Werror", "-shared",
           "-fPIC", f"-I{header.parent}", str(tmp / "wrapper.c"), "-o", str(lib)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode == 0, f"{' '.join(cmd)}\n{done.stdout}{done.stderr}"
    so = ctypes.CDLL(str(lib))
    u32p = ctypes.POINTER(ctypes.c_uint32)
    so.kat.argtypes = [u32p, u32p, u32p]
    so.kat.restype = None
    so.threshold.argtypes = [ctypes.c_double]
    so.threshold.restype = ctypes.c_uint32
    for f in (so.keep_one, so.keep_four):
        f.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint32,
                      ctypes.c_uint32, ctypes.POINTER(ctypes.c_ubyte)]
        f.restype = None
    return so


@pytest.mark.parametrize("rounds,ctr,key,want", KAT10)
def test_c_header_known_answers(philox_c, rounds, ctr, key, want):
    c = (ctypes.c_uint32 * 4)(*ctr)
    k = (ctypes.c_uint32 * 2)(*key)
    out = (ctypes.c_uint32 * 4)()
    philox_c.kat(c, k, out)
    assert list(out) == list(want)


def test_c_header_threshold(philox_c):
    for p in [0.0, 1e-12, 0.1, 0.25, 1 / 3, 0.5, 0.9, 1 - 2**-33,
              float(np.nextafter(1.0, 0.0))]:
        assert philox_c.threshold(p) == _philox.dropout_threshold(p), p


@pytest.mark.parametrize("seed,slice_", SEEDS_SLICES)
@pytest.mark.parametrize("p", [0.1, 0.5, 0.93])
def test_c_header_draws_the_numpy_pattern(philox_c, seed, slice_, p):
    Lq, Lk = 7, 13                                  # Lk not a multiple of 4
    want = _philox.dropout_keep(seed, p, np.array([slice_], dtype=np.uint64), Lq, Lk)[0]
    t = _philox.dropout_threshold(p)
    for f in (philox_c.keep_one, philox_c.keep_four):
        got = np.zeros((Lq, Lk), np.uint8)
        f(seed, slice_, Lq, Lk, t, got.ctypes.data_as(ctypes.POINTER(ctypes.c_ubyte)))
        np.testing.assert_array_equal(got.astype(bool), want)


# ------------------------------------------------ a loop written from the documentation

def loop_variants(q, k, v, *, groups=1, mask=None, bias=None, causal=None, scale=None,
                  window=None, softcap=None, slopes=None, q_lengths=None,
                  kv_lengths=None):
    """Scores, weights, output and lse of (B, H, L, E) arrays, one (i, j) at a time in
    Python floats, straight from the documentation's sentences."""
    B, H, Lq, E = q.shape
    Lk = k.shape[2]
    scale = 1 / math.sqrt(E) if scale is None else scale
    left, right = window or (None, None)
    slopes = None if slopes is None else np.broadcast_to(slopes, (B, H))
    s = np.full((B, H, Lq, Lk), -math.inf)
    w = np.zeros((B, H, Lq, Lk))
    out = np.zeros((B, H, Lq, v.shape[3]))
    lse = np.full((B, H, Lq), -math.inf)
    for b in range(B):
        lq = Lq if q_lengths is None else int(q_lengths[b])
        lk = Lk if kv_lengths is None else int(kv_lengths[b])
        d = lk - lq if causal == "bottom_right" else 0      # query i sits at i + d
        for h in range(H):
            for i in range(lq):
                pos = i + d
                for j in range(lk):
                    if causal is not None and j > pos:
                        continue
                    if left is not None and j < pos - left:
                        continue
                    if right is not None and j > pos + right:
                        continue
                    if mask is not None and not mask[b, h, i, j]:
                        continue
                    x = scale * float(q[b, h, i] @ k[b, h // groups, j])
                    if softcap is not None:
                        x = softcap * math.tanh(x / softcap)
                    if bias is not None:
                        x += bias[b, h, i, j]
                    if slopes is not None:
                        x -= slopes[b, h] * abs(pos - j)
                    s[b, h, i, j] = x
                m = max(s[b, h, i])
                if m == -math.inf:
                    continue
                e = [math.exp(x - m) for x in s[b, h, i]]
                total = sum(e)
                w[b, h, i] = [x / total for x in e]
                out[b, h, i] = sum(wj * v[b, h // groups, j] for j, wj in enumerate(w[b, h, i]))
                lse[b, h, i] = m + math.log(total)
    return s, w, out, lse


WINDOWS = [None, (1, 0), (0, 2), (2, None), (None, 1), (0, 0)]


@pytest.mark.parametrize("extras", [False, True], ids=["plain", "all-extras"])
@pytest.mark.parametrize("window", WINDOWS, ids=str)
@pytest.mark.parametrize("causal", [None, "top_left", "bottom_right"])
@pytest.mark.parametrize("Lq,Lk", [(4, 6), (6, 4), (5, 5)])
def test_against_a_loop(causal, Lq, Lk, window, extras):
    rng = np.random.default_rng(11)
    B, Hq, Hkv, E = 2, 4, 2, 3
    q = rng.standard_normal((B, Hq, Lq, E))
    k, v = rng.standard_normal((B, Hkv, Lk, E)), rng.standard_normal((B, Hkv, Lk, 2))
    kw, loop_kw = {}, {}
    if extras:
        mask = rng.random((B, Hq, Lq, Lk)) < 0.8
        bias = rng.standard_normal((B, Hq, Lq, Lk))
        slopes = rng.random((B, Hq))
        q_lengths, kv_lengths = np.array([Lq - 1, Lq]), np.array([Lk, Lk - 2])
        kw = dict(mask=mask, bias=bias, softcap=0.8, alibi_slopes=slopes,
                  q_lengths=q_lengths, kv_lengths=kv_lengths)
        loop_kw = dict(mask=mask, bias=bias, softcap=0.8, slopes=slopes,
                       q_lengths=q_lengths, kv_lengths=kv_lengths)
    common = dict(causal=causal or False, window=window, enable_gqa=True, **kw)
    want_s, want_w, want_out, want_lse = loop_variants(
        q, k, v, groups=Hq // Hkv, causal=causal, window=window, **loop_kw)
    np.testing.assert_allclose(reference.scores(q, k, **common), want_s, rtol=1e-12,
                               atol=1e-14)
    np.testing.assert_allclose(reference.attention_weights(q, k, **common), want_w,
                               rtol=1e-12, atol=1e-14)
    out, lse = reference.attention(q, k, v, return_lse=True, **common)
    np.testing.assert_allclose(out, want_out, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-12)


# ------------------------------------------------------------------------- hand values

def test_window_hand_values():
    q, k = np.zeros((4, 2)), np.zeros((4, 2))           # every score 0: uniform weights
    h = 0.5
    np.testing.assert_allclose(reference.attention_weights(q, k, window=(1, 0)),
                               [[1, 0, 0, 0], [h, h, 0, 0], [0, h, h, 0], [0, 0, h, h]])
    np.testing.assert_allclose(reference.attention_weights(q, k, window=(0, 1)),
                               [[h, h, 0, 0], [0, h, h, 0], [0, 0, h, h], [0, 0, 0, 1]])
    # sliding-window attention: causal plus window (w, 0)
    np.testing.assert_allclose(
        reference.attention_weights(q, k, causal=True, window=(1, None)),
        reference.attention_weights(q, k, window=(1, 0)))
    # bottom_right: 2 queries at positions 2 and 3 among 4 keys
    np.testing.assert_allclose(
        reference.attention_weights(q[:2], k, causal="bottom_right", window=(1, 0)),
        [[0, h, h, 0], [0, 0, h, h]])
    # a side as wide as the sequences, or wider, restricts nothing
    for side in (8, 10**30):
        np.testing.assert_array_equal(reference.scores(q, k, window=(side, side)),
                                      reference.scores(q, k))


def test_softcap_hand_values():
    q = np.array([[1.0, 0.0]])
    k = np.array([[3.0, 0.0], [0.0, 0.0], [-40.0, 0.0]])
    s = reference.scores(q, k, scale=1, softcap=2, bias=[[1.0, -1.0, 0.0]])
    # capped first, then the bias: 2 tanh(3/2) + 1, 2 tanh(0) - 1, 2 tanh(-20)
    np.testing.assert_allclose(s, [[2 * math.tanh(1.5) + 1, -1, 2 * math.tanh(-20)]])
    assert s[0, 2] >= -2          # the cap bounds the score before the bias


def test_alibi_hand_values():
    q, k = np.zeros((1, 2, 2)), np.zeros((1, 4, 2))      # one head, Lq = 2, Lk = 4
    np.testing.assert_allclose(reference.scores(q, k, alibi_slopes=[0.5]),
                               [[[0, -0.5, -1, -1.5], [-0.5, 0, -0.5, -1]]])
    # bottom_right: the queries sit at positions 2 and 3
    np.testing.assert_allclose(
        reference.scores(q, k, alibi_slopes=[0.5], causal="bottom_right"),
        [[[-1, -0.5, 0, -np.inf], [-1.5, -1, -0.5, 0]]])
    # slopes (B, Hq), one per batch and head
    q2, k2 = np.zeros((2, 1, 1, 2)), np.zeros((2, 1, 2, 2))
    np.testing.assert_allclose(reference.scores(q2, k2, alibi_slopes=[[1.0], [3.0]]),
                               [[[[0, -1]]], [[[0, -3]]]])


def test_lengths_hand_values():
    q, k = np.zeros((2, 1, 3, 2)), np.zeros((2, 1, 4, 2))
    v = np.arange(8.0).reshape(1, 4, 2) * np.ones((2, 1, 1, 1))
    kw = dict(q_lengths=[1, 3], kv_lengths=[2, 4])
    w = reference.attention_weights(q, k, **kw)
    np.testing.assert_allclose(w[0, 0], [[0.5, 0.5, 0, 0], [0] * 4, [0] * 4])
    np.testing.assert_allclose(w[1, 0], np.full((3, 4), 0.25))
    s = reference.scores(q, k, **kw)
    assert (s[0, 0, 1:] == -np.inf).all() and (s[0, 0, 0, 2:] == -np.inf).all()
    assert (s[0, 0, 0, :2] == 0).all()
    out, lse = reference.attention(q, k, v, return_lse=True, **kw)
    np.testing.assert_allclose(out[0, 0], [[1, 2], [0, 0], [0, 0]])
    np.testing.assert_allclose(lse[0, 0], [math.log(2), -np.inf, -np.inf])
    np.testing.assert_allclose(lse[1, 0], [math.log(4)] * 3)


def test_lengths_set_the_bottom_right_offset():
    """d = kv_lengths[b] - q_lengths[b]: each sequence's own lengths."""
    q, k = np.zeros((1, 3, 2)), np.zeros((1, 5, 2))
    w = reference.attention_weights(q, k, causal="bottom_right", q_lengths=[2],
                                    kv_lengths=[3])
    t = 1 / 3
    np.testing.assert_allclose(w[0], [[0.5, 0.5, 0, 0, 0], [t, t, t, 0, 0], [0] * 5])
    # only one of the two given: the other is the full length
    w = reference.attention_weights(q, k, causal="bottom_right", kv_lengths=[4])
    np.testing.assert_allclose(w[0, 0], [0.5, 0.5, 0, 0, 0])     # d = 4 - 3


def test_float32_follows_float64():
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((2, 2, 5, 4)) for _ in range(3))
    kw = dict(causal="bottom_right", window=(2, 1), softcap=3.0, alibi_slopes=[0.2, 0.7],
              q_lengths=[4, 5], kv_lengths=[5, 3], dropout_p=0.25, dropout_seed=9,
              return_lse=True)
    out32, lse32 = reference.attention(*(x.astype(np.float32) for x in (q, k, v)), **kw)
    out64, lse64 = reference.attention(q, k, v, **kw)
    assert out32.dtype == lse32.dtype == np.float32
    np.testing.assert_allclose(out32, out64, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(lse32, lse64, rtol=1e-4, atol=1e-5)


# ----------------------------------------------------------------------------- dropout

def _kept(out):
    return out != 0


def _eye_like(k):
    """v = I for keys k: the attention output is then the weight matrix."""
    L = k.shape[-2]
    return np.broadcast_to(np.eye(L), k.shape[:-2] + (L, L))


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_dropout_keeps_one_minus_p_and_scales(p):
    """With v = I the output is the dropped weight matrix itself: kept entries are the
    weights times 1/(1-p), about a fraction 1-p of them, the rest exactly 0; and the
    pattern is _philox.dropout_keep over the C-order slice indices of *batch."""
    rng = np.random.default_rng(1)
    B, H, L = 2, 3, 128
    q, k = rng.standard_normal((B, H, L, 4)), rng.standard_normal((B, H, L, 4))
    out = reference.attention(q, k, _eye_like(k), dropout_p=p, dropout_seed=2024)
    w = reference.attention_weights(q, k)
    keep = _philox.dropout_keep(2024, p, np.arange(B * H).reshape(B, H), L, L)
    np.testing.assert_array_equal(_kept(out), keep)
    np.testing.assert_allclose(out[keep], w[keep] / (1 - p), rtol=1e-13)
    n = keep.size
    assert abs(keep.mean() - (1 - p)) < 5 * math.sqrt(p * (1 - p) / n)


def test_dropout_pattern_depends_only_on_seed_slice_i_j():
    rng = np.random.default_rng(5)
    L, E = 24, 3

    def pattern(q, k, seed=77, **kw):
        return _kept(reference.attention(q, k, _eye_like(k), dropout_p=0.5,
                                         dropout_seed=seed, **kw))

    q, k = np.zeros((2, 3, L, E)), np.zeros((2, 3, L, E))   # every weight > 0
    base = pattern(q, k)
    qr, kr = rng.standard_normal(q.shape), rng.standard_normal(k.shape)
    np.testing.assert_array_equal(pattern(qr, kr), base)                # values
    np.testing.assert_array_equal(pattern(q.astype(np.float32), k.astype(np.float32)),
                                  base)                                   # dtype
    np.testing.assert_array_equal(pattern(q.reshape(6, L, E), k.reshape(6, L, E)),
                                  base.reshape(6, L, L))               # batch layout
    np.testing.assert_array_equal(pattern(q[:, :, :10], k), base[:, :, :10])   # Lq
    np.testing.assert_array_equal(pattern(q, k[:, :, :13])[..., :13],
                                  base[..., :13])                        # Lk
    # a causal mask removes weights but does not move the pattern of the others
    causal = pattern(q, k, causal=True)
    allowed = np.tril(np.ones((L, L), bool))
    np.testing.assert_array_equal(causal, base & allowed)
    assert not np.array_equal(pattern(q, k, seed=78), base)             # the seed
    assert not np.array_equal(base[0, 0], base[0, 1])                   # the slice


def test_dropout_leaves_lse_and_p0_alone():
    rng = np.random.default_rng(6)
    q, k, v = (rng.standard_normal((2, 6, 3)) for _ in range(3))
    out, lse = reference.attention(q, k, v, return_lse=True)
    out_d, lse_d = reference.attention(q, k, v, dropout_p=0.3, dropout_seed=1,
                                       return_lse=True)
    np.testing.assert_array_equal(lse_d, lse)
    assert not np.allclose(out_d, out)
    np.testing.assert_array_equal(
        reference.attention(q, k, v, dropout_p=0.0, dropout_seed=1), out)


# -------------------------------------------------------------------------- gradients

def _numeric_grads(f, arrays, h=1e-6):
    grads = []
    for a in arrays:
        g = np.zeros_like(a)
        for idx in np.ndindex(a.shape):
            old = a[idx]
            a[idx] = old + h
            up = f()
            a[idx] = old - h
            down = f()
            a[idx] = old
            g[idx] = (up - down) / (2 * h)
        grads.append(g)
    return grads


GRAD_CASES = {
    "plain": {},
    "top_left": dict(causal=True),
    "bottom_right": dict(causal="bottom_right"),
    "window": dict(window=(1, 1)),
    "sliding": dict(causal="bottom_right", window=(2, 0)),
    "softcap": dict(softcap=0.6),
    "alibi": dict(alibi_slopes=[0.3, 0.9]),
    "lengths": dict(q_lengths=[2, 4], kv_lengths=[5, 3]),
    "dropout": dict(dropout_p=0.4, dropout_seed=31),
    "mask_bias": "mask_bias",
    "everything": "everything",
}


@pytest.mark.parametrize("case", list(GRAD_CASES))
def test_backward_against_finite_differences(case):
    rng = np.random.default_rng(8)
    B, Hq, Hkv, Lq, Lk, E = 2, 2, 1, 4, 5, 3
    q = rng.standard_normal((B, Hq, Lq, E))
    k, v = rng.standard_normal((B, Hkv, Lk, E)), rng.standard_normal((B, Hkv, Lk, 2))
    kw = GRAD_CASES[case]
    if isinstance(kw, str):
        kw = dict(mask=rng.random((B, Hq, Lq, Lk)) < 0.7,
                  bias=rng.standard_normal((B, 1, Lq, Lk)))
        if case == "everything":
            kw.update(causal="bottom_right", window=(2, 1), softcap=0.9,
                      alibi_slopes=[[0.1, 0.5], [0.2, 1.0]], q_lengths=[3, 4],
                      kv_lengths=[5, 4], dropout_p=0.3, dropout_seed=2**40 + 3)
    kw["enable_gqa"] = True
    grad_out = rng.standard_normal((B, Hq, Lq, 2))
    out, lse = reference.attention(q, k, v, return_lse=True, **kw)
    dq, dk, dv = reference.attention_backward(grad_out, q, k, v, out, lse, **kw)
    numeric = _numeric_grads(
        lambda: float(np.sum(reference.attention(q, k, v, **kw) * grad_out)), [q, k, v])
    for got, want in zip((dq, dk, dv), numeric):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-8)


def test_padded_rows_have_zero_gradients():
    rng = np.random.default_rng(9)
    q, k, v = (rng.standard_normal((2, 3, 6, 4)) for _ in range(3))
    kw = dict(q_lengths=[2, 6], kv_lengths=[3, 0], causal="bottom_right",
              dropout_p=0.2, dropout_seed=4)
    out, lse = reference.attention(q, k, v, return_lse=True, **kw)
    assert (out[0, :, 2:] == 0).all() and (lse[0, :, 2:] == -np.inf).all()
    assert (out[1] == 0).all() and (lse[1] == -np.inf).all()    # no keys at all
    dq, dk, dv = reference.attention_backward(rng.standard_normal(out.shape), q, k, v,
                                              out, lse, **kw)
    assert (dq[0, :, 2:] == 0).all() and (dk[0, :, 3:] == 0).all()
    assert (dv[0, :, 3:] == 0).all()
    assert (dq[1] == 0).all() and (dk[1] == 0).all() and (dv[1] == 0).all()
    assert np.abs(dq[0, :, :2]).min() > 0


# ------------------------------------------------------------------------------ varlen

def _pack(rng, seqlens, H, E):
    return rng.standard_normal((sum(seqlens), H, E)), np.cumsum([0] + seqlens)


VARLEN_KW = dict(causal="bottom_right", window=(3, 1), softcap=1.5)


def test_varlen_equals_attention_per_sequence():
    rng = np.random.default_rng(12)
    lq, lk, Hq, Hkv, E = [3, 0, 5, 2, 4], [4, 2, 5, 0, 1], 4, 2, 3
    q, cu_q = _pack(rng, lq, Hq, E)
    k, cu_k = _pack(rng, lk, Hkv, E)
    v, _ = _pack(rng, lk, Hkv, 2)
    slopes = rng.random((len(lq), Hq))
    out, lse = reference.attention_varlen(q, k, v, cu_q.astype(np.int32), cu_k,
                                          alibi_slopes=slopes, return_lse=True,
                                          **VARLEN_KW)
    assert out.shape == (sum(lq), Hq, 2) and lse.shape == (Hq, sum(lq))
    for b in range(len(lq)):
        rq, rk = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        o, s = reference.attention(q[rq].swapaxes(0, 1), k[rk].swapaxes(0, 1),
                                   v[rk].swapaxes(0, 1), enable_gqa=True,
                                   alibi_slopes=slopes[b], return_lse=True, **VARLEN_KW)
        np.testing.assert_allclose(out[rq], o.swapaxes(0, 1), rtol=1e-13, atol=1e-15)
        np.testing.assert_allclose(lse[:, rq], s, rtol=1e-13)


def _pad(x, cu, L):
    """Packed (total, H, E) -> padded (B, H, L, E) with zeros."""
    B = len(cu) - 1
    out = np.zeros((B, x.shape[1], L, x.shape[2]))
    for b in range(B):
        out[b, :, :cu[b + 1] - cu[b]] = x[cu[b]:cu[b + 1]].swapaxes(0, 1)
    return out


def test_varlen_equals_padded_attention_with_lengths_and_dropout():
    """Slice b * Hq + h of the varlen call is slice (b, h) of the padded batch: the same
    dropout pattern, so the same outputs and gradients."""
    rng = np.random.default_rng(13)
    lq, lk, Hq, Hkv, E, L = [3, 5, 1], [4, 5, 2], 4, 2, 3, 5
    q, cu_q = _pack(rng, lq, Hq, E)
    k, cu_k = _pack(rng, lk, Hkv, E)
    v, _ = _pack(rng, lk, Hkv, 2)
    kw = dict(VARLEN_KW, alibi_slopes=rng.random(Hq), dropout_p=0.35, dropout_seed=99)
    out, lse = reference.attention_varlen(q, k, v, cu_q, cu_k, return_lse=True, **kw)
    qp, kp, vp = _pad(q, cu_q, L), _pad(k, cu_k, L), _pad(v, cu_k, L)
    lengths = dict(q_lengths=lq, kv_lengths=lk)
    out_p, lse_p = reference.attention(qp, kp, vp, enable_gqa=True, return_lse=True,
                                       **lengths, **kw)
    np.testing.assert_allclose(_pad(out, cu_q, L), out_p, rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(_pad(lse.T[:, :, None], cu_q, L)[..., 0],
                               np.where(np.isinf(lse_p), 0, lse_p), rtol=1e-13)
    grad_out = rng.standard_normal(out.shape)
    grads = reference.attention_varlen_backward(grad_out, q, k, v, out, lse, cu_q, cu_k,
                                                **kw)
    grads_p = reference.attention_backward(_pad(grad_out, cu_q, L), qp, kp, vp, out_p,
                                           lse_p, enable_gqa=True, **lengths, **kw)
    for got, want, cu in zip(grads, grads_p, (cu_q, cu_k, cu_k)):
        np.testing.assert_allclose(_pad(got, cu, L), want, rtol=1e-12, atol=1e-14)


def test_varlen_backward_against_finite_differences():
    rng = np.random.default_rng(14)
    lq, lk = [2, 0, 3], [3, 1, 2]
    q, cu_q = _pack(rng, lq, 2, 2)
    k, cu_k = _pack(rng, lk, 1, 2)
    v, _ = _pack(rng, lk, 1, 2)
    kw = dict(VARLEN_KW, alibi_slopes=[0.4, 0.8], dropout_p=0.3, dropout_seed=5)
    grad_out = rng.standard_normal((sum(lq), 2, 2))
    out, lse = reference.attention_varlen(q, k, v, cu_q, cu_k, return_lse=True, **kw)
    grads = reference.attention_varlen_backward(grad_out, q, k, v, out, lse, cu_q, cu_k,
                                                **kw)
    numeric = _numeric_grads(lambda: float(np.sum(
        reference.attention_varlen(q, k, v, cu_q, cu_k, **kw) * grad_out)), [q, k, v])
    for got, want in zip(grads, numeric):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-8)


# ------------------------------------------------------------------------------ errors

Q3, K3 = np.zeros((2, 4, 3, 2)), np.zeros((2, 4, 5, 2))

ERRORS = [
    # window
    (dict(window=(-1, 0)), ValueError, "window's left side must be >= 0"),
    (dict(window=(0, -2)), ValueError, "window's right side must be >= 0"),
    (dict(window=(1.5, 0)), TypeError, "window's left side must be an int"),
    (dict(window=(0, True)), TypeError, "window's right side must be an int"),
    (dict(window=3), TypeError, "window must be a pair"),
    (dict(window="ab"), TypeError, "window must be a pair"),
    (dict(window=(1, 2, 3)), ValueError, "window must be a pair"),
    # softcap
    (dict(softcap=0), ValueError, "softcap must be finite and > 0"),
    (dict(softcap=-1.0), ValueError, "softcap"),
    (dict(softcap=math.inf), ValueError, "softcap"),
    (dict(softcap=math.nan), ValueError, "softcap"),
    (dict(softcap=10**400), ValueError, "softcap"),
    (dict(softcap="2"), TypeError, "softcap must be a real number"),
    (dict(softcap=True), TypeError, "softcap"),
    # ALiBi
    (dict(alibi_slopes=np.ones(3)), ValueError,
     r"alibi_slopes of shape \(3,\) does not broadcast to .*\(2, 4\)"),
    (dict(alibi_slopes=np.ones((5, 4))), ValueError, r"alibi_slopes of shape \(5, 4\)"),
    (dict(alibi_slopes=np.ones((1, 2, 4))), ValueError, r"alibi_slopes of shape \(1, 2, 4\)"),
    (dict(alibi_slopes=1.0), ValueError, r"alibi_slopes of shape \(\)"),
    (dict(alibi_slopes=np.ones(4, complex)), TypeError, "alibi_slopes must hold real"),
    (dict(alibi_slopes=np.ones(4, bool)), TypeError, "alibi_slopes"),
    # lengths
    (dict(q_lengths=[1.0, 2.0]), TypeError, "q_lengths must hold integers"),
    (dict(kv_lengths=[True, False]), TypeError, "kv_lengths must hold integers"),
    (dict(q_lengths=[1, 2, 3]), ValueError, r"q_lengths must have shape \(B,\) = \(2,\)"),
    (dict(kv_lengths=[[1], [2]]), ValueError, r"kv_lengths must have shape .*\(2, 1\)"),
    (dict(q_lengths=[1, 4]), ValueError, r"q_lengths must lie in \[0, 3\]"),
    (dict(q_lengths=[-1, 2]), ValueError, "q_lengths must lie in"),
    (dict(kv_lengths=[6, 2]), ValueError, r"kv_lengths must lie in \[0, 5\]"),
    # dropout
    (dict(dropout_p=1.0, dropout_seed=0), ValueError, r"dropout_p must lie in \[0, 1\)"),
    (dict(dropout_p=-0.1, dropout_seed=0), ValueError, "dropout_p"),
    (dict(dropout_p=math.nan, dropout_seed=0), ValueError, "dropout_p"),
    (dict(dropout_p=10**400, dropout_seed=0), ValueError, "dropout_p"),
    (dict(dropout_p="0.1", dropout_seed=0), TypeError, "dropout_p must be a real"),
    (dict(dropout_p=0.1), ValueError, "needs dropout_seed"),
    (dict(dropout_p=0.1, dropout_seed=1.5), TypeError, "dropout_seed must be an int"),
    (dict(dropout_p=0.1, dropout_seed=True), TypeError, "dropout_seed"),
    (dict(dropout_p=0.1, dropout_seed=-1), ValueError, r"dropout_seed must lie in"),
    (dict(dropout_p=0.1, dropout_seed=2**64), ValueError, "dropout_seed"),
    (dict(dropout_seed="7"), TypeError, "dropout_seed"),
]


@pytest.mark.parametrize("kw,exc,match", ERRORS, ids=[str(e[0])[:40] for e in ERRORS])
def test_errors_of_attention(kw, exc, match):
    with pytest.raises(exc, match=match):
        reference.attention(Q3, K3, K3, **kw)


@pytest.mark.parametrize("kw,exc,match", [e for e in ERRORS if "dropout" not in str(e)],
                         ids=[str(e[0])[:40] for e in ERRORS if "dropout" not in str(e)])
def test_errors_of_scores_weights_and_backward(kw, exc, match):
    for f in (reference.scores, reference.attention_weights):
        with pytest.raises(exc, match=match):
            f(Q3, K3, **kw)
    out = np.zeros((2, 4, 3, 2))
    with pytest.raises(exc, match=match):
        reference.attention_backward(out, Q3, K3, K3, out, np.zeros((2, 4, 3)), **kw)


def test_errors_that_need_other_shapes():
    q2, k2 = np.zeros((3, 2)), np.zeros((5, 2))
    with pytest.raises(ValueError, match=r"alibi_slopes needs q with a head axis.*\(3, 2\)"):
        reference.attention(q2, k2, k2, alibi_slopes=[1.0])
    # q of 2 dimensions, k of 3: the batch has a head axis, q does not
    with pytest.raises(ValueError, match="alibi_slopes needs q with a head axis"):
        reference.scores(q2, K3[0], alibi_slopes=np.ones(4))
    for name in ("q_lengths", "kv_lengths"):
        with pytest.raises(ValueError, match=f"{name} needs at least one batch axis"):
            reference.attention(q2, k2, k2, **{name: [1]})
    # no dropout where no attention output comes back
    for f in (reference.scores, reference.attention_weights):
        with pytest.raises(TypeError):
            f(Q3, K3, dropout_p=0.1, dropout_seed=1)


def _varlen(**kw):
    q, k = np.zeros((6, 4, 2)), np.zeros((5, 2, 2))
    args = dict(q=q, k=k, v=k, cu_seqlens_q=np.array([0, 2, 6]),
                cu_seqlens_k=np.array([0, 5, 5]))
    args.update(kw)
    return reference.attention_varlen(**args)


VARLEN_ERRORS = [
    (dict(cu_seqlens_q=np.array([0.0, 2, 6])), "cu_seqlens_q must be int32 or int64"),
    (dict(cu_seqlens_k=np.array([0, 5, 5], np.uint32)), "cu_seqlens_k must be int32"),
    (dict(cu_seqlens_q=[[0, 2, 6]]), r"cu_seqlens_q must be 1-D .* shape \(1, 3\)"),
    (dict(cu_seqlens_q=np.array([], np.int64)), "cu_seqlens_q must be 1-D"),
    (dict(cu_seqlens_q=np.array([1, 2, 6])), "cu_seqlens_q must start at 0"),
    (dict(cu_seqlens_k=np.array([0, 5, 4])), "cu_seqlens_k must be non-decreasing"),
    (dict(cu_seqlens_q=np.array([0, 2, 5])),
     "cu_seqlens_q must end at the number of packed rows 6"),
    (dict(cu_seqlens_k=np.array([0, 5])),
     r"cu_seqlens_q and cu_seqlens_k must have the same length .*\(3,\) and \(2,\)"),
    (dict(q=np.zeros((6, 3, 2))), r"multiple of the key/value heads .*\(5, 2, 2\)"),
    (dict(q=np.zeros((1, 6, 4, 2))), r"q must have shape \(total_q, Hq, E\)"),
    (dict(v=np.zeros((4, 2, 2))), "k and v must have the same rows and heads"),
    (dict(alibi_slopes=np.ones((3, 4))), r"alibi_slopes of shape \(3, 4\) .*\(2, 4\)"),
    (dict(window=(0, -1)), "window's right side"),
]


@pytest.mark.parametrize("kw,match", VARLEN_ERRORS, ids=[m[:30] for _, m in VARLEN_ERRORS])
def test_errors_of_varlen(kw, match):
    with pytest.raises(ValueError, match=match):
        _varlen(**kw)
    assert _varlen(cu_seqlens_q=np.array([0, 2, 6], np.int32)).shape == (6, 4, 2)


def test_errors_of_the_backward_shapes():
    q, k = np.zeros((6, 4, 2)), np.zeros((5, 2, 2))
    cu_q, cu_k = np.array([0, 2, 6]), np.array([0, 5, 5])
    with pytest.raises(ValueError, match=r"lse must have shape \(4, 6\)"):
        reference.attention_varlen_backward(q, q, k, k, q, np.zeros((6, 4)), cu_q, cu_k)
    with pytest.raises(ValueError, match=r"grad_out must have shape \(6, 4, 2\)"):
        reference.attention_varlen_backward(q[:5], q, k, k, q, np.zeros((4, 6)), cu_q,
                                            cu_k)


# -------------------------------------------------------------- the normalised values

def test_validation_returns_normalised_values():
    assert _v.check_window(None) == (None, None)
    assert _v.check_window([np.int64(3), None]) == (3, None)
    assert _v.check_softcap(np.float32(2)) == 2.0 and _v.check_softcap(None) is None
    assert _v.check_dropout(0, None) == (0.0, None)
    assert _v.check_dropout(0.5, np.uint64(2**64 - 1)) == (0.5, 2**64 - 1)
    lengths = _v.check_lengths(np.array([1, 2], np.int32), "q_lengths", (2, 4), 3)
    assert lengths.dtype == np.int64 and lengths.tolist() == [1, 2]
    var = _v.variant_args((2, 4), 3, 5, (2, 4, 3, 2), np.dtype(np.float32),
                          window=(7, 8), alibi_slopes=[1, 2, 3, 4])
    assert var.window == (7, None)          # a side >= Lq + Lk restricts nothing
    assert var.alibi_slopes.dtype == np.float32
    assert _v.query_offsets("bottom_right", 3, 5) == 2
    assert _v.query_offsets("top_left", 3, 5, [1, 2]).tolist() == [0, 0]
    assert _v.query_offsets("bottom_right", 3, 5, [1, 2]).tolist() == [4, 3]
    assert _v.query_offsets("bottom_right", 3, 5, [1, 3], [2, 5]).tolist() == [1, 2]
    cu_q, cu_k = _v.check_cu_seqlens(np.array([0, 3], np.int32), [0, 0], 3, 0)
    assert cu_q.dtype == cu_k.dtype == np.int64


def test_philox_docstring_example():
    import doctest
    assert doctest.testmod(_philox, optionflags=doctest.NORMALIZE_WHITESPACE).failed == 0
