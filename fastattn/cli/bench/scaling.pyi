# Type stubs for fastattn.cli.bench.scaling: one table per shape over thread counts.
from collections.abc import Mapping, Sequence
from typing import Any

from .grid import Case

__all__ = ["usable_cores", "run_scaling", "scaling_report"]

def usable_cores() -> int: ...
def run_scaling(grid: Sequence[Case] | None = ..., counts: Sequence[int] = ..., *,
                backward: bool = ..., use_torch: bool = ...,
                ceilings: Mapping[int, Mapping[str, Any]] | None = ...,
                max_rounds: int = ..., min_rounds: int = ..., time_budget: float = ...,
                min_sample_time: float = ..., progress: bool = ..., seed: int = ...,
                _progress: Any = ...) -> list[dict[str, Any]]: ...
def scaling_report(grid: Sequence[Case] | None = ..., counts: Sequence[int] = ..., *,
                   backward: bool = ..., use_torch: bool = ..., measure: bool = ...,
                   overhead: bool = ..., progress: bool = ..., seed: int = ...,
                   **settings: float) -> dict[str, Any]: ...
