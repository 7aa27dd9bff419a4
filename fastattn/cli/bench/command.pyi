# Type stubs for fastattn.cli.bench.command: the options of `fastattn bench` and run.
import argparse

__all__ = ["add_arguments", "run"]

def add_arguments(parser: argparse.ArgumentParser) -> None: ...
def run(args: argparse.Namespace) -> int: ...
