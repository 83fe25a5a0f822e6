"""Strategy ``flashcp`` under an attention mask that is not causal in every layer.

flashcp's passes balance causal work; a windowed layer's work is nearly linear in tokens
once documents exceed the window, so the plan that balances the causal work is not the
one that balances the layer-weighted work ``sum_g count_g work_g`` (core/window_work.py),
and its exchange is priced by prefixes where a windowed layer moves only halos. Here the
layouts of a fixed candidate list are priced under the request's mask and the best by
the weighted objective wins:

1. ``flashcp``: the causal plan at the request's R and exchange (``flashcp_bounded``:
   with ``max_kv_tokens_per_rank``, its own bounded candidates);
2. ``contiguous_halo``: N contiguous equal-token ranges (the halo baseline);
3. ``weighted_contiguous``: N contiguous ranges within R on the weighted work whose
   largest cut position inside a document is least (``contiguous_halo.weighted_cuts``),
   no rank holding more than R times the even token share (a work-balanced cut of a
   long document gives its cheap first part to few ranks: unbounded, the padding would
   reach several times the tokens, and every rank runs its linear layers on it);
4. ``chunks <k>``: the packed sequence in k N equal-token chunks, k per rank, placed by
   LPT on the weighted work (``contiguous_halo.chunk_ranks``), k = 2, 4, .. ``MAX_CHUNKS``
   in turn while none of the above meets R (more chunks balance better and move more
   halos);
5. ``flashcp repaired``: where flashcp's plan misses R on the weighted work, the same
   plan with shard tails moved from the heaviest ranks to the lightest until it meets R
   (``weighted_repair``: at most ``MAX_MOVES`` moves, none past ``MAX_SHARDS`` shards,
   no rank above R times the even token share or flashcp's own fullest rank). It often
   keeps flashcp's exchange, but a chunked layout can move less, so the chunks run as
   if it were not there;
6. ``flashcp R=<r>`` at each tighter causal target of ``TIGHTER``, then ``per_doc`` (up
   to ``PER_DOC_CHUNKS`` chunks), tried in order only while no candidate meets R on the
   weighted work.

Objective: among the candidates whose layer-weighted imbalance is at most R, the least
layer-weighted critical-path exchange in the request's mode (``MaskFigures.comm_tokens``:
``sum_g count_g max_i recv_g[i]``), ties by imbalance then list order; if none meets R,
the most balanced (the info then declares the miss, ``balance.declared``). With a KV
bound a candidate over it is left out (the mask's peak is its causal layer's: a window's
receive is within the causal prefix). The plan's info names the choice
(``mask_candidate``) and every candidate's figures (``mask_candidates``: weighted
imbalance, weighted exchange, tokens on the fullest rank).

Cost: one flashcp solve priced in O(s log s + G s) for s shards and G windows
(``window_work.alltoallv_figures_of``; other modes ``mask_figures_of``), its repair
(``weighted_repair``'s bound) priced the same way where it misses R; the contiguous
and chunk candidates in closed form on their cuts (O(D G + N log S (log D + G)) and
O(k N (log N + log D + G)) for D documents, S tokens), only the chosen one built; the
tighter flashcp solves and per_doc (O(D N)) only when none of those meets R.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import replace
from functools import partial
from typing import NamedTuple

from planner_service.core import cost
from planner_service.core import window_work as ww
from planner_service.core.build import Layout, canonical_group
from planner_service.core.cost import imbalance
from planner_service.core.metrics import int_arrays
from planner_service.core.request import PlanRequest
from planner_service.solvers.balance import declared
from planner_service.solvers.baselines import per_doc_layout
from planner_service.solvers.contiguous_halo import (
    WeightedPrefix,
    chunk_ranks,
    chunked_figures,
    chunked_layout,
    contiguous_figures,
    contiguous_layout,
    range_bounds,
    weighted_cuts,
)
from planner_service.solvers.flashcp import flashcp_layout
from planner_service.solvers.kv_bound import layout_peak, listed
from planner_service.solvers.weighted_repair import repaired_layout

MAX_CHUNKS = 32
"""Most equal-token chunks per rank tried (``chunked_layout``: 2, 4, .. MAX_CHUNKS)."""
TIGHTER = (0.5, 0.25)
"""Causal targets tried below R, as shares of R's slack (R = 1.05: 1.025, 1.0125)."""
PER_DOC_CHUNKS = 1 << 18
"""Most chunks (2 N a document) of the ``per_doc`` fallback: its layout and price take
O(D N), more than all the other candidates together on many documents, where documents
shorter than 2 N tokens leave it unbalanced anyway."""


class Priced(NamedTuple):
    """A candidate layout's figures under the mask."""

    name: str
    layout: Layout | None
    """None for a contiguous candidate priced on its cuts (built only if chosen)."""
    imbalance: float
    """Layer-weighted imbalance over all grouped ranks."""
    comm_tokens: int
    """Layer-weighted critical-path exchange, the worst group's."""
    tokens: int
    """Tokens on the fullest rank (the plan pads every rank of its group to it)."""
    work: tuple[int, ...] = ()
    """Per grouped rank, the layer-weighted work (empty for a closed-form candidate)."""


def price(name: str, layout: Layout, request: PlanRequest, mode: str) -> Priced:
    """``layout`` under the request's mask in ``mode``. O(G s log s); under all-to-all-v
    the shards as given, one sort for all windows (``window_work.alltoallv_figures_of``)."""
    work: list[int] = []
    comm = most = 0
    for group in layout.groups:
        arrays = cost.shard_arrays([list(rank) for rank in group.shards]) \
            if mode == "alltoallv" else None
        if arrays is not None:
            loads, group_comm = ww.alltoallv_figures_of(arrays, request.mask)
            tokens = int(cost.per_rank_sums(arrays.end - arrays.start, arrays.bounds).max(
                initial=0))
        else:
            shards, arrays = canonical_group([list(rank) for rank in group.shards])
            if arrays is None:
                arrays = int_arrays(shards)
            tokens = max(sum(s.end - s.start for s in rank) for rank in shards)
            figures = ww.mask_figures_of(arrays, request.mask, comm_mode=mode,
                                         tokens_per_rank=tokens)
            loads, group_comm = figures.workload, figures.comm_tokens
        work += loads
        comm = max(comm, group_comm)
        most = max(most, tokens)
    return Priced(name, layout, imbalance(work), comm, most, tuple(work))


def group_imbalances(layout: Layout, request: PlanRequest) -> list[float]:
    """Each group's layer-weighted imbalance under the request's mask. O(G s log s)."""
    mode = request.comm_mode or "alltoallv"
    return [price("", Layout([group], {}), request, mode).imbalance for group in layout.groups]


def redeclared(layout: Layout, request: PlanRequest) -> Layout:
    """A layout of a strategy that balances causal work (flashcp_paper, ilp, fcp), its
    ``balance.declared`` fields recomputed from the layer-weighted work under the
    request's mask, so a plan whose weighted imbalance misses R says so (and one that
    meets it carries neither field). O(G s log s)."""
    info = {k: v for k, v in layout.info.items()
            if k not in ("imbalance_target_met", "imbalance_reached")}
    return Layout(layout.groups, declared(info, group_imbalances(layout, request),
                                          request.imbalance_target))


def masked_flashcp_layout(doc_lengths: Sequence[int], request: PlanRequest,
                          base: Callable[[Sequence[int], PlanRequest], Layout]) -> Layout:
    """The candidate with the best weighted objective (module docstring); ``base`` is
    flashcp's causal strategy (``flashcp_bounded.bounded_flashcp_layout``)."""
    mode = request.comm_mode or "alltoallv"
    target = request.imbalance_target
    bound = request.max_kv_tokens_per_rank
    slack = target - 1.0
    priced: list[Priced] = []

    def candidate(name: str, make: Callable[[], Layout | None]) -> Priced | None:
        made = make()
        if made is None:
            return None
        layout = listed(made)
        if bound is not None and layout_peak(layout, mode) > bound:
            return None
        return price(name, layout, request, mode)

    def attempt(name: str, make: Callable[[], Layout | None]) -> None:
        p = candidate(name, make)
        if p is not None:
            priced.append(p)

    def met() -> bool:
        return any(p.imbalance <= target for p in priced)

    def causal_at(r: float) -> Callable[[], Layout]:
        return lambda: flashcp_layout(doc_lengths, replace(request, imbalance_target=r))

    causal = listed(base(doc_lengths, request))
    priced.append(price("flashcp", causal, request, mode))
    prefix = WeightedPrefix(doc_lengths, request.mask)
    total, n = prefix.offsets[-1], request.cp_size
    padded = math.floor(target * -(-total // n)) if n else 0
    # Priced now, listed after the chunks: they run as if it were not there.
    repaired = None if met() else candidate("flashcp repaired", lambda: repaired_layout(
        causal, priced[0].work, prefix, request.mask, target, max(padded, priced[0].tokens)))
    built: dict[str, Callable[[], Layout]] = {}

    def closed(name: str, figures: tuple[float, int], most: int,
               make: Callable[[], Layout]) -> None:
        priced.append(Priced(name, None, figures[0], figures[1], most))
        built[name] = make

    # Under all-to-all-v without a KV bound the contiguous and chunked candidates are
    # priced in closed form and only the chosen one is built.
    fast = mode == "alltoallv" and bound is None
    for name, cuts in (("contiguous_halo", range_bounds(total, n)),
                       ("weighted_contiguous", weighted_cuts(prefix, n, target, padded))):
        if not cuts:
            continue
        make = partial(contiguous_layout, doc_lengths, cuts)
        if fast:
            closed(name, contiguous_figures(prefix, cuts, request.mask),
                   max(b - a for a, b in zip(cuts, cuts[1:], strict=False)), make)
        else:
            attempt(name, make)
    per_rank = 2
    while not met() and per_rank <= MAX_CHUNKS and per_rank * n <= total:
        chunks = chunk_ranks(prefix, n, per_rank)
        make = partial(chunked_layout, doc_lengths, chunks)
        if fast:
            imb, comm, most = chunked_figures(prefix, chunks, request.mask)
            closed(f"chunks {per_rank}", (imb, comm), most, make)
        else:
            attempt(f"chunks {per_rank}", make)
        per_rank *= 2
    if repaired is not None:
        priced.append(repaired)
    if not met():
        for share in TIGHTER:
            r = 1.0 + share * slack
            attempt(f"flashcp R={r:g}", causal_at(r))
            if met():
                break
        if not met() and 2 * len(doc_lengths) * n <= PER_DOC_CHUNKS:
            attempt("per_doc", lambda: per_doc_layout(doc_lengths, request))
    within = [p for p in priced if p.imbalance <= target]
    if within:
        best = min(within, key=lambda p: (p.comm_tokens, p.imbalance))
    else:
        best = min(priced, key=lambda p: p.imbalance)
    layout = best.layout or built[best.name]()
    info = {k: v for k, v in layout.info.items()
            if k not in ("imbalance_target_met", "imbalance_reached")}
    info.update({
        "imbalance_target": target,
        "objective": mode,
        "mask_candidate": best.name,
        "mask_candidates": [{"candidate": p.name, "weighted_imbalance": p.imbalance,
                             "weighted_comm_tokens": p.comm_tokens, "max_tokens": p.tokens}
                            for p in priced],
    })
    return Layout(layout.groups, declared(info, (best.imbalance,), target))
