# Type stubs for fastattn.cli.info: the `fastattn info` subcommand.
import argparse

__all__ = ["add_arguments", "run"]

def add_arguments(parser: argparse.ArgumentParser) -> None: ...
def run(args: argparse.Namespace) -> int: ...
