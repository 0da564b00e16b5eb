"""The planner: a session's iteration as a `Job` → the checked plan to send, or why none.

`Planner.run` does the work a plan costs: it extracts the steady iteration of the job's
shape from its events (`learn.extract_shape`) and plans it as `tidalpool simulate` does
(`tidalplan.placed`): under the session's swap limit, the swap schedule of tidalpool's
search, swaps only (its executor does not rebuild blocks), split into the device pieces it
leaves and placed, made for lower limits until the footprint fits (`placed.fit`); without
one, every block placed whole (`placed.unlimited`). The plan is written as a PlanUpdate
(`tidalplan.wire`), then that update as a whole is checked again by `wire.check` (schedule
simulated and validated, placement validated over its pieces) before it is cached and
returned:

    iteration ──▶ cache (signature, limit, bandwidth, version) ──▶ wire.check ──┬──▶ Made
        │            none there, or a defect (logged once)                      │
        └──▶ fit / unlimited ──▶ wire.encode ──▶ wire.check ──▶ cache ──────────┘

A plan that does not fit the limit, or whose footprint is more than the session's device
lease, is `Refused` with what the session is told (`PlanUnavailable`: under the op-wise
bound, with that bound as the lowest limit that could work; over the lease; no schedule
found). A cached plan is checked the same way before it is used, against the session's lease
too, and must have been made for the session's limit and bandwidth. The cache is another
user's to write into: whatever is wrong with an entry (unreadable, not a regular file, too
large, not a plan, or refused by the check) is a defect, logged as `plan.cache_defect` and
counted, and the iteration is planned as if there were no entry; the plan made then replaces
it. A defect is never the session's planning failure.

A session under virtual residency (`Job.page_bytes`) is planned the same way with
`wire.paged_session_plan`, its persistent blocks where its step marks say they are
(`Job.live_at`): written by `wire.encode_paged` (version 3), checked by `wire.check_paged`
(its mapped pages under the limit, its mapped peak within the lease), and cached under a name
that holds the page and those addresses too. While a persistent block of its iteration is
missing from its latest step mark, it is `Waiting`.

The daemon runs the planner in a process of its own (`PlannerProcess`): a plan computes in
Python for up to `plan_deadline_s`, and on the daemon's interpreter it would take the GIL from
every thread that serves clients (attaches, health, the front door). That process is killed
when a job outlives its deadline by `KILL_GRACE_S` (extraction and the plan's check are not
cut by the search's deadline) and started again for the next; the job is then a failure
(`PlannerStopped`), as is one whose process ended under it.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import queue
import signal
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from logging.handlers import QueueHandler
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from tidalcore import planupdate, unplanned
from tidalcore.events import Events
from tidalcore.units import ALIGNMENT, format_size
from tidalcore.unplanned import PlanUnavailable
from tidalcore.v1 import pool_pb2
from tidalplan.model import Iteration

from tidalpoold import plan_cache
from tidalpoold.plan_cache import Defect, PlanCache
from tidalpoold.settings import Settings

if TYPE_CHECKING:
    from multiprocessing.process import BaseProcess

    from tidalplan.paged import PagedPlan
    from tidalplan.placed import Combined

log = logging.getLogger("tidalpoold.planning")

Taken = TypeVar("Taken")

KILL_GRACE_S = 5.0
"""How long past its `plan_deadline_s` a job may run in the planner's process before that
process is killed (and started again for the next job)."""

MEASURED_SPREAD = 1.5
"""A cached plan for an unthrottled session serves a daemon whose backend measured a copy
bandwidth up to this factor from the one it was made at (its prediction retimed at this
daemon's); further apart, the session gets a plan made for its own."""


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


_Made = TypeVar("_Made", Planned, PlannedPaged)


@dataclass(frozen=True, slots=True)
class Job:
    """One plan to make: the session's events and what its plan must hold to."""

    session: str  # its id, for the log
    events: Events
    shape: str  # the iteration shape to plan ("": the session's one shape)
    several_shapes: bool  # the session has stepped into a second shape
    swap_limit: int  # 0: none
    gbps: float  # the copy bandwidth its swaps are planned at
    measured: bool  # `gbps` is what the backend measured (the session does not throttle)
    device_lease: int | None  # bytes; None: not bounded
    host_lease: int | None
    budget_s: float  # what was left of plan_deadline_s when the job was handed over
    page_bytes: int = 0  # under virtual residency: its page; 0: a contiguous session
    live_at: Mapping[int, tuple[int, bool]] = field(default_factory=dict)  # its step mark's


@dataclass(frozen=True, slots=True)
class Made:
    """A plan to send: the update (tagged with its shape), where it came from ("cache", or
    the solver that placed it), the height and lower bound the session's footprint is
    reported by, and what its kind of plan says of itself (for the log)."""

    update: pool_pb2.PlanUpdate
    source: str
    height: int
    lower_bound: int
    about: dict[str, int]

    def __reduce__(self) -> tuple[Callable[..., Made], tuple[object, ...]]:
        """Pickled with its update as bytes (the message's class pickles by a module name of
        the schema's, not this package's)."""
        about = (self.source, self.height, self.lower_bound, self.about)
        return _made, (self.update.SerializeToString(), *about)


def _made(update: bytes, source: str, height: int, lower_bound: int, about: dict[str, int]) -> Made:
    """A pickled `Made` again."""
    return Made(pool_pb2.PlanUpdate.FromString(update), source, height, lower_bound, about)


@dataclass(frozen=True, slots=True)
class Refused:
    """No plan to send (`unfit` says why) and what the session is told."""

    unfit: Unfit
    told: PlanUnavailable


@dataclass(frozen=True, slots=True)
class TooLarge:
    """The iteration makes more allocations than the daemon plans (max_plan_allocations)."""

    allocations: int


@dataclass(frozen=True, slots=True)
class Waiting:
    """A paged session's persistent blocks its step marks have not placed (these ids)."""

    missing: list[int]


Outcome = Made | Refused | TooLarge | Waiting


class PlannerStopped(Exception):
    """The planner's process was killed past the job's deadline, or ended under it."""


class PlanningFailed(Exception):
    """The planner raised in its process; the message is its one-line why."""


class Planner:
    """Makes a daemon's plans (`run`), here: its settings, and the plan cache it shares with
    the node's other daemons."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.cache = PlanCache(settings.plan_cache_dir, settings.plan_cache_bytes)
        self.defects = 0  # cache entries refused (and planned past)

    def warm(self) -> None:
        """Import the planner's modules (a few tenths of a second), as the first plan would."""
        _import_planner()

    def close(self) -> None:
        """Nothing runs but the caller's thread: nothing to stop."""

    def run(self, job: Job) -> Outcome:
        """The plan `job` asks for of its shape's steady iteration, or why there is none (see
        the module); what the planner raises is the caller's, a failure."""
        from tidalplan.learn import extract_shape, to_problem
        from tidalplan.placement import lower_bound

        started = time.perf_counter()

        def budget() -> float:
            """What is left of the job's budget: the solver starts no new round or layout past
            it."""
            return max(0.0, job.budget_s - (time.perf_counter() - started))

        iteration = extract_shape(job.events, job.shape)
        if job.several_shapes:  # the next iteration may be of another shape
            iteration = dataclasses.replace(iteration, boundary_swaps=False)
        if len(iteration.blocks) > self.settings.max_plan_allocations:
            return TooLarge(len(iteration.blocks))
        if job.page_bytes:
            return self._run_paged(job, iteration, budget)
        made = _closed_else_open(
            job.session,
            iteration,
            lambda it: self.make(
                it,
                job.swap_limit,
                job.gbps,
                job.device_lease,
                job.host_lease,
                measured=job.measured,
                budget_s=budget(),
            ),
        )
        if isinstance(made, Unfit):
            return _refused(made, iteration, job, budget())
        plan = made.update
        plan.shape = job.shape
        bound = lower_bound(to_problem(made.checked.pieces, ALIGNMENT)[0])
        about = {
            "height": plan.height_bytes,
            "footprint": plan.prediction.footprint_bytes,
            "lower_bound": bound,
        }
        return Made(plan, made.source, plan.height_bytes, bound, about)

    def _run_paged(self, job: Job, iteration: Iteration, budget: Callable[[], float]) -> Outcome:
        """`run` for a session under virtual residency: its paged plan, its persistent blocks
        where its latest step mark put them; Waiting while one of them is not there."""
        persistent_at, missing = placed_by_session(iteration, job.live_at)
        if missing:
            return Waiting(missing)
        made = _closed_else_open(
            job.session,
            iteration,
            lambda it: self.make_paged(
                it,
                job.swap_limit,
                job.gbps,
                job.page_bytes,
                persistent_at,
                job.device_lease,
                job.host_lease,
                measured=job.measured,
                budget_s=budget(),
            ),
        )
        if isinstance(made, Unfit):
            return _refused(made, iteration, job, budget())
        plan = made.update
        plan.shape = job.shape
        peak = plan.mapped_peak_bytes
        about = {"page": plan.page_bytes, "region": plan.region_bytes, "mapped_peak": peak}
        return Made(plan, made.source, peak, peak, about)

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
            self.defects += 1
            log.warning(
                "plan.cache_defect", extra={"key": name, "path": str(made.path), "why": made.why}
            )
            return None
        return made


def _refused(unfit: Unfit, iteration: Iteration, job: Job, left_s: float) -> Refused:
    """What `job`'s session is told of `unfit` (`unavailable`); a search that did not fit its
    limit with nothing left of its budget (`left_s`) was cut at the plan's deadline."""
    if unfit.beyond == "limit" and left_s <= 0:
        unfit = dataclasses.replace(unfit, beyond="deadline")
    told = dataclasses.replace(unavailable(unfit, iteration, job.gbps), shape=job.shape)
    return Refused(unfit, told)


@dataclass(frozen=True, slots=True)
class _Done:
    """The planner process's answer to a job: its outcome, or the one-line why it raised
    (`failure`); the cache defects it met; what it logged meanwhile."""

    outcome: Outcome | None
    failure: str
    defects: int
    records: list[logging.LogRecord]


class PlannerProcess:
    """A `Planner` in a process of its own, one job at a time. The process is spawned (a
    fork would copy the daemon's threads' locks mid-use) and imports the planner at once;
    `run` hands it a job and waits for its outcome, killing the process when the job outlives
    its budget by `grace_s` (the job is then `PlannerStopped`), and a process that ended is
    started again for the next job. What it logs is logged here, as the daemon's."""

    def __init__(
        self, settings: Settings, grace_s: float = KILL_GRACE_S, start: bool = True
    ) -> None:
        """`start`: start the process now (else at `warm` or the first job)."""
        self.settings = settings
        self.grace_s = grace_s
        self.defects = 0  # cache entries the process refused (and planned past)
        self.restarts = 0  # processes started after the first
        self._context = multiprocessing.get_context("spawn")
        self._one_job = threading.Lock()
        self._state = threading.Lock()  # what the deadline's timer reads too
        self._process: BaseProcess | None = None
        self._conn: Connection | None = None
        self._busy: BaseProcess | None = None  # the process a job runs on now
        self._overdue = False
        self._closed = False
        if start:
            self._start()

    @property
    def pid(self) -> int | None:
        """The process's pid (None before it is started, and between a failed start and the next
        job)."""
        process = self._process
        return process.pid if process is not None else None

    def warm(self) -> None:
        """Start the process unless it runs (or a job is starting it): the next job then finds
        the planner imported. A failure to start is the next job's to report."""
        if not self._one_job.acquire(blocking=False):
            return  # a job runs on it, or starts it
        try:
            if self._process is None and not self._closed:
                self._start()
        except OSError as e:
            log.warning("plan.planner_not_started", extra={"why": str(e)})
        finally:
            self._one_job.release()

    def _start(self) -> None:
        ours, theirs = self._context.Pipe()
        level = logging.getLogger("tidalpoold").getEffectiveLevel()
        process = self._context.Process(
            target=_serve, args=(theirs, self.settings, level), name="planner", daemon=True
        )
        try:
            process.start()
        finally:
            theirs.close()
        self._process, self._conn = process, ours

    def run(self, job: Job) -> Outcome:
        """`Planner.run(job)` in the process; PlannerStopped when it was killed past the job's
        budget or ended under it, PlanningFailed when the planner raised there. A process
        that ended between jobs (the OOM killer's choice, say) is replaced first: no job is
        lost to it."""
        with self._one_job:
            if self._closed:
                raise PlannerStopped("the daemon is stopping")
            if self._process is not None and self._process.exitcode is not None:
                self._replace("between plans")
            if self._conn is None:
                self._start()  # the last one could not be started
            assert self._process is not None and self._conn is not None
            limit_s = job.budget_s + self.grace_s
            with self._state:
                self._busy, self._overdue = self._process, False
            timer = threading.Timer(limit_s, self._kill_overdue, args=(self._process,))
            timer.daemon = True
            timer.start()
            try:
                self._conn.send(job)
                done: _Done = self._conn.recv()
            except (EOFError, OSError) as e:
                if self._overdue:
                    why = (
                        f"the planner was stopped {limit_s:.1f} s into the plan,"
                        f" {self.grace_s:g} s past what was left of the daemon's deadline for"
                        " a plan (its setting plan_deadline_s)"
                    )
                    self._replace("past its deadline")
                else:
                    how = self._replace("while planning")
                    why = f"the planner's process ended while making this plan ({how})"
                raise PlannerStopped(why) from e
            finally:
                with self._state:
                    self._busy = None
                timer.cancel()
        for record in done.records:
            logging.getLogger(record.name).handle(record)
        self.defects += done.defects
        if done.outcome is None:
            raise PlanningFailed(done.failure)
        return done.outcome

    def _kill_overdue(self, process: BaseProcess) -> None:
        """The deadline's timer: kill `process` if the job is still on it."""
        with self._state:
            if self._busy is process:
                self._overdue = True
                process.kill()

    def _replace(self, when: str) -> str:
        """Reap the process (it ended or is killed now, `when`), start the next one unless
        closing, log `plan.planner_stopped` and say how the process ended."""
        process, conn = self._process, self._conn
        self._process = self._conn = None
        assert process is not None and conn is not None
        process.kill()
        process.join()
        conn.close()
        code = process.exitcode or 0
        how = f"killed by signal {-code}" if code < 0 else f"exit status {code}"
        log.warning("plan.planner_stopped", extra={"pid": process.pid, "how": how, "when": when})
        if not self._closed:
            self.restarts += 1
            try:
                self._start()
            except OSError as e:  # the next job tries again
                log.warning("plan.planner_not_started", extra={"why": str(e)})
        return how

    def close(self) -> None:
        """Stop the process; a job on it fails (PlannerStopped)."""
        with self._state:
            self._closed = True
            process = self._process
        if process is not None:
            process.kill()
        with self._one_job:  # the job on it, if any, has seen it end
            process, conn = self._process, self._conn
            self._process = self._conn = None
        if process is not None:
            process.join()
        if conn is not None:
            conn.close()


def _serve(conn: Connection, settings: Settings, level: int) -> None:
    """The planner process: jobs from `conn` and their `_Done` back, until the daemon closes
    its end (or is gone: the next answer cannot be sent)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the daemon's to handle; this ends with it
    records: queue.SimpleQueue[logging.LogRecord] = queue.SimpleQueue()
    root = logging.getLogger()
    root.handlers[:] = [QueueHandler(records)]
    root.setLevel(level)
    planner = Planner(settings)
    _import_planner()
    while True:
        try:
            job = conn.recv()
        except (EOFError, OSError):
            return
        before, outcome, failure = planner.defects, None, ""
        try:
            outcome = planner.run(job)
        except Exception as e:
            failure = " ".join(f"{type(e).__name__}: {e}".split())  # one line
        logged = []
        while not records.empty():
            logged.append(records.get())
        done = _Done(outcome, failure, planner.defects - before, logged)
        try:
            conn.send(done)
        except OSError:  # the daemon is gone
            return
        except Exception as e:  # it did not pickle, so nothing was sent: say so instead
            why = " ".join(f"the plan could not be returned: {type(e).__name__}: {e}".split())
            conn.send(dataclasses.replace(done, outcome=None, failure=why, records=[]))


def _closed_else_open(
    session: str, iteration: Iteration, make: Callable[[Iteration], _Made | Unfit]
) -> _Made | Unfit:
    """`make(iteration)`; where that is a plan of a shape of several with the persistent blocks
    on the device at the boundary and none fits (their bytes alone may be over the limit),
    the plan that may keep them away there: the iterations of other shapes then find them
    away and bring them in on demand."""
    made = make(iteration)
    if isinstance(made, Unfit) and not iteration.boundary_swaps:
        why = "no plan fits with every persistent block on the device at the boundary"
        log.info("plan.boundary_open", extra={"session": session, "why": why})
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
