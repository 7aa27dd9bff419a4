# Type stubs for fastattn.cli.bench.threads: one thread count for every contender.
from contextlib import AbstractContextManager
from typing import Any

__all__ = ["MAX_THREADS", "default_threads", "max_threads", "check_threads",
           "thread_limits"]

MAX_THREADS: int

def default_threads() -> int: ...
def max_threads() -> int: ...
def check_threads(threads: Any, name: str = ...) -> int: ...

# torch_module: the imported torch, or None
def thread_limits(threads: int,
                  torch_module: Any = ...) -> AbstractContextManager[dict[str, bool]]: ...
