"""Shared helpers: random inputs and the tolerance rule of the test suite."""

import tempfile

import numpy as np

# Subprocesses run here, outside the source tree, so that they import the installed
# package (the source folder has no compiled extensions).
OUTSIDE_SOURCE = tempfile.gettempdir()

# Errors are measured relative to the scale of the output (for attention, max |v|:
# every output row is a convex combination of value rows).
RTOL = {np.float16: 2e-3, np.float32: 2e-6, np.float64: 1e-12}


def tolerance(dtype):
    return RTOL[np.dtype(dtype).type]


def assert_close(actual, expected, dtype, scale=None):
    """|actual - expected| <= tol(dtype) * scale, with NaN and inf where expected has them."""
    actual = np.asarray(actual, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    same_special = (np.isnan(actual) == np.isnan(expected)) & (
        np.isinf(expected) <= (actual == expected))
    assert same_special.all(), "NaN/inf pattern differs"
    finite = np.isfinite(expected)
    if scale is None:
        scale = max(1.0, float(np.max(np.abs(expected[finite]), initial=0.0)))
    err = np.max(np.abs(actual[finite] - expected[finite]), initial=0.0)
    assert err <= tolerance(dtype) * scale, f"max error {err:.3g} > {tolerance(dtype)} * {scale:.3g}"


def randn(rng, shape, dtype=np.float64):
    return rng.standard_normal(shape).astype(dtype)
