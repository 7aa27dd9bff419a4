"""The Examples sections of the docstrings run as doctests, and the documentation site
builds without a warning."""

import doctest
import importlib
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

MODULES = ["fastattn._api", "fastattn._config", "fastattn._grad", "fastattn.reference",
           "fastattn.transformer", "fastattn.explain", "fastattn.demo"]


def needs(*modules):
    """A mark that skips where a module is missing, and PyTorch under the sanitizer
    build (its native code does not run with ASan preloaded)."""
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    sanitized = bool(os.environ.get("FASTATTN_SANITIZED"))
    return pytest.mark.skipif(bool(missing) or sanitized,
                              reason=f"needs {', '.join(modules)}; not under the sanitizer")


MODULES += [pytest.param("fastattn.torch", marks=needs("torch")),
            pytest.param("fastattn.integrations.transformers",
                         marks=needs("torch", "transformers"))]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0


DOCS = Path(__file__).resolve().parent.parent / "docs"


@needs("torch", "transformers", "dask")
def test_sphinx_site_builds_without_warnings(tmp_path):
    """The documentation site (docs/conf.py: the guide from README.md, the contract,
    the API reference from these docstrings, the other pages) builds with warnings as
    errors, against the fastattn this test imports. Its API pages of fastattn.torch,
    fastattn.integrations.transformers and fastattn.dask import them, hence the
    extras; the docs toolchain is the ``docs`` extra."""
    pytest.importorskip("sphinx", reason="needs the docs extra (sphinx)")
    pytest.importorskip("numpydoc", reason="needs the docs extra (numpydoc)")
    pytest.importorskip("myst_parser", reason="needs the docs extra (myst-parser)")
    if not (DOCS / "conf.py").is_file():
        pytest.skip("docs/conf.py not found (run from a source tree or an sdist)")
    import fastattn

    # the fastattn under test, not whatever the docs folder's parent holds (a source
    # tree without compiled modules, when the tests run against an installed package):
    # its folder first on the path, and Sphinx started outside the source tree (``-m``
    # puts the working directory first on sys.path)
    env = dict(os.environ)
    package_root = str(Path(fastattn.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(
        [package_root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    res = subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html",
         "-d", str(tmp_path / "doctrees"), str(DOCS), str(tmp_path / "html")],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, f"sphinx failed:\n{res.stdout[-5000:]}\n{res.stderr[-5000:]}"
    for page in ("index", "guide", "contract", "performance", "api/fastattn",
                 "api/torch", "api/dask", "public_cython_api"):
        assert (tmp_path / "html" / f"{page}.html").is_file(), page
