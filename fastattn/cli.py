"""The ``fastattn`` command (also ``python -m fastattn``).

Each subcommand lives in its own module, which provides ``add_arguments(parser)`` and
``run(args) -> int``; this file only lists them.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name: (module, one-line help)
SUBCOMMANDS = {
    "bench": ("fastattn.bench",
              "time fastattn against the NumPy baseline and PyTorch over a grid of shapes"),
    "info": ("fastattn.cli", "print version, OpenMP, threads and build flags"),
    "explain": ("fastattn.explain",
                "show, from random data, why the scores are divided by sqrt(d_k)"),
    "demo": ("fastattn.demo", 'the worked example "The cat sat", step by step'),
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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``fastattn info`` takes no arguments."""


def run(args: argparse.Namespace) -> int:
    """``fastattn info``: the same as :func:`fastattn.show_config`."""
    from . import show_config
    show_config()
    return 0


def build_parser() -> argparse.ArgumentParser:
    from . import __version__
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


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
