"""The balance target as a contract: a plan within ``imbalance_target`` or one that says so.

Every strategy that takes the request's R (``flashcp``, ``flashcp_paper``, ``fcp`` inside
each group, ``auto`` through the flashcp layout it picks) returns a layout whose workload
imbalance is at most R, or one whose info carries ``imbalance_target_met: false`` and
``imbalance_reached`` (the most balanced imbalance the strategy found: the plan's
``metrics.imbalance`` for one group, the worst group's for several). The two fields are
added only where R is missed: a plan within R carries neither, so its bytes and plan_id
are those it had before the contract was written down.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

TARGET_MET = "imbalance_target_met"
"""Info field: False where the plan misses the request's R (absent where it meets it)."""
REACHED = "imbalance_reached"
"""Info field beside ``TARGET_MET``: the imbalance the plan reached (its worst group's)."""


def declared(info: Mapping[str, Any], imbalances: Iterable[float], target: float) -> dict[str, Any]:
    """``info``, plus the two fields where the worst of ``imbalances`` (one per group) is
    above ``target``. O(groups)."""
    worst = max(imbalances, default=1.0)
    if worst <= target:
        return dict(info)
    return {**info, TARGET_MET: False, REACHED: worst}


def missed(info: Mapping[str, Any]) -> float | None:
    """The imbalance a layout's info declares it reached above its R, None if it declares
    none (the layout meets R, or its strategy takes no R)."""
    if info.get(TARGET_MET) is False:
        return float(info[REACHED])
    return None
