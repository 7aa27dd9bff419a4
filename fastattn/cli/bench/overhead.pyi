# Type stubs for fastattn.cli.bench.overhead: the per-call time of a tiny call.
from typing import Any

from .grid import Case

__all__ = ["OVERHEAD_CASE", "OVERHEAD_SETTINGS", "measure_overhead"]

OVERHEAD_CASE: Case
OVERHEAD_SETTINGS: dict[str, float]
OVERHEAD_CONTENDERS: tuple[str, ...]

# torch_module: the imported torch, or None
def measure_overhead(threads: int | None = ..., *, torch_module: Any = ...,
                     rounds: int | None = ..., min_sample_time: float | None = ...,
                     seed: int = ...) -> dict[str, Any]: ...
