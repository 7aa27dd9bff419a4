"""The ``fastattn`` command (also ``python -m fastattn``).

Each subcommand lives in its own module of this package, which provides
``add_arguments(parser)`` and ``run(args) -> int``; this file only lists them. The
modules are imported and the parser is built when :func:`main` runs, never at
``import fastattn``.
"""

from __future__ import annotations

import argparse
import importlib
import os
import tempfile
from typing import Callable, Optional, Sequence

__all__ = ["SUBCOMMANDS", "positive_int", "int_in_range", "writable_path",
           "build_parser", "main"]

# name: (module, one-line help)
SUBCOMMANDS = {
    "bench": ("fastattn.cli.bench",
              "time fastattn against the NumPy baseline and PyTorch over a grid of shapes"),
    "info": ("fastattn.cli.info", "print version, OpenMP, threads and build flags"),
    "explain": ("fastattn.cli.explain",
                "show, from random data, why the scores are divided by sqrt(d_k)"),
    "demo": ("fastattn.cli.demo", 'the worked example "The cat sat", step by step'),
}


def _shown(text: str, limit: int = 40) -> str:
    """``repr(text)``, cut to about ``limit`` characters (a usage error echoes the
    value; a value of thousands of digits should not fill the screen)."""
    return repr(text) if len(text) <= limit else repr(text[:limit]) + "..."


def _parse_int(text: str, expected: str) -> int:
    try:
        return int(text)
    except ValueError:          # not a number, or more digits than int() reads
        pass
    raise argparse.ArgumentTypeError(f"expected {expected}, got {_shown(text)}")


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1, else a usage error naming the value."""
    n = _parse_int(text, "an integer >= 1")
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {_shown(text)}")
    return n


def int_in_range(low: int, high: Optional[int] = None) -> Callable[[str], int]:
    """An argparse type: an integer in ``[low, high]`` (no upper bound when ``high`` is
    None), else a usage error naming the value and the range."""
    expected = (f"an integer >= {low}" if high is None
                else f"an integer from {low} to {high}")

    def parse(text: str) -> int:
        n = _parse_int(text, expected)
        if n < low or (high is not None and n > high):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {_shown(text)}")
        return n

    parse.__name__ = "int"
    return parse


def writable_path(suffixes: Sequence[str] = ()) -> Callable[[str], str]:
    """An argparse type: a file path the command can write at its end, checked when
    the options are parsed rather than after a long run.

    The path must not be empty nor a folder. An existing file must open for appending
    (nothing is written to it); otherwise a temporary file must be creatable in the
    nearest existing folder above it (the missing folders between are created when the
    file is written), which also catches read-only file systems and ``/proc`` where
    permission bits alone do not. With ``suffixes`` (e.g. ``(".png",)``), the name must
    end with one of them (any case).
    """
    def refuse(text: str, why: str):
        raise argparse.ArgumentTypeError(f"cannot write {_shown(text)}: {why}")

    def parse(text: str) -> str:
        if not text.strip():
            raise argparse.ArgumentTypeError(f"expected a file path, got {_shown(text)}")
        if suffixes and not text.lower().endswith(tuple(s.lower() for s in suffixes)):
            raise argparse.ArgumentTypeError(
                f"expected a file name ending in {' or '.join(suffixes)}, got "
                f"{_shown(text)}")
        path = os.path.abspath(text)
        if os.path.isdir(path) or text.endswith(("/", os.sep)):
            refuse(text, "it is a folder")
        if os.path.exists(path):
            try:
                open(path, "ab").close()
            except OSError as exc:
                refuse(text, exc.strerror or str(exc))
            return text
        parent = os.path.dirname(path)
        while not os.path.exists(parent):
            parent = os.path.dirname(parent)
        if not os.path.isdir(parent):
            refuse(text, f"{parent} is a file, not a folder")
        try:
            tempfile.TemporaryFile(dir=parent).close()
        except OSError as exc:
            refuse(text, f"cannot create a file in {parent} "
                         f"({exc.strerror or exc})")
        return text

    parse.__name__ = "path"
    return parse


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
