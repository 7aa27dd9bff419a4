"""The ``fastattn explain`` command: the tables of :mod:`fastattn.explain`, printed."""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import sys

from . import int_in_range, writable_path
from ..explain import (DEFAULT_KEYS, DEFAULT_ROWS, DEFAULT_SAMPLES, DIMS, explain_table,
                       format_table, plot)

__all__ = ["add_arguments", "run"]

#: Bounds of the options. The draws are made in chunks, so --samples and --rows only
#: cost time; one softmax row holds --keys x --max-dk numbers (and a few copies), so
#: their bounds keep a row within 64 MiB.
MAX_SAMPLES = 10_000_000
MAX_ROWS = 1_000_000
MAX_KEYS = 1024
MAX_DK = 8192


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the options of ``fastattn explain`` to ``parser``."""
    parser.description = ("Reproduce, from seeded random data, why attention divides "
                          "the scores q.k by sqrt(d_k).")
    parser.add_argument("--seed", type=int_in_range(0), default=0,
                        help="seed of the random draws, an integer >= 0 "
                             "(default: %(default)s)")
    parser.add_argument("--samples", type=int_in_range(2, MAX_SAMPLES),
                        default=DEFAULT_SAMPLES,
                        help="(q, k) pairs of width max d_k drawn for the variances; "
                             "each gives max_dk/d_k pairs of width d_k; from 2 to "
                             f"{MAX_SAMPLES} (default: %(default)s)")
    parser.add_argument("--keys", type=int_in_range(1, MAX_KEYS), default=DEFAULT_KEYS,
                        help=f"scores per softmax row, at most {MAX_KEYS} "
                             "(default: %(default)s)")
    parser.add_argument("--rows", type=int_in_range(1, MAX_ROWS), default=DEFAULT_ROWS,
                        help="softmax rows of width max d_k drawn; each gives "
                             f"max_dk/d_k rows of width d_k; at most {MAX_ROWS} "
                             "(default: %(default)s)")
    parser.add_argument("--max-dk", type=int_in_range(1, MAX_DK), default=DIMS[-1],
                        help="largest d_k; the table runs over powers of two up to it; "
                             f"at most {MAX_DK} (default: %(default)s)")
    parser.add_argument("--plot", metavar="PATH",
                        type=writable_path((".png", ".svg", ".pdf")),
                        help="also draw the table to PATH (PNG, or SVG or PDF for a "
                             "name ending in .svg or .pdf; missing folders are "
                             "created; needs matplotlib)")


def run(args: argparse.Namespace) -> int:
    """Run ``fastattn explain``: print the table (and save the plot); return 0."""
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        print("fastattn explain: --plot needs matplotlib (pip install matplotlib)",
              file=sys.stderr)
        return 1
    dims = [2 ** i for i in range(int(math.log2(args.max_dk)) + 1)]
    table = explain_table(dims, samples=args.samples, keys=args.keys, rows=args.rows,
                          seed=args.seed)
    k = args.keys
    print("Why attention divides q.k by sqrt(d_k)\n")
    top = dims[-1]
    print(f"q and k have d_k independent N(0, 1) components (seed {args.seed}). Variances "
          f"over {args.samples}\n(q, k) pairs at d_k = {top}, {args.samples * top} at "
          f"d_k = 1; softmax over rows of {k} scores\n(one query, {k} keys), averaged "
          f"over {args.rows} rows at d_k = {top}, {args.rows * top} at d_k = 1.\n")
    print(format_table(table))
    print("\nvar(q.k) grows like d_k; dividing by sqrt(d_k) keeps it near 1.")
    print("Unscaled, softmax saturates as d_k grows: the largest probability goes toward "
          "1 and\nthe entropy toward 0; the Jacobian norm (the size of the gradient "
          "through softmax)\nrises while a few keys share the weight, then falls toward "
          "0 as one key takes it all.\nScaled, all three stay where d_k = 1 puts them. "
          f"For reference, {k} equal scores give\nmax probability {1 / k:.3f}, entropy "
          f"{math.log(k):.3f} and Jacobian norm {math.sqrt(1 / k - 1 / k ** 2):.3f}; "
          "a one-hot row gives 1, 0 and 0.")
    if args.plot:
        os.makedirs(os.path.dirname(os.path.abspath(args.plot)), exist_ok=True)
        plot(table, args.plot, keys=k)
        print(f"\nplot written to {args.plot}")
    return 0
