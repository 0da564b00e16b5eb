"""The daemon's planning worker: trace → steady iteration → plan → checked PlanUpdate → stream.

Runs on one worker thread of the daemon, never on a request thread: a session
that marks `plan_after_iterations` iterations is queued once. The worker
extracts its steady iteration and plans it as `tidalpool simulate` does
(`tidalplan.combined`): under the session's swap limit, the swap schedule of
tidalpool's search, swaps only (its executor does not rebuild blocks), split
into the device pieces it leaves and placed, made for lower limits until the
footprint fits (`combined.fit`); without one, every block placed whole
(`combined.unlimited`). The plan is written as a PlanUpdate (`tidalplan.wire`),
then that update as a whole is checked again by `wire.check` (schedule
simulated and validated, placement validated over its pieces) before it is
cached and sent:

    iteration ──▶ cache (signature, limit, bandwidth, version) ──▶ wire.check ──┬──▶ stream
        │            none there, or its check refuses it                        │
        └──▶ fit / unlimited ──▶ wire.encode ──▶ wire.check ──▶ cache ──────────┘

A plan that does not fit the limit is not sent: the session keeps swapping by
its LRU cache. A cached plan is checked the same way before it is used.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tidalcore.units import ALIGNMENT
from tidalcore.v1 import pool_pb2
from tidalplan.model import Iteration, SwapPlan

from tidalpoold import plan_cache
from tidalpoold.plan_cache import PlanCache
from tidalpoold.sessions import PlanFootprint, Session
from tidalpoold.settings import Settings

if TYPE_CHECKING:
    from tidalplan.combined import Combined

    from tidalpoold.backends import Backend

log = logging.getLogger("tidalpoold.planning")

DEFAULT_COPY_GBPS = 12.0
"""Bandwidth the swap planner assumes for a session whose copies are not throttled (PCIe 3 x16),
where the backend measured none."""


def copy_gbps_of(backend: Backend) -> float:
    """The bandwidth to plan unthrottled sessions' swaps at: the slower direction the backend
    measured (the cuda backend's `h2d_gbps` and `d2h_gbps` facts), else DEFAULT_COPY_GBPS
    (sim, or a cuda backend whose probe was skipped)."""
    facts = backend.facts()
    try:
        slowest = min(float(facts["h2d_gbps"]), float(facts["d2h_gbps"]))
    except (KeyError, ValueError):
        return DEFAULT_COPY_GBPS
    return slowest if math.isfinite(slowest) and slowest > 0 else DEFAULT_COPY_GBPS


@dataclass(frozen=True, slots=True)
class Planned:
    """A plan ready to send: the update, what `wire.check` found in it, and where it came
    from ("cache", or the solver that placed it)."""

    update: pool_pb2.PlanUpdate
    checked: Combined
    source: str


@dataclass(frozen=True, slots=True)
class Unfit:
    """No schedule tried left a placement within the limit: nothing to send."""

    footprint: int | None  # of the schedule made for the limit itself; None: infeasible
    limit: int
    planned_for: int  # the lowest limit a schedule was made for
    rounds: int


def _import_planner() -> None:
    """Import the planner's modules (a few tenths of a second) on the worker thread, so that
    a session's first plan does not wait for them."""
    from tidalplan import combined, wire

    del combined, wire


class PlanWorker:
    """Queues sessions for planning and runs the pure planner on one worker thread."""

    def __init__(
        self,
        settings: Settings,
        copy_gbps: float = DEFAULT_COPY_GBPS,
        on_planned: Callable[[str, float], None] | None = None,
    ) -> None:
        """`on_planned(outcome, seconds)` is told of every plan sent: "cached" or "solved",
        and the seconds it took from the trace to the stream (the daemon's metrics)."""
        self.settings = settings
        self.copy_gbps = copy_gbps  # for sessions whose copies are not throttled
        self.on_planned = on_planned
        self.cache = PlanCache(settings.plan_cache_dir)
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="planner")
        self._worker.submit(_import_planner)  # off the start, before the first plan needs it
        self._queued: set[str] = set()
        self._lock = threading.Lock()
        self._next_plan_id = 1
        self.plans_made = 0
        self.plans_cached = 0
        self.plans_failed = 0
        self.plans_unfit = 0  # swap plans whose placement did not fit the limit: not sent

    def on_step(self, session: Session) -> None:
        """Called after each step mark; queues the session once it has enough iterations."""
        after = self.settings.plan_after_iterations
        if not after or session.trace.iterations_seen < after:
            return
        with self._lock:
            if session.id in self._queued:
                return
            self._queued.add(session.id)
        self._worker.submit(self._plan_quietly, session)

    def swap_gbps(self, session: Session) -> float:
        """The copy bandwidth a session's swaps are planned at: its own throttle, else the
        backend's measured one."""
        return session.copy_gbps or self.copy_gbps

    def close(self) -> None:
        self._worker.shutdown(wait=False, cancel_futures=True)

    def _plan_quietly(self, session: Session) -> None:
        try:
            self.plan(session)
        except Exception as e:  # a plan that fails leaves the session learning, nothing more
            self.plans_failed += 1
            log.warning(
                "plan.failed", extra={"session": session.id, "why": f"{type(e).__name__}: {e}"}
            )

    def make(self, iteration: Iteration, swap_limit: int, gbps: float) -> Planned | Unfit:
        """The checked plan of `iteration` for `swap_limit` (0: none) with copies at `gbps`:
        from the cache when a plan made for the same is there and passes `wire.check`, else
        planned, encoded, checked and cached. Unfit when a swap plan does not fit."""
        from tidalplan import combined, wire
        from tidalplan.learn import signature

        name = plan_cache.key(signature(iteration), swap_limit, gbps, wire.VERSION)
        cached = self.cache.get(name)
        if cached is not None:
            try:
                return Planned(cached, wire.check(iteration, cached), "cache")
            except ValueError as e:  # InvalidPlacement and InvalidSwapPlan too
                log.warning("plan.cache_invalid", extra={"key": name, "why": str(e)})
        time_limit_s = self.settings.plan_time_limit_s
        if swap_limit:
            plan = combined.fit(
                iteration, _swaps_on_ops, swap_limit, gbps, gbps, time_limit_s=time_limit_s
            )
            if not plan.fits:
                return Unfit(plan.footprint, swap_limit, int(plan.planned_for), plan.rounds)
        else:
            plan = combined.unlimited(iteration, gbps, gbps, time_limit_s=time_limit_s)
        update = wire.encode(iteration, plan, gbps)
        checked = wire.check(iteration, update)  # the whole plan, as it will be sent
        self.cache.put(name, update)
        assert plan.combined is not None  # it fits
        return Planned(update, checked, plan.combined.placement.solver)

    def plan(self, session: Session) -> pool_pb2.PlanUpdate | None:
        """Plan `session`'s steady iteration and put the plan on its stream; None (and the
        session keeps learning) when its swap plan does not fit its limit."""
        from tidalcore.events import Events
        from tidalplan.learn import extract, to_problem
        from tidalplan.placement import lower_bound

        started = time.perf_counter()
        trace = session.trace
        events = Events.concat(list(trace.chunks), dict(trace.names))
        iteration = extract(events, events.marks())
        made = self.make(iteration, session.swap_limit, self.swap_gbps(session))
        if isinstance(made, Unfit):
            self.plans_unfit += 1
            log.warning(
                "plan.unfit",
                extra={
                    "session": session.id,
                    "footprint": made.footprint,
                    "limit": made.limit,
                    "planned_for": made.planned_for,
                    "rounds": made.rounds,
                },
            )
            return None
        plan = made.update
        if made.source == "cache":
            self.plans_cached += 1
        else:
            self.plans_made += 1
        bound = lower_bound(to_problem(made.checked.pieces, ALIGNMENT)[0])
        with self._lock:
            plan.plan_id = self._next_plan_id
            self._next_plan_id += 1
        seconds = time.perf_counter() - started
        session.plan = PlanFootprint(plan.height_bytes, bound)
        session.outbox.put(pool_pb2.ServerMessage(plan=plan))
        if self.on_planned is not None:
            self.on_planned("cached" if made.source == "cache" else "solved", seconds)
        log.info(
            "plan.sent",
            extra={
                "session": session.id,
                "plan": plan.plan_id,
                "source": made.source,
                "allocations": len(plan.sizes),
                "height": plan.height_bytes,
                "footprint": plan.prediction.footprint_bytes,
                "lower_bound": bound,
                "limit": plan.limit_bytes,
                "swaps": len(plan.swap_blocks),
                "predicted_step_ns": plan.prediction.step_ns,
                "seconds": round(seconds, 3),
            },
        )
        return plan


def _swaps_on_ops(it: Iteration, limit: int, out_gbps: float, in_gbps: float) -> SwapPlan:
    """`policies.swaps_only` (the session's executor moves blocks but cannot rebuild them), its
    swap-ins issued at op starts as the client issues them (`wire.on_ops`)."""
    from tidalplan import policies, wire

    return wire.on_ops(it, policies.swaps_only(it, limit, out_gbps, in_gbps))
