"""The Examples sections of the docstrings run as doctests."""

import doctest
import importlib

import pytest

MODULES = ["fastattn._api", "fastattn._config", "fastattn._grad", "fastattn.reference"]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0
