"""The drivers are chosen at import from the CPU's features; FASTATTN_ISA caps them."""

import os

import numpy as np
import pytest

import fastattn
from fastattn import _cpu, _dispatch

from helpers import assert_close, run_with_isa

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
    expect = isa if isa in supported else supported[-1]
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
