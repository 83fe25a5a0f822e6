"""Sequences picked by their number in ``bench.ilp_compare``'s log, for the benches that
look at a few of them closely (``bench.ilp_limit``, ``bench.ilp_relax``).

A parametric family (``family:pile``) draws its documents in chunks sized by the whole
request, so its packed sequences depend on how many are packed: sequence k of a
100-sequence packing is not sequence k of a 50-sequence one. The picked sequences are
therefore taken from a packing of ``--packed`` sequences (default 100, ``ilp_compare``'s
default ``--sequences``), never of just as many as the largest number picked.
"""

from __future__ import annotations

import argparse

from planner_service.data import make_source, pack_sequences

COMPARE_SEQUENCES = 100
"""``bench.ilp_compare``'s default ``--sequences``."""


def add_arguments(parser: argparse.ArgumentParser, default_sequences: str) -> None:
    """The data set, context, N, R, seed and picked sequences, as ``ilp_compare`` takes them."""
    parser.add_argument("--dataset", default="code")
    parser.add_argument("--context", type=int, default=131072)
    parser.add_argument("--cp", type=int, default=4)
    parser.add_argument("--sequences", default=default_sequences,
                        help="1-based numbers, as in bench.ilp_compare's log")
    parser.add_argument("--packed", type=int, default=COMPARE_SEQUENCES,
                        help="sequences packed, as ilp_compare's --sequences (module docstring)")
    parser.add_argument("--imbalance-target", type=float, default=1.05)
    parser.add_argument("--seed", type=int, default=0)


def picked_sequences(args: argparse.Namespace) -> list[tuple[int, list[int]]]:
    """(number, doc lengths) of every picked sequence, in the order given.

    Exits with a message naming ``--sequences`` if a number is outside 1..``--packed``.
    """
    picked = [int(x) for x in args.sequences.split(",")]
    if not all(1 <= k <= args.packed for k in picked):
        raise SystemExit(f"--sequences: every number must be in [1, {args.packed}] (--packed), "
                         f"got {args.sequences}")
    sequences = pack_sequences(make_source(args.dataset), context_length=args.context,
                               num_sequences=args.packed, seed=args.seed)
    return [(k, sequences[k - 1]) for k in picked]
