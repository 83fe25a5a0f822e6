"""What a request may cost, known before it is queued: its lane and its plan's size.

Every request is priced here from its fields alone (no solver runs, no plan is built), in
O(documents) time, before the executor admits it:

- **lane** (``fast`` or ``slow``): the strategies whose solve is linear or a heuristic
  (the baselines, flashcp, flashcp_paper) and ``auto`` run in the fast lane while their
  work (documents x ranks) is at most PLANNER_FAST_LANE_MAX_WORK; the search strategies
  (``ilp``, ``fcp``), FCP schedules and larger heuristic requests run in the slow lane.
  The executor reserves PLANNER_FAST_WORKERS solver processes for the fast lane, so a
  cheap plan never waits behind a slow one (executor.py, pool.py).
- **plan bytes**: an upper bound on the plan's canonical JSON for the strategies whose
  shard count follows from the request (``per_doc`` and ``zigzag``: every doc in
  min(length, 2N) chunks; ``llama3``: at most K + 2N shards; ``ring``: K + N). A request
  whose bound is above PLANNER_MAX_PLAN_BYTES is refused (422, ``cp_size``) instead of
  solved. The other strategies make few shards per doc (whole docs, and cuts only of
  the docs no rank can hold); their plans are checked against the same limit after the
  solve (worker_tasks.solve_in_worker), which the work bound PLANNER_MAX_SHARDS keeps short.
- **ring size**: a ``p2p_ring`` plan is priced only up to ``step_time.runs.MAX_RING_PAIRS``
  (shard, other holder of its doc) pairs. ``per_doc`` and ``zigzag`` place the tokens of a
  doc of length L on exactly min(L, N) ranks (``solvers.common.zigzag_doc_shards``), each
  holding at least one shard of it, so their pairs are at least the sum over docs of
  m (m - 1), m = min(L, N): a request whose floor is above the limit is refused (422,
  ``comm_mode``) as the solve would be, before it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from planner_service.core.errors import FieldError
from planner_service.core.step_time.runs import MAX_RING_PAIRS
from planner_service.service.lanes import FAST, SLOW

LANES = (FAST, SLOW)

FAST_STRATEGIES = frozenset({"llama3", "ring", "per_doc", "zigzag", "flashcp",
                             "flashcp_paper", "auto"})
"""Strategies that may run in the fast lane (within PLANNER_FAST_LANE_MAX_WORK)."""

SHARD_JSON_BYTES = len('{"doc":,"end":,"start":},')
"""Bytes of one shard's JSON besides its three numbers (Group.to_dict, canonical JSON)."""
RANK_JSON_BYTES = 512
"""Bytes a rank adds to a plan besides its shards: its padding, rank_stats entries and
list brackets (five integers of at most 20 digits, with separators, rounded up)."""
PLAN_JSON_BYTES = 8192
"""Bytes of a plan's fixed fields: metrics, model, info and names (rounded up)."""


class Cost(NamedTuple):
    """The price of one request, computed before it is queued."""

    lane: str
    """``fast`` or ``slow`` (module docstring)."""
    work: int
    """Documents x ranks: the size every strategy's stated complexity grows with."""
    plan_bytes: int | None
    """Upper bound on the plan's JSON bytes; None where the strategy gives none."""


def _digits(value: int) -> int:
    return len(str(value))


def chunked_shards(doc_lengths: Sequence[int], pieces: int) -> list[int]:
    """Per doc, the most shards a cut into ``pieces`` equal chunks makes: min(length,
    pieces) (a chunk is at least one token; empty chunks are no shards)."""
    return [min(length, pieces) for length in doc_lengths]


def plan_bytes_bound(strategy: str, doc_lengths: Sequence[int], ranks: int) -> int | None:
    """Upper bound on the JSON bytes of ``strategy``'s plan, or None if it has none
    (module docstring). O(documents)."""
    k = len(doc_lengths)
    fixed = PLAN_JSON_BYTES + ranks * RANK_JSON_BYTES + k * (_digits(max(doc_lengths)) + 1)
    if strategy in ("per_doc", "zigzag"):
        shards = chunked_shards(doc_lengths, 2 * ranks)
        body = sum(count * (SHARD_JSON_BYTES + _digits(doc) + 2 * _digits(length))
                   for doc, (count, length) in enumerate(zip(shards, doc_lengths, strict=True)))
        return fixed + body
    if strategy in ("llama3", "ring"):
        count = k + (2 * ranks if strategy == "llama3" else ranks)
        each = SHARD_JSON_BYTES + _digits(k) + 2 * _digits(max(doc_lengths))
        return fixed + count * each
    return None


def request_cost(strategy: str, doc_lengths: Sequence[int], ranks: int,
                 fast_lane_max_work: int) -> Cost:
    """The lane, work and plan-byte bound of a plan request. O(documents)."""
    work = len(doc_lengths) * ranks
    lane = FAST if strategy in FAST_STRATEGIES and work <= fast_lane_max_work else SLOW
    return Cost(lane, work, plan_bytes_bound(strategy, doc_lengths, ranks))


def check_plan_bytes(cost: Cost, max_plan_bytes: int, field: str = "cp_size") -> None:
    """Refuse a request whose plan would be larger than PLANNER_MAX_PLAN_BYTES; raises
    FieldError naming ``field`` and the limit."""
    if cost.plan_bytes is not None and cost.plan_bytes > max_plan_bytes:
        raise FieldError(field, f"{field}: the plan would be up to {cost.plan_bytes} bytes of "
                         f"JSON, above the limit {max_plan_bytes} (PLANNER_MAX_PLAN_BYTES); "
                         "use fewer ranks or documents, or a strategy that splits fewer "
                         "documents")


def ring_pairs_floor(strategy: str, doc_lengths: Sequence[int], ranks: int) -> int:
    """A lower bound on the ring pairs of ``strategy``'s plan (module docstring): the
    sum of m (m - 1), m = min(L, N), for ``per_doc`` and ``zigzag``; 0 for the others.
    O(documents)."""
    if strategy not in ("per_doc", "zigzag"):
        return 0
    return sum(min(length, ranks) * (min(length, ranks) - 1) for length in doc_lengths)


def check_ring_floor(strategy: str, doc_lengths: Sequence[int], ranks: int,
                     comm_mode: str) -> None:
    """Refuse a ``p2p_ring`` request whose plan is surely too large to price (the refusal
    its solve would end in, before it); raises FieldError naming ``comm_mode``."""
    if comm_mode != "p2p_ring":
        return
    floor = ring_pairs_floor(strategy, doc_lengths, ranks)
    if floor > MAX_RING_PAIRS:
        raise FieldError(
            "comm_mode",
            f"comm_mode: the ring of a p2p_ring plan is modelled for at most {MAX_RING_PAIRS} "
            f"(shard, other holder of its doc) pairs per group (MAX_RING_PAIRS), this "
            f"{strategy} plan would have at least {floor}; use fewer ranks or another comm_mode")
