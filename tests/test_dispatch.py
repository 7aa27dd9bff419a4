"""The drivers are chosen at import from the CPU's features; FASTATTN_ISA caps them
(and FASTATTN_ISA_LEVELS, at build time, the levels built)."""

import os
import platform
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest

import fastattn
from fastattn import _cpu, _dispatch

from helpers import assert_close, run_with_isa

SANITIZED = bool(os.environ.get("FASTATTN_SANITIZED"))     # set by tools/sanitize.sh

PROBE = """
import json, warnings
import numpy as np
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import fastattn
from fastattn import _config
rng = np.random.default_rng(1)
q, k, v = (rng.standard_normal((2, 3, 130, 40)) for _ in range(3))
out = fastattn.attention(q, k, v, causal=True)
print(json.dumps({"isa": _config.config()["isa"], "out": out.ravel()[::97].tolist(),
                  "warnings": [str(w.message) for w in caught]}))
"""


def run_with(isa):
    return run_with_isa(PROBE, isa)


def test_the_level_in_use_is_built_and_supported():
    assert _dispatch.level in _dispatch.built_levels
    assert _dispatch.level in _cpu.supported_levels()
    assert "baseline" in _dispatch.built_levels
    assert fastattn._config.config()["isa"] == _dispatch.level
    if os.environ.get("FASTATTN_ISA") is None:
        # the best level that is both built and supported
        both = [lv for lv in _cpu.LEVELS
                if lv in _dispatch.built_levels and lv in _cpu.supported_levels()]
        assert _dispatch.level == both[-1]


@pytest.mark.parametrize("isa", ["baseline", "avx2", "avx512"])
def test_forcing_a_level(isa):
    got = run_with(isa)
    supported = [lv for lv in _cpu.supported_levels() if lv in _dispatch.built_levels]
    # a cap: the highest level built and supported that is not above the one asked for
    # (a wheel built for avx512 and baseline only runs baseline under FASTATTN_ISA=avx2)
    at_most = _dispatch.LEVELS[:_dispatch.LEVELS.index(isa) + 1]
    expect = [lv for lv in supported if lv in at_most][-1]
    assert got["isa"] == expect
    if isa not in _cpu.supported_levels():      # never more than the CPU runs
        assert any("supports only" in w for w in got["warnings"])
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((2, 3, 130, 40)) for _ in range(3))
    ref = fastattn.reference.attention(q, k, v, causal=True)
    assert_close(np.array(got["out"]), ref.ravel()[::97], np.float64)


def test_an_unknown_level_is_ignored_with_a_warning():
    got = run_with("sse9")
    assert any("sse9" in w for w in got["warnings"])
    assert got["isa"] == run_with(None)["isa"]


DECODE_PROBE = """
import json, numpy as np, fastattn
rng = np.random.default_rng(5)
got = {}
for groups, Lq, dtype, Ev in ((1, 1, "float32", 40), (4, 1, "float32", 40),
                              (8, 1, "float32", 40), (5, 1, "float32", 40),
                              (3, 2, "float32", 40), (4, 1, "float16", 40),
                              (1, 1, "float32", 136), (6, 1, "float32", 136)):
    q = rng.standard_normal((1, 2 * groups, Lq, 72)).astype(dtype)
    k = rng.standard_normal((1, 2, 700, 72)).astype(dtype)
    v = rng.standard_normal((1, 2, 700, Ev)).astype(dtype)
    out = fastattn.attention(q, k, v, enable_gqa=True, causal="bottom_right")
    got[f"{groups} {Lq} {dtype} {Ev}"] = out.astype(np.float32).view(np.uint32).tolist()
print(json.dumps(got))
"""


def assert_bits_close(got, want):
    for key, bits in want.items():
        np.testing.assert_allclose(np.array(got[key], np.uint32).view(np.float32),
                                   np.array(bits, np.uint32).view(np.float32),
                                   rtol=2e-3 if "float16" in key else 2e-6, atol=1e-6)


def test_decode_gives_the_same_bits_with_and_without_the_avx512_kernels():
    """The decode path's AVX-512 kernels (src/fa_dots.h: 16 dot products at a time in
    blocks of 1 x 16, 2 x 8 or 4 x 4 rows by keys, then the values' sums) add in the
    order the portable loops do: grouped-query items of 1 to 10 rows (value rows of 40
    columns: masked; of 136: whole vectors, then masked) give the bits of
    the avx2 level, which runs those loops with the same fused multiply-adds (gcc fuses
    them in an optimised build; the sanitizers' build checks the load between a product
    and its sum, so they are not fused there: close, not equal). The baseline level has
    no FMA: its products round once more, so it is close, not equal."""
    levels = [lv for lv in ("baseline", "avx2", "avx512")
              if lv in _dispatch.built_levels and lv in _cpu.supported_levels()]
    if "avx512" not in levels or "avx2" not in levels:
        pytest.skip("this CPU (or build) lacks AVX2 or AVX-512")
    got = {lv: run_with_isa(DECODE_PROBE, lv) for lv in levels}
    if SANITIZED:
        assert_bits_close(got["avx512"], got["avx2"])
    else:
        assert got["avx512"] == got["avx2"]
    assert_bits_close(got["baseline"], got["avx2"])


def test_the_build_refuses_an_unknown_level_name():
    # FASTATTN_ISA_LEVELS names the driver levels to build (setup.py): a misspelt one
    # stops the build with the known names, rather than building baseline alone
    setup_py = Path(__file__).resolve().parents[1] / "setup.py"
    if not setup_py.exists():
        pytest.skip("no setup.py beside the tests")
    pytest.importorskip("Cython")
    env = dict(os.environ, FASTATTN_ISA_LEVELS="avx2,avx3")
    res = subprocess.run([sys.executable, str(setup_py), "--name"], cwd=setup_py.parent,
                         env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode != 0
    assert "FASTATTN_ISA_LEVELS names unknown levels ['avx3']" in res.stderr
    assert "'baseline', 'avx2', 'avx512'" in res.stderr


HEADERS_PROBE = "".join(f'#include "{name}"\n' for name in (
    "fa_exp.h", "fa_half.h", "fa_codes.h", "fa_transpose.h", "fa_dots.h", "fa_softmax.h",
    "fa_bf16.h", "fa_amx.h", "fa_prefetch.h", "philox.h", "fa_microtile.h",
    "fa_interrupt.h", "fa_limits.h")) + """
int fa_probe(void) {
    return FA_HAVE_AVX512_BF16 + FA_HAVE_AMX_BF16 + FA_HAVE_BLOCK_SOFTMAX;
}
"""


@pytest.mark.parametrize("flags", [
    [], ["-mavx2"], ["-mavx2", "-mfma", "-mf16c"], ["-mavx512f"],
    ["-mavx512f", "-mavx512bw"], ["-mavx512f", "-mavx512dq"], ["-march=x86-64-v4"],
    ["-march=x86-64-v4", "-DFA_AMX_EMULATE"], ["-march=x86-64-v4", "-DFA_NO_AMX"]],
    ids=lambda flags: " ".join(flags) or "plain")
def test_the_kernel_headers_compile_with_any_subset_of_the_instruction_sets(tmp_path,
                                                                            flags):
    """Each header guards its vector code by the instruction sets that code needs (a
    compiler, or -m flags, with only part of AVX-512 builds the portable code there):
    every header together compiles, with implicit declarations as errors as setup.py
    asks, for each of these sets."""
    src = Path(fastattn.__file__).parent / "src"
    compiler = shutil.which("gcc") or shutil.which("cc")
    if platform.machine() not in ("x86_64", "AMD64") or compiler is None \
            or not (src / "fa_amx.h").exists():
        pytest.skip("needs an x86-64 C compiler and fastattn's headers")
    (tmp_path / "probe.c").write_text(HEADERS_PROBE)
    res = subprocess.run(
        [compiler, "-O1", "-Werror=implicit-function-declaration", *flags,
         "-I", str(src), "-I", sysconfig.get_paths()["include"], "-c",
         str(tmp_path / "probe.c"), "-o", str(tmp_path / "probe.o")],
        capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
