"""flashcp's nested zigzag: chunks checked position by position against their limits."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from planner_service.core.plan import Shard
from planner_service.solvers.flashcp.nested import Role, nested_chunks, nested_zigzag
from planner_service.solvers.flashcp.ranks import Ranks


def need(positions: set[int]) -> int:
    """KV a rank needs for one doc it holds at these positions: the prefix up to its
    highest position, minus what it holds (token by token)."""
    return max(positions) + 1 - len(positions) if positions else 0


def work(positions: set[int]) -> int:
    return sum(p + 1 for p in positions)  # query p attends p + 1 keys


@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.data())
def test_nested_chunks_cover_the_doc_once_within_every_roles_limits(data):
    length = data.draw(st.integers(2, 300))
    roles = [Role(data.draw(st.integers(0, 300)), data.draw(st.integers(-50, 40000)),
                  data.draw(st.integers(0, 150)))
             for _ in range(data.draw(st.integers(2, 4)))]
    density = data.draw(st.sampled_from([0.0, 3.5, 40.0, 150.0]))
    bound = data.draw(st.integers(0, 500))
    chunks = nested_chunks(length, roles, bound, density)
    if chunks is None:
        return
    assert len(chunks) <= len(roles)
    held = [{p for a, b in pair for p in range(a, b)} for pair in chunks]
    assert sorted(p for positions in held for p in positions) == list(range(length))
    for role, positions in zip(roles, held, strict=False):  # inner roles may take nothing
        assert len(positions) <= role.room
        assert work(positions) - density * len(positions) <= role.budget + 1e-6
        assert role.need + need(positions) <= bound


def test_nested_chunks_meet_a_bound_the_equal_zigzag_misses():
    # One doc of 1200 tokens over 3 ranks with room 600 each and no other docs: the equal
    # zigzag's outer rank holds [0, 200) and [1000, 1200) and needs 800 of the prefix.
    # Nested chunks with the outer rank holding a longer low chunk need less.
    roles = [Role(600, 1e12, 0) for _ in range(3)]
    chunks = nested_chunks(1200, roles, 700, 0.0)
    assert chunks is not None
    assert max(need({p for a, b in pair for p in range(a, b)}) for pair in chunks) <= 700


@settings(max_examples=100, deadline=None, derandomize=True)
@given(st.data())
def test_nested_zigzag_places_every_position_once_within_the_rooms(data):
    n = data.draw(st.integers(2, 5))
    ranks = Ranks(n, 400)
    for r in range(n):  # some docs already placed, whole
        size = data.draw(st.integers(0, 150))
        if size:
            ranks.add(r, 100 + r, 0, size)
    length = data.draw(st.integers(2, sum(400 - t for t in ranks.tokens)))
    allowed = data.draw(st.sampled_from([1e4, 1e5, 1e6]))
    before = [list(shards) for shards in ranks.shards]
    placed = nested_zigzag(ranks, 0, length, allowed, data.draw(st.sampled_from([0.0, 50.0])))
    mine = [[s for s in shards if s.doc == 0] for shards in ranks.shards]
    if not placed:
        assert ranks.shards == before
        return
    assert sorted(p for shards in mine for s in shards for p in range(s.start, s.end)) == list(range(length))
    assert all(t <= 400 for t in ranks.tokens)
    assert [[s for s in shards if s.doc != 0] for shards in ranks.shards] == before
    assert all(isinstance(s, Shard) for shards in mine for s in shards)
