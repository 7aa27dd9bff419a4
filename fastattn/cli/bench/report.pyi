# Type stubs for fastattn.cli.bench.report: the table, the JSON and the plot of a run.
from collections.abc import Mapping
from os import PathLike
from typing import Any

__all__ = ["format_report", "write_json", "plot_report"]

def format_report(report: Mapping[str, Any]) -> str: ...
def write_json(report: Mapping[str, Any], path: str | PathLike[str]) -> None: ...
def plot_report(report: Mapping[str, Any], path: str | PathLike[str]) -> None: ...
