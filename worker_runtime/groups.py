"""Process groups for the CP groups of multi-group (FCP) plans, created once and cached.

``torch.distributed.new_group`` must be called by every process of the default group,
in the same order, even by processes that are not members (the group name is a counter).
So every rank creates the groups of *all* of a plan's rank sets, in plan order, skipping
sets it created before. Collectives then run only inside a rank's own group: ranks
outside a group never call into it, so they never block on it.

Plan ranks are ranks of the parent process group passed to the runtime; they are mapped
to global ranks for ``new_group``. A plan with one group covering the whole parent group
uses the parent group itself and creates nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch.distributed as dist


class GroupCache:
    """Maps a rank set (ranks of ``parent``) to its process group; one cache per parent."""

    def __init__(self, parent: Any = None) -> None:
        self.parent = parent
        self._groups: dict[tuple[int, ...], Any] = {}
        self.created: list[tuple[int, ...]] = []
        """Rank sets in creation order (what every rank must agree on)."""

    def ensure(self, rank_sets: Sequence[Sequence[int]]) -> None:
        """Create the missing groups among ``rank_sets``, in the given order.

        Collective over the *default* group: every process calls it with the same sets.
        """
        size = dist.get_world_size(self.parent)
        for ranks in rank_sets:
            key = tuple(int(r) for r in ranks)
            if key in self._groups:
                continue
            if sorted(key) == list(range(size)):
                self._groups[key] = self.parent if self.parent is not None else dist.group.WORLD
                continue
            global_ranks = [dist.get_global_rank(self._parent_group(), r) for r in key]
            self._groups[key] = dist.new_group(global_ranks)
            self.created.append(key)

    def get(self, ranks: Sequence[int]) -> Any:
        """The process group of a rank set; raises RuntimeError if ``ensure`` never made it."""
        key = tuple(int(r) for r in ranks)
        try:
            return self._groups[key]
        except KeyError:
            raise RuntimeError(f"no process group for ranks {list(key)}; call ensure() first") from None

    def _parent_group(self) -> Any:
        return self.parent if self.parent is not None else dist.group.WORLD


_CACHES: dict[int, GroupCache] = {}


def group_cache(parent: Any = None) -> GroupCache:
    """The process-wide cache for ``parent`` (None: the default group)."""
    key = id(parent) if parent is not None else 0
    if key not in _CACHES:
        _CACHES[key] = GroupCache(parent)
    return _CACHES[key]


def clear_group_caches() -> None:
    """Forget cached groups (after ``destroy_process_group``)."""
    _CACHES.clear()
