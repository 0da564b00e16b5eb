"""The daemon's planning of a session from its trace: the plan `tidalpool simulate` makes for
its swap limit, checked as a whole before it is sent, cached by what it was made for and checked
again when taken from the cache; a plan that does not fit is not sent."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from tidalcore.events import ALLOC, FREE, ITER, OP, READ, WRITE, Events
from tidalcore.units import Bytes, format_size
from tidalcore.unplanned import FAILED, NO_SCHEDULE, TOO_LARGE, UNDER_OP_BOUND, PlanUnavailable
from tidalcore.v1 import pool_pb2
from tidalplan import wire
from tidalplan.learn import extract, signature
from tidalpoold import plan_cache
from tidalpoold.backends import SimBackend
from tidalpoold.plan_worker import PlanWorker, Turns
from tidalpoold.planning import Job, Outcome, Planned, Planner, Unfit
from tidalpoold.sessions import PlanFootprint, Reason, Registry, Session
from tidalpoold.settings import Settings
from tidalpoold.trace import decode_chunk

C = 2 * 1024 * 1024
WAIT_S = 60.0  # for a state, on a busy machine

# As in test_swap_policies: A (1000 B) is idle from op1 to op7, B needs its room between.
#   t0 a A   t1 op 100 A   t2 op 2000   t3 a B   t4 op 3000 B   t5 f B   t6 op 1500
#   t7 op 500 A   t8 f A
HIDE = ["a A 1000", "o 100 A", "o 2000", "a B 1000", "o 3000 B", "f B", "o 1500", "o 500 A", "f A"]


def chunk(steps: list[str], persistent: dict[str, int], iterations: int = 3) -> pool_pb2.TraceChunk:
    """The events of `iterations` steps of `steps` (`tests/unit/iterations.py`'s syntax), each
    after a step mark, then a last mark; persistent blocks allocated first."""
    msg = pool_pb2.TraceChunk(first_event=0)

    def event(kind: int, block: int, size: int = 0, ns: int = 0, name: int = 0) -> None:
        for column, value in zip(
            ("kinds", "block_ids", "sizes", "durations_ns", "name_ids"),
            (kind, block, size, ns, name),
            strict=True,
        ):
            getattr(msg, column).append(value)

    ids = {name: k + 1 for k, name in enumerate(persistent)}
    for name, size in persistent.items():
        event(ALLOC, ids[name], size)
    names: dict[str, int] = {}
    for n in range(iterations):
        event(ITER, n)
        live = dict(ids)
        for tick, step in enumerate(steps):
            kind, *args = step.split()
            if kind == "a":
                live[args[0]] = len(ids) + 1 + n * len(steps) + tick
                event(ALLOC, live[args[0]], int(args[1]))
            elif kind == "f":
                event(FREE, live.pop(args[0]))
            else:
                op = f"op{tick}"
                names.setdefault(op, len(names) + 1)
                for block in args[1:]:
                    event(WRITE if block.startswith(">") else READ, live[block.lstrip(">")])
                event(OP, tick, ns=int(args[0]), name=names[op])
    event(ITER, iterations)
    for op, name_id in names.items():
        msg.new_names[name_id] = op
    return msg


def settings_in(directory: Path, **changes: float) -> Settings:
    """Pools of four chunks (C bytes), leases of one, sockets and plan cache in `directory`."""
    changes = {"plan_time_limit_s": 1.0, **changes}
    return Settings(
        device_pool=Bytes(4 * C),
        host_pool=Bytes(4 * C),
        default_device_lease=Bytes(C),
        default_host_lease=Bytes(C),
        chunk_size=Bytes(C),
        socket_dir=directory,
        plan_cache_dir=directory / "plans",
        metrics_address="",
        **changes,  # type: ignore[arg-type]
    )


@pytest.fixture
def registry(tmp_path: Path) -> Iterator[Registry]:
    backend = SimBackend(4 * C, 4 * C, C)
    yield Registry(settings_in(tmp_path), backend)
    backend.close()


@pytest.fixture
def planner(registry: Registry) -> Iterator[PlanWorker]:
    p = PlanWorker(registry.settings)
    yield p
    p.close()


def session(
    registry: Registry,
    swap_limit: int,
    copy_gbps: float = 1.0,
    steps: list[str] = HIDE,
    persistent: dict[str, int] | None = None,
) -> Session:
    s = registry.open(C, C, "job", 1, 0)
    registry.attach(s, swap_limit, copy_gbps)
    s.trace.add(chunk(steps, persistent or {}))
    return s


def sent(s: Session) -> pool_pb2.PlanUpdate | None:
    """The plan on the session's stream, if any (nothing else may be there)."""
    if s.outbox.empty():
        return None
    message = s.outbox.get_nowait()
    assert message is not None and message.WhichOneof("body") == "plan", message
    return message.plan


def told(s: Session) -> list[PlanUnavailable]:
    """Every PlanUnavailable on the session's stream (nothing else may be there)."""
    out = []
    while not s.outbox.empty():
        message = s.outbox.get_nowait()
        assert message is not None and message.WhichOneof("body") == "unplanned", message
        out.append(PlanUnavailable.of(message.unplanned))
    return out


def end(registry: Registry, *sessions: Session) -> None:
    for s in sessions:
        registry.end(s.id, Reason.REASON_DETACHED, "test")


def test_a_swapping_session_gets_the_checked_plan_of_its_limit(
    registry: Registry, planner: PlanWorker, caplog: pytest.LogCaptureFixture
) -> None:
    a = session(registry, swap_limit=1500)
    with caplog.at_level(logging.INFO, "tidalpoold.planning"):
        plan = planner.plan(a)
    assert plan is not None and sent(a) == plan
    # A out after op1 (op 0), issued back at op6 (op 3) for op7 (op 4); B between, in A's
    # bytes: one 1024-byte slot, A's pieces and B all at 0.
    assert (plan.version, plan.plan_id, list(plan.sizes), list(plan.offsets)) == (
        2,
        1,
        [1000, 1000],
        [0, 0],
    )
    assert list(plan.swap_blocks) == [0]
    assert (list(plan.swap_out_after), list(plan.swap_in_at), list(plan.swap_in_before)) == (
        [0],
        [3],
        [4],
    )
    assert list(plan.swap_in_offsets) == [0]
    assert (plan.height_bytes, plan.limit_bytes, plan.prediction.footprint_bytes) == (
        1024,
        1500,
        1024,
    )
    assert (plan.prediction.step_ns, plan.prediction.stall_ns) == (7100, 0)  # hidden
    assert a.plan == PlanFootprint(1024, 1024)
    assert (planner.plans_made, planner.plans_cached, planner.plans_unfit) == (1, 0, 0)
    (line,) = [r for r in caplog.records if r.getMessage() == "plan.sent"]
    assert (line.footprint, line.swaps, line.predicted_step_ns, line.limit) == (1024, 1, 7100, 1500)  # type: ignore[attr-defined]
    # The next session of the same job, limit and bandwidth: the same plan, from the cache.
    b = session(registry, swap_limit=1500)
    again = planner.plan(b)
    assert again is not None and again.plan_id == 2
    again.plan_id = 1
    assert again == plan
    assert (planner.plans_made, planner.plans_cached) == (1, 1)
    end(registry, a, b)


def test_a_plan_that_does_not_fit_the_limit_is_not_sent(
    registry: Registry, planner: PlanWorker, caplog: pytest.LogCaptureFixture
) -> None:
    # 1000 live bytes fit a limit of 1000, but each block takes 1024 once aligned; below it
    # op1 cannot run at all.
    s = session(registry, swap_limit=1000)
    with caplog.at_level(logging.INFO, "tidalpoold.planning"):
        assert planner.plan(s) is None
    assert s.plan is None
    # 1000 is the op-wise bound itself: a schedule is possible, its placement is not.
    assert told(s) == [
        PlanUnavailable(
            1000,
            NO_SCHEDULE,
            "no schedule found for limit 1000 B (the one made for it needs 1 KiB once placed)",
        )
    ]
    assert (planner.plans_made, planner.plans_unfit, planner.plans_failed) == (0, 1, 0)
    (line,) = [r for r in caplog.records if r.getMessage() == "plan.unfit"]
    assert (line.footprint, line.limit) == (1024, 1000)  # type: ignore[attr-defined]
    assert not list(registry.settings.plan_cache_dir.glob("*.plan"))  # nothing cached
    end(registry, s)


@pytest.mark.parametrize(
    ("persistent", "limit", "bound", "shown"),
    [
        ({}, 999, 1000, ("999 B", "1000 B")),  # op1 reads A (1000 B)
        # op1 reads A and the persistent W: both count; rounded alike, the sizes are exact
        ({"W": 300}, 1299, 1300, ("1299 B", "1300 B")),
        ({"W": 300}, 1000, 1300, ("1000 B", "1.3 KiB")),
    ],
)
def test_a_limit_under_the_op_wise_bound_is_told_with_the_bound(
    registry: Registry,
    planner: PlanWorker,
    persistent: dict[str, int],
    limit: int,
    bound: int,
    shown: tuple[str, str],
) -> None:
    steps = ["a A 1000", "o 100 A" + (" W" if persistent else ""), *HIDE[2:]]
    s = session(registry, swap_limit=limit, steps=steps, persistent=persistent)
    assert planner.plan(s) is None
    (why,) = told(s)
    assert why == PlanUnavailable(
        limit,
        UNDER_OP_BOUND,
        f"swap limit {shown[0]} is under the op-wise bound {shown[1]}, the bytes one op needs on"
        " the device at once: no plan fits it",
        bound,
    )
    assert why.line().endswith(
        f"; the lowest limit that could work is {format_size(bound)} ({bound} bytes)"
    )
    assert (planner.plans_unfit, planner.plans_failed) == (1, 0)
    end(registry, s)


def test_a_failed_plan_is_told_in_one_line(
    registry: Registry, planner: PlanWorker, monkeypatch: pytest.MonkeyPatch
) -> None:
    def fail(*args: object, **kwargs: object) -> None:
        raise ValueError("the iteration\nhas no ops")

    monkeypatch.setattr(planner.planners[0], "make", fail)
    s = session(registry, swap_limit=1500)
    planner._plan_quietly(s)
    assert told(s) == [
        PlanUnavailable(1500, FAILED, "planning failed: ValueError: the iteration has no ops")
    ]
    assert planner.plans_failed == 1
    end(registry, s)


def test_plans_are_cached_by_signature_limit_bandwidth_and_version(
    registry: Registry, planner: PlanWorker
) -> None:
    sessions = [
        session(registry, swap_limit=1500),
        session(registry, swap_limit=2000),
        session(registry, swap_limit=1500, copy_gbps=2.0),
        session(registry, swap_limit=0),
    ]
    for s in sessions:
        assert planner.plan(s) is not None
    assert (planner.plans_made, planner.plans_cached) == (4, 0)
    events_chunk = chunk(HIDE, {})
    events = Events.concat([decode_chunk(events_chunk)], dict(events_chunk.new_names))
    key = signature(extract(events, events.marks()))
    names = sorted(p.name for p in registry.settings.plan_cache_dir.glob("*.plan"))
    assert names == sorted(
        f"{plan_cache.key(key, limit, gbps, wire.VERSION)}.plan"
        for limit, gbps in ((1500, 1.0), (2000, 1.0), (1500, 2.0), (0, 0.0))
    )
    assert all(name.startswith(key.hex() + "-") for name in names)
    end(registry, *sessions)


def test_a_plan_without_a_swap_limit_places_every_block_whole(
    registry: Registry, planner: PlanWorker
) -> None:
    s = session(registry, swap_limit=0, persistent={"W": 300})
    plan = planner.plan(s)
    assert plan is not None
    assert (plan.version, plan.limit_bytes, len(plan.swap_blocks)) == (2, 0, 0)
    assert (list(plan.offsets), plan.height_bytes, plan.resident_persistent_bytes) == (
        [0, 1024],
        2048,
        300,
    )
    assert (plan.prediction.step_ns, plan.prediction.footprint_bytes) == (7100, 2348)
    assert s.plan == PlanFootprint(2048, 2048)
    end(registry, s)


def test_a_cached_plan_that_fails_its_check_is_made_again(
    registry: Registry, planner: PlanWorker, caplog: pytest.LogCaptureFixture
) -> None:
    first = session(registry, swap_limit=1500)
    assert planner.plan(first) is not None
    (path,) = registry.settings.plan_cache_dir.glob("*.plan")
    cached = pool_pb2.PlanUpdate.FromString(path.read_bytes())
    cached.swap_in_before[0] = 2  # A back for op4 (t4), but issued at op6 (t6), after it
    path.write_bytes(cached.SerializeToString())
    second = session(registry, swap_limit=1500)
    with caplog.at_level(logging.INFO, "tidalpoold.planning"):
        plan = planner.plan(second)
    assert plan is not None and list(plan.swap_in_before) == [4]
    assert [r.getMessage() for r in caplog.records][:2] == ["plan.cache_defect", "plan.sent"]
    assert "in_at must lie in [2, in_before]" in caplog.records[0].why  # type: ignore[attr-defined]
    assert (planner.plans_made, planner.plans_cached) == (2, 0)
    fixed = pool_pb2.PlanUpdate.FromString(path.read_bytes())
    assert list(fixed.swap_in_before) == [4]  # the cache holds the new plan
    path.write_bytes(b"\xff not a plan")
    third = session(registry, swap_limit=1500)
    assert planner.plan(third) is not None
    assert (planner.plans_made, planner.plans_cached) == (3, 0)
    end(registry, first, second, third)


def test_a_limit_swaps_alone_cannot_reach_is_told_where() -> None:
    # mlp.b64 at 0.9 of its peak: over the op-wise bound, but at its optimizer's foreach ops
    # (op 24) what is live cannot be brought under the limit by swaps alone.
    from tidaloffline.simulate_command import load
    from tidalplan.autoswap import load as curve
    from tidalpoold.planning import Unfit, unavailable

    it = load(Path(__file__).resolve().parents[2] / "traces" / "mlp.b64.trace.csv")
    limit = int(0.9 * int(curve(it).max()))
    told = unavailable(Unfit(None, limit, limit, 1), it, 12.0)
    assert told.kind == NO_SCHEDULE
    assert told.reason.startswith(f"no schedule found for limit {format_size(limit)}: swaps")
    assert "swaps alone cannot free enough before op 24 " in told.reason
    # the lowest limit that could work: there every tick can be covered, just under it not
    from tidalplan.bound import step_bound

    assert told.lowest_limit_bytes > limit
    at = step_bound(it, told.lowest_limit_bytes, 12.0, 12.0, recompute=False)
    under = step_bound(it, told.lowest_limit_bytes - 1, 12.0, 12.0, recompute=False)
    assert "cannot be covered" not in at.reason and "cannot be covered" in under.reason
    # without the bandwidth, no proof is looked for
    bare = unavailable(Unfit(None, limit, limit, 1), it)
    assert bare.reason == f"no schedule found for limit {format_size(limit)}"


def test_a_plan_whose_swaps_need_more_than_the_host_lease_is_told_so() -> None:
    from tidalcore.unplanned import OVER_LEASE
    from tidalpoold.planning import Unfit, unavailable

    events_chunk = chunk(HIDE, {})
    events = Events.concat([decode_chunk(events_chunk)], dict(events_chunk.new_names))
    it = extract(events, events.marks())
    told = unavailable(Unfit(3 << 20, 2 << 20, 1 << 20, 1, "host"), it)
    assert told.kind == OVER_LEASE and told.lowest_limit_bytes == 0
    assert told.reason == (
        "the plan's swapped-out blocks need up to 3 MiB of the host lease at once, more than"
        " the session's host lease of 2 MiB: attach with a host_limit of 3 MiB or more"
    )


def test_a_contiguous_plan_is_judged_against_the_host_lease_too(
    registry: Registry, planner: PlanWorker
) -> None:
    """A out from op1 to op7 needs 1024 host bytes (its 1000 aligned): a host lease of 1000
    cannot hold it, made or from the cache, and the plan is not sent; 1024 can."""
    s = session(registry, swap_limit=1500)
    events = Events.concat(list(s.trace.chunks), dict(s.trace.names))
    it = extract(events, events.marks())
    made_by = Planner(registry.settings)
    short = made_by.make(it, 1500, 1.0, C, host=1000)
    assert short == Unfit(1024, 1000, 1500, 1, "host")
    assert made_by.make(it, 1500, 1.0, C, host=1000) == short  # from the cache: judged as well
    made = made_by.make(it, 1500, 1.0, C, host=1024)
    assert isinstance(made, Planned) and list(made.update.swap_blocks) == [0]
    end(registry, s)


def test_a_cached_plan_serves_a_run_whose_ops_took_other_times(
    registry: Registry, planner: PlanWorker
) -> None:
    """The same job again, its ops measured 10% slower (as every run measures them a little
    differently): its plan comes from the cache, with the same schedule and placement, and its
    prediction is this run's timeline, not the last one's."""
    first = session(registry, swap_limit=1500)
    made = planner.plan(first)
    slower = []
    for step in HIDE:
        words = step.split()
        if words[0] == "o":
            words[1] = str(int(words[1]) * 11 // 10)
        slower.append(" ".join(words))
    assert slower[1] == "o 110 A" and slower[6] == "o 1650"
    second = session(registry, swap_limit=1500, steps=slower)
    cached = planner.plan(second)
    assert made is not None and cached is not None
    assert (planner.plans_made, planner.plans_cached, planner.cache_defects) == (1, 1, 0)
    for column in ("offsets", "swap_blocks", "swap_out_after", "swap_in_at", "swap_in_before"):
        assert getattr(cached, column) == getattr(made, column), column
    assert (made.prediction.step_ns, cached.prediction.step_ns) == (7100, 7810)  # hidden both
    end(registry, first, second)


def test_a_plan_without_a_swap_limit_is_cached_whatever_the_bandwidth(
    registry: Registry, planner: PlanWorker
) -> None:
    """Nothing is copied without a swap limit: two daemons that measured their copies at
    different speeds serve the same job the same plan, from the cache."""
    first = session(registry, swap_limit=0, copy_gbps=1.0)
    made = planner.plan(first)
    second = session(registry, swap_limit=0, copy_gbps=2.0)
    cached = planner.plan(second)
    assert made is not None and cached is not None
    assert (planner.plans_made, planner.plans_cached, planner.cache_defects) == (1, 1, 0)
    assert (cached.offsets, cached.height_bytes) == (made.offsets, made.height_bytes)
    assert (made.prediction.copy_gbps, cached.prediction.copy_gbps) == (1.0, 2.0)
    end(registry, first, second)


def test_an_unthrottled_sessions_plan_serves_daemons_that_measured_about_as_much(
    registry: Registry,
) -> None:
    """Copies not throttled run at what each daemon's backend measured at start, a little
    different each time: a plan cached by a daemon that measured 1.0 GB/s serves one that
    measured 1.25 (retimed at 1.25), and one that measured 2.0 gets a plan made for it."""
    workers = [PlanWorker(registry.settings, copy_gbps=g) for g in (1.0, 1.25, 2.0)]
    try:
        first, second, third = (session(registry, swap_limit=1500, copy_gbps=0) for _ in workers)
        made = workers[0].plan(first)
        cached = workers[1].plan(second)
        other = workers[2].plan(third)
        assert made is not None and cached is not None and other is not None
        assert (workers[1].plans_made, workers[1].plans_cached) == (0, 1)
        assert (workers[2].plans_made, workers[2].plans_cached) == (1, 0)
        assert workers[2].cache_defects == 1  # made at 1 GB/s: more than 1.5 times from 2
        for column in ("offsets", "swap_blocks", "swap_out_after", "swap_in_before"):
            assert getattr(cached, column) == getattr(made, column), column
        assert [p.prediction.copy_gbps for p in (made, cached, other)] == [1.0, 1.25, 2.0]
        # A throttled session's plan is its bandwidth's alone, measured or not.
        throttled = session(registry, swap_limit=1500, copy_gbps=1.25)
        assert workers[1].plan(throttled) is not None
        assert (workers[1].plans_made, workers[1].plans_cached) == (1, 1)
        end(registry, first, second, third, throttled)
    finally:
        for w in workers:
            w.close()


def capped(worker: PlanWorker, cap: int) -> None:
    """`worker` and its planner with a `max_plan_allocations` of `cap`."""
    worker.settings = dataclasses.replace(worker.settings, max_plan_allocations=cap)
    worker.planners = [Planner(worker.settings)]


def test_an_iteration_of_more_allocations_than_the_cap_is_not_planned_and_told_so(
    registry: Registry, planner: PlanWorker
) -> None:
    """HIDE makes two allocations an iteration: under a cap of one, its session is told the
    count and the setting, and no solve runs; at a cap of two it is planned."""
    capped(planner, 1)
    s = session(registry, swap_limit=1500)
    assert planner.plan(s) is None
    reason = (
        "its iteration makes 2 allocations, more than the 1 this daemon plans (its setting"
        " max_plan_allocations): the session runs without a plan"
    )
    assert told(s) == [PlanUnavailable(1500, TOO_LARGE, reason)]
    assert (planner.plans_too_large, planner.plans_made) == (1, 0)
    capped(planner, 2)
    assert planner.plan(s) is not None and planner.plans_made == 1
    end(registry, s)


def test_a_session_over_the_cap_is_told_before_its_iteration_is_extracted(
    registry: Registry, planner: PlanWorker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With its step marks, a session's allocations are counted from the kinds between the last
    two: over the cap, it is told so and no extraction runs (the sessions behind it in line
    wait for none)."""
    import tidalplan.learn

    capped(planner, 1)
    s = session(registry, swap_limit=1500)
    for before in (10, 20):  # HIDE's iterations: a mark and nine events each
        s.trace.step(pool_pb2.StepMark(events_before=before))
    assert s.trace.allocations_of("") == 2

    def extract_shape(*args: object) -> None:
        raise AssertionError("extracted")

    monkeypatch.setattr(tidalplan.learn, "extract_shape", extract_shape)
    assert planner.plan(s) is None
    reason = (
        "its iteration makes 2 allocations, more than the 1 this daemon plans (its setting"
        " max_plan_allocations): the session runs without a plan"
    )
    assert told(s) == [PlanUnavailable(1500, TOO_LARGE, reason)]
    end(registry, s)


class _Waiting:
    """What Turns looks at of a session: its uid (and its name, to tell them apart)."""

    def __init__(self, name: str, uid: int) -> None:
        self.id, self.uid = name, uid


def test_the_planner_serves_uids_in_turn() -> None:
    """Uid 1 queued five sessions before uid 2's one and uid 3's two: uid 2's waits for one of
    uid 1's, not five; each uid's own go in the order they came."""
    turns = Turns()
    for name, uid in [("a1", 1), ("a2", 1), ("a3", 1), ("a4", 1), ("a5", 1)]:
        turns.put(_Waiting(name, uid))  # type: ignore[arg-type]
    turns.put(_Waiting("b1", 2))  # type: ignore[arg-type]
    turns.put(_Waiting("c1", 3))  # type: ignore[arg-type]
    turns.put(_Waiting("c2", 3))  # type: ignore[arg-type]
    order = []
    for _ in range(8):
        slot, session, _shape = turns.take()  # type: ignore[misc]
        order.append(session.id)
        turns.done(slot, session.uid)
    assert order == ["a1", "b1", "c1", "a2", "c2", "a3", "a4", "a5"]
    assert turns.waiting() == 0
    turns.close()
    assert turns.take() is None  # closed: the planning thread ends


def test_a_plan_cut_at_its_deadline_is_told_so(
    registry: Registry, planner: PlanWorker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past plan_deadline_s the search judges nothing more: what it had found by then does not
    fit, and the session is told that the deadline stopped it."""
    monkeypatch.setattr(planner, "_budget", lambda started: 0.0)
    s = session(registry, swap_limit=1500)
    assert planner.plan(s) is None
    assert told(s) == [
        PlanUnavailable(
            1500,
            NO_SCHEDULE,
            "no schedule found for limit 1.5 KiB before the daemon's deadline for a plan (its"
            " setting plan_deadline_s), where the search stopped: a longer deadline may find one",
        )
    ]
    end(registry, s)


def test_a_plan_waits_for_the_next_iterations_events_or_a_second(
    registry: Registry, planner: PlanWorker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The iteration a plan takes is the one the last step mark ended, and what it leaves live
    is freed in the next: the plan waits until the next iteration's events are in (as many as
    the one before), or CATCH_UP_S passed, so that every daemon of a job's ranks learns the same
    iteration whatever the timing of its stream."""
    from tidalpoold import plan_worker

    s = registry.open(C, C, "job", 1, 0)
    registry.attach(s, 1500, 1.0)
    msg = chunk(HIDE, {}, iterations=3)
    s.trace.add(msg)
    iters = [k for k, kind in enumerate(msg.kinds) if kind == ITER]
    for n, at in enumerate(iters[:3]):  # the third mark: the third iteration's events are in
        s.trace.step(pool_pb2.StepMark(iteration=n, events_before=at))
    assert s.trace.caught_up()
    s.trace.step(pool_pb2.StepMark(iteration=3, events_before=iters[3]))  # none after it yet
    assert not s.trace.caught_up()
    planner.on_step(s, "", ())
    planner.on_events(s)  # a heartbeat, nothing new
    assert (s.id, "") not in planner._queued  # not in line for the planning thread: waiting
    assert (s.id, "") in planner._catching_up
    monkeypatch.setattr(plan_worker, "CATCH_UP_S", 0.0)  # as when a second has passed
    planner.on_events(s)  # planned with what it has
    deadline = time.monotonic() + 60
    while (plan := sent(s)) is None:
        assert time.monotonic() < deadline and planner.plans_failed == 0, "no plan"
        time.sleep(0.01)
    assert plan.limit_bytes == 1500
    end(registry, s)


def test_a_plan_waiting_for_the_next_iteration_goes_once_a_later_mark_ends_it(
    registry: Registry, planner: PlanWorker
) -> None:
    """Where the next iteration is shorter (another shape), its events never match the one
    before: the next step mark, which ends it, is enough."""
    s = registry.open(C, C, "job", 1, 0)
    registry.attach(s, 1500, 1.0)
    msg = chunk(HIDE, {}, iterations=3)
    s.trace.add(msg)
    iters = [k for k, kind in enumerate(msg.kinds) if kind == ITER]
    for n, at in enumerate(iters):
        s.trace.step(pool_pb2.StepMark(iteration=n, events_before=at))
    planner.on_step(s, "", ())
    assert (s.id, "") in planner._catching_up and (s.id, "") not in planner._queued
    s.trace.step(pool_pb2.StepMark(iteration=len(iters), events_before=iters[-1] + 1))
    planner.on_step(s, "", ())
    assert (s.id, "") in planner._queued and (s.id, "") not in planner._catching_up
    end(registry, s)


def test_one_uid_takes_all_planners_but_one() -> None:
    """Three planners: uid 1's plans take two at most; uid 2's takes the third at once, and uid
    1's third waits for one of its own to end."""
    turns = Turns(slots=3)
    for name in ("a1", "a2", "a3"):
        turns.put(_Waiting(name, 1))  # type: ignore[arg-type]
    turns.put(_Waiting("b1", 2))  # type: ignore[arg-type]
    taken = [turns.take() for _ in range(3)]
    assert [(slot, s.id) for slot, s, _ in taken] == [(0, "a1"), (1, "b1"), (2, "a2")]  # type: ignore[misc]
    assert not turns.ready()  # no planner free
    turns.done(1, 2)
    assert not turns.ready()  # a planner free, but uid 1 holds its share
    turns.done(0, 1)
    assert turns.ready()
    slot, s, _ = turns.take()  # type: ignore[misc]
    assert (slot, s.id) == (0, "a3")
    turns.close()


class _Held:
    """A planner whose plans wait until `go` is set, then are made by `made_by`; `warmed`
    once told to warm."""

    def __init__(self, made_by: Planner) -> None:
        self.made_by, self.defects = made_by, 0
        self.go, self.started, self.warmed = threading.Event(), threading.Event(), False

    def run(self, job: Job) -> Outcome:
        self.started.set()
        assert self.go.wait(WAIT_S)
        return self.made_by.run(job)

    def warm(self) -> None:
        self.warmed = True

    def close(self) -> None:
        self.go.set()


def test_a_plan_does_not_wait_for_another_uids_plan_under_way(registry: Registry) -> None:
    """Two planners: uid 1's plan holds the first (and has the second warmed after a second);
    uid 2's is made on the second meanwhile; uid 1's next waits for its first to end."""
    held, second = _Held(Planner(registry.settings)), _Held(Planner(registry.settings))
    second.go.set()
    worker = PlanWorker(registry.settings, planners=[held, second])
    try:
        worker._first_made = True  # past the first plan, which may start the first planner
        heavy = registry.open(C, C, "heavy", 1, 1)
        registry.attach(heavy, 1500, 1.0)
        heavy.trace.add(chunk(HIDE, {}))
        worker._queue(heavy, "")
        assert held.started.wait(WAIT_S)
        bystander = session(registry, swap_limit=1500)  # uid 0
        worker._queue(bystander, "")
        deadline = time.monotonic() + WAIT_S
        while bystander.outbox.empty():
            assert time.monotonic() < deadline, "the bystander's plan waited"
            time.sleep(0.01)
        assert sent(bystander) is not None and heavy.outbox.empty()
        later = registry.open(C, C, "later", 2, 1)  # uid 1 again
        registry.attach(later, 1500, 1.0)
        later.trace.add(chunk(HIDE, {}))
        worker._queue(later, "")
        assert worker._turns.waiting() == 1 and not worker._turns.ready()
        deadline = time.monotonic() + WAIT_S
        while not second.warmed:
            assert time.monotonic() < deadline, "the second planner was never warmed"
            time.sleep(0.01)
        held.go.set()
        for s in (heavy, later):
            while s.outbox.empty():
                assert time.monotonic() < deadline, "no plan after the first planner was free"
                time.sleep(0.01)
            assert sent(s) is not None
        end(registry, heavy, bystander, later)
    finally:
        worker.close()


def test_the_first_step_mark_warms_the_first_planner(registry: Registry) -> None:
    """A daemon's first planner starts when a session first marks a step, not before: a daemon
    whose sessions never step starts none."""
    held = _Held(Planner(registry.settings))
    held.go.set()
    worker = PlanWorker(registry.settings, planners=[held])
    try:
        s = session(registry, swap_limit=1500)
        assert not held.warmed
        worker.on_step(s)
        deadline = time.monotonic() + WAIT_S
        while not held.warmed:
            assert time.monotonic() < deadline, "never warmed"
            time.sleep(0.01)
        end(registry, s)
    finally:
        worker.close()
