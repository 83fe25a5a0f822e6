"""Plans every rank agrees on: fetch on one rank, broadcast the answer to the group.

Each rank asking the service itself can split a group: one rank gets the service's plan
while another, past its deadline, falls back to a local plan, and the runtime then stops
with CollectiveCheckError. Here only the source rank (``src``, a rank of ``group``) asks,
and what it ends up with (the service's plan, or its local fallback, or the error that
no planner accepts the input) is broadcast, so every rank runs the same plan or raises
the same error. One ``broadcast_object_list`` per plan, run one batch ahead on a
background thread; a plan that came through here needs no further check
(``ContextParallelAttention(..., agreed=True)``).

torch is imported inside the calls, so importing this module (and the planner service,
which never needs it) does not load torch. Without torch.distributed initialised the
source is the only rank and nothing is broadcast.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Generic, Protocol, TypeVar

from planner_service.client.global_batch import GlobalSchedule
from planner_service.client.prefetch import ClientPlan
from planner_service.core.plan import Plan
from planner_service.core.solved import SolvedPlan

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)
MIN_GET_TIMEOUT_S = 0.001
"""After the service's budget: take its plan if in, else the fallback without waiting."""


class AgreementError(RuntimeError):
    """The source rank could not produce a plan; raised on every rank with its message."""


class PlanSource(Protocol[T_co]):
    """What the source rank plans with: PlanClient (one sequence per batch) or
    ScheduleClient (global batches, ``doc_lengths`` being its list of sequences)."""

    def prefetch(self, batch_id: Any, doc_lengths: Any, /) -> None: ...

    def get(self, batch_id: Any, timeout: float | None = None, doc_lengths: Any = None, /
            ) -> T_co: ...

    def wait(self, batch_id: Any, timeout: float, /) -> bool: ...

    @property
    def timeout_s(self) -> float: ...


def group_rank(group: Any = None) -> int:
    """This process's rank in ``group`` (0 without torch.distributed)."""
    import torch.distributed as dist

    return dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0


def agree_on(produce: Callable[[], T] | None, *, encode: Callable[[T], Any],
             decode: Callable[[Any], T], group: Any = None, src: int = 0) -> T:
    """Run ``produce()`` on rank ``src`` of ``group`` and give its value to every rank.

    ``encode`` turns the value into a small picklable payload for the broadcast and
    ``decode`` turns it back on the other ranks (``src`` keeps its own value). Collective:
    every rank of ``group`` must call it. If ``produce`` raises on ``src``, the error is
    broadcast instead: ``src`` re-raises its own exception, the others raise
    AgreementError with its text, so no rank is left waiting.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        if produce is None:
            raise ValueError("agree_on: the source rank must pass produce")
        return produce()
    me = dist.get_rank(group)
    value: T | None = None
    error: BaseException | None = None
    payload: list[Any] = [None]
    if me == src:
        if produce is None:
            raise ValueError("agree_on: the source rank must pass produce")
        try:
            value = produce()
            payload[0] = ("ok", encode(value))
        except Exception as exc:  # noqa: BLE001 - every rank must hear of it
            error = exc
            payload[0] = ("error", f"{type(exc).__name__}: {exc}")
    dist.broadcast_object_list(payload, group=group, group_src=src)
    kind, body = payload[0]
    if me == src:
        if error is not None:
            raise error
        return value  # type: ignore[return-value]
    if kind == "error":
        raise AgreementError(f"rank {src} (the planning rank) failed: {body}")
    return decode(body)


def _encode_plan(plan: ClientPlan) -> tuple[str, str, bool, str | None, float]:
    return plan.plan_json, plan.source, plan.fallback, plan.reason, plan.solve_ms


def _decode_plan(body: tuple[str, str, bool, str | None, float]) -> ClientPlan:
    plan_json, source, fallback, reason, solve_ms = body
    plan = Plan.from_json(plan_json)
    return ClientPlan(SolvedPlan(plan_json, plan.plan_id, plan.strategy, solve_ms, plan=plan),
                      source, fallback, reason)


class PlanAgreement(Generic[T]):
    """One-batch-ahead planning for a group of ranks that must all run the same plan.

    ``client`` plans on the source rank (a PlanClient, any back end); other ranks may
    pass None. Every rank calls ``prefetch`` and ``get`` with the same batch ids in the
    same order (they are collective over ``group``). ``prefetch`` returns at once: on a
    background thread the source waits for its client's plan (at most the client's
    timeout, then its local fallback) and broadcasts it, while the step trains; ``get``
    then usually finds the plan agreed already. It returns the same ClientPlan (plan,
    source, fallback flag, reason) on every rank. ``encode``/``decode`` turn the client's
    answer into the broadcast payload and back (see ``schedule_agreement`` for FCP).

    The broadcasts run on that one thread in call order, so ``group`` must be a group no
    other thread uses at the same time: a gloo group of its own (``dist.new_group(ranks,
    backend="gloo")``), which also keeps them off an NCCL training stream.
    """

    def __init__(self, client: PlanSource[T] | None, *, group: Any = None, src: int = 0,
                 timeout: float | None = None,
                 encode: Callable[[T], Any] = _encode_plan,  # type: ignore[assignment]
                 decode: Callable[[Any], T] = _decode_plan,  # type: ignore[assignment]
                 ) -> None:
        self.client = client
        self.encode, self.decode = encode, decode
        self.group = group
        self.src = src
        self.timeout = timeout
        self.is_src = group_rank(group) == src
        if self.is_src and client is None:
            raise ValueError(f"PlanAgreement: rank {src} (src) needs a client")
        self._worker = ThreadPoolExecutor(1, "plan-agreement")
        self._pending: dict[str, Future[T]] = {}

    def prefetch(self, batch_id: Any, doc_lengths: Any, *, timeout: float | None = None
                 ) -> None:
        """Start planning and agreeing on a batch in the background; returns at once.
        ``timeout``: how long after this call the source waits for the service before
        its fallback (default: the agreement's, else the client's ``timeout_s``). Only the
        source uses ``doc_lengths``."""
        key = str(batch_id)
        if key in self._pending:
            return
        budget = None
        if self.is_src:
            assert self.client is not None
            self.client.prefetch(batch_id, doc_lengths)
            budget = timeout if timeout is not None else self.timeout
            budget = self.client.timeout_s if budget is None else budget
        self._pending[key] = self._worker.submit(self._agree, batch_id, None, budget)

    def get(self, batch_id: Any, timeout: float | None = None,
            doc_lengths: Any = None) -> T:
        """The batch's plan on every rank (the source's service plan or its fallback).

        A batch not prefetched is planned now (``timeout`` and ``doc_lengths`` apply to
        it). Raises on every rank when the source cannot plan (ServiceError there,
        AgreementError elsewhere).
        """
        future = self._pending.pop(str(batch_id), None)
        if future is None:
            future = self._worker.submit(self._agree, batch_id, doc_lengths, None,
                                         timeout)
        return future.result()

    def close(self) -> None:
        self._worker.shutdown(wait=True, cancel_futures=False)

    def _agree(self, batch_id: Any, doc_lengths: Any, budget: float | None,
               timeout: float | None = None) -> T:
        """Prefetched (``budget`` set on the source): give the service its whole budget,
        then take its answer or, at once, the fallback. The wait does not consume the
        batch, so a service back after an outage is seen (a client that already holds a
        fallback would otherwise return it at once and never hear the answer)."""
        client = self.client

        def produce() -> T:
            assert client is not None
            if budget is None:
                return client.get(batch_id, timeout, doc_lengths)
            client.wait(batch_id, budget)
            return client.get(batch_id, MIN_GET_TIMEOUT_S, doc_lengths)

        return agree_on(produce if self.is_src else None, encode=self.encode,
                        decode=self.decode, group=self.group, src=self.src)


def _decode_schedule(body: tuple[Any, ...]) -> GlobalSchedule:
    return GlobalSchedule(*body)


def schedule_agreement(client: PlanSource[GlobalSchedule] | None, *, group: Any = None,
                       src: int = 0, timeout: float | None = None
                       ) -> PlanAgreement[GlobalSchedule]:
    """PlanAgreement for FCP schedules of global batches (ScheduleClient on ``src``)."""
    return PlanAgreement(client, group=group, src=src, timeout=timeout, encode=tuple,
                         decode=_decode_schedule)
