"""The bit-identity corpus (tools/bits.py): the exact bits of a fixed set of calls, at
this process's instruction-set level and with each bfloat16 kernel this CPU and build
can run, against tests/bits.json. A change that leaves the arithmetic alone (a
refactor of the kernels, a new scratch layout) leaves these bits alone; a change that
means to change them writes the file anew with ``python tools/bits.py --write``.
"""

import importlib.util
import json
import os
from pathlib import Path

import pytest

HERE = Path(__file__).parent


def load_bits():
    """tools/bits.py, the corpus's own module."""
    spec = importlib.util.spec_from_file_location("bits", HERE.parent / "tools" / "bits.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module

pytestmark = pytest.mark.skipif(
    os.environ.get("FASTATTN_SANITIZED") == "1" or os.environ.get("FASTATTN_SANITIZE_AMX"),
    reason="an instrumented or emulating build computes other bits")


def test_the_corpus_has_the_same_bits(monkeypatch):
    from fastattn import _dispatch
    pytest.importorskip("ml_dtypes")
    if getattr(_dispatch.drivers, "AMX_EMULATED", False):
        pytest.skip("an emulating build computes other bits")
    want = json.loads((HERE / "bits.json").read_text())
    for attr in ("bf16_dot", "amx"):                 # compute() sets them
        monkeypatch.setattr(_dispatch, attr, getattr(_dispatch, attr))
    got = load_bits().compute()
    assert set(got) <= set(want), f"no stored bits for {set(got) - set(want)}"
    for config, hashes in got.items():
        differ = sorted(case for case, h in hashes.items() if want[config].get(case) != h)
        assert not differ, f"{config}: {len(differ)} of {len(hashes)} differ: {differ[:8]}"
