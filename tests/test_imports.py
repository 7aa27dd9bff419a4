"""What ``import fastattn`` loads: the library, not its satellites.

The command line (argparse, fastattn.cli and its subcommands, the benchmark) is
imported only by the ``fastattn`` command; fastattn.explain and fastattn.demo load on
first use (PEP 562). Each check runs in a fresh interpreter, where nothing else has
imported them yet.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import fastattn

# the folder this fastattn is imported from (the source tree or site-packages)
ROOT = Path(fastattn.__file__).resolve().parent.parent
SOURCE_TREE = Path(__file__).resolve().parent.parent

SATELLITES = """
def satellites():
    return sorted(m for m in sys.modules
                  if m in ("argparse", "fastattn.cli", "fastattn.explain", "fastattn.demo")
                  or m.startswith("fastattn.cli.") or m.startswith("fastattn.bench"))
"""


def run_fresh(code, tmp_path):
    """Run ``code`` in a new interpreter, outside the source tree; its stdout as JSON."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=tmp_path, env=env, timeout=120)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def test_import_fastattn_loads_no_satellite(tmp_path):
    code = "import json, sys\n" + SATELLITES + """
import fastattn
loaded = satellites()
listed = [name for name in ("explain", "demo") if name in dir(fastattn)]
table = fastattn.explain.variance_table([1, 4], samples=100, seed=0)
steps = fastattn.demo.worked_example()
print(json.dumps({"after_import": loaded, "listed": listed, "after_use": satellites(),
                  "d_k": table["d_k"].tolist(),
                  "weights": steps["weights"][0].round(3).tolist()}))
"""
    got = run_fresh(code, tmp_path)
    assert got["after_import"] == []
    assert got["listed"] == ["explain", "demo"]
    # the library modules load on first use, still without the command line
    assert got["after_use"] == ["fastattn.demo", "fastattn.explain"]
    assert got["d_k"] == [1, 4]
    assert got["weights"] == [0.422, 0.155, 0.422]


@pytest.mark.parametrize("statement", ["from fastattn import explain",
                                       "from fastattn import *",
                                       "import fastattn.explain as explain"])
def test_the_ways_to_reach_explain(statement, tmp_path):
    code = "import json, sys\n" + SATELLITES + statement + """
t = explain.softmax_stats([[0.0, 0.0]])
print(json.dumps({"max_p": t["max_p"].tolist(), "loaded": satellites()}))
"""
    got = run_fresh(code, tmp_path)
    assert got == {"max_p": [0.5], "loaded": ["fastattn.explain"]}


# the runtimes of ``fastattn bench --peers`` (the ``peers`` extra): imported only by the
# worker process that times each, never by fastattn or its command line
PEER_MODULES = ("openvino", "onnxruntime", "onnx", "jax", "jaxlib")


def test_no_import_loads_a_peer_runtime(tmp_path):
    code = f"""import json, sys
import fastattn
after_fastattn = [m for m in {PEER_MODULES!r} if m in sys.modules]
from fastattn.cli import build_parser
from fastattn.cli.bench import peers
build_parser()
print(json.dumps({{"fastattn": after_fastattn,
                   "cli": [m for m in {PEER_MODULES!r} if m in sys.modules],
                   "peers": list(peers.PEERS)}}))
"""
    got = run_fresh(code, tmp_path)
    assert got == {"fastattn": [], "cli": [],
                   "peers": ["openvino", "onnxruntime", "jax"]}


def test_unknown_names_still_raise():
    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
        fastattn.no_such_name
    assert "explain" in fastattn.__all__ and fastattn.explain.DIMS[-1] == 1024


def test_the_command_line_still_loads_everything(tmp_path):
    code = "import json, sys\n" + SATELLITES + """
from fastattn.cli import build_parser
build_parser()
print(json.dumps(satellites()))
"""
    got = run_fresh(code, tmp_path)
    for name in ("argparse", "fastattn.cli", "fastattn.cli.info", "fastattn.cli.explain",
                 "fastattn.cli.demo", "fastattn.cli.bench", "fastattn.cli.bench.grid"):
        assert name in got


def packages_in(folder):
    """The import names of the packages (folders with an __init__.py) under folder."""
    return sorted(".".join(p.parent.relative_to(folder.parent).parts)
                  for p in folder.rglob("__init__.py"))


@pytest.mark.skipif(not (SOURCE_TREE / "pyproject.toml").is_file(),
                    reason="needs the source tree")
def test_pyproject_ships_every_package_and_its_stubs():
    tomllib = pytest.importorskip("tomllib")
    config = tomllib.loads((SOURCE_TREE / "pyproject.toml").read_text())["tool"]
    packages = config["setuptools"]["packages"]
    assert sorted(packages) == packages_in(SOURCE_TREE / "fastattn")
    data = config["setuptools"]["package-data"]
    for package in packages:
        folder = SOURCE_TREE.joinpath(*package.split("."))
        if any(folder.glob("*.pyi")):
            assert "*.pyi" in data.get(package, []), f"{package}: its stubs are not shipped"
