# Type stubs for fastattn.cli.explain: the `fastattn explain` subcommand.
import argparse

__all__ = ["add_arguments", "run"]

MAX_SAMPLES: int
MAX_ROWS: int
MAX_KEYS: int
MAX_DK: int

def add_arguments(parser: argparse.ArgumentParser) -> None: ...
def run(args: argparse.Namespace) -> int: ...
