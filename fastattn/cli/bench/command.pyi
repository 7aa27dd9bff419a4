# Type stubs for fastattn.cli.bench.command: the options of `fastattn bench` and run.
import argparse

__all__ = ["add_arguments", "run"]

MAX_ROUNDS: int
MAX_TIME_BUDGET: float
PLOT_SUFFIXES: tuple[str, ...]

def add_arguments(parser: argparse.ArgumentParser) -> None: ...
def run(args: argparse.Namespace) -> int: ...
