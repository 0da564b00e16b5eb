"""Faults of processes and of the machine, with real client processes beside a bystander.

    clients ──SIGKILL mid-churn, SIGSTOP past the heartbeat timeout──▶ tidalpoold ◀── survivors
    tidalpoold ──SIGKILL, restarted on its socket directory; open files exhausted; plan-cache
                 files that are noise, a FIFO, a link to /dev/zero, or huge

After each fault: the daemon is alive (or, killed, restarts on the same directory), the
survivors' and the bystander's bytes are intact and they still allocate, a survivor's whole
trace reaches the daemon when it closes, and once every session has ended the accounting is
exact (leased 0, free == total on both pools) and the daemon's RSS and fds are back within the
bounds of test_fuzz.py.

Run as a module, this file is the client process the tests drive (`Worker`):

    python -m tests.integration.test_fault_suite SOCKET_DIR SEED [DEVICE_LIMIT]

prints "ready <session id>" once its arrays hold bytes drawn from SEED, then answers one line
per command: check (ok | corrupt [i]), churn N (churned), spin (spinning, then allocates and
frees until killed), run N (N mallocs and frees with an op now and then: done <events>), closed
(closed | open), op and malloc (computed / allocated | raised <error>: <why>), quit (closes the
session: bye <events recorded>).
"""

from __future__ import annotations

import os
import queue
import re
import resource
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import suppress
from pathlib import Path

import numpy as np
import pytest
import tidalpool
from tidalclient.errors import TidalpoolError
from tidalclient.executors.base import Block
from tidalclient.local import LocalDaemon, is_serving
from tidalcore.v1 import handles_pb2
from tidalcore.wire import HANDLES_SOCKET, HANDLES_VERSION

from ..conftest import StartDaemon
from .test_fuzz import (
    Bystander,
    MiB,
    Target,
    check_bounds,
    daemon_open_fds,
    frame,
    handles_exchange,
    ready,
    steady_rss,
    wait_for,
)
from .test_planning import run_until_planned

ROOT = Path(__file__).resolve().parents[2]
MODULE = "tests.integration.test_fault_suite"
GiB = 1 << 30


# -- the client process ------------------------------------------------------------------------
def worker_main(argv: list[str]) -> None:
    """The client process: attach, fill arrays, answer commands (see the module docstring)."""
    socket_dir, seed = argv[0], int(argv[1])
    device_limit = argv[2] if len(argv) > 2 else "16MiB"
    rng = np.random.default_rng(seed)
    try:
        session = tidalpool.attach(
            socket_dir, device_limit=device_limit, host_limit="2MiB", job_name=f"worker-{seed}"
        )
    except TidalpoolError as e:
        print(f"attach-failed {e}", flush=True)
        sys.exit(3)
    arrays, expected = [], []
    for n in (1000, 65536, 300000):
        values = rng.integers(0, 256, n, dtype=np.uint8)
        a = session.array(n, "uint8")
        a[:] = values
        arrays.append(a)
        expected.append(values)
    print(f"ready {session.id}", flush=True)

    def attempt(what: str, fn: Callable[[], object]) -> str:
        """`what` if `fn` ran, else the error it raised."""
        try:
            fn()
        except TidalpoolError as e:
            return f"raised {type(e).__name__}: {e}"
        return what

    def op() -> None:
        with session.op(reads=[arrays[0]], name="sum") as (a,):
            int(a.sum())

    for line in sys.stdin:
        command, *args = line.split() or [""]
        if command == "check":
            pairs = enumerate(zip(arrays, expected, strict=True))
            bad = [i for i, (a, e) in pairs if not np.array_equal(a, e)]
            print("ok" if not bad else f"corrupt {bad}", flush=True)
        elif command == "churn":
            for size in rng.integers(1, 1 << 16, int(args[0])):
                session.free(session.malloc(int(size)))
            print("churned", flush=True)
        elif command == "spin":
            print("spinning", flush=True)
            while True:
                session.free(session.malloc(int(rng.integers(1, 1 << 16))))
        elif command == "run":
            run(session, rng, int(args[0]), arrays[0])
            print(f"done {session.recorder.events_recorded}", flush=True)
        elif command == "closed":
            print("closed" if session.closed else "open", flush=True)
        elif command == "op":
            print(attempt("computed", op), flush=True)
        elif command == "malloc":
            print(attempt("allocated", lambda: session.free(session.malloc(64))), flush=True)
        elif command == "quit":
            break
    session.close()
    print(f"bye {session.recorder.events_recorded}", flush=True)


def run(session: tidalpool.Session, rng: np.random.Generator, ops: int, array: object) -> None:
    """`ops` mallocs and frees (at most 32 blocks live), an op over `array` every 64."""
    live: list[Block] = []
    for i in range(ops):
        if live and (len(live) >= 32 or rng.random() < 0.5):
            session.free(live.pop(int(rng.integers(len(live)))))
        else:
            try:
                live.append(session.malloc(int(rng.integers(1, 1 << 16))))
            except tidalpool.LeaseExceeded:
                session.free(live.pop(0))
        if i % 64 == 63:
            with session.op(reads=[array], name=f"op{i % 7}"):
                pass
    for block in live:
        session.free(block)


class Worker:
    """A client process (this module run as `worker_main`), driven line by line."""

    def __init__(self, socket_dir: Path, seed: int, device_limit: str = "16MiB") -> None:
        self.seed = seed
        self.proc = subprocess.Popen(
            [sys.executable, "-m", MODULE, str(socket_dir), str(seed), device_limit],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )
        self._lines: queue.SimpleQueue[str | None] = queue.SimpleQueue()
        self._reader = threading.Thread(target=self._read, name=f"worker-{seed}", daemon=True)
        self._reader.start()
        self.session_id = ""

    def start(self, timeout: float = 60.0) -> Worker:
        """Wait for "ready"; AssertionError with what it said instead."""
        first = self.read(timeout)
        assert first.startswith("ready "), f"worker {self.seed}: {first}"
        self.session_id = first.split()[1]
        return self

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line.strip())
        self._lines.put(None)

    def read(self, timeout: float = 60.0) -> str:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"worker {self.seed} said nothing for {timeout:g} s") from None
        if line is None:
            self._lines.put(None)
            return f"exited with {self.proc.wait()}"
        return line

    def said(self) -> str | None:
        """Its next line if one has come, without waiting."""
        try:
            line = self._lines.get_nowait()
        except queue.Empty:
            return None
        if line is None:
            self._lines.put(None)
            return f"exited with {self.proc.wait()}"
        return line

    def send(self, command: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()

    def ask(self, command: str, timeout: float = 60.0) -> str:
        self.send(command)
        return self.read(timeout)

    def quit(self) -> int:
        """Close its session; the events it recorded."""
        said = self.ask("quit")
        assert said.startswith("bye "), f"worker {self.seed} on quit: {said}"
        self.close()
        return int(said.split()[1])

    def signal(self, signum: int) -> None:
        self.proc.send_signal(signum)

    def close(self) -> None:
        if self.proc.poll() is None:
            with suppress(OSError):
                self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                with suppress(OSError):
                    pipe.close()
        self._reader.join(timeout=10)


@pytest.fixture
def workers() -> Iterator[list[Worker]]:
    """Workers a test starts; every one still running is killed at the end."""
    started: list[Worker] = []
    yield started
    for w in started:
        w.close()


def spawn(workers: list[Worker], d: LocalDaemon, seed: int, limit: str = "16MiB") -> Worker:
    w = Worker(d.socket_dir, seed, limit)
    workers.append(w)
    return w.start()


def events_received(d: LocalDaemon, session_id: str) -> int:
    """The trace events the daemon had of a session when it ended (its session.ended line)."""
    pattern = re.compile(rf"session\.ended session={re.escape(session_id)}\b.*\bevents=(\d+)")
    found = [m for m in map(pattern.search, d.log_path.read_text().splitlines()) if m]
    assert len(found) == 1, f"{len(found)} session.ended lines for {session_id}"
    return int(found[0].group(1))


def quit_whole(d: LocalDaemon, w: Worker) -> None:
    """Close a survivor: its bytes intact, and the daemon received every event it recorded."""
    assert w.ask("check") == "ok", f"worker {w.seed}'s bytes changed"
    recorded = w.quit()
    wait_for(lambda: "session.ended session=" + w.session_id in d.log_path.read_text(), "its end")
    assert events_received(d, w.session_id) == recorded, f"worker {w.seed} lost trace events"


def assert_exact(target: Target, context: str) -> None:
    """Every session has ended: both pools wholly free."""
    wait_for(lambda: not target.sessions(), f"{context}: every session to end")
    wait_for(
        lambda: all(
            u.leased_bytes == 0 and u.free_bytes == u.total_bytes
            for s in [target.pool_status()]
            for u in (s.device, s.host)
        ),
        f"{context}: every chunk back in its pool",
    )
    status = target.pool_status()
    for usage in (status.device, status.host):
        assert (usage.total_bytes, usage.leased_bytes, usage.free_bytes) == (
            256 * MiB,
            0,
            256 * MiB,
        )


def leased_matches_sessions(target: Target) -> bool:
    """The pools' leased bytes are exactly the leases of the sessions listed."""
    infos = target.session_infos()
    status = target.pool_status()
    device = sum(s.lease.device.length for s in infos)
    host = sum(s.lease.host.length for s in infos)
    return (status.device.leased_bytes, status.host.leased_bytes) == (device, host)


def measured(d: LocalDaemon) -> tuple[int, int]:
    """The daemon's steady RSS and open fds (skips where /proc/PID/fd is not readable)."""
    if not os.access(f"/proc/{d.process.pid}/fd", os.R_OK):
        pytest.skip("the daemon's /proc/PID/fd is not readable here (it is non-dumpable)")
    return steady_rss(d.process.pid), daemon_open_fds(d.process.pid)


# -- the tests ---------------------------------------------------------------------------------
def test_killed_and_stopped_clients_leave_the_others_working(
    start_daemon: StartDaemon, workers: list[Worker]
) -> None:
    """Two clients SIGKILLed mid-churn and one SIGSTOPped past the heartbeat timeout while two
    others churn: the killed ones' leases return at once, the stopped one is evicted, and once
    it runs again its next op and malloc raise SessionClosed."""
    d = ready(start_daemon("--heartbeat-interval-s", "0.25", "--heartbeat-timeout-s", "2"))
    target = Target(d.socket_dir)
    bystander = Bystander(d.socket_dir)
    try:
        rss, fds = measured(d)
        survivors = [spawn(workers, d, seed) for seed in (1, 2)]
        killed = [spawn(workers, d, seed) for seed in (3, 4)]
        stopped = spawn(workers, d, 5)
        for w in killed:
            assert w.ask("spin") == "spinning"
        for w in survivors:
            w.send("churn 3000")
        for w in killed:
            w.signal(signal.SIGKILL)
        for w in survivors:
            assert w.read() == "churned"
        gone = {w.session_id for w in killed}
        wait_for(lambda: not gone & set(target.sessions()), "the killed clients' sessions to end")
        assert leased_matches_sessions(target)

        stopped.signal(signal.SIGSTOP)
        wait_for(lambda: stopped.session_id not in target.sessions(), "the eviction", 30)
        # The session leaves the list before its end is logged: wait for the line.
        evicted = rf"session\.ended session={stopped.session_id} reason=evicted"
        wait_for(lambda: re.search(evicted, d.log_path.read_text()), "the eviction's log line")
        for w in survivors:
            assert w.ask("churn 1000") == "churned"
            assert w.ask("check") == "ok"
        bystander.check("while a client is stopped")
        stopped.signal(signal.SIGCONT)
        wait_for(lambda: stopped.ask("closed") == "closed", "the resumed client to learn its end")
        assert stopped.ask("op").startswith("raised SessionClosed"), "an evicted client computed"
        assert stopped.ask("malloc").startswith("raised SessionClosed")
        stopped.quit()
        assert leased_matches_sessions(target)

        for w in survivors:
            w.send("churn 20000")  # chunks still queued when it closes: all must arrive
        for w in survivors:
            assert w.read() == "churned"
            quit_whole(d, w)
        bystander.check("after the faults")
        bystander.close()
        assert_exact(target, "after the clients")
        check_bounds(d.process.pid, rss, fds, "after the clients")
    finally:
        target.close()
        with suppress(Exception):
            bystander.close()


def test_the_daemon_killed_and_restarted_on_its_socket_directory(
    start_daemon: StartDaemon, workers: list[Worker]
) -> None:
    """SIGKILL the daemon under a client: the client's next malloc raises SessionClosed, a new
    attach says the daemon cannot be reached, and a daemon started on the same directory
    serves at once; a third one beside it is refused and changes nothing."""
    d = ready(start_daemon())
    orphan = spawn(workers, d, 11)
    d.process.kill()
    d.process.wait()
    wait_for(lambda: orphan.ask("closed") == "closed", "the client to learn the daemon died")
    assert orphan.ask("malloc").startswith("raised SessionClosed")
    with pytest.raises(tidalpool.AttachError, match="cannot reach tidalpoold"):
        tidalpool.attach(d.socket_dir, device_limit="2MiB")

    again = LocalDaemon.start(
        d.socket_dir,
        device_pool="256MiB",
        host_pool="256MiB",
        default_lease="64MiB",
        chunk_size="2MiB",
    )
    ready(again)
    target = Target(d.socket_dir)
    bystander: Bystander | None = None
    try:
        assert orphan.quit() >= 0  # closing after its daemon died neither hangs nor raises
        bystander = Bystander(d.socket_dir)
        rss, fds = measured(again)
        survivor = spawn(workers, again, 12)
        assert survivor.ask("churn 2000") == "churned"

        third = subprocess.run(
            [
                *(sys.executable, "-m", "tidalpoold", "serve", "--socket-dir", str(d.socket_dir)),
                *("--device-pool", "64MiB", "--host-pool", "64MiB", "--metrics-address", ""),
                *("--default-device-lease", "2MiB", "--default-host-lease", "2MiB"),
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert third.returncode != 0, "a second daemon started on a directory already served"
        assert "another daemon" in third.stderr + third.stdout, third.stderr[-2000:]
        assert is_serving(d.socket_dir) and again.process.poll() is None
        bystander.check("after a second daemon was refused")

        quit_whole(again, survivor)
        bystander.close()
        assert_exact(target, "after the restart")
        check_bounds(again.process.pid, rss, fds, "after the restart")
    finally:
        target.close()
        if bystander is not None:
            with suppress(Exception):
                bystander.close()
        again.stop()


def lowest_free_fd(pid: int) -> int:
    """The lowest fd number the process does not hold: with RLIMIT_NOFILE there, it can open
    nothing new until it closes one below."""
    held = {int(name) for name in os.listdir(f"/proc/{pid}/fd")}
    return next(n for n in range(len(held) + 1) if n not in held)


def test_fd_exhaustion_then_recovery(start_daemon: StartDaemon, workers: list[Worker]) -> None:
    """With its open files exhausted, the daemon ends sessions (one killed, one closing) and
    refuses or holds new ones without dying; once the limit is restored, attaches are served
    again and every chunk comes back (a chunk it could not renew meanwhile returns too)."""
    d = ready(start_daemon())
    pid = d.process.pid
    target = Target(d.socket_dir)
    bystander = Bystander(d.socket_dir)
    late: Worker | None = None
    limits = resource.prlimit(pid, resource.RLIMIT_NOFILE)
    try:
        rss, fds = measured(d)
        killed, closing, survivor = (spawn(workers, d, seed) for seed in (21, 22, 23))
        assert killed.ask("spin") == "spinning"
        target.sessions()  # the admin connection is open before the files run out
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (lowest_free_fd(pid), limits[1]))
        try:
            killed.signal(signal.SIGKILL)
            closing.quit()
            ended = {killed.session_id, closing.session_id}
            wait_for(lambda: not ended & set(target.sessions()), "the two sessions to end")
            late = Worker(d.socket_dir, 24)  # its attach meets a daemon out of files
            workers.append(late)
            with suppress(OSError):  # and so does a connection that says nothing
                handles_exchange(d.socket_dir / HANDLES_SOCKET, b"", timeout=1.0)
            assert d.process.poll() is None, "the daemon died when its open files ran out"
            bystander.check("while the daemon is out of files")
        finally:
            resource.prlimit(pid, resource.RLIMIT_NOFILE, limits)

        said = late.read(60)  # served once files are back, or refused: never silent
        assert said.startswith(("ready ", "attach-failed ")), said
        request = frame(
            handles_pb2.HandlesRequest(
                version=HANDLES_VERSION, device_bytes=2 * MiB, job_name="after"
            ).SerializeToString()
        )

        def served() -> bool:
            return handles_exchange(d.socket_dir / HANDLES_SOCKET, request, timeout=3).outcome in (
                "granted",
                "RESOURCE_EXHAUSTED",
            )

        wait_for(served, "the handles socket to serve again once files are back", 30)
        with tidalpool.attach(d.socket_dir, device_limit="2MiB", job_name="after") as s:
            s.free(s.malloc(MiB))
        if said.startswith("ready "):
            late.session_id = said.split()[1]
            quit_whole(d, late)
        quit_whole(d, survivor)
        bystander.check("after the files came back")
        bystander.close()
        assert_exact(target, "after the open files ran out")
        check_bounds(pid, rss, fds, "after the open files ran out")
    finally:
        target.close()
        with suppress(Exception):
            bystander.close()


def plant(path: Path, kind: str, rng: np.random.Generator) -> None:
    """Replace a cached plan with something that is not one."""
    path.unlink()
    if kind == "noise":
        path.write_bytes(rng.bytes(4096))
    elif kind == "fifo":
        os.mkfifo(path)  # opening it to read waits for a writer that never comes
    elif kind == "dev-zero":
        path.symlink_to("/dev/zero")  # reading it never ends
    elif kind == "huge":
        with path.open("wb") as f:
            f.truncate(8 * GiB)  # sparse: 8 GiB to read, nothing on disk
    else:
        raise ValueError(kind)


def unblock(path: Path) -> None:
    """A reader stuck opening a FIFO goes on (it reads nothing) once a writer opens it."""
    if path.is_fifo():
        with suppress(OSError):
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))


@pytest.mark.parametrize("kind", ["noise", "fifo", "dev-zero", "huge"])
def test_a_corrupt_plan_cache_file_is_planned_around(
    start_daemon: StartDaemon, tmp_path: Path, kind: str
) -> None:
    """A job planned once finds its cached plan replaced by noise, a FIFO, a link to /dev/zero
    or an 8 GiB file: its next run still gets a plan, the daemon stays alive and small, and the
    cache holds a plan again. (The daemon's address space is capped 2 GiB above its size for the
    test, so that a daemon reading /dev/zero to its end fails in a second instead of filling
    the machine's memory.)"""
    cache = tmp_path / "plans"
    d = ready(start_daemon("--plan-cache-dir", str(cache)))
    pid = d.process.pid
    target = Target(d.socket_dir)
    bystander = Bystander(d.socket_dir)
    space = resource.prlimit(pid, resource.RLIMIT_AS)
    planted: list[Path] = []
    try:
        with tidalpool.attach(d.socket_dir, device_limit="8MiB", job_name="planned") as s:
            run_until_planned(s)
        planted = sorted(cache.glob("*.plan"))
        assert planted, "the first run cached no plan"
        rss, fds = measured(d)
        size = int(Path(f"/proc/{pid}/status").read_text().split("VmSize:")[1].split()[0]) * 1024
        resource.prlimit(pid, resource.RLIMIT_AS, (size + 2 * GiB, space[1]))
        for path in planted:
            plant(path, kind, np.random.default_rng(7))
        with tidalpool.attach(d.socket_dir, device_limit="8MiB", job_name="planned") as s:
            run_until_planned(s, limit=20)
        assert d.process.poll() is None
        for path in planted:
            assert path.is_file() and not path.is_symlink(), f"{path} is still not a plan"
        bystander.check("after the corrupt plans")
        bystander.close()
        assert_exact(target, "after the corrupt plans")
        check_bounds(pid, rss, fds, "after the corrupt plans")
    finally:
        for path in planted:
            unblock(path)
        if d.process.poll() is None:
            resource.prlimit(pid, resource.RLIMIT_AS, space)
        target.close()
        with suppress(Exception):
            bystander.close()


if __name__ == "__main__":
    worker_main(sys.argv[1:])
