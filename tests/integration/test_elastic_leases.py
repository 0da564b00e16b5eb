"""Elastic leases against a real daemon and real client processes: a job that borrowed the
whole pool gives chunks back, while it runs and with its data intact, for a newcomer's floor;
a job that does not give back is ended at the deadline and the others do not notice."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import tidalpool
from tidalclient.status import fetch

from ..conftest import StartDaemon
from .test_fuzz import wait_for

MiB = 1 << 20
SMALL = ("--default-device-lease", "2MiB")  # under the pool of 32 MiB

# A job that checks its data: `blocks` tensors of 1 MiB, each stamped with its own value and
# the iteration, read and checked by every op (an access to swapped-out bytes would fault).
# It prints its session id, then "step N HELD" after each iteration.
JOB = textwrap.dedent(
    """
    import sys
    import numpy as np
    import tidalpool

    socket_dir, floor, ceiling, blocks = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    session = tidalpool.attach(
        socket_dir, host_limit="96MiB", swap_limit=f"{blocks + 8}MiB", page_bytes="64KiB",
        device_min=floor, device_max=ceiling if ceiling != "0" else None,
    )
    print(session.id, flush=True)
    arrays = [session.tensor((256 * 1024,), "float32") for _ in range(blocks)]
    for k, a in enumerate(arrays):
        with session.op(writes=[a], name="fill") as (x,):
            x[:] = k
    step = 0
    while True:
        for k, a in enumerate(arrays):
            with session.op(writes=[a], name="check") as (x,):
                want = k + step
                if not (x == want).all():
                    print("corrupt", k, step, flush=True)
                    sys.exit(3)
                x += 1
        step += 1
        session.step()
        print("step", step, session.elastic.held_chunks, flush=True)
    """
)

# A job that borrows, then hangs inside an op (a kernel that never ends): it cannot give back.
STUCK = textwrap.dedent(
    """
    import sys, time
    import tidalpool

    session = tidalpool.attach(
        sys.argv[1], host_limit="8MiB", swap_limit="64MiB", page_bytes="64KiB",
        device_min="2MiB",
    )
    block = session.tensor((1024,), "float32")
    print(session.id, flush=True)
    try:
        with session.op(writes=[block], name="hang"):
            while not session.closed:
                time.sleep(0.05)
    except tidalpool.SessionClosed:
        pass
    print("ended", session.connection.goodbye.message, flush=True)
    """
)


# A job that stamps its blocks, then waits outside any op (as a job between steps: loading data,
# writing a checkpoint) until told to go on, then checks them.
IDLE = textwrap.dedent(
    """
    import sys
    import tidalpool

    session = tidalpool.attach(
        sys.argv[1], host_limit="64MiB", swap_limit="64MiB", page_bytes="64KiB",
        device_min="2MiB",
    )
    arrays = [session.tensor((256 * 1024,), "float32") for _ in range(12)]
    for k, a in enumerate(arrays):
        with session.op(writes=[a], name="fill") as (x,):
            x[:] = k
    print(session.id, flush=True)
    sys.stdin.readline()  # idle: no op, no allocation, no step
    for k, a in enumerate(arrays):
        with session.op(writes=[a], name="check") as (x,):
            assert (x == k).all(), k
    print("ok", session.elastic.held_chunks, flush=True)
    """
)


class Job:
    def __init__(self, script: Path, *args: str) -> None:
        self.process = subprocess.Popen(
            [sys.executable, str(script), *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.process.stdout is not None
        self.id = self.process.stdout.readline().strip()
        assert self.id.startswith("s-"), self.id

    def line(self) -> str:
        assert self.process.stdout is not None
        text = self.process.stdout.readline()
        assert text, f"job {self.id} exited ({self.process.wait()})"
        return text.strip()

    def steps_until(self, held: int | None = None) -> int:
        """Read its steps until one reports `held` chunks (any, when None); that step."""
        while True:
            words = self.line().split()
            assert words[0] == "step", words
            if held is None or int(words[2]) == held:
                return int(words[1])

    def stop(self) -> None:
        self.process.kill()
        self.process.wait(timeout=30)
        assert self.process.stdout is not None and self.process.stdin is not None
        self.process.stdout.close()
        self.process.stdin.close()


@pytest.fixture
def scripts(tmp_path: Path) -> Iterator[tuple[Path, Path, Path]]:
    job, stuck, idle = tmp_path / "job.py", tmp_path / "stuck.py", tmp_path / "idle.py"
    job.write_text(JOB)
    stuck.write_text(STUCK)
    idle.write_text(IDLE)
    yield job, stuck, idle


def held(socket_dir: Path, session_id: str) -> int:
    _, sessions = fetch(socket_dir)
    return next(len(s.lease.device.chunks) for s in sessions.sessions if s.session_id == session_id)


def test_a_newcomer_gets_its_floor_from_a_job_that_borrowed_the_whole_pool(
    start_daemon: StartDaemon, scripts: tuple[Path, Path, Path]
) -> None:
    daemon = start_daemon(*SMALL, device_pool="32MiB", chunk_size="2MiB")  # 16 chunks
    job = Job(scripts[0], str(daemon.socket_dir), "4MiB", "0", "40")  # needs 48 MiB: all 16
    try:
        job.steps_until(held=16)
        status, _ = fetch(daemon.socket_dir)
        assert status.device.free_bytes == 0
        with tidalpool.attach(
            daemon.socket_dir,
            host_limit="8MiB",
            swap_limit="16MiB",
            page_bytes="64KiB",
            device_min="12MiB",
            device_max="12MiB",
        ) as newcomer:
            assert newcomer.elastic is not None and newcomer.elastic.held_chunks == 6
            block = newcomer.tensor((1024,), "float32")
            with newcomer.op(writes=[block]) as (x,):
                x[:] = 7
            # The borrower runs on, on the 10 chunks it has left, its data checked each op.
            job.steps_until(held=10)
            job.steps_until()
            assert held(daemon.socket_dir, job.id) == 10
        # The newcomer gone, the borrower grows back to the whole pool.
        job.steps_until(held=16)
    finally:
        job.stop()


def test_a_job_that_does_not_give_back_is_ended_and_nobody_else_notices(
    start_daemon: StartDaemon, scripts: tuple[Path, Path, Path]
) -> None:
    daemon = start_daemon(
        *SMALL, "--quota-deadline-s", "1", device_pool="32MiB", chunk_size="2MiB"
    )  # 16 chunks
    bystander = Job(scripts[0], str(daemon.socket_dir), "8MiB", "8MiB", "6")
    stuck = Job(scripts[1], str(daemon.socket_dir))
    try:
        bystander.steps_until(held=4)
        wait_for(
            lambda: held(daemon.socket_dir, stuck.id) == 12, "the stuck job to borrow the rest"
        )
        with tidalpool.attach(
            daemon.socket_dir,
            host_limit="8MiB",
            swap_limit="16MiB",
            page_bytes="64KiB",
            device_min="16MiB",
            device_max="16MiB",
        ) as newcomer:
            assert newcomer.elastic is not None and newcomer.elastic.held_chunks == 8
        words = stuck.line()
        assert words.startswith("ended") and "did not give back" in words, words
        before = bystander.steps_until()
        assert bystander.steps_until() == before + 1  # on, uncorrupted, its 4 chunks its own
        assert held(daemon.socket_dir, bystander.id) == 4
    finally:
        bystander.stop()
        stuck.stop()


def test_a_job_between_steps_gives_back_in_time_and_finds_its_data(
    start_daemon: StartDaemon, scripts: tuple[Path, Path, Path]
) -> None:
    # A deadline no idle job would meet if it waited for its next op (it makes none), and that
    # a busy machine's give-back meets.
    daemon = start_daemon(
        *SMALL, "--quota-deadline-s", "10", device_pool="32MiB", chunk_size="2MiB"
    )  # 16 chunks
    idle = Job(scripts[2], str(daemon.socket_dir))
    try:
        wait_for(lambda: held(daemon.socket_dir, idle.id) == 16, "the idle job to borrow the pool")
        with tidalpool.attach(
            daemon.socket_dir,
            host_limit="8MiB",
            swap_limit="16MiB",
            page_bytes="64KiB",
            device_min="20MiB",
            device_max="20MiB",
        ) as newcomer:
            assert newcomer.elastic is not None and newcomer.elastic.held_chunks == 10
            assert held(daemon.socket_dir, idle.id) == 6  # given back while it made no op
            assert idle.process.stdin is not None
            idle.process.stdin.write("go on\n")
            idle.process.stdin.flush()
            assert idle.line() == "ok 6"  # its 12 MiB of blocks intact, on 12 MiB of chunks
    finally:
        idle.stop()
