import numpy as np
import pytest


@pytest.fixture
def rng():
    """A seeded generator: every test sees the same data on every run."""
    return np.random.default_rng(20261121)


# Hypothesis (the fuzz tests): seeded and deterministic, 300 examples per test;
# FASTATTN_FUZZ_LONG=1 runs 10x more.
try:
    import os

    from hypothesis import HealthCheck, settings
except ImportError:         # the fuzz tests skip themselves without hypothesis
    pass
else:
    _fuzz = dict(derandomize=True, deadline=None, database=None, print_blob=True,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                        HealthCheck.filter_too_much])
    settings.register_profile("fastattn", max_examples=300, **_fuzz)
    settings.register_profile("fastattn-long", max_examples=3000, **_fuzz)
    # FASTATTN_FUZZ_EXAMPLES=n: n examples per test (tools/valgrind.sh runs a few)
    if os.environ.get("FASTATTN_FUZZ_EXAMPLES"):
        settings.register_profile(
            "fastattn-n", max_examples=int(os.environ["FASTATTN_FUZZ_EXAMPLES"]), **_fuzz)
    settings.load_profile(
        "fastattn-n" if os.environ.get("FASTATTN_FUZZ_EXAMPLES")
        else "fastattn-long" if os.environ.get("FASTATTN_FUZZ_LONG") == "1"
        else "fastattn")
