"""Flexible Context Parallelism (FCP, arXiv:2602.21788): CP groups of any integer degree.

A batch of heterogeneous sequences is split into micro-batches; in each, stage 1 packs
sequences into atomic groups (Best-Fit-Decreasing into the memory headroom of long
sequences) and stage 2 picks every group's CP degree by the paper's 2D dynamic program
over a profiled cost model (equations 7 to 10); each group then gets an intra-group
shard plan from an ordinary strategy (flashcp by default, zigzag for the paper's ring).

Entry points: ``schedule(ScheduleRequest) -> FcpResult`` and ``plan_global_batch``.
"""

from planner_service.fcp.cost_model import PROFILES, FcpProfile, get_profile, group_time
from planner_service.fcp.requests import (
    FcpResult,
    MicroBatchSchedule,
    ScheduledGroup,
    ScheduleRequest,
)
from planner_service.fcp.schedule import GlobalSchedule, plan_global_batch, schedule

__all__ = [
    "PROFILES",
    "FcpProfile",
    "FcpResult",
    "GlobalSchedule",
    "MicroBatchSchedule",
    "ScheduleRequest",
    "ScheduledGroup",
    "get_profile",
    "group_time",
    "plan_global_batch",
    "schedule",
]
