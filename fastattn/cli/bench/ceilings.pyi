# Type stubs for fastattn.cli.bench.ceilings: the machine's sgemm, dgemm and bandwidth.
from typing import Any, Callable

__all__ = ["GEMM_N", "BANDWIDTH_BYTES", "measure_ceilings", "read_probe"]

GEMM_N: int
BANDWIDTH_BYTES: int | None

def measure_ceilings(threads: int | None = ..., *, gemm_n: int | None = ...,
                     bandwidth_bytes: int | None = ...,
                     repeats: int = ...,
                     torch_module: Any = ...) -> dict[str, Any]: ...

def read_probe(nbytes: int | None = ...) -> tuple[Callable[[], object], int]: ...
