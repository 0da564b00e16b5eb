"""The daemon's planning worker: trace → steady iteration → plan → checked PlanUpdate → stream.

Runs on one worker thread of the daemon, never on a request thread: a session
that marks `plan_after_iterations` iterations is queued once, and the queue serves
uids in turn (`Turns`: one uid's many sessions wait behind each other, not in front
of another uid's); an iteration of more than `max_plan_allocations` allocations is not
planned (the session is told so). The worker
extracts its steady iteration and plans it as `tidalpool simulate` does
(`tidalplan.placed`): under the session's swap limit, the swap schedule of
tidalpool's search, swaps only (its executor does not rebuild blocks), split
into the device pieces it leaves and placed, made for lower limits until the
footprint fits (`placed.fit`); without one, every block placed whole
(`placed.unlimited`). The plan is written as a PlanUpdate (`tidalplan.wire`),
then that update as a whole is checked again by `wire.check` (schedule
simulated and validated, placement validated over its pieces) before it is
cached and sent:

    iteration ──▶ cache (signature, limit, bandwidth, version) ──▶ wire.check ──┬──▶ stream
        │            none there, or a defect (logged once)                      │
        └──▶ fit / unlimited ──▶ wire.encode ──▶ wire.check ──▶ cache ──────────┘

A plan that does not fit the limit, or whose footprint is more than the session's
device lease, is not sent: the session keeps swapping by its LRU cache, and is told
why once on its stream (`PlanUnavailable`: under the op-wise bound, with that bound
as the lowest limit that could work; over the lease; no schedule found; or the
planner's failure). A cached
plan is checked the same way before it is used, against the session's lease too,
and must have been made for the session's limit and bandwidth. The cache is
another user's to write into: whatever is wrong with an entry (unreadable, not a
regular file, too large, not a plan, or refused by the check) is a defect, logged
as `plan.cache_defect`, and the iteration is planned as if there were no entry;
the plan made then replaces it. A defect is never the session's planning failure.

A session under virtual residency (`Session.page_bytes`) is planned the same way with
`wire.paged_session_plan`, its persistent blocks where its step marks say they are
(`Session.live_at`): written by `wire.encode_paged` (version 3), checked by
`wire.check_paged` (its mapped pages under the limit, its mapped peak within the lease),
and cached under a name that holds the page and those addresses too. While a persistent
block of its iteration is missing from its latest step mark, it gets no plan: it is
queued again at its next step.

A session whose steps name iteration shapes (StepMark.shape) is planned per shape, each from
its last whole iteration (`learn.extract_shape`) and tagged with it; once it has stepped into a
second shape, with its persistent blocks on the device at every boundary
(`Iteration.boundary_swaps`), and the plans made before are made again.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from tidalcore import planupdate, unplanned
from tidalcore.units import ALIGNMENT, format_size
from tidalcore.unplanned import PlanUnavailable
from tidalcore.v1 import pool_pb2
from tidalplan.model import Iteration

from tidalpoold import plan_cache
from tidalpoold.plan_cache import Defect, PlanCache
from tidalpoold.sessions import PlanFootprint, Session
from tidalpoold.settings import Settings

if TYPE_CHECKING:
    from tidalplan.paged import PagedPlan
    from tidalplan.placed import Combined

    from tidalpoold.backends import Backend

log = logging.getLogger("tidalpoold.planning")

Taken = TypeVar("Taken")

CATCH_UP_S = 1.0
"""How long a plan waits for the events of the iteration after the one it plans
(`TraceStore.caught_up`) before it is made with those it has: a job waiting for its plan
after its learning iterations sends no more."""
FORGET_AFTER_S = 60.0  # a shape still catching up after this long: its session is gone
MEASURED_SPREAD = 1.5
"""A cached plan for an unthrottled session serves a daemon whose backend measured a copy
bandwidth up to this factor from the one it was made at (its prediction retimed at this
daemon's); further apart, the session gets a plan made for its own."""

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


@dataclass(frozen=True, slots=True)
class Planned:
    """A plan ready to send: the update, what `wire.check` found in it, and where it came
    from ("cache", or the solver that placed it)."""

    update: pool_pb2.PlanUpdate
    checked: Combined
    source: str


@dataclass(frozen=True, slots=True)
class PlannedPaged:
    """A paged plan ready to send: the version-3 update, the plan `wire.check_paged` rebuilt
    from it, and where it came from ("cache", or the solver that placed its page-owning
    blocks)."""

    update: pool_pb2.PlanUpdate
    checked: PagedPlan
    source: str


@dataclass(frozen=True, slots=True)
class Unfit:
    """No schedule tried left a placement within the limit, or the plan's footprint is more
    than the session's device lease: nothing to send."""

    footprint: int | None  # of the schedule made for the limit itself; None: infeasible
    limit: int  # the bytes it had to fit: the swap limit, or the lease (`beyond`)
    planned_for: int  # the lowest limit a schedule was made for
    rounds: int
    # what it does not fit: "limit", "lease" or "host" (the host lease); "deadline": the limit,
    # the search cut at the plan's deadline (plan_deadline_s)
    beyond: str = "limit"


def _import_planner() -> None:
    """Import the planner's modules (a few tenths of a second) on the worker thread, so that
    a session's first plan does not wait for them."""
    from tidalplan import paged, placed, wire

    del paged, placed, wire


class Turns:
    """Sessions' iteration shapes waiting for the planning thread, served in turn by uid: the
    next is the oldest waiting of the uid served longest ago. One uid's many sessions (a client
    attaching again and again with new traces) or shapes wait behind each other, never in front
    of another uid's: a plan waits at most one plan of each other uid with plans waiting."""

    def __init__(self) -> None:
        self._by_uid: OrderedDict[int, deque[tuple[Session, str]]] = OrderedDict()
        self._ready = threading.Condition()
        self._closed = False

    def put(self, session: Session, shape: str = "") -> None:
        with self._ready:
            self._by_uid.setdefault(session.uid, deque()).append((session, shape))
            self._ready.notify()

    def take(self) -> tuple[Session, str] | None:
        """The next session and shape to plan (blocks while none waits); None once closed."""
        with self._ready:
            self._ready.wait_for(lambda: self._closed or bool(self._by_uid))
            if self._closed:
                return None
            uid, waiting = next(iter(self._by_uid.items()))
            taken = waiting.popleft()
            del self._by_uid[uid]
            if waiting:  # its next one waits behind every other uid's
                self._by_uid[uid] = waiting
            return taken

    def waiting(self) -> int:
        with self._ready:
            return sum(len(q) for q in self._by_uid.values())

    def close(self) -> None:
        with self._ready:
            self._closed = True
            self._by_uid.clear()
            self._ready.notify_all()


_Made = TypeVar("_Made", Planned, PlannedPaged)


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
        self.cache = PlanCache(settings.plan_cache_dir, settings.plan_cache_bytes)
        self._turns = Turns()
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
        self.cache_defects = 0  # cache entries refused (and planned past)
        self._thread = threading.Thread(target=self._run, name="planner", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        _import_planner()  # off the start, before the first plan needs it
        while (taken := self._turns.take()) is not None:
            self._plan_quietly(*taken)

    def on_step(
        self, session: Session, ended: str | None = None, forgotten: Sequence[str] = ()
    ) -> None:
        """Called after each step mark, which ended an iteration of shape `ended` and made the
        session forget `forgotten` (`TraceStore.step`): queues each shape of the session once
        it has marked `plan_after_iterations` iterations, one of them whole (a session of one
        shape: as soon as it has marked them). A forgotten shape is planned again if it
        comes back."""
        again: set[str] = set()
        with self._lock:
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
        """Plan no more: the sessions waiting are dropped; a plan being made ends as it will."""
        self._turns.close()

    def _plan_quietly(self, session: Session, shape: str = "") -> None:
        """`plan(session, shape)`; a plan that fails leaves the session learning, logged
        (`plan.failed`) and told why on its stream (`PlanUnavailable`, kind "failed")."""
        try:
            self.plan(session, shape)
        except Exception as e:
            self.plans_failed += 1
            why = " ".join(f"{type(e).__name__}: {e}".split())  # one line
            log.warning("plan.failed", extra={"session": session.id, "shape": shape, "why": why})
            told = PlanUnavailable(
                session.swap_limit, unplanned.FAILED, f"planning failed: {why}", shape=shape
            )
            session.outbox.put(pool_pb2.ServerMessage(unplanned=told.message()))

    def make(
        self,
        iteration: Iteration,
        swap_limit: int,
        gbps: float,
        lease: int | None = None,
        host: int | None = None,
        measured: bool = False,
        budget_s: float | None = None,
    ) -> Planned | Unfit:
        """The checked plan of `iteration` for `swap_limit` (0: none) with copies at `gbps`,
        within a device `lease` of that many bytes (None: not bounded): from the cache when a
        plan made for the same is there and passes `wire.check`, else planned, encoded,
        checked and cached. `measured`: `gbps` is what the backend measured (the session does
        not throttle its copies), and a plan cached at a bandwidth within `MEASURED_SPREAD`
        of it serves too. Unfit when a swap plan does not fit its limit, a plan's footprint is
        more than the lease, or its swapped-out blocks need more than a `host` lease of that
        many bytes at once (`profile.host_peak`)."""
        from tidalplan.learn import signature

        # Without a swap limit nothing is copied: the bandwidth changes nothing of the plan (an
        # unthrottled session's is what each daemon measured at start), so it is not its key.
        made_at = (plan_cache.MEASURED if measured else gbps) if swap_limit else 0.0
        name = plan_cache.key(signature(iteration), swap_limit, made_at, planupdate.ARENA_VERSION)
        made = self._cached_else_solved(
            name,
            lambda: self._cached(name, iteration, swap_limit, gbps, lease, measured),
            lambda: self._solve(name, iteration, swap_limit, gbps, lease, budget_s),
        )
        return self._host_room(made, iteration, swap_limit, host)

    def _cached_else_solved(
        self, name: str, cached: Callable[[], _Made | None], solve: Callable[[], _Made | Unfit]
    ) -> _Made | Unfit:
        """The plan `cached` finds under `name`, else the one `solve` makes under the cache's
        lock (`PlanCache.solving`): a daemon that waited there for another of the node (a rank
        on another GPU) takes the plan that one cached."""
        found = cached()
        if found is not None:
            return found
        with self.cache.solving(name, self.settings.plan_deadline_s) as waited:
            found = cached() if waited else None
            return found if found is not None else solve()

    def _solve(
        self,
        name: str,
        iteration: Iteration,
        swap_limit: int,
        gbps: float,
        lease: int | None,
        budget_s: float | None,
    ) -> Planned | Unfit:
        """`make`'s plan when no daemon has one cached: planned, encoded, checked, cached."""
        from tidalplan import placed, wire
        from tidalplan.placement import time_left

        time_limit_s = self.settings.plan_time_limit_s
        if swap_limit:
            plan = placed.fit(
                iteration,
                wire.session_schedule_within(budget_s),
                swap_limit,
                gbps,
                gbps,
                time_limit_s=time_limit_s,
                budget_s=budget_s,
            )
            if not plan.fits:
                return Unfit(plan.footprint, swap_limit, int(plan.planned_for), plan.rounds)
        else:
            seconds = time_left(time_limit_s, budget_s, time.monotonic())
            plan = placed.unlimited(iteration, gbps, gbps, time_limit_s=seconds)
        assert plan.combined is not None  # it fits
        footprint = int(plan.combined.footprint)
        if lease is not None and footprint > lease:
            return Unfit(footprint, lease, int(plan.planned_for), plan.rounds, "lease")
        update = wire.encode(iteration, plan, gbps)
        checked = wire.check(iteration, update, lease=lease)  # the whole plan, as it is sent
        self.cache.put(name, update)
        return Planned(update, checked, plan.combined.placement.solver)

    def make_paged(
        self,
        iteration: Iteration,
        swap_limit: int,
        gbps: float,
        page: int,
        persistent_at: list[tuple[int, bool]],
        lease: int | None = None,
        host: int | None = None,
        measured: bool = False,
        budget_s: float | None = None,
    ) -> PlannedPaged | Unfit:
        """The checked paged plan of `iteration` for `swap_limit` mapped bytes with copies at
        `gbps`, in pages of `page` bytes, its persistent blocks at `persistent_at` (per
        `iteration.persistent`), mapping at most a device `lease` of that many bytes (None:
        not bounded): from the cache when a plan made for all of these is there and passes
        `wire.check_paged`, else planned, encoded, checked and cached. Unfit when no plan
        fits the limit (planned once per layout, at the limit itself: one round), its mapped
        peak is more than the lease, or its swapped-out blocks need more than a `host` lease of
        that many bytes at once (`profile.host_peak`). `measured` as for `make`."""
        from tidalplan.learn import signature

        made_at = plan_cache.MEASURED if measured else gbps
        name = plan_cache.key(
            signature(iteration), swap_limit, made_at, planupdate.PAGED_VERSION, page, persistent_at
        )

        made = self._cached_else_solved(
            name,
            lambda: self._from_cache(
                name,
                lambda found, path: _checked_paged(
                    found, path, iteration, swap_limit, gbps, page, persistent_at, lease, measured
                ),
            ),
            lambda: self._solve_paged(
                name, iteration, swap_limit, gbps, page, persistent_at, lease, budget_s
            ),
        )
        return self._host_room(made, iteration, swap_limit, host)

    def _solve_paged(
        self,
        name: str,
        iteration: Iteration,
        swap_limit: int,
        gbps: float,
        page: int,
        persistent_at: list[tuple[int, bool]],
        lease: int | None,
        budget_s: float | None,
    ) -> PlannedPaged | Unfit:
        """`make_paged`'s plan when no daemon has one cached: planned, encoded, checked,
        cached."""
        from tidalplan import wire

        plan = wire.paged_session_plan(
            iteration,
            swap_limit,
            gbps,
            page,
            persistent_at,
            time_limit_s=self.settings.plan_time_limit_s,
            budget_s=budget_s,
        )
        if plan.mapped_peak is None:  # it does not fit
            return Unfit(None, swap_limit, swap_limit, 1)
        if lease is not None and plan.mapped_peak > lease:
            return Unfit(int(plan.mapped_peak), lease, swap_limit, 1, "lease")
        update = wire.encode_paged(iteration, plan, gbps)
        checked = wire.check_paged(iteration, update, swap_limit, gbps, persistent_at)
        self.cache.put(name, update)
        return PlannedPaged(update, checked, plan.layout.solver)

    @staticmethod
    def _host_room(
        made: _Made | Unfit, iteration: Iteration, swap_limit: int, host: int | None
    ) -> _Made | Unfit:
        """`made`, or Unfit when its swapped-out blocks need more than a `host` lease (None:
        not bounded) at once: each rounded to the session's page under virtual residency,
        else to the alignment its host lease is allocated in. An Unfit stays as it is."""
        from tidalplan import wire
        from tidalplan.profile import host_peak

        if host is None or isinstance(made, Unfit):
            return made
        if isinstance(made, PlannedPaged):
            schedule, unit = made.checked.schedule, made.checked.layout.page
        else:
            schedule, unit = wire.decode(iteration, made.update).schedule, ALIGNMENT
        need = host_peak(iteration, schedule, unit)
        if need > host:
            return Unfit(need, host, swap_limit, 1, "host")
        return made

    def _cached(
        self,
        name: str,
        iteration: Iteration,
        swap_limit: int,
        gbps: float,
        lease: int | None,
        measured: bool,
    ) -> Planned | None:
        """The plan cached under `name` when it is one made for `iteration`, `swap_limit` and
        `gbps` (`measured`: about as much) that passes `wire.check` within `lease`; None as
        `_from_cache` says."""
        return self._from_cache(
            name,
            lambda found, path: _checked(found, path, iteration, swap_limit, gbps, lease, measured),
        )

    def _from_cache(
        self, name: str, take: Callable[[pool_pb2.PlanUpdate, Path], Taken | Defect]
    ) -> Taken | None:
        """The plan cached under `name` as `take` (the update and its path) makes it ready to
        send; None when there is none or it has a defect (`take` says which), which is logged
        once (`plan.cache_defect`) and counted. Nothing the entry holds raises from here: the
        caller plans as if there were no entry."""
        path = self.cache.path(name)
        try:
            found = self.cache.get(name)
        except Exception as e:  # the cache reports what it knows as a Defect; this is the rest
            found = Defect(path, f"cannot be read: {type(e).__name__}: {e}")
        if found is None:
            return None
        made = found if isinstance(found, Defect) else take(found, path)
        if isinstance(made, Defect):
            self.cache_defects += 1
            log.warning(
                "plan.cache_defect", extra={"key": name, "path": str(made.path), "why": made.why}
            )
            return None
        return made

    def plan(self, session: Session, shape: str = "") -> pool_pb2.PlanUpdate | None:
        """Plan `session`'s steady iteration of `shape` (`learn.extract_shape`) and put the plan
        on its stream, tagged with the shape; None (and the session keeps learning) when its
        plan does not fit its swap limit or device lease, which the stream is told once, with
        why (`PlanUnavailable`, see `unavailable`). A paged session's plan is made by
        `_plan_paged`."""
        from tidalcore.events import Events
        from tidalplan.learn import extract_shape, to_problem
        from tidalplan.placement import lower_bound

        started = time.perf_counter()
        trace = session.trace
        # Counted first from the kinds alone: a session over the cap costs the planner no
        # extraction, so the sessions behind it in line wait for none.
        if (allocations := trace.allocations_of(shape)) > self.settings.max_plan_allocations:
            self._too_large(session, shape, allocations)
            return None
        events = Events.concat(list(trace.chunks), dict(trace.names))
        iteration = extract_shape(events, shape)
        if len(trace.shapes.counts) > 1:  # the next iteration may be of another shape
            iteration = dataclasses.replace(iteration, boundary_swaps=False)
        else:
            with self._lock:
                self._open.add((session.id, shape))
        if len(iteration.blocks) > self.settings.max_plan_allocations:
            self._too_large(session, shape, len(iteration.blocks))
            return None
        if session.page_bytes:
            return self._plan_paged(session, shape, iteration, started)
        made = _closed_else_open(
            session,
            iteration,
            lambda it: self.make(
                it,
                session.swap_limit,
                self.swap_gbps(session),
                session.device.length,
                session.host.length,
                measured=not session.copy_gbps,
                budget_s=self._budget(started),
            ),
        )
        if isinstance(made, Unfit):
            self._tell_unfit(session, shape, made, iteration, started)
            return None
        plan = made.update
        plan.shape = shape
        bound = lower_bound(to_problem(made.checked.pieces, ALIGNMENT)[0])
        about = {
            "height": plan.height_bytes,
            "footprint": plan.prediction.footprint_bytes,
            "lower_bound": bound,
        }
        self._send(
            session, plan, made.source, PlanFootprint(plan.height_bytes, bound), started, about
        )
        return plan

    def _too_large(self, session: Session, shape: str, allocations: int) -> None:
        """Count, log (`plan.too_large`) and tell `session` that its iteration of `shape`, of
        `allocations` allocations, is more than the daemon plans."""
        cap = self.settings.max_plan_allocations
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
        if source == "cache":
            self.plans_cached += 1
        else:
            self.plans_made += 1
        with self._lock:
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

    def _tell_unfit(
        self, session: Session, shape: str, made: Unfit, iteration: Iteration, started: float
    ) -> None:
        """Count and log an unfit plan (`plan.unfit`) and tell the session why (`unavailable`):
        past the plan's deadline, that the search was cut there."""
        if made.beyond == "limit" and self._budget(started) <= 0:
            made = dataclasses.replace(made, beyond="deadline")
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
        told = unavailable(made, iteration, self.swap_gbps(session))
        told = dataclasses.replace(told, shape=shape)
        session.outbox.put(pool_pb2.ServerMessage(unplanned=told.message()))

    def _plan_paged(
        self, session: Session, shape: str, iteration: Iteration, started: float
    ) -> pool_pb2.PlanUpdate | None:
        """`plan` for a session under virtual residency: its paged plan, its persistent blocks
        where its latest step mark put them; None when one of them is not there (the session
        is queued again at its next step) or no plan fits (the session is told, as `plan`
        tells it)."""
        persistent_at, missing = placed_by_session(iteration, session.live_at)
        if missing:
            log.debug(
                "plan.waiting",
                extra={
                    "session": session.id,
                    "missing": missing[:8],
                    "why": "persistent blocks its step marks have not placed",
                },
            )
            with self._lock:
                self._queued.discard((session.id, shape))
            return None
        made = _closed_else_open(
            session,
            iteration,
            lambda it: self.make_paged(
                it,
                session.swap_limit,
                self.swap_gbps(session),
                session.page_bytes,
                persistent_at,
                session.device_quota(),
                session.host.length,
                measured=not session.copy_gbps,
                budget_s=self._budget(started),
            ),
        )
        if isinstance(made, Unfit):
            self._tell_unfit(session, shape, made, iteration, started)
            return None
        plan = made.update
        plan.shape = shape
        peak = plan.mapped_peak_bytes
        about = {"page": plan.page_bytes, "region": plan.region_bytes, "mapped_peak": peak}
        self._send(session, plan, made.source, PlanFootprint(peak, peak), started, about)
        return plan


def _closed_else_open(
    session: Session, iteration: Iteration, make: Callable[[Iteration], _Made | Unfit]
) -> _Made | Unfit:
    """`make(iteration)`; where that is a plan of a shape of several with the persistent blocks
    on the device at the boundary and none fits (their bytes alone may be over the limit),
    the plan that may keep them away there: the iterations of other shapes then find them
    away and bring them in on demand."""
    made = make(iteration)
    if isinstance(made, Unfit) and not iteration.boundary_swaps:
        why = "no plan fits with every persistent block on the device at the boundary"
        log.info("plan.boundary_open", extra={"session": session.id, "why": why})
        made = make(dataclasses.replace(iteration, boundary_swaps=True))
    return made


def placed_by_session(
    iteration: Iteration, live_at: Mapping[int, tuple[int, bool]]
) -> tuple[list[tuple[int, bool]], list[int]]:
    """Where the session put `iteration`'s persistent blocks (address, owns pages), in their
    order, from its latest step mark's live blocks `live_at`; and the ids of those it did not
    list (a plan waits for them)."""
    found = [live_at.get(pid) for pid, _ in iteration.persistent]
    missing = [pid for (pid, _), at in zip(iteration.persistent, found, strict=True) if at is None]
    return [at for at in found if at is not None], missing


def unavailable(unfit: Unfit, iteration: Iteration, gbps: float | None = None) -> PlanUnavailable:
    """What the session is told of an `unfit` plan of `iteration`: under the op-wise bound
    (`profile.op_bound`, as `tidalpool simulate` and `replay` refuse such a limit) with that
    bound as the lowest limit that could work, a footprint over the device lease, or no
    schedule found (the lowest limit not known), and, given the copies' `gbps`, when the
    swap-only bound (`step_bound(recompute=False)`) proves that none exists, where, with
    `bound.cover_floor` as the lowest limit that could work."""
    from tidalplan.bound import cover_floor, step_bound
    from tidalplan.profile import op_bound

    limit = format_size(unfit.limit)
    if unfit.beyond == "host":
        need = format_size(unfit.footprint or 0)
        return PlanUnavailable(
            unfit.limit,
            unplanned.OVER_LEASE,
            f"the plan's swapped-out blocks need up to {need} of the host lease at once, more"
            f" than the session's host lease of {limit}: attach with a host_limit of {need} or"
            " more",
        )
    if unfit.beyond == "lease":
        return PlanUnavailable(
            unfit.limit,
            unplanned.OVER_LEASE,
            f"the plan's footprint {format_size(unfit.footprint or 0)} is more than the"
            f" session's device lease of {limit}",
        )
    bound = op_bound(iteration)
    if unfit.limit < bound:
        below, above = limit, format_size(bound)
        if below == above:  # rounded alike: the bytes tell them apart
            below, above = f"{unfit.limit} B", f"{bound} B"
        return PlanUnavailable(
            unfit.limit,
            unplanned.UNDER_OP_BOUND,
            f"swap limit {below} is under the op-wise bound {above}, the bytes one op needs"
            " on the device at once: no plan fits it",
            bound,
        )
    reason = f"no schedule found for limit {limit}"
    if unfit.beyond == "deadline":
        return PlanUnavailable(
            unfit.limit,
            unplanned.NO_SCHEDULE,
            reason + " before the daemon's deadline for a plan (its setting plan_deadline_s),"
            " where the search stopped: a longer deadline may find one",
        )
    if unfit.footprint is not None:
        reason += f" (the one made for it needs {format_size(unfit.footprint)} once placed)"
    lowest = 0
    if gbps is not None:
        proof = step_bound(iteration, unfit.limit, gbps, gbps, recompute=False)
        if proof.ns is None and proof.reason.startswith("tick "):
            tick = int(proof.reason.split()[1])
            op = next((k for k, o in enumerate(iteration.ops) if o.tick >= tick), None)
            where = f"before op {op}" if op is not None else f"at tick {tick}"
            reason += (
                f": swaps alone cannot free enough {where} (the iteration's live bytes exceed"
                f" the limit by up to {format_size(proof.excess_bytes)}, and there not enough of"
                " them can leave)"
            )
            lowest = cover_floor(iteration)  # under it no plan fits; at it, one may
    return PlanUnavailable(unfit.limit, unplanned.NO_SCHEDULE, reason, lowest)


def _checked(
    update: pool_pb2.PlanUpdate,
    path: Path,
    iteration: Iteration,
    swap_limit: int,
    gbps: float,
    lease: int | None,
    measured: bool = False,
) -> Planned | Defect:
    """A cached `update` (from `path`) as a plan to send, or the defect that refuses it: its
    version, the iteration, limit and bandwidth it was made for (any bandwidth without a
    limit: nothing is copied; `measured`: one within `MEASURED_SPREAD` of `gbps`), then, with
    its prediction simulated again on this run's op times at the session's bandwidth
    (`wire.refreshed`), `wire.check` within `lease`. The bytes are anyone's: any error they
    raise is a defect, not a failure."""
    from tidalplan import wire
    from tidalplan.learn import signature

    if update.version != planupdate.ARENA_VERSION:
        return Defect(path, f"plan version {update.version}, not {planupdate.ARENA_VERSION}")
    if update.signature != signature(iteration):
        return Defect(path, "made for another iteration (its signature is not this one's)")
    made_for = (update.limit_bytes, update.prediction.copy_gbps)
    if made_for[0] != swap_limit or (swap_limit and not _serves(made_for[1], gbps, measured)):
        return Defect(
            path,
            f"made for limit {made_for[0]} at {made_for[1]:g} GB/s, not the session's"
            f" {swap_limit} at {gbps:g} GB/s",
        )
    try:
        update = wire.refreshed(iteration, update, gbps)
    except Exception as e:  # ValueError and its kin, and what odd values raise (OverflowError)
        return Defect(path, f"refused by wire.refreshed: {type(e).__name__}: {e}")
    try:
        return Planned(update, wire.check(iteration, update, lease=lease), "cache")
    except Exception as e:
        return Defect(path, f"refused by wire.check: {type(e).__name__}: {e}")


def _checked_paged(
    update: pool_pb2.PlanUpdate,
    path: Path,
    iteration: Iteration,
    swap_limit: int,
    gbps: float,
    page: int,
    persistent_at: list[tuple[int, bool]],
    lease: int | None,
    measured: bool = False,
) -> PlannedPaged | Defect:
    """A cached paged `update` (from `path`) as a plan to send, or the defect that refuses
    it: its version and page, then, with its prediction simulated again on this run's op
    times (`wire.refreshed_paged`; `measured`: at `gbps`, when it was made within
    `MEASURED_SPREAD` of it), `wire.check_paged` (the iteration, limit, bandwidth and
    persistent addresses it was made for), then its mapped peak within `lease`. The bytes are
    anyone's: any error they raise is a defect, not a failure."""
    from tidalplan import wire

    if update.version != planupdate.PAGED_VERSION:
        return Defect(path, f"plan version {update.version}, not {planupdate.PAGED_VERSION}")
    if update.page_bytes != page:
        return Defect(
            path, f"made for pages of {update.page_bytes} bytes, not the session's {page}"
        )
    made_at = update.prediction.copy_gbps
    if measured and not _serves(made_at, gbps, measured):
        return Defect(
            path,
            f"made at {made_at:g} GB/s, more than {MEASURED_SPREAD:g} times from the"
            f" {gbps:g} GB/s this backend measured",
        )
    try:
        update = wire.refreshed_paged(
            iteration, update, persistent_at, gbps=gbps if measured else None
        )
    except Exception as e:  # ValueError and its kin, and what odd values raise
        return Defect(path, f"refused by wire.refreshed_paged: {type(e).__name__}: {e}")
    try:
        checked = wire.check_paged(iteration, update, swap_limit, gbps, persistent_at)
    except Exception as e:
        return Defect(path, f"refused by wire.check_paged: {type(e).__name__}: {e}")
    if lease is not None and update.mapped_peak_bytes > lease:
        return Defect(
            path,
            f"maps {update.mapped_peak_bytes} bytes at most, more than the session's device"
            f" lease of {lease}",
        )
    return PlannedPaged(update, checked, "cache")


def _serves(made_at: float, gbps: float, measured: bool) -> bool:
    """Whether a plan made with copies at `made_at` GB/s serves a session whose copies run at
    `gbps`: the same, or, `measured` (the backend's figure, not a throttle), within
    `MEASURED_SPREAD` of it."""
    if not measured:
        return made_at == gbps
    return made_at > 0 and max(made_at, gbps) <= MEASURED_SPREAD * min(made_at, gbps)
