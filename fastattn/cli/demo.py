"""The ``fastattn demo`` command: the steps of :mod:`fastattn.demo`, printed."""

from __future__ import annotations

import argparse
import sys

import numpy as np

from . import _shown, int_in_range
from .._api import attention
from ..demo import WORDS, format_steps, worked_example

__all__ = ["add_arguments", "run"]

#: Bounds of the options: the embedding width (--dim, or that of --embeddings) at most
#: MAX_DIM, as --seed draws width x width projections and the demo prints every
#: matrix, one column per dimension; a float64 has at most 17 significant decimals.
MAX_DIM = 64
MAX_DECIMALS = 17


def _sentence(text):
    if not text.split():
        raise argparse.ArgumentTypeError(f"expected at least one word, got {_shown(text)}")
    return text


def _parse_embeddings(text):
    try:
        rows = [[float(x) for x in row.replace(",", " ").split()]
                for row in text.split(";") if row.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"embeddings must be numbers, rows separated by ';', e.g. "
            f"'1,0,1,0; 0,1,0,1; 1,1,1,1'; got {_shown(text)}") from None
    if not rows or len({len(r) for r in rows}) != 1 or not rows[0]:
        raise argparse.ArgumentTypeError(
            f"embeddings must be rows of equal length separated by ';', got {_shown(text)}")
    if len(rows[0]) > MAX_DIM:
        raise argparse.ArgumentTypeError(
            f"embeddings may be at most {MAX_DIM} numbers wide, got {len(rows[0])}")
    rows = np.array(rows)
    if not np.isfinite(rows).all():
        raise argparse.ArgumentTypeError(
            f"embeddings must be finite numbers (no nan or inf), got {_shown(text)}")
    return rows


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the options of ``fastattn demo`` to ``parser``."""
    parser.description = ('The worked example of scaled dot-product attention, step by '
                          'step: "The cat sat" with identity projections.')
    parser.add_argument("--sentence", default=" ".join(WORDS), type=_sentence,
                        help="the words, separated by spaces (default: %(default)r); "
                             "other than three words needs --embeddings or --seed")
    parser.add_argument("--embeddings", type=_parse_embeddings, metavar="ROWS",
                        help="one embedding per word: finite numbers separated by ',' "
                             "or spaces, rows by ';', at most "
                             f"{MAX_DIM} a row (default: The=1,0,1,0 cat=0,1,0,1 "
                             "sat=1,1,1,1)")
    parser.add_argument("--seed", type=int_in_range(0),
                        help="draw random embeddings (N(0, 1), --dim wide) and random "
                             "projections with this seed (an integer >= 0) instead of "
                             "the defaults")
    parser.add_argument("--dim", type=int_in_range(1, MAX_DIM), default=4,
                        help=f"embedding width with --seed, at most {MAX_DIM} "
                             "(default: %(default)s)")
    parser.add_argument("--decimals", type=int_in_range(0, MAX_DECIMALS), default=3,
                        help=f"decimals printed, from 0 to {MAX_DECIMALS} "
                             "(default: %(default)s)")


def run(args: argparse.Namespace) -> int:
    """Run ``fastattn demo``: print every step; return 0 (2 on bad options)."""
    words = args.sentence.split()
    embeddings = args.embeddings
    w = {}
    try:
        if args.seed is not None:
            rng = np.random.default_rng(args.seed)
            if embeddings is None:
                embeddings = rng.standard_normal((len(words), args.dim)).round(2)
            d = embeddings.shape[1]
            w = {n: rng.standard_normal((d, d)).round(2) for n in ("w_q", "w_k", "w_v")}
        steps = worked_example(words, embeddings, **w)
    except ValueError as e:
        print(f"fastattn demo: {e}", file=sys.stderr)
        return 2
    print(f'Scaled dot-product attention over "{" ".join(words)}", step by step\n')
    print(format_steps(steps, words, decimals=args.decimals))
    fused = attention(steps["Q"], steps["K"], steps["V"])
    diff = float(np.max(np.abs(fused - steps["output"]))) if fused.size else 0.0
    print(f"\nThe fused fastattn.attention(Q, K, V) gives the same outputs "
          f"(largest difference {diff:.1e}).")
    return 0
