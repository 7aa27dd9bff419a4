# Type stubs for fastattn.cli: the `fastattn` command (console script fastattn.cli:main).
import argparse
from collections.abc import Sequence

__all__ = ["SUBCOMMANDS", "positive_int", "build_parser", "main"]

SUBCOMMANDS: dict[str, tuple[str, str]]

def positive_int(text: str) -> int: ...
def build_parser() -> argparse.ArgumentParser: ...
def main(argv: Sequence[str] | None = ...) -> int: ...
