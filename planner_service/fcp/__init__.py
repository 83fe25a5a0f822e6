"""Flexible Context Parallelism (FCP, arXiv:2602.21788): CP groups of any integer degree.

A batch of heterogeneous sequences is split into micro-batches; in each, stage 1 packs
sequences into atomic groups (Best-Fit-Decreasing into the memory headroom of long
sequences) and stage 2 picks every group's CP degree by the paper's 2D dynamic program
over a profiled cost model (equations 7 to 10).

This package is the algorithm alone: it imports only the core. The intra-group shard
plans come from other strategies: ``planner_service.solvers.fcp_schedule.schedule``
(a batch, ``POST /v1/schedule``) and the ``fcp`` strategy of one packed sequence
(``planner_service.solvers.fcp_strategy``).

Entry point: ``plan_global_batch`` (micro-batches, groups and degrees).
"""

from planner_service.fcp.cost_model import PROFILES, FcpProfile, get_profile, group_time
from planner_service.fcp.requests import FcpResult, MicroBatchSchedule, ScheduledGroup
from planner_service.fcp.schedule import GlobalSchedule, plan_global_batch

__all__ = [
    "PROFILES",
    "FcpProfile",
    "FcpResult",
    "GlobalSchedule",
    "MicroBatchSchedule",
    "ScheduledGroup",
    "get_profile",
    "group_time",
    "plan_global_batch",
]
