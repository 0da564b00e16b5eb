"""The daemon's plans for a session under virtual residency: an attach with pages is checked
(the page, the lease's chunks, the swap limit), the live blocks a step mark carries are kept,
and once every persistent block of the steady iteration is among them the session gets a
version-3 plan, checked and cached by where those blocks are."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator

import pytest
from tidalcore.errors import InvalidArgument
from tidalcore.v1 import pool_pb2
from tidalcore.wire import TOKEN_KEY
from tidalpoold.plan_worker import PlanWorker
from tidalpoold.services import PoolService
from tidalpoold.sessions import PlanFootprint, Registry, Session

from . import test_plan_worker
from .test_plan_worker import C, chunk, end

# Sessions with a device lease of one chunk (C bytes), and a plan worker: test_plan_worker's.
registry = test_plan_worker.registry
planner = test_plan_worker.planner

PAGE = 4096
DEADLINE_S = 60.0  # for a plan on a busy machine
# tests/unit/iterations.py's paged_pair for pages of 4096 bytes: W (persistent, 4 pages), V
# (persistent, small); A (2 pages) over [0, 4), B (under a page) over [1, 7), C (3 pages, 2.4%
# of them wasted) over [5, 9). W and V are trace blocks 1 and 2.
STEPS = [
    "a A 8192",
    "a B 4000",
    "o 100 W A >B",
    "o 100",
    "f A",
    "a C 12000",
    "o 100 B >C",
    "f B",
    "o 100 W C V",
    "f C",
]
PERSISTENT = {"W": 16384, "V": 400}
W, V = 1, 2
# Where the session put them: W on pages 0-3, V packed on page 4; its plan's region starts at
# page 5.
LIVE = {W: (0, True), V: (4 * PAGE, False)}
LIMIT = 8 * PAGE  # W, C and B: 9 pages at f2 without a swap


class Context:
    """What PoolService.attach reads of a gRPC context: the session's token."""

    def __init__(self, token: str) -> None:
        self.token = token

    def invocation_metadata(self) -> list[tuple[str, str]]:
        return [(TOKEN_KEY, self.token)]


@pytest.fixture
def service(registry: Registry, planner: PlanWorker) -> PoolService:
    return PoolService(registry, planner)


def attached(
    service: PoolService, page: int = PAGE, limit: int = LIMIT, gbps: float = 100.0
) -> Session:
    """A session attached through the Pool service with pages of `page` bytes."""
    s = service.registry.open(C, C, "job", 1, 0)
    request = pool_pb2.AttachRequest(swap_limit_bytes=limit, copy_gbps=gbps, page_bytes=page)
    service.attach(request, Context(s.token))
    return s


def mark(s: Session, live: dict[int, tuple[int, bool]]) -> pool_pb2.ClientMessage:
    """A step mark after every event sent, carrying `live` (block id: address, owning)."""
    return pool_pb2.ClientMessage(
        step=pool_pb2.StepMark(
            events_before=s.trace.events_received,
            live_block_ids=list(live),
            live_addresses=[a for a, _ in live.values()],
            live_owning=[o for _, o in live.values()],
        )
    )


def traced(service: PoolService, s: Session, live: dict[int, tuple[int, bool]]) -> None:
    """The session's trace, then the step marks that queue it for planning, each with
    `live`."""
    service._handle(s, pool_pb2.ClientMessage(trace=chunk(STEPS, PERSISTENT)))
    for _ in range(service.registry.settings.plan_after_iterations):
        service._handle(s, mark(s, live))


def wait_for(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        assert time.monotonic() < deadline, f"not within {DEADLINE_S} s: {what}"
        time.sleep(0.01)


def received(planner: PlanWorker, s: Session) -> pool_pb2.PlanUpdate:
    """The plan the worker thread puts on `s`'s stream; fails when planning fails."""
    wait_for(
        lambda: not s.outbox.empty() or bool(planner.plans_failed or planner.plans_unfit),
        "a plan on the session's stream",
    )
    message = s.outbox.get_nowait()
    assert message is not None and message.WhichOneof("body") == "plan", message
    return message.plan


@pytest.fixture
def sessions(registry: Registry) -> Iterator[list[Session]]:
    made: list[Session] = []
    yield made
    end(registry, *made)


def test_a_paged_session_gets_a_version_3_plan_within_its_limit(
    service: PoolService, planner: PlanWorker, sessions: list[Session]
) -> None:
    s = attached(service)
    sessions.append(s)
    assert (s.page_bytes, s.swap_limit) == (PAGE, LIMIT)
    traced(service, s, LIVE)
    assert s.live_at == LIVE
    plan = received(planner, s)
    assert (plan.version, plan.plan_id, plan.page_bytes, plan.limit_bytes) == (3, 1, PAGE, LIMIT)
    assert plan.mapped_peak_bytes == LIMIT
    # A owns the region's first 2 pages; B and C are packed past them (C's rounding to 3 pages,
    # 2.4% of it, is more than the 2% `max_waste` tried first, and that plan fits).
    assert (list(plan.addresses), list(plan.owning)) == (
        [0, 2 * PAGE, 3 * PAGE],
        [True, False, False],
    )
    assert plan.region_bytes == 6 * PAGE
    # W leaves after op 0 and is issued back at op 2 for op 3.
    assert (list(plan.swap_blocks), list(plan.swap_persistent)) == ([W], [True])
    assert (list(plan.swap_out_after), list(plan.swap_in_at), list(plan.swap_in_before)) == (
        [0],
        [2],
        [3],
    )
    assert s.plan == PlanFootprint(LIMIT, LIMIT)
    assert (planner.plans_made, planner.plans_cached, planner.plans_unfit) == (1, 0, 0)


def test_a_paged_plan_is_cached_by_where_the_persistent_blocks_are(
    service: PoolService, planner: PlanWorker, sessions: list[Session]
) -> None:
    first = attached(service)
    sessions.append(first)
    traced(service, first, LIVE)
    plan = received(planner, first)
    again = attached(service)
    sessions.append(again)
    traced(service, again, LIVE)
    cached = received(planner, again)
    assert (planner.plans_made, planner.plans_cached) == (1, 1)
    cached.plan_id = plan.plan_id
    assert cached == plan
    # W one page higher: the region starts a page later, and the plan is made again.
    moved = attached(service)
    sessions.append(moved)
    traced(service, moved, {W: (PAGE, True), V: (5 * PAGE, False)})
    assert received(planner, moved).addresses == plan.addresses  # from its own region's start
    assert (planner.plans_made, planner.plans_cached) == (2, 1)
    assert len(list(service.registry.settings.plan_cache_dir.glob("*.plan"))) == 2


def test_a_cached_paged_plan_serves_a_run_whose_ops_took_other_times(
    service: PoolService, planner: PlanWorker, sessions: list[Session]
) -> None:
    """The same job again with its ops measured 50% slower: its plan comes from the cache,
    with the same addresses and schedule, and a prediction of this run's times."""
    first = attached(service)
    sessions.append(first)
    traced(service, first, LIVE)
    plan = received(planner, first)
    again = attached(service)
    sessions.append(again)
    slower = [step.replace("o 100", "o 150") for step in STEPS]
    service._handle(again, pool_pb2.ClientMessage(trace=chunk(slower, PERSISTENT)))
    for _ in range(service.registry.settings.plan_after_iterations):
        service._handle(again, mark(again, LIVE))
    cached = received(planner, again)
    assert (planner.plans_made, planner.plans_cached, planner.cache_defects) == (1, 1, 0)
    for column in ("addresses", "owning", "swap_blocks", "swap_out_after", "swap_in_before"):
        assert getattr(cached, column) == getattr(plan, column), column
    assert cached.prediction.baseline_ns == plan.prediction.baseline_ns * 3 // 2
    assert cached.prediction.step_ns > plan.prediction.step_ns


def test_a_step_mark_without_a_persistent_block_gets_no_plan_until_one_carries_it(
    service: PoolService,
    planner: PlanWorker,
    sessions: list[Session],
    caplog: pytest.LogCaptureFixture,
) -> None:
    s = attached(service)
    sessions.append(s)
    with caplog.at_level(logging.DEBUG, "tidalpoold.planning"):
        traced(service, s, {V: LIVE[V]})  # W not among the live blocks
        wait_for(
            lambda: any(r.getMessage() == "plan.waiting" for r in caplog.records),
            "the planner to find W missing",
        )
    (waiting,) = [r for r in caplog.records if r.getMessage() == "plan.waiting"]
    assert waiting.missing == [W]  # type: ignore[attr-defined]
    assert s.outbox.empty()
    assert (planner.plans_made, planner.plans_unfit, planner.plans_failed) == (0, 0, 0)
    service._handle(s, mark(s, LIVE))  # the next step: W is there
    plan = received(planner, s)
    assert (plan.version, plan.mapped_peak_bytes) == (3, LIMIT)


@pytest.mark.parametrize(
    ("limit", "kind", "lowest"),
    [
        # f3 reads W, C and V: 28784 bytes, over 7 pages; no limit under them can work.
        (7 * PAGE, "under_op_bound", 16384 + 12000 + 400),
        # Over them, but W's, C's and V's pages are 8 at f3.
        (7 * PAGE + PAGE // 2, "no_schedule", 0),
    ],
)
def test_a_paged_limit_no_plan_fits_is_told(
    service: PoolService,
    planner: PlanWorker,
    sessions: list[Session],
    limit: int,
    kind: str,
    lowest: int,
) -> None:
    s = attached(service, limit=limit)
    sessions.append(s)
    traced(service, s, LIVE)
    wait_for(lambda: not s.outbox.empty(), "the session to be told")
    message = s.outbox.get_nowait()
    assert message is not None and message.WhichOneof("body") == "unplanned", message
    told = message.unplanned
    assert (told.kind, told.limit_bytes, told.lowest_limit_bytes) == (kind, limit, lowest)
    assert (planner.plans_unfit, planner.plans_made) == (1, 0)


@pytest.mark.parametrize(
    ("page", "limit", "message"),
    [
        (1000, LIMIT, "page_bytes 1000 is not a power of two of at least 4096 bytes"),
        (3 * PAGE, LIMIT, "page_bytes 12288 is not a power of two of at least 4096 bytes"),
        (2 * C, LIMIT, f"page_bytes {2 * C} does not divide the lease's chunks of {C} bytes"),
        (PAGE, 0, "page_bytes 4096 needs a swap limit: pages move only under swap_limit_bytes"),
    ],
)
def test_an_attach_with_pages_it_cannot_have_is_refused(
    service: PoolService, sessions: list[Session], page: int, limit: int, message: str
) -> None:
    with pytest.raises(InvalidArgument, match=message):
        attached(service, page=page, limit=limit)
    (s,) = service.registry.sessions()
    sessions.append(s)
    assert (s.state, s.page_bytes) == ("pending", 0)


def test_an_attach_with_pages_under_the_devices_mapping_granularity_is_refused(
    service: PoolService, sessions: list[Session], monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = service.registry.backend
    facts = backend.facts()
    monkeypatch.setattr(backend, "facts", lambda: {**facts, "granularity_bytes": 16 * PAGE})
    with pytest.raises(InvalidArgument, match="not a multiple of the device's mapping granularity"):
        attached(service, page=PAGE)
    sessions.extend(service.registry.sessions())
    s = attached(service, page=16 * PAGE)
    sessions.append(s)
    assert s.page_bytes == 16 * PAGE


def bad_marks() -> list[tuple[Callable[[pool_pb2.StepMark], object], str]]:
    return [
        (
            lambda m: m.live_owning.append(True),
            "live columns differ in length: 2 ids, 2 addresses, 3 owning",
        ),
        (lambda m: m.live_block_ids.__setitem__(1, W), f"lists live block {W} twice"),
        (lambda m: m.live_addresses.__setitem__(0, 100), f"live block {W} owns pages at 100"),
    ]


@pytest.mark.parametrize(("change", "message"), bad_marks())
def test_a_step_mark_with_live_blocks_that_cannot_be_is_refused_and_not_taken(
    service: PoolService,
    sessions: list[Session],
    change: Callable[[pool_pb2.StepMark], object],
    message: str,
) -> None:
    s = attached(service)
    sessions.append(s)
    bad = mark(s, LIVE)
    change(bad.step)
    with pytest.raises(InvalidArgument, match=message):
        service._handle(s, bad)
    assert (s.trace.iterations_seen, dict(s.live_at)) == (0, {})


def test_a_contiguous_session_may_not_send_live_blocks(
    service: PoolService, sessions: list[Session]
) -> None:
    s = attached(service, page=0)
    sessions.append(s)
    with pytest.raises(InvalidArgument, match="the session has no pages"):
        service._handle(s, mark(s, LIVE))
    service._handle(s, mark(s, {}))  # a mark without them, as before
    assert s.trace.iterations_seen == 1


def test_an_unthrottled_paged_plan_serves_a_daemon_that_measured_about_as_much(
    registry: Registry, sessions: list[Session]
) -> None:
    """As for contiguous plans: a paged plan cached by a daemon that measured 100 GB/s serves
    one that measured 120 (its prediction at 120), and not one that measured 200."""
    workers = [PlanWorker(registry.settings, copy_gbps=g) for g in (100.0, 120.0, 200.0)]
    try:
        plans = []
        for w in workers:
            service = PoolService(registry, w)
            s = attached(service, gbps=0.0)
            sessions.append(s)
            traced(service, s, LIVE)
            plans.append(received(w, s))
        assert [(w.plans_made, w.plans_cached) for w in workers] == [(1, 0), (0, 1), (1, 0)]
        assert workers[2].cache_defects == 1
        for column in ("addresses", "owning", "swap_blocks", "swap_out_after", "swap_in_before"):
            assert getattr(plans[1], column) == getattr(plans[0], column), column
        assert [p.prediction.copy_gbps for p in plans] == [100.0, 120.0, 200.0]
    finally:
        for w in workers:
            w.close()
