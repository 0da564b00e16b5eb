"""The daemon's planning worker: trace → steady iteration → placement → validated plan → stream.

Runs on one worker thread of the daemon, never on a request thread: a session
that marks `plan_after_iterations` iterations is queued once; the worker
extracts its steady iteration, looks its signature up in the plan cache,
solves and validates the placement when it is not there, and puts the plan on
the session's stream. The client switches to it at its next step().

A session that swaps (AttachRequest.swap_limit_bytes) also gets the swap
schedule of tidalpool's search, swaps only (its executor does not rebuild
blocks), for its limit, as columns of the PlanUpdate against the iteration's
structure (allocation index, op index); the cache keeps placements only, since
the schedule depends on the session's limit.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from bisect import bisect_left
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from tidalcore.units import ALIGNMENT, Bytes, Offset
from tidalcore.v1 import pool_pb2
from tidalplan.model import Iteration, Placement, Problem, SwapPlan

from tidalpoold.plan_cache import PlanCache
from tidalpoold.sessions import PlanFootprint, Session
from tidalpoold.settings import Settings

if TYPE_CHECKING:
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


def add_swaps(plan: pool_pb2.PlanUpdate, it: Iteration, swaps: SwapPlan) -> None:
    """Append `swaps` to `plan` as the client executes them: ticks become op indices (in_at: the
    first op at or after it), blocks allocation indices or, when persistent, trace block ids."""
    ticks = [op.tick for op in it.ops]
    index = {tick: k for k, tick in enumerate(ticks)}
    for s in swaps.swaps:
        in_before = index[s.in_before]
        if s.in_at is not None:
            in_at = min(bisect_left(ticks, s.in_at), in_before)
        else:  # the planner's default: the op before in_before, not before out_after's next
            earliest = 0 if s.in_before <= s.out_after else index[s.out_after] + 1
            in_at = max(in_before - 1, earliest)
        plan.swap_blocks.append(it.persistent[s.block][0] if s.persistent else s.block)
        plan.swap_persistent.append(s.persistent)
        plan.swap_out_after.append(index[s.out_after])
        plan.swap_in_at.append(in_at)
        plan.swap_in_before.append(in_before)


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
        self._queued: set[str] = set()
        self._lock = threading.Lock()
        self._next_plan_id = 1
        self.plans_made = 0
        self.plans_cached = 0
        self.plans_failed = 0

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

    def _cached(
        self, key: bytes, problem: Problem, mapping: list[int], sizes: list[int]
    ) -> Placement | None:
        """The cached plan of this signature as a placement, if it fits this iteration."""
        from tidalplan.validate import InvalidPlacement, validate

        plan = self.cache.get(key)
        if plan is None or list(plan.sizes) != sizes:
            return None
        placement = Placement(
            offsets=tuple(Offset(plan.offsets[block]) for block in mapping),
            height=Bytes(plan.height_bytes),
            solver="cache",
        )
        try:
            validate(problem, placement)
        except InvalidPlacement as e:
            log.warning("plan.cache_invalid", extra={"signature": key.hex(), "why": str(e)})
            return None
        return placement

    def plan(self, session: Session) -> pool_pb2.PlanUpdate:
        from tidalcore.events import Events
        from tidalplan.learn import extract, signature, to_problem
        from tidalplan.placement import lower_bound, solve
        from tidalplan.validate import validate

        started = time.perf_counter()
        trace = session.trace
        events = Events.concat(list(trace.chunks), dict(trace.names))
        iteration = extract(events, events.marks())
        key = signature(iteration)
        problem, mapping = to_problem(iteration, alignment=ALIGNMENT)
        sizes = [int(b.size) for b in iteration.blocks]
        placement = self._cached(key, problem, mapping, sizes)
        source = "cache"
        if placement is None:
            placement = solve(problem, time_limit_s=self.settings.plan_time_limit_s)
            source = placement.solver
        validate(problem, placement)  # every plan, cached or new, before it is used
        offsets = [0] * len(sizes)
        for buffer_index, block_index in enumerate(mapping):
            offsets[block_index] = placement.offsets[buffer_index]
        plan = pool_pb2.PlanUpdate(
            signature=key, sizes=sizes, offsets=offsets, height_bytes=placement.height
        )
        if source == "cache":
            self.plans_cached += 1
        else:
            self.cache.put(plan)
            self.plans_made += 1
        if session.swap_limit:
            from tidalplan import policies

            gbps = self.swap_gbps(session)
            add_swaps(
                plan,
                iteration,
                policies.swaps_only(iteration, session.swap_limit, gbps, gbps),
            )
        bound = lower_bound(problem)
        with self._lock:
            plan.plan_id = self._next_plan_id
            self._next_plan_id += 1
        seconds = time.perf_counter() - started
        session.plan = PlanFootprint(plan.height_bytes, bound)
        session.outbox.put(pool_pb2.ServerMessage(plan=plan))
        if self.on_planned is not None:
            self.on_planned("cached" if source == "cache" else "solved", seconds)
        log.info(
            "plan.sent",
            extra={
                "session": session.id,
                "plan": plan.plan_id,
                "source": source,
                "allocations": len(plan.sizes),
                "height": plan.height_bytes,
                "lower_bound": bound,
                "swaps": len(plan.swap_blocks),
                "seconds": round(seconds, 3),
            },
        )
        return plan
