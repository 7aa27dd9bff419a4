# Type stubs for fastattn.cli.bench.peers: OpenVINO, ONNX Runtime and JAX, isolated.
from collections.abc import Callable, Mapping, Sequence
from types import TracebackType
from typing import Any, NamedTuple

import numpy as np
from numpy.typing import NDArray

from .contenders import Unavailable
from .grid import Case

__all__ = ["PEERS", "PEER_PACKAGES", "INSTALL_HINT", "NotApplicable", "PeerCall",
           "ADAPTERS", "installed", "not_installed", "case_support", "peer_causal",
           "make_peer_callable", "sample_rows", "reference_sample", "check_answer",
           "fastest_peer", "peer_geomeans", "WorkerPool"]

PEERS: tuple[str, ...]
PEER_PACKAGES: dict[str, tuple[str, ...]]
INSTALL_HINT: str
WORKER_TIMEOUT_S: float
SAMPLE_BLOCK: int

class NotApplicable(Unavailable): ...

class PeerCall(NamedTuple):
    call: Callable[[], object]
    output: Callable[[object], NDArray[Any]]
    runs: str

ADAPTERS: dict[str, Callable[[Case, Mapping[str, NDArray[Any]], int], PeerCall]]

def installed(peer: str) -> bool: ...
def not_installed(peer: str) -> str: ...
def peer_causal(case: Case) -> bool | None: ...
def case_support(case: Case, peer: str, backward: bool = ...) -> str | None: ...
def jax_environment(threads: int) -> dict[str, Any]: ...
def make_peer_callable(case: Case, peer: str, arrays: Mapping[str, NDArray[Any]],
                       threads: int) -> PeerCall: ...
def sample_rows(Lq: int, block: int = ...) -> NDArray[np.int64]: ...
def reference_sample(case: Case, arrays: Mapping[str, NDArray[Any]]
                     ) -> tuple[NDArray[np.int64], NDArray[np.float64]]: ...
def check_answer(case: Case, got: NDArray[Any], rows: NDArray[np.int64],
                 expected: NDArray[np.float64]) -> tuple[bool, float | None, float]: ...
def fastest_peer(samples: Mapping[str, Sequence[float]],
                 fastattn: Sequence[float]) -> dict[str, Any] | None: ...
def peer_geomeans(rows: Sequence[Mapping[str, Any]]
                  ) -> dict[str, dict[str, Any] | None]: ...

class WorkerPool:
    threads: int
    peers: tuple[str, ...]
    read_probe: bool
    probe_bytes: int | None
    inline: bool
    workers: dict[str, Any]
    def __init__(self, threads: int, peers: Sequence[str] = ..., *,
                 read_probe: bool = ..., probe_bytes: int | None = ...,
                 inline: bool = ...) -> None: ...
    def __enter__(self) -> WorkerPool: ...
    def __exit__(self, exc_type: type[BaseException] | None,
                 exc: BaseException | None, tb: TracebackType | None) -> None: ...
    def close(self) -> None: ...
    def time_case(self, case: Case, contenders: Sequence[str], *, backward: bool,
                  seed: int, max_rounds: int, min_rounds: int, time_budget: float,
                  min_sample_time: float,
                  arrays: Mapping[str, NDArray[Any]] | None = ...) -> dict[str, Any]: ...
