"""The ``fastattn info`` command: the same as :func:`fastattn.show_config`."""

from __future__ import annotations

import argparse

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``fastattn info`` takes no arguments."""


def run(args: argparse.Namespace) -> int:
    """``fastattn info``: print the configuration; return 0."""
    from .. import show_config
    show_config()
    return 0
