# Type stubs for fastattn.cli.bench.threads: one thread count for every contender.
from contextlib import AbstractContextManager
from typing import Any

__all__ = ["default_threads", "thread_limits"]

def default_threads() -> int: ...

# torch_module: the imported torch, or None
def thread_limits(threads: int,
                  torch_module: Any = ...) -> AbstractContextManager[dict[str, bool]]: ...
