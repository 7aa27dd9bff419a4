"""Sphinx configuration of fastattn's documentation.

Build it (warnings are errors; tests/test_docs.py does the same into a temporary folder):

    pip install ".[docs]"
    python -m sphinx -W --keep-going -b html docs docs/_build/html

The API reference is generated from the docstrings of the fastattn that ``import
fastattn`` finds (an installed package or a built source tree on ``PYTHONPATH``):
this file does not put the source tree on ``sys.path``, since an unbuilt tree has no
compiled modules to import. The pages for ``fastattn.torch``,
``fastattn.integrations.transformers`` and ``fastattn.dask`` need their extras
(``fastattn[torch]``, ``fastattn[dask]``).
"""

from __future__ import annotations

import re

import fastattn

project = "fastattn"
author = "the fastattn authors"
copyright = "the fastattn authors"
version = release = fastattn.__version__

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.mathjax",
    "numpydoc",
    "myst_parser",
]

source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build"]

# ------------------------------------------------------------------- MyST (Markdown)
# "#install"-style links of README.md and the pages resolve to their headings
myst_heading_anchors = 3
myst_enable_extensions = ["dollarmath"]

# ------------------------------------------------------------------- autodoc, numpydoc
autodoc_default_options = {"members": False}
autodoc_member_order = "bysource"
autosummary_generate = False          # the pages list their entries themselves
numpydoc_show_class_members = False   # MultiHeadAttention's methods are listed by hand
numpydoc_class_members_toctree = False

# The docstrings write batch shapes as in the code, ``(*batch, Lq, E)``, also outside
# literals (``q : array_like of shape (*batch_q, Lq, E)``), where reST would read the
# star as the start of an emphasis that never ends. Before numpydoc sees a docstring,
# such a star (one that starts the name of a batch shape, outside ``literals`` and
# `roles`) is escaped; nothing else in the docstrings changes.
_LITERAL = re.compile(r"(``.+?``|`[^`]*`)")
_BATCH_STAR = re.compile(r"(?<![\\*\w])\*(?=(?:batch|broadcast_batch)\w*)")


def _escape_batch_stars(app, what, name, obj, options, lines):
    for n, line in enumerate(lines):
        if "*" in line:
            parts = _LITERAL.split(line)
            lines[n] = "".join(part if i % 2 else _BATCH_STAR.sub(r"\\*", part)
                               for i, part in enumerate(parts))


def setup(app):
    app.connect("autodoc-process-docstring", _escape_batch_stars, priority=400)


# ------------------------------------------------------------------- HTML
html_theme = "alabaster"
html_title = f"fastattn {release}"
html_static_path: list = []
