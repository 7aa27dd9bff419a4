# Type stubs for fastattn.cli.bench.timing: interleaved rounds of rotating order.
from collections.abc import Callable, Collection, Hashable, Mapping, Sequence
from typing import Any

__all__ = ["interleaved", "summary"]

def summary(values: Sequence[float]) -> dict[str, float]: ...
def interleaved(calls: Mapping[Hashable, Callable[[], object]], *, max_rounds: int,
                min_rounds: int, time_budget: float, min_sample_time: float,
                setup: Mapping[Hashable, Callable[[], object]] | None = ...,
                spinning: Collection[Hashable] = ...
                ) -> tuple[dict[Hashable, list[float]], dict[Hashable, Any],
                           dict[Hashable, int], dict[Hashable, str]]: ...
