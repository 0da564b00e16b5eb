"""A job whose iterations differ in shape gets a plan per shape from a real daemon, runs each
shape's plan for its iterations, and keeps at most the daemon's number of shapes planned."""

from __future__ import annotations

import logging
import random
import re
import time

import pytest
import tidalpool

from ..conftest import StartDaemon

KiB = 1024


def iteration(s: tidalpool.Session, batch: int, shape: str | None = None) -> None:
    """A matmul and a ReLU whose blocks grow with the batch: input, weights' gradient,
    output, its activation; all freed within the iteration."""
    s.step(shape=str(batch) if shape is None else shape)
    x = s.malloc(batch * KiB)
    y = s.malloc(2 * batch * KiB)
    z = s.malloc(2 * batch * KiB)
    s.free(y)
    g = s.malloc(batch * KiB)
    s.free(x)
    s.free(z)
    s.free(g)


def until(condition: object, what: str, step: object, limit_s: float = 30.0) -> int:
    """Run `step()` until `condition()`; the runs it took."""
    deadline, n = time.monotonic() + limit_s, 0
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"not within {limit_s} s: {what}"
        step()  # type: ignore[operator]
        n += 1
        time.sleep(0.005)
    return n


def plans_sent(log: str) -> list[str]:
    """The shapes of the plans the daemon sent, in order."""
    return re.findall(r"plan\.sent .*?shape=(\S*)", log)


SESSIONS = {
    "placed": {},
    "swapping": {"swap_limit": "1MiB"},
    "paged": {"swap_limit": "1MiB", "page_bytes": "64KiB"},
}


@pytest.mark.parametrize("kind", SESSIONS)
def test_a_job_that_cycles_its_batch_size_runs_a_plan_for_each(
    start_daemon: StartDaemon, kind: str
) -> None:
    d = start_daemon()
    sizes = (64, 128, 96)
    with tidalpool.attach(d.socket_dir, device_limit="8MiB", **SESSIONS[kind]) as s:

        def cycle() -> None:
            for b in sizes:
                iteration(s, b)

        until(lambda: set(s.plans) == {"64", "128", "96"}, "a plan for each shape", cycle)
        cycle()  # each plan takes over at its shape's next step
        before = s.stats()
        modes = []
        for _ in range(5):
            for b in sizes:
                iteration(s, b)
                modes.append(s.stats().mode)
        after = s.stats()
    assert modes == ["planned"] * 15
    assert after.plan_misses == before.plan_misses
    assert after.plan_hits - before.plan_hits == 15 * 4
    assert sorted(plans_sent(d.log_path.read_text())) == ["128", "64", "96"]


@pytest.mark.parametrize("kind", ["placed", "paged"])
def test_shapes_unnamed_are_recognised_by_their_first_allocation(
    start_daemon: StartDaemon, kind: str
) -> None:
    """Steps naming no shape, in a random order of batch sizes, each iteration beginning with
    an op on a persistent block (before any allocation tells its shape): each shape is planned
    apart and, once planned, runs its plan from its first allocation on, with no miss."""
    d = start_daemon()
    sizes = (64, 128, 96)
    rng = random.Random(0)
    with tidalpool.attach(
        d.socket_dir, device_limit="8MiB", recognise_shapes=True, **SESSIONS[kind]
    ) as s:
        w = s.malloc(16 * KiB)  # persistent: the weights

        def one(batch: int) -> None:
            s.step()
            assert s.shape != "" or batch == sizes[0]  # the shape before, until an allocation
            with s.op(writes=[w], name="zero_grad"):
                pass
            x = s.malloc(batch * KiB)
            assert s.shape == f"auto-{batch * KiB}"
            y = s.malloc(2 * batch * KiB)
            with s.op(reads=[x, w], writes=[y], name="matmul"):
                pass
            s.free(x)
            g = s.malloc(batch * KiB)
            s.free(y)
            s.free(g)

        def cycle() -> None:
            for b in sizes:
                one(b)

        shapes = {f"auto-{b * KiB}" for b in sizes}
        until(lambda: set(s.plans) == shapes, "a plan for each shape", cycle)
        cycle()  # each plan takes over at its shape's next iteration
        before = s.stats()
        order = [rng.choice(sizes) for _ in range(30)]
        modes = []
        for b in order:
            one(b)
            modes.append(s.stats().mode)
        after = s.stats()
    assert modes == ["planned"] * len(order)
    assert after.plan_misses == before.plan_misses
    assert after.plan_hits - before.plan_hits == len(order) * 3
    assert sorted(plans_sent(d.log_path.read_text())) == sorted(shapes)


def test_a_job_of_several_shapes_that_names_none_is_told_how_to(
    start_daemon: StartDaemon, caplog: pytest.LogCaptureFixture
) -> None:
    """Steps naming no shape, batch sizes cycling: the one plan misses most allocations of the
    other sizes' iterations, and the session says once how to get a plan per shape."""
    d = start_daemon()
    caplog.set_level(logging.WARNING, logger="tidalpool")

    def told() -> list[str]:
        return [r.getMessage() for r in caplog.records if "recognise_shapes=True" in r.message]

    with tidalpool.attach(d.socket_dir, device_limit="8MiB") as s:

        def cycle() -> None:
            for b in (64, 128, 96):
                iteration(s, b, shape="")

        until(lambda: told(), "the session's advice", cycle)
        for _ in range(5):
            cycle()
    [line] = told()
    assert "of the 4 allocations of its last iteration missed its plan" in line


def test_recognising_shapes_is_refused_where_plans_cannot_switch(
    start_daemon: StartDaemon,
) -> None:
    d = start_daemon()
    with pytest.raises(ValueError, match="only when paged: give page_bytes too"):
        tidalpool.attach(d.socket_dir, swap_limit="1MiB", recognise_shapes=True)
    with pytest.raises(ValueError, match="native allocator's framework makes itself"):
        tidalpool.attach(d.socket_dir, allocator="native", recognise_shapes=True)


def test_a_new_shape_mid_run_runs_online_and_disturbs_no_other(start_daemon: StartDaemon) -> None:
    d = start_daemon()
    with tidalpool.attach(d.socket_dir, device_limit="8MiB") as s:

        def cycle() -> None:
            iteration(s, 64)
            iteration(s, 128)

        until(lambda: set(s.plans) == {"64", "128"}, "a plan for each shape", cycle)
        cycle()
        with pytest.raises(ValueError, match="is 129 bytes, longer than 128"):
            s.step(shape="x" * 129)
        with pytest.raises(TypeError, match="shape must be a str, not int"):
            s.step(shape=200)  # type: ignore[arg-type]
        iteration(s, 200)  # never seen: placed online, recorded
        assert s.stats().mode == "learning"
        before = s.stats()
        for _ in range(4):
            cycle()
            assert s.stats().mode == "planned"
        after = s.stats()
    assert after.plan_misses == before.plan_misses
    assert after.plan_hits - before.plan_hits == 4 * 2 * 4


def test_a_shape_seen_once_is_forgotten_under_the_bound(start_daemon: StartDaemon) -> None:
    d = start_daemon("--max-plan-shapes", "2")
    with tidalpool.attach(d.socket_dir, device_limit="8MiB") as s:

        def cycle() -> None:
            iteration(s, 64)
            iteration(s, 128)

        until(lambda: set(s.plans) == {"64", "128"}, "a plan for each shape", cycle)
        iteration(s, 200)  # once: the least recent shape, 64, loses its plan here and there
        assert set(s.plans) == {"128"}
        # 64 back takes the place of the least recent, 128, which then takes 200's.
        until(lambda: set(s.plans) == {"64", "128"}, "64 and 128 planned again", cycle)
        for _ in range(3):
            cycle()
            assert s.stats().mode == "planned"
    log = d.log_path.read_text()
    assert sorted(plans_sent(log)) == ["128", "128", "64", "64"]  # 200: never planned
    again = [line for line in log.splitlines() if "plan.sent" in line][2:]
    assert all("source=cache" in line for line in again)


def test_a_second_shape_has_the_first_planned_again(start_daemon: StartDaemon) -> None:
    """A plan made while the session had one shape may keep persistent blocks away across the
    boundary, where another shape's plan expects them: it is made again once a second shape
    comes, keeping them on the device there."""
    d = start_daemon()
    with tidalpool.attach(d.socket_dir, device_limit="8MiB", swap_limit="1MiB") as s:
        s.malloc(64 * KiB)  # persistent
        until(lambda: "64" in s.plans, "a plan for 64", lambda: iteration(s, 64))
        first = s.plans["64"].plan_id

        def cycle() -> None:
            iteration(s, 64)
            iteration(s, 128)

        until(
            lambda: set(s.plans) == {"64", "128"} and s.plans["64"].plan_id != first,
            "64 planned again beside 128",
            cycle,
        )
        for _ in range(3):
            cycle()
            assert s.stats().mode == "planned"
    assert sorted(plans_sent(d.log_path.read_text())) == ["128", "64", "64"]
