# Type stubs for fastattn.cli.bench.runner: interleaved rounds over the cases, a run.
from collections.abc import Mapping, Sequence
from typing import Any

from .grid import Case
from .serving import ServingCase

__all__ = ["FULL_SETTINGS", "QUICK_SETTINGS", "run_benchmarks", "geometric_means",
           "benchmark_report"]

FULL_SETTINGS: dict[str, float]
QUICK_SETTINGS: dict[str, float]

def run_benchmarks(grid: Sequence[Case] | None = ..., threads: int | None = ..., *,
                   backward: bool = ..., use_torch: bool = ...,
                   use_numpy: bool = ..., ceilings: Mapping[str, Any] | None = ...,
                   max_rounds: int = ..., min_rounds: int = ..., time_budget: float = ...,
                   min_sample_time: float = ..., progress: bool = ..., seed: int = ...,
                   read_probe: bool = ..., peers: Sequence[str] | None = ...,
                   _progress: Any = ...) -> list[dict[str, Any]]: ...
def geometric_means(rows: Sequence[Mapping[str, Any]]
                    ) -> dict[str, dict[str, Any] | None]: ...
def benchmark_report(grid: Sequence[Case] | None = ..., threads: int | None = ..., *,
                     backward: bool = ..., use_torch: bool = ..., use_numpy: bool = ...,
                     measure: bool = ..., overhead: bool = ...,
                     torch_op: bool = ..., progress: bool = ..., seed: int = ...,
                     serving: Sequence[ServingCase] = ...,
                     peers: Sequence[str] | None = ...,
                     **settings: float) -> dict[str, Any]: ...
