import numpy as np
import pytest


@pytest.fixture
def rng():
    """A seeded generator: every test sees the same data on every run."""
    return np.random.default_rng(20261121)


@pytest.fixture(scope="session")
def consumer(tmp_path_factory):
    """tests/extending/consumer.pyx built against fastattn's public C-level API.

    Skips when Cython or a C compiler is missing; built once per test session.
    """
    from pathlib import Path

    from extending_build import build_extension
    source = Path(__file__).parent / "extending" / "consumer.pyx"
    return build_extension(tmp_path_factory.mktemp("consumer"), "fastattn_consumer",
                           source)
