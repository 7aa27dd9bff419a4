# Type stubs for fastattn.cli.demo: the `fastattn demo` subcommand.
import argparse

__all__ = ["add_arguments", "run"]

MAX_DIM: int
MAX_DECIMALS: int

def add_arguments(parser: argparse.ArgumentParser) -> None: ...
def run(args: argparse.Namespace) -> int: ...
