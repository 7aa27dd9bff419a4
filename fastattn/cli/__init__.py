"""The ``fastattn`` command (also ``python -m fastattn``).

Each subcommand lives in its own module of this package, which provides
``add_arguments(parser)`` and ``run(args) -> int``; this file only lists them. The
modules are imported and the parser is built when :func:`main` runs, never at
``import fastattn``.
"""

from __future__ import annotations

import argparse
import importlib
from typing import Optional, Sequence

__all__ = ["SUBCOMMANDS", "positive_int", "build_parser", "main"]

# name: (module, one-line help)
SUBCOMMANDS = {
    "bench": ("fastattn.cli.bench",
              "time fastattn against the NumPy baseline and PyTorch over a grid of shapes"),
    "info": ("fastattn.cli.info", "print version, OpenMP, threads and build flags"),
    "explain": ("fastattn.cli.explain",
                "show, from random data, why the scores are divided by sqrt(d_k)"),
    "demo": ("fastattn.cli.demo", 'the worked example "The cat sat", step by step'),
}


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1, else a usage error naming the value."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {n}")
    return n


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``fastattn``: one subparser per entry of :data:`SUBCOMMANDS`."""
    from .. import __version__
    parser = argparse.ArgumentParser(
        prog="fastattn",
        description="Scaled dot-product attention on multicore CPUs.")
    parser.add_argument("--version", action="version", version=f"fastattn {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        module = importlib.import_module(module_name)
        p = sub.add_parser(name, help=help_text, description=help_text)
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run ``fastattn`` with ``argv`` (default: the process's arguments); the exit status."""
    args = build_parser().parse_args(argv)
    return int(args._run(args) or 0)
