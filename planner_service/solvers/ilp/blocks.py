"""Blocks: the units the ILP places, and conversions between blocks and shards.

A doc of length L is cut at

- every multiple of the granularity g (the last block is shorter when g does not divide L);
- for the docs chosen to have one, every power of two below min(g, L) (a *geometric head*:
  blocks [0, 1), [1, 2), [2, 4), ..., [g/2, g));
- every cut position of a reference layout (the flashcp plan), if one is given.

Why the head: every rank must hold T = ceil(S / N) tokens or fewer (the shortfall is
explicit padding, N T - S tokens in all), which blocks of g tokens alone rarely allow.
Any count in [0, g] is a sum of head blocks, and a doc's head is the cheapest place to cut
it: the rank that takes [0, k) needs no KV, the rank keeping the rest receives k tokens,
and the head's workload is about k^2 / 2. The ILP gives heads to the longest docs and to
the docs the reference splits (``ilp.head_docs``): heads on every doc would multiply the
model's size for little gain. Why the reference cuts: the reference plan is then exactly
a block placement, so the model always has a solution (the hint).
"""

from __future__ import annotations

from collections.abc import Container, Iterable, Mapping, Sequence
from typing import NamedTuple

from planner_service.core.plan import Shard


class Blocks(NamedTuple):
    """The blocks of a packed sequence, ordered by (doc, start), and their per-doc runs."""

    blocks: tuple[Shard, ...]
    doc_runs: tuple[range, ...]
    """doc_runs[d]: indices into ``blocks`` of doc d's blocks, in position order."""


def cut_blocks(
    doc_lengths: Sequence[int],
    granularity: int,
    extra_cuts: Mapping[int, Iterable[int]] | None = None,
    head_docs: Container[int] | None = None,
) -> Blocks:
    """Cut every doc into blocks (module docstring); ``extra_cuts[d]`` are more cut positions
    of doc d (positions outside (0, L) are ignored); only docs in ``head_docs`` (all if
    None) get the geometric head."""
    assert granularity >= 1
    blocks: list[Shard] = []
    runs: list[range] = []
    for doc, length in enumerate(doc_lengths):
        cuts = set(range(granularity, length, granularity))
        power = 1 if head_docs is None or doc in head_docs else length
        while power < min(granularity, length):
            cuts.add(power)
            power *= 2
        if extra_cuts and doc in extra_cuts:
            cuts.update(c for c in extra_cuts[doc] if 0 < c < length)
        edges = [0, *sorted(cuts), length]
        first = len(blocks)
        blocks.extend(Shard(doc, a, b) for a, b in zip(edges, edges[1:], strict=False))
        runs.append(range(first, len(blocks)))
    return Blocks(tuple(blocks), tuple(runs))


def layout_cuts(shards_per_rank: Iterable[Iterable[Shard]]) -> dict[int, set[int]]:
    """Every shard boundary of a layout, per doc."""
    cuts: dict[int, set[int]] = {}
    for rank in shards_per_rank:
        for s in rank:
            cuts.setdefault(s.doc, set()).update((s.start, s.end))
    return cuts


def place_blocks(blocks: Blocks, shards_per_rank: Sequence[Iterable[Shard]]) -> list[int]:
    """The rank of every block under a layout whose cuts are all block edges.

    Raises ValueError if a block is not inside exactly one shard.
    """
    owner: list[int | None] = [None] * len(blocks.blocks)
    for rank, shards in enumerate(shards_per_rank):
        for s in shards:
            for b in blocks.doc_runs[s.doc]:
                block = blocks.blocks[b]
                if block.start >= s.start and block.end <= s.end:
                    if owner[b] is not None:
                        raise ValueError(f"block {block} is placed twice")
                    owner[b] = rank
                elif block.start < s.end and s.start < block.end:
                    raise ValueError(f"shard {s} cuts block {block}")
    missing = [blocks.blocks[b] for b, r in enumerate(owner) if r is None]
    if missing:
        raise ValueError(f"blocks {missing[:3]} are in no shard")
    return [r for r in owner if r is not None]


def block_shards(blocks: Blocks, ranks: Sequence[int], num_ranks: int) -> list[list[Shard]]:
    """Per-rank shards of a block placement (touching blocks merge in the plan builder)."""
    out: list[list[Shard]] = [[] for _ in range(num_ranks)]
    for block, rank in zip(blocks.blocks, ranks, strict=True):
        out[rank].append(block)
    return out
