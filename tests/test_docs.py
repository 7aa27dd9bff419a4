"""The Examples sections of the docstrings run as doctests."""

import doctest
import importlib
import importlib.util
import os

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
