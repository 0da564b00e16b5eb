"""The daemon's planning worker: sessions in line for a plan → `planning` → their streams.

Never on a request thread: a session that marks `plan_after_iterations` iterations is
queued once, and the queue serves uids in turn (`Turns`: one uid's many sessions wait behind
each other, not in front of another uid's), each plan on the first free of the worker's
planners, one uid's plans on all but one of them at most; an iteration of more than
`max_plan_allocations` allocations is not planned (the session is told so), counted from its
events' kinds before anything is extracted. The worker hands each a `planning.Job` (its
events, limit, leases, bandwidth, the plan's deadline) and puts what comes back on its
stream: the plan, numbered; or, when none fits its swap limit or device lease, why, once
(`PlanUnavailable`: under the op-wise bound, with that bound as the lowest limit that could
work; over the lease; no schedule found; or the planner's failure). The session keeps
swapping by its LRU cache meanwhile. The daemon's planners are processes of its own
(`planning.PlannerProcess`, `planner_processes` of them); a `PlanWorker` given none plans on
its threads (`planning.Planner`).

A session under virtual residency (`Session.page_bytes`) whose persistent block is missing
from its latest step mark gets no plan: it is queued again at its next step.

A session whose steps name iteration shapes (StepMark.shape) is planned per shape, each from
its last whole iteration (`learn.extract_shape`) and tagged with it; once it has stepped into a
second shape, with its persistent blocks on the device at every boundary
(`Iteration.boundary_swaps`), and the plans made before are made again.
"""

from __future__ import annotations

import heapq
import logging
import math
import threading
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

from tidalcore import unplanned
from tidalcore.events import Events
from tidalcore.unplanned import PlanUnavailable
from tidalcore.v1 import pool_pb2

from tidalpoold.planning import (
    Job,
    Made,
    Outcome,
    Planner,
    PlannerStopped,
    PlanningFailed,
    Refused,
    TooLarge,
    Waiting,
)
from tidalpoold.sessions import PlanFootprint, Session
from tidalpoold.settings import Settings

if TYPE_CHECKING:
    from tidalpoold.backends import Backend

log = logging.getLogger("tidalpoold.planning")

CATCH_UP_S = 1.0
"""How long a plan waits for the events of the iteration after the one it plans
(`TraceStore.caught_up`) before it is made with those it has: a job waiting for its plan
after its learning iterations sends no more."""
FORGET_AFTER_S = 60.0  # a shape still catching up after this long: its session is gone
WARM_AFTER_S = 0.25  # a plan running this long has the next planner warmed

DEFAULT_COPY_GBPS = 12.0
"""Bandwidth the swap planner assumes for a session whose copies are not throttled (PCIe 3 x16),
where the backend measured none."""


def copy_gbps_of(backend: Backend) -> float:
    """The bandwidth to plan unthrottled sessions' swaps at: the slower direction the backend
    measured at start, its `h2d_gbps` and `d2h_gbps` facts (cuda: pinned copies over PCIe;
    sim: memmove between memfd mappings, as its clients copy), else DEFAULT_COPY_GBPS (a
    backend whose probe was skipped, `probe_bytes=0`, or one that reports no such facts)."""
    facts = backend.facts()
    try:
        slowest = min(float(facts["h2d_gbps"]), float(facts["d2h_gbps"]))
    except (KeyError, ValueError):
        return DEFAULT_COPY_GBPS
    return slowest if math.isfinite(slowest) and slowest > 0 else DEFAULT_COPY_GBPS


class Plans(Protocol):
    """Where plans are made: `planning.Planner` (on the caller's thread) or
    `planning.PlannerProcess` (in a process of its own)."""

    defects: int  # plan cache entries refused (and planned past)

    def run(self, job: Job) -> Outcome: ...

    def warm(self) -> None:
        """Be ready for a plan soon (import the planner, start the process), not waiting for
        it."""

    def close(self) -> None: ...


class Turns:
    """Sessions' iteration shapes waiting for a planner, served in turn by uid: the next is the
    oldest waiting of the uid served longest ago. One uid's many sessions (a client attaching
    again and again with new traces) or shapes wait behind each other, never in front of
    another uid's: a plan waits at most one plan of each other uid with plans waiting. With
    `slots` planners, one uid's plans take at most all but one of them at once (one, with
    one): another uid's plan then never waits for it."""

    def __init__(self, slots: int = 1) -> None:
        self._by_uid: OrderedDict[int, deque[tuple[Session, str]]] = OrderedDict()
        self._ready = threading.Condition()
        self._closed = False
        self._free = list(range(slots))  # planners free, a heap: the lowest taken first
        self._planning: Counter[int] = Counter()  # plans under way by uid
        self._per_uid = max(1, slots - 1)

    def put(self, session: Session, shape: str = "") -> None:
        with self._ready:
            self._by_uid.setdefault(session.uid, deque()).append((session, shape))
            self._ready.notify_all()

    def take(self) -> tuple[int, Session, str] | None:
        """The planner to use (its slot) and the next session and shape to plan, once one
        waits of a uid under its share and a planner is free (blocking till then); None once
        closed. `done` gives the slot back."""
        with self._ready:
            self._ready.wait_for(lambda: self._closed or self._next_uid() is not None)
            if self._closed:
                return None
            uid = self._next_uid()
            assert uid is not None
            waiting = self._by_uid.pop(uid)
            session, shape = waiting.popleft()
            if waiting:  # its next one waits behind every other uid's
                self._by_uid[uid] = waiting
            self._planning[uid] += 1
            return heapq.heappop(self._free), session, shape

    def _next_uid(self) -> int | None:
        if not self._free:
            return None
        return next((u for u in self._by_uid if self._planning[u] < self._per_uid), None)

    def done(self, slot: int, uid: int) -> None:
        """The plan `take` gave `slot` for, of `uid`, is over."""
        with self._ready:
            heapq.heappush(self._free, slot)
            self._planning[uid] -= 1
            if not self._planning[uid]:
                del self._planning[uid]
            self._ready.notify_all()

    def ready(self) -> bool:
        """Whether `take` would return at once."""
        with self._ready:
            return self._closed or self._next_uid() is not None

    def waiting(self) -> int:
        with self._ready:
            return sum(len(q) for q in self._by_uid.values())

    def close(self) -> None:
        with self._ready:
            self._closed = True
            self._by_uid.clear()
            self._ready.notify_all()


class PlanWorker:
    """Queues sessions for planning, and has each plan made by a free planner on a thread of
    its own."""

    def __init__(
        self,
        settings: Settings,
        copy_gbps: float = DEFAULT_COPY_GBPS,
        on_planned: Callable[[str, float], None] | None = None,
        planners: Sequence[Plans] = (),
    ) -> None:
        """`on_planned(outcome, seconds)` is told of every plan sent: "cached" or "solved",
        and the seconds it took from the trace to the stream (the daemon's metrics).
        `planners` make the plans, as many at once, the first free of them first (none given:
        one `planning.Planner`, on the plan's thread); the worker closes them. The first is
        warmed (`Plans.warm`) at the first step mark of any session; while a plan runs on it
        for `WARM_AFTER_S`, the second, so that a plan coming then finds it ready."""
        self.settings = settings
        self.copy_gbps = copy_gbps  # for sessions whose copies are not throttled
        self.on_planned = on_planned
        self.planners: list[Plans] = list(planners) or [Planner(settings)]
        self._turns = Turns(len(self.planners))
        self._queued: set[tuple[str, str]] = set()  # (session id, shape) queued or planned
        # Of those, planned while their session had one shape: their persistent blocks may be
        # away across the boundary, which iterations of another shape do not expect.
        self._open: set[tuple[str, str]] = set()
        # (session id, shape) due to be planned once the events of the iteration after the one
        # it plans are in: since when (monotonic seconds), and the step marks seen then.
        self._catching_up: dict[tuple[str, str], tuple[float, int]] = {}
        self._lock = threading.Lock()
        self._next_plan_id = 1
        self.plans_made = 0
        self.plans_cached = 0
        self.plans_failed = 0
        self.plans_unfit = 0  # plans that did not fit the limit or the lease: not sent
        self.plans_too_large = 0  # iterations of more than max_plan_allocations: not planned
        self._stepped = False  # a session has marked a step
        self._first_made = False  # the first planner has made a plan
        self._thread = threading.Thread(target=self._run, name="planner", daemon=True)
        self._thread.start()

    @property
    def cache_defects(self) -> int:
        """Plan cache entries refused (and planned past)."""
        return sum(p.defects for p in self.planners)

    def _run(self) -> None:
        """The dispatcher: each plan, once a planner is free for it, on a thread of its own."""
        while (taken := self._turns.take()) is not None:
            slot, session, shape = taken
            plan = threading.Thread(
                target=self._plan_on, args=(slot, session, shape), name=f"plan-{slot}", daemon=True
            )
            plan.start()

    def _plan_on(self, slot: int, session: Session, shape: str) -> None:
        """`_plan_quietly` on planner `slot`, which is given back after. A plan on the first
        that runs `WARM_AFTER_S` has the second warmed, the first plan made there excepted (it
        may run that long on the process's start alone); the others start when a plan needs
        them."""
        warm = None
        if slot == 0 and len(self.planners) > 1 and self._first_made:
            warm = threading.Timer(WARM_AFTER_S, self.planners[1].warm)
            warm.daemon = True
            warm.start()
        try:
            self._plan_quietly(session, shape, self.planners[slot])
        finally:
            if warm is not None:
                warm.cancel()
            if slot == 0:
                self._first_made = True
            self._turns.done(slot, session.uid)

    def on_step(
        self, session: Session, ended: str | None = None, forgotten: Sequence[str] = ()
    ) -> None:
        """Called after each step mark, which ended an iteration of shape `ended` and made the
        session forget `forgotten` (`TraceStore.step`): queues each shape of the session once
        it has marked `plan_after_iterations` iterations, one of them whole (a session of one
        shape: as soon as it has marked them). A forgotten shape is planned again if it
        comes back. The first step mark the worker sees warms its first planner, on a thread of
        its own: a plan comes `plan_after_iterations` steps later."""
        again: set[str] = set()
        with self._lock:
            first, self._stepped = not self._stepped, True
            for shape in forgotten:
                self._queued.discard((session.id, shape))
                self._open.discard((session.id, shape))
            if len(session.trace.shapes.counts) > 1:  # plans of one shape are made again
                again = {shape for sid, shape in self._open if sid == session.id}
                for shape in again:
                    self._open.discard((session.id, shape))
                    self._queued.discard((session.id, shape))
        after = self.settings.plan_after_iterations
        if not after:
            return
        if first:
            threading.Thread(target=self.planners[0].warm, name="planner-warm", daemon=True).start()
        self.on_events(session)  # a mark ends the iteration after any that waited for it
        current = session.trace.shapes.current
        marks = session.trace.iterations_seen
        for shape in {s for s in (ended, current) if s is not None} | again:
            count = session.trace.shape_counts(shape)
            if count is None or count.marks < after:
                continue
            if count.whole < 1 and len(session.trace.shapes.counts) > 1:
                continue
            if shape == ended and not session.trace.caught_up():
                # Its iteration just ended: planned once the next one's events are in.
                with self._lock:
                    if (session.id, shape) not in self._queued:
                        self._catching_up.setdefault((session.id, shape), (time.monotonic(), marks))
                continue
            self._queue(session, shape)

    def on_events(self, session: Session) -> None:
        """Called after trace events, a heartbeat or a step mark of `session`: queues a shape
        whose plan waits for the events of the iteration after the one it plans, once they are
        in (`TraceStore.caught_up`, or a later mark ended that iteration) or `CATCH_UP_S` have
        passed (a job that sends no more, waiting for its plan)."""
        if not self._catching_up:
            return
        now = time.monotonic()
        with self._lock:
            gone = [k for k, (t, _) in self._catching_up.items() if now - t > FORGET_AFTER_S]
            for key in gone:
                del self._catching_up[key]  # its session is gone
            waiting = [(k, v) for k, v in self._catching_up.items() if k[0] == session.id]
        caught_up = session.trace.caught_up()
        marks = session.trace.iterations_seen
        for (_, shape), (since, marks_then) in waiting:
            if caught_up or marks > marks_then or now - since >= CATCH_UP_S:
                with self._lock:
                    self._catching_up.pop((session.id, shape), None)
                self._queue(session, shape)

    def replan(self, session: Session) -> None:
        """`session`'s limit moved (its elastic quota): plan again each shape planned or
        queued for it (the plan cache keys plans by limit)."""
        with self._lock:
            shapes = {shape for sid, shape in self._queued if sid == session.id}
            for shape in shapes:
                self._queued.discard((session.id, shape))
                self._open.discard((session.id, shape))
        for shape in shapes:
            self._queue(session, shape)

    def _queue(self, session: Session, shape: str) -> None:
        """Put `session`'s `shape` in line for the planning thread, unless it is there."""
        with self._lock:
            if (session.id, shape) in self._queued:
                return
            self._queued.add((session.id, shape))
        self._turns.put(session, shape)

    def _budget(self, started: float) -> float:
        """What is left of a plan's `plan_deadline_s` once it started at `started`
        (perf_counter): the solver starts no new round or layout past it."""
        return max(0.0, self.settings.plan_deadline_s - (time.perf_counter() - started))

    def swap_gbps(self, session: Session) -> float:
        """The copy bandwidth a session's swaps are planned at: its own throttle, else the
        backend's measured one."""
        return session.copy_gbps or self.copy_gbps

    def close(self) -> None:
        """Plan no more: the sessions waiting are dropped, the planner closed (a plan being
        made in its process ends there)."""
        self._turns.close()
        for planner in self.planners:
            planner.close()

    def _plan_quietly(
        self, session: Session, shape: str = "", planner: Plans | None = None
    ) -> None:
        """`plan(session, shape, planner)`; a plan that fails leaves the session learning, logged
        (`plan.failed`) and told why on its stream (`PlanUnavailable`, kind "failed")."""
        try:
            self.plan(session, shape, planner)
        except Exception as e:
            with self._lock:
                self.plans_failed += 1
            if isinstance(e, PlannerStopped | PlanningFailed):
                why = str(e)  # a one-line why of its own
            else:
                why = " ".join(f"{type(e).__name__}: {e}".split())  # one line
            log.warning("plan.failed", extra={"session": session.id, "shape": shape, "why": why})
            told = PlanUnavailable(
                session.swap_limit, unplanned.FAILED, f"planning failed: {why}", shape=shape
            )
            session.outbox.put(pool_pb2.ServerMessage(unplanned=told.message()))

    def plan(
        self, session: Session, shape: str = "", planner: Plans | None = None
    ) -> pool_pb2.PlanUpdate | None:
        """Plan `session`'s steady iteration of `shape` on `planner` (None: the first) and put
        the plan on its stream, tagged with the shape; None (and the session keeps learning)
        when it gets none, which the stream is told once, with why (`PlanUnavailable`), save
        while a paged session's persistent blocks wait for its next step mark."""
        started = time.perf_counter()
        trace = session.trace
        # Counted first from the kinds alone: a session over the cap costs the planner no
        # extraction, so the sessions behind it in line wait for none.
        if (allocations := trace.allocations_of(shape)) > self.settings.max_plan_allocations:
            self._too_large(session, shape, allocations)
            return None
        several_shapes = len(trace.shapes.counts) > 1
        if not several_shapes:
            with self._lock:
                self._open.add((session.id, shape))
        paged = bool(session.page_bytes)
        job = Job(
            session.id,
            Events.concat(list(trace.chunks), dict(trace.names)),
            shape,
            several_shapes,
            session.swap_limit,
            self.swap_gbps(session),
            not session.copy_gbps,
            session.device_quota() if paged else session.device.length,
            session.host.length,
            self._budget(started),
            session.page_bytes,
            dict(session.live_at) if paged else {},
        )
        outcome = (planner or self.planners[0]).run(job)
        if isinstance(outcome, TooLarge):
            self._too_large(session, shape, outcome.allocations)
            return None
        if isinstance(outcome, Waiting):
            log.debug(
                "plan.waiting",
                extra={
                    "session": session.id,
                    "missing": outcome.missing[:8],
                    "why": "persistent blocks its step marks have not placed",
                },
            )
            with self._lock:
                self._queued.discard((session.id, shape))
            return None
        if isinstance(outcome, Refused):
            self._tell_unfit(session, outcome)
            return None
        assert isinstance(outcome, Made)
        footprint = PlanFootprint(outcome.height, outcome.lower_bound)
        self._send(session, outcome.update, outcome.source, footprint, started, outcome.about)
        return outcome.update

    def _too_large(self, session: Session, shape: str, allocations: int) -> None:
        """Count, log (`plan.too_large`) and tell `session` that its iteration of `shape`, of
        `allocations` allocations, is more than the daemon plans."""
        cap = self.settings.max_plan_allocations
        with self._lock:
            self.plans_too_large += 1
        reason = (
            f"its iteration makes {allocations:,} allocations, more than the {cap:,} this"
            " daemon plans (its setting max_plan_allocations): the session runs without a plan"
        )
        log.warning(
            "plan.too_large",
            extra={"session": session.id, "allocations": allocations, "cap": cap},
        )
        told = PlanUnavailable(session.swap_limit, unplanned.TOO_LARGE, reason, shape=shape)
        session.outbox.put(pool_pb2.ServerMessage(unplanned=told.message()))

    def _send(
        self,
        session: Session,
        plan: pool_pb2.PlanUpdate,
        source: str,
        footprint: PlanFootprint,
        started: float,
        about: dict[str, int],
    ) -> None:
        """Count `plan` (made, or from the cache: `source`), number it, put it on `session`'s
        stream and log it (`plan.sent`, with `about`: what its kind of plan says of itself)."""
        with self._lock:
            if source == "cache":
                self.plans_cached += 1
            else:
                self.plans_made += 1
            plan.plan_id = self._next_plan_id
            self._next_plan_id += 1
        seconds = time.perf_counter() - started
        session.plan = footprint
        session.outbox.put(pool_pb2.ServerMessage(plan=plan))
        if self.on_planned is not None:
            self.on_planned("cached" if source == "cache" else "solved", seconds)
        log.info(
            "plan.sent",
            extra={
                "session": session.id,
                "plan": plan.plan_id,
                "shape": plan.shape,
                "source": source,
                "allocations": len(plan.sizes),
                **about,
                "limit": plan.limit_bytes,
                "swaps": len(plan.swap_blocks),
                "predicted_step_ns": plan.prediction.step_ns,
                "seconds": round(seconds, 3),
            },
        )

    def _tell_unfit(self, session: Session, refused: Refused) -> None:
        """Count and log an unfit plan (`plan.unfit`) and tell the session why."""
        made = refused.unfit
        with self._lock:
            self.plans_unfit += 1
        log.warning(
            "plan.unfit",
            extra={
                "session": session.id,
                "footprint": made.footprint,
                "limit": made.limit,
                "beyond": made.beyond,
                "planned_for": made.planned_for,
                "rounds": made.rounds,
            },
        )
        session.outbox.put(pool_pb2.ServerMessage(unplanned=refused.told.message()))
