"""The plan cache holds what any local user may have put under a plan's name. Whatever is
there that is not a plan made for the session (random bytes, a truncated plan, another
message, a FIFO, a link, a file over MAX_PLAN_BYTES, another limit's plan, a plan shifted past
the session's bytes) is logged once as `plan.cache_defect` and planned past on the worker
thread, never blocking it, never counting as the session's planning failure, and the plan
made replaces the entry."""

from __future__ import annotations

import contextlib
import logging
import os
import random
import re
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from tidalcore.events import Events
from tidalcore.unplanned import OVER_LEASE, PlanUnavailable
from tidalcore.v1 import common_pb2, pool_pb2
from tidalplan import combined, wire
from tidalplan.learn import extract
from tidalplan.model import Iteration
from tidalpoold.plan_cache import MAX_PLAN_BYTES, Defect, PlanCache
from tidalpoold.plan_worker import PlanWorker
from tidalpoold.sessions import Registry, Session
from tidalpoold.trace import decode_chunk

from . import test_plan_worker
from .test_plan_worker import HIDE, C, chunk, end, session, told

# Sessions with a device lease of one chunk (C bytes), and a plan worker: test_plan_worker's.
registry = test_plan_worker.registry
planner = test_plan_worker.planner

DEADLINE_S = 60.0  # for a plan on a busy machine; a blocked planning thread never makes one
PERSISTENT = {"W": 300}  # outside the arena: the lease leaves C - 300 bytes for the pieces


@pytest.fixture
def fifo_writers() -> Iterator[list[Path]]:
    """FIFOs planted by a test; at its end each is opened for writing and closed, so that a
    thread blocked opening one for reading (the defect these tests catch) goes on and the
    test process can exit."""
    planted: list[Path] = []
    yield planted
    for path in planted:
        with contextlib.suppress(OSError):  # no FIFO there, or no reader: nothing to release
            if stat.S_ISFIFO(os.lstat(path).st_mode):
                os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))


def planned_on_worker(planner: PlanWorker, s: Session) -> pool_pb2.PlanUpdate:
    """The plan the worker thread puts on `s`'s stream once `on_step` queues it, as in the
    daemon; fails, without hanging, when the planning fails or no plan comes in time."""
    failed, unfit = planner.plans_failed, planner.plans_unfit
    for _ in range(planner.settings.plan_after_iterations):  # the marks the client sends
        s.trace.step(pool_pb2.StepMark(events_before=s.trace.events_received))
    planner.on_step(s)
    deadline = time.monotonic() + DEADLINE_S
    while s.outbox.empty():
        assert (planner.plans_failed, planner.plans_unfit) == (failed, unfit), "no plan made"
        assert time.monotonic() < deadline, "no plan in time: the planning thread is blocked"
        time.sleep(0.01)
    message = s.outbox.get_nowait()
    assert message is not None and message.WhichOneof("body") == "plan", message
    return message.plan


def without_id(plan: pool_pb2.PlanUpdate) -> pool_pb2.PlanUpdate:
    """`plan` as the cache holds it: before the worker numbers it."""
    copy = pool_pb2.PlanUpdate()
    copy.CopyFrom(plan)
    copy.plan_id = 0
    return copy


def reserialized(data: bytes, change: Callable[[pool_pb2.PlanUpdate], object]) -> bytes:
    plan = pool_pb2.PlanUpdate.FromString(data)
    change(plan)
    return plan.SerializeToString()


def shifted(by: int) -> Callable[[pool_pb2.PlanUpdate], object]:
    """Every piece `by` bytes higher in the arena, the height and footprint with them: a plan
    consistent in itself, lying past the bytes the session may use."""

    def shift(plan: pool_pb2.PlanUpdate) -> None:
        plan.offsets[:] = [o + by for o in plan.offsets]
        plan.swap_in_offsets[:] = [o + by for o in plan.swap_in_offsets]
        plan.height_bytes += by
        plan.prediction.footprint_bytes += by

    return shift


def over_the_cap(path: Path, good: bytes) -> None:
    """A valid PlanUpdate of MAX_PLAN_BYTES + 1 bytes: the plan, then an unknown field of
    zeros (sparse on disk). Read and parsed, it would be taken as the plan."""
    field = (1000 << 3) | 2  # field 1000, length-delimited: kept as an unknown field
    head = bytearray(good)
    head += _varint(field)
    length = MAX_PLAN_BYTES + 1 - len(head)
    length -= len(_varint(length))
    head += _varint(length)
    assert len(head) + length == MAX_PLAN_BYTES + 1
    with path.open("wb") as f:
        f.write(head)
        f.truncate(MAX_PLAN_BYTES + 1)
    assert pool_pb2.PlanUpdate.FromString(path.read_bytes()).sizes == [1000, 1000]


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


def bound_socket(path: Path) -> None:
    """A Unix socket at `path`, bound in a short folder (the path of a socket is limited to
    107 bytes) and moved there."""
    short = Path(tempfile.mkdtemp(prefix="tp-", dir="/tmp"))
    try:
        with socket.socket(socket.AF_UNIX) as s:
            s.bind(str(short / "s"))
        os.rename(short / "s", path)
    finally:
        shutil.rmtree(short)


def link_to_a_copy(path: Path, good: bytes, elsewhere: Path) -> None:
    """A link at `path` to a copy of the good plan in `elsewhere`: a plan, but not the
    cache's own file."""
    (elsewhere / "good.plan").write_bytes(good)
    path.symlink_to(elsewhere / "good.plan")


def read_in_a_child(path: Path) -> str:
    """What `PlanCache.get` says of the entry at `path`, asked in a child process whose address
    space is capped at 1 GiB, within the deadline: a cache that read /dev/zero whole would
    fail there instead of taking this machine's memory."""
    code = (
        "import resource, sys; from pathlib import Path;"
        " resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30));"
        " from tidalpoold.plan_cache import PlanCache;"
        " print(PlanCache(Path(sys.argv[1])).get(sys.argv[2]))"
    )
    name = path.name.removesuffix(".plan")
    done = subprocess.run(
        [sys.executable, "-c", code, str(path.parent), name],
        capture_output=True,
        text=True,
        timeout=DEADLINE_S,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip()


@dataclass(frozen=True)
class Hostile:
    """What is put under the plan's name (given the path, the good plan's bytes and a folder
    elsewhere), the `why` the defect is logged with (a regex), the session's swap limit, and
    whether the cache is first asked about it in a child process (`read_in_a_child`)."""

    plant: Callable[[Path, bytes, Path], object]
    why: str
    swap_limit: int = 1500
    in_a_child_first: bool = False


HOSTILE = {
    "random bytes": Hostile(
        lambda p, good, _: p.write_bytes(random.Random(7).randbytes(4096)),
        r"^not a PlanUpdate \(4096 bytes\): Error parsing message",
    ),
    "a truncated plan": Hostile(
        lambda p, good, _: p.write_bytes(good[:-1]),  # the last field cut short
        r"^not a PlanUpdate \(\d+ bytes\): Error parsing message",
    ),
    "a foreign protobuf": Hostile(
        lambda p, good, _: p.write_bytes(
            common_pb2.SessionInfo(session_id="s-1", job_name="job", pid=7).SerializeToString()
        ),
        r"^plan version 0, not 2$",
    ),
    "an older version": Hostile(
        lambda p, good, _: p.write_bytes(reserialized(good, lambda u: setattr(u, "version", 1))),
        r"^plan version 1, not 2$",
    ),
    "another iteration's plan": Hostile(
        lambda p, good, _: p.write_bytes(
            reserialized(good, lambda u: setattr(u, "signature", bytes(16)))
        ),
        r"^made for another iteration",
    ),
    "another limit's plan": Hostile(
        lambda p, good, _: p.write_bytes(
            reserialized(good, lambda u: setattr(u, "limit_bytes", 2000))
        ),
        r"^made for limit 2000 at 1 GB/s, not the session's 1500 at 1 GB/s$",
    ),
    "another bandwidth's plan": Hostile(
        lambda p, good, _: p.write_bytes(
            reserialized(good, lambda u: setattr(u.prediction, "copy_gbps", 0.5))
        ),
        r"^made for limit 1500 at 0.5 GB/s, not the session's 1500 at 1 GB/s$",
    ),
    "an offset past 63 bits": Hostile(
        lambda p, good, _: p.write_bytes(
            reserialized(good, lambda u: u.offsets.__setitem__(0, 2**64 - 1024))
        ),
        r"^refused by wire\.check: ValueError: piece \d+ \(allocation 0's first\) lies at"
        rf" \[{2**64 - 1024}, {2**64}\) of the arena, past the 1200 bytes",
    ),
    "a FIFO": Hostile(
        lambda p, good, _: os.mkfifo(p),
        r"^not a regular file but a FIFO$",
    ),
    "a directory": Hostile(lambda p, good, _: p.mkdir(), r"^not a regular file but a directory$"),
    "a socket": Hostile(
        lambda p, good, _: bound_socket(p), r"^cannot be opened: No such device or address$"
    ),
    "a link to /dev/zero": Hostile(
        lambda p, good, _: p.symlink_to("/dev/zero"),
        r"^a symbolic link, not a plan file: not followed$",
        in_a_child_first=True,
    ),
    "a link to a good plan elsewhere": Hostile(
        lambda p, good, elsewhere: link_to_a_copy(p, good, elsewhere),
        r"^a symbolic link, not a plan file: not followed$",
    ),
    "a plan over the cap": Hostile(
        lambda p, good, _: over_the_cap(p, good),
        rf"^{MAX_PLAN_BYTES + 1} bytes, over the {MAX_PLAN_BYTES} a plan may take: not read$",
    ),
    "a plan shifted past the limit": Hostile(
        lambda p, good, _: p.write_bytes(reserialized(good, shifted(C))),
        r"^refused by wire\.check: ValueError: piece \d+ \(allocation 0's first\) lies at"
        rf" \[{C}, {C + 1024}\) of the arena, past the 1200 bytes its limit of 1500 leaves"
        r" beside 300 resident persistent bytes$",
    ),
    "a plan shifted past the lease": Hostile(
        lambda p, good, _: p.write_bytes(reserialized(good, shifted(C))),
        r"^refused by wire\.check: ValueError: piece \d+ \(allocation 0's first\) lies at"
        rf" \[{C}, {C + 1024}\) of the arena, past the {C - 300} bytes the session's device"
        rf" lease of {C} leaves beside 300 resident persistent bytes$",
        swap_limit=0,
    ),
}


@pytest.mark.parametrize("name", HOSTILE)
def test_a_defect_in_the_cache_is_logged_once_and_the_plan_made_anew(
    name: str,
    registry: Registry,
    planner: PlanWorker,
    fifo_writers: list[Path],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    hostile = HOSTILE[name]
    first = session(registry, hostile.swap_limit, persistent=PERSISTENT)
    good = planned_on_worker(planner, first)
    (path,) = registry.settings.plan_cache_dir.glob("*.plan")
    good_bytes = path.read_bytes()
    assert good_bytes == without_id(good).SerializeToString()
    path.unlink()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    fifo_writers.append(path)
    hostile.plant(path, good_bytes, elsewhere)
    if hostile.in_a_child_first:
        assert read_in_a_child(path) == str(
            Defect(path, "a symbolic link, not a plan file: not followed")
        )

    second = session(registry, hostile.swap_limit, persistent=PERSISTENT)
    with caplog.at_level(logging.INFO, "tidalpoold.planning"):
        again = planned_on_worker(planner, second)  # within DEADLINE_S, or fails
    assert without_id(again) == without_id(good)  # the same plan, solved anew
    assert (planner.plans_made, planner.plans_cached, planner.plans_failed) == (2, 0, 0)
    assert planner.cache_defects == 1
    events = [r.getMessage() for r in caplog.records]
    assert events.count("plan.cache_defect") == 1 and "plan.failed" not in events
    (defect,) = [r for r in caplog.records if r.getMessage() == "plan.cache_defect"]
    assert defect.path == str(path)  # type: ignore[attr-defined]
    assert defect.key == path.name.removesuffix(".plan")  # type: ignore[attr-defined]
    assert defect.levelno == logging.WARNING
    assert re.search(hostile.why, defect.why), defect.why  # type: ignore[attr-defined]

    if name == "a directory":  # it cannot be replaced; the session has its plan all the same
        assert "plan.cache_unwritable" in events
        end(registry, first, second)
        return
    # The plan made replaces the entry (a link is replaced, not written through) ...
    assert stat.S_ISREG(os.lstat(path).st_mode)
    assert path.read_bytes() == good_bytes
    if name == "a link to a good plan elsewhere":
        assert (elsewhere / "good.plan").read_bytes() == good_bytes
    # ... and the next session of the job gets it from the cache.
    third = session(registry, hostile.swap_limit, persistent=PERSISTENT)
    assert without_id(planned_on_worker(planner, third)) == without_id(good)
    assert (planner.plans_made, planner.plans_cached, planner.cache_defects) == (2, 1, 1)
    assert not list(registry.settings.plan_cache_dir.glob("*.tmp"))
    end(registry, first, second, third)


def iteration_of(steps: list[str], persistent: dict[str, int]) -> Iteration:
    msg = chunk(steps, persistent)
    events = Events.concat([decode_chunk(msg)], dict(msg.new_names))
    return extract(events, events.marks())


def test_check_bounds_the_pieces_by_the_lease() -> None:
    it = iteration_of(HIDE, PERSISTENT)
    update = wire.encode(it, combined.unlimited(it, 1.0, 1.0), 1.0)
    # A at 0, B at 1024, both 1000 bytes (1024 aligned); W's 300 bytes outside the arena.
    assert (list(update.offsets), update.height_bytes) == ([0, 1024], 2048)
    assert wire.check(it, update, lease=2348).footprint == 2348  # exactly the lease
    with pytest.raises(
        ValueError,
        match=r"^piece \d+ \(allocation 1's first\) lies at \[1024, 2048\) of the arena, past"
        r" the 2047 bytes the session's device lease of 2347 leaves beside 300 resident"
        r" persistent bytes$",
    ):
        wire.check(it, update, lease=2347)
    # Without a lease or limit an offset must still be one the validator can hold.
    update.offsets[1] = 2**64 - 1024
    with pytest.raises(ValueError, match=r"past the 9223372036854775807 bytes an offset can"):
        wire.check(it, update)


def test_a_plan_over_the_lease_is_not_sent(
    registry: Registry, planner: PlanWorker, caplog: pytest.LogCaptureFixture
) -> None:
    # Two live blocks of 1.5 MiB cannot both lie in a lease of 2 MiB: the trace says more
    # than the session could hold, and no plan is sent for it; the session is told why.
    steps = [f"a A {3 * C // 4}", "o 100 A", f"a B {3 * C // 4}", "o 100 A B", "f B", "f A"]
    s = session(registry, swap_limit=0, steps=steps)
    with caplog.at_level(logging.INFO, "tidalpoold.planning"):
        assert planner.plan(s) is None
    assert told(s) == [
        PlanUnavailable(
            C,
            OVER_LEASE,
            "the plan's footprint 3 MiB is more than the session's device lease of 2 MiB",
        )
    ]
    assert s.plan is None
    assert (planner.plans_made, planner.plans_unfit, planner.plans_failed) == (0, 1, 0)
    (line,) = [r for r in caplog.records if r.getMessage() == "plan.unfit"]
    assert (line.footprint, line.limit, line.beyond) == (3 * C // 2, C, "lease")  # type: ignore[attr-defined]
    assert not list(registry.settings.plan_cache_dir.glob("*.plan"))  # nothing cached
    end(registry, s)


def test_the_cache_keeps_a_plan_private_and_reads_no_entry_as_none(tmp_path: Path) -> None:
    cache = PlanCache(tmp_path / "plans")
    assert cache.get("absent") is None  # no directory yet
    cache.put("p", pool_pb2.PlanUpdate(version=2, sizes=[4096]))
    assert cache.get("p") == pool_pb2.PlanUpdate(version=2, sizes=[4096])
    assert stat.S_IMODE(os.lstat(cache.path("p")).st_mode) == 0o600
    assert sorted(p.name for p in cache.directory.iterdir()) == ["p.plan"]
    assert cache.get("absent") is None
    link = cache.path("link")
    link.symlink_to(cache.path("p"))
    assert cache.get("link") == Defect(link, "a symbolic link, not a plan file: not followed")


def test_the_cache_keeps_to_its_size_and_the_least_recently_used_plans_go(
    tmp_path: Path,
) -> None:
    """Plans of 1,000 bytes under a limit of 3,500: after the fourth, the oldest goes; a plan
    read meanwhile is recent again and stays; what is not a regular plan file is left alone."""
    cache = PlanCache(tmp_path / "plans", limit=3_500)
    plan = pool_pb2.PlanUpdate(sizes=[1] * 1_000)
    size = len(plan.SerializeToString())
    assert 950 < size < 1_100
    for k, name in enumerate("abc"):
        cache.put(name, plan)
        os.utime(cache.path(name), ns=(k * 10**9, k * 10**9))  # a, b, c in that order
    (tmp_path / "plans" / "notes.txt").write_bytes(b"x" * 5_000)  # not a plan: not counted
    (tmp_path / "plans" / "z.plan").symlink_to(tmp_path / "elsewhere")  # not followed
    assert cache.get("a") == plan  # a read: a is the most recent now
    cache.put("d", plan)
    left = sorted(p.name for p in (tmp_path / "plans").glob("*.plan"))
    assert left == ["a.plan", "c.plan", "d.plan", "z.plan"] and cache.evicted == 1
    assert (tmp_path / "plans" / "notes.txt").exists()
    big = pool_pb2.PlanUpdate(sizes=[1] * 5_000)  # over the limit alone: kept, the rest go
    cache.put("e", big)
    assert sorted(p.name for p in (tmp_path / "plans").glob("*.plan")) == ["e.plan", "z.plan"]
    assert cache.get("e") == big and cache.evicted == 4
    with pytest.raises(ValueError, match="a plan cache of 0 bytes"):
        PlanCache(tmp_path, limit=0)


# -- one solve for the daemons of a node ---------------------------------------------------------
NAME = "0123abcd" * 4 + "-feedface"


def test_a_daemon_waits_for_the_plan_another_is_making_then_goes_on(tmp_path: Path) -> None:
    """Two daemons sharing the directory: the second to need a plan waits while the first
    makes it (it then finds it cached); one that holds the lock past the wait is planned past."""
    import threading

    cache = PlanCache(tmp_path)
    holding, release, done = threading.Event(), threading.Event(), threading.Event()
    result: list[bool] = []

    def first() -> None:
        with cache.solving(NAME, wait_s=DEADLINE_S):
            holding.set()
            release.wait(DEADLINE_S)

    def second() -> None:
        with cache.solving(NAME, wait_s=DEADLINE_S) as waited:
            result.append(waited)
        done.set()

    a = threading.Thread(target=first)
    a.start()
    assert holding.wait(DEADLINE_S)
    b = threading.Thread(target=second)
    b.start()
    assert not done.wait(0.2)  # it waits while the first holds the lock
    release.set()
    a.join()
    b.join()
    assert result == [True]
    # Not held: nobody waits. Held past the wait: planned past, said once.
    with cache.solving(NAME, wait_s=DEADLINE_S) as waited:
        assert not waited
        with cache.solving(NAME, wait_s=0.05) as waited_again:
            assert waited_again
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"solving-{0x0123 % 64:02d}.lock"]


def test_a_killed_holder_leaves_no_lock_and_a_planted_lock_file_is_planned_past(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cache = PlanCache(tmp_path)
    lock = tmp_path / f"solving-{0x0123 % 64:02d}.lock"
    script = (
        "import fcntl, os, time\n"
        f"fd = os.open({str(lock)!r}, os.O_RDWR | os.O_CREAT, 0o600)\n"
        "fcntl.flock(fd, fcntl.LOCK_EX)\n"
        "print('held', flush=True)\n"
        "time.sleep(600)\n"
    )
    with subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True) as h:
        try:
            assert h.stdout is not None and h.stdout.readline() == "held\n"
        finally:
            h.kill()  # SIGKILL while it holds the lock
            h.wait(timeout=DEADLINE_S)
    with cache.solving(NAME, wait_s=DEADLINE_S) as waited:
        assert not waited  # the kernel released it with the process
    lock.unlink()
    lock.mkdir()  # another user's entry under the lock's name
    with caplog.at_level(logging.WARNING), cache.solving(NAME, wait_s=DEADLINE_S) as waited:
        assert not waited
    (record,) = [r for r in caplog.records if r.getMessage() == "plan.cache_unlocked"]
    assert "directory" in str(record.__dict__["why"])
