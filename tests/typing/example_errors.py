"""Misuses that the stubs let `mypy --strict` catch: each line marked "E:" is an error."""

from __future__ import annotations

import numpy as np

import fastattn

x = np.ones((4, 8))
fastattn.attention(x, x, x, causal="diagonal")       # E: not a causal convention
fastattn.attention(x, x, x, scale="0.5")             # E: scale is a number
fastattn.attention(x, x, x, num_threads=2.0)         # E: num_threads is an integer
fastattn.attention(x, x, x, True)                    # E: options are keyword-only
fastattn.softmax(x, out=[0.0])                       # E: out is an ndarray
n: str = fastattn.get_num_threads()                  # E: it returns an int
out, lse = fastattn.attention(x, x, x, return_lse=True)
lse.no_such_attribute                                # E: lse is an ndarray
fastattn.attension(x, x, x)                          # E: no such name (lazy: two)
fastattn.explain.variance_table(dims=4)              # E: dims is a sequence
