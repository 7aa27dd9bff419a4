"""The bit-identity corpus: the exact bits fastattn computes for a fixed set of calls.

Every kernel change that is meant to leave the arithmetic alone (a refactor, a new
layout of the scratch, a new driver) must leave these bits alone: tests/test_bits.py
recomputes the corpus at the instruction-set level of its process, with each
bfloat16 kernel this CPU and build can run, and compares the hashes with
tests/bits.json. A change that is meant to change the arithmetic writes the file anew:

    python tools/bits.py --write            # every level this CPU runs, each in a
                                            # child process with FASTATTN_ISA set
                                            # (the other levels' bits are kept)

The corpus covers the forward (out and lse) and the backward (every gradient) of
every path (tiles, keys split over pieces, decoding, decoding split), every variant
alone and all together, grouped-query heads, packed batches, in float32, float64,
bfloat16 and float16, and scores, attention_weights, softmax and weighted_sum.

Its bits are fastattn's alone, the same on every CPU of a level: the inputs come from
NumPy's seeded generator and casts, never from NumPy's arithmetic, whose last bits
follow the CPU (OpenBLAS picks its kernels by CPU, and NumPy's float64 exp and sums
take other SIMD paths with AVX-512), nor from ml_dtypes' casts from float64, whose
rounding changed between releases (0.5 rounded through float32, 0.7 rounds once): a
bfloat16 input is cast from float32 (``normal``). The one gradient NumPy computes,
that of the sinks (a float64 sum over the query rows), is digested rounded to float32
where it is float64 (narrower results are rounded from it anyway). The bits do depend
on the compiler: where the portable loops of the avx2 level leave a multiply and an
add to gcc, another gcc version may fuse other pairs into FMAs, so tests/bits.json
holds the bits of the compiler CI builds with.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
CORPUS = HERE.parent / "tests" / "bits.json"

PATHS = {
    "tiled": (2, 4, 2, 70, 150, 32, 24),          # (B, Hq, Hkv, Lq, Lk, E, Ev)
    "split": (1, 2, 2, 64, 4096, 64, 64),
    "decode": (2, 8, 2, 2, 300, 64, 64),
    "decode-split": (1, 2, 1, 1, 3000, 128, 128),
}


def variants(rng, B, Hq, Lq, Lk):
    return {
        "none": {},
        "causal": dict(causal=True),
        "bottom-right": dict(causal="bottom_right"),
        "mask-bias": dict(mask=rng.random((Lq, Lk)) < 0.8,
                          bias=rng.standard_normal((Hq, Lq, Lk)).astype(np.float32)),
        "window": dict(causal=True, window=(33, 2)),
        "softcap": dict(softcap=5.0),
        "alibi": dict(alibi_slopes=2.0 ** -np.arange(1, Hq + 1)),
        "lengths": dict(q_lengths=np.minimum([Lq, Lq // 2 + 1], Lq)[:B],
                        kv_lengths=np.minimum([Lk // 3, Lk], Lk)[:B]),
        "dropout": dict(dropout_p=0.2, dropout_seed=77),
        "sinks": dict(sinks=rng.standard_normal(Hq).astype(np.float32) + 2),
        "all": dict(causal="bottom_right", window=(100, 0), softcap=8.0,
                    alibi_slopes=np.linspace(0.1, 1, Hq),
                    sinks=np.zeros(Hq, np.float32), dropout_p=0.1, dropout_seed=5),
    }


def digest(*arrays) -> str:
    h = hashlib.sha256()
    for a in arrays:
        a = np.ascontiguousarray(a)
        h.update(str((a.shape, a.dtype.str)).encode())
        h.update(a.view(np.uint8).tobytes())
    return h.hexdigest()[:20]


def normal(rng, shape, dt) -> np.ndarray:
    """Seeded standard normal numbers in ``dt``, bfloat16 cast from float32 (one
    rounding, the same in every ml_dtypes release)."""
    x = rng.standard_normal(shape)
    return (x.astype(np.float32) if dt.name == "bfloat16" else x).astype(dt)


def corpus(dtypes) -> dict:
    """{case: hash} of every call of the corpus in the given dtype names."""
    import fastattn
    try:
        import ml_dtypes
    except ImportError:
        ml_dtypes = None
    out = {}
    for name in dtypes:
        dt = np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)
        for path, (B, Hq, Hkv, Lq, Lk, E, Ev) in PATHS.items():
            rng = np.random.default_rng(len(path) * 1000 + Lq)
            q = normal(rng, (B, Hq, Lq, E), dt)
            k = normal(rng, (B, Hkv, Lk, E), dt)
            v = normal(rng, (B, Hkv, Lk, Ev), dt)
            go = normal(rng, (B, Hq, Lq, Ev), dt)
            for var, kw in variants(rng, B, Hq, Lq, Lk).items():
                kw = dict(kw, enable_gqa=True)
                o, lse = fastattn.attention(q, k, v, return_lse=True, **kw)
                grads = fastattn.attention_backward(go, q, k, v, o, lse, **kw)
                if "sinks" in kw and grads[3].dtype == np.float64:
                    grads = (*grads[:3], grads[3].astype(np.float32))
                key = f"{name}/{path}/{var}"
                out[key + "/forward"] = digest(o, lse)
                out[key + "/backward"] = digest(*grads)
        rng = np.random.default_rng(9)
        q = normal(rng, (2, 3, 70, 16), dt)
        k = normal(rng, (2, 3, 90, 16), dt)
        out[f"{name}/scores"] = digest(fastattn.scores(q, k, causal=True, softcap=3.0))
        out[f"{name}/weights"] = digest(fastattn.attention_weights(
            q, k, alibi_slopes=[0.1, 0.2, 0.3], sinks=np.zeros(3, np.float32)))
        out[f"{name}/softmax"] = digest(fastattn.softmax(q * 3, axis=-2))
        out[f"{name}/weighted_sum"] = digest(fastattn.weighted_sum(
            fastattn.softmax(np.tile(q[..., :9], 10)), k))
        cu = np.array([0, 3, 3, 70, 72], np.int32)
        pq = normal(rng, (72, 4, 32), dt)
        pk = normal(rng, (72, 2, 32), dt)
        o, lse = fastattn.attention_varlen(pq, pk, pk, cu, cu, causal=True,
                                           sinks=np.ones(4, np.float32), return_lse=True)
        out[f"{name}/varlen"] = digest(o, lse)
    return out


def kernels_of_this_process() -> list:
    """The bfloat16 kernels the driver module in use can run here."""
    from fastattn import _cpu, _dispatch
    found = ["fma"]
    f = _cpu.matrix_features()
    if f["avx512_bf16"] and getattr(_dispatch.drivers, "HAS_AVX512_BF16", False):
        found.append("avx512_bf16")
    if (getattr(_dispatch.drivers, "HAS_AMX_BF16", False)
            and not getattr(_dispatch.drivers, "AMX_EMULATED", False)
            and f["amx_bf16"] and f["amx_int8"] and f["amx_os"] and _cpu.request_amx()):
        found.append("amx_bf16")
    return found


def compute() -> dict:
    """{config: {case: hash}} for this process's level: the float dtypes under the
    level's name, bfloat16 under "level/kernel" for each kernel it can run."""
    from fastattn import _dispatch
    level = _dispatch.level
    result = {level: corpus(["float32", "float64", "float16"])}
    for kernel in kernels_of_this_process():
        _dispatch.bf16_dot = kernel == "avx512_bf16"
        _dispatch.amx = kernel == "amx_bf16"
        result[f"{level}/{kernel}"] = corpus(["bfloat16"])
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true",
                        help=f"compute every level this CPU runs and write {CORPUS}")
    parser.add_argument("--here", action="store_true",
                        help="print this process's configs as JSON (internal)")
    args = parser.parse_args(argv)
    if args.here:
        print(json.dumps(compute()))
        return 0
    from fastattn import _dispatch
    found = {}
    for level in _dispatch.supported_levels:
        if level not in _dispatch.built_levels:
            continue
        env = dict(os.environ, FASTATTN_ISA=level)
        res = subprocess.run([sys.executable, __file__, "--here"], env=env,
                             capture_output=True, text=True, check=True)
        found.update(json.loads(res.stdout))
    if args.write:
        kept = {c: h for c, h in json.loads(CORPUS.read_text()).items() if c not in found}
        CORPUS.write_text(json.dumps({**kept, **found}, indent=1, sort_keys=True) + "\n")
        print(f"wrote {CORPUS}: {', '.join(sorted(found))}"
              + (f"; kept as they were: {', '.join(sorted(kept))}" if kept else ""))
    else:
        print(json.dumps({c: len(v) for c, v in found.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
