"""The long version of the fault-and-fuzz suite: hostile and broken peers against real daemons.

    python bench/soak.py [--messages 100000] [--attaches 200] [--hostile 100] [--clients 32]
                         [--ops 100000] [--kill-fraction 0.3] [--trace-events N]
                         [--seconds 900] [--seed S] [--attack-seconds 10] [--streams 80]
                         [--flood 1000] [--heavy-allocations 100000]
                         [--phases fuzz,attach,memory,accounting,starve]
                         [--json OUT]

Starts its own sim daemons (one per phase, in temporary socket directories) and runs:

  fuzz        --messages mutated messages across every unary RPC (Pool, Admin, Health), the
              Session stream and the handles socket (tests/integration/test_fuzz.py's kit),
              counting daemon crashes (goal 0), status codes per target, and answers outside
              what each target may answer; the bystander is checked after every round
  attach      attach latency (p50/p99/max over --attaches attaches) with no hostile peer, the
              baseline, then with --hostile connections to the handles socket that stay
              silent or drip a byte every 100 ms (goal: p99 <= 100 ms)
  memory      daemon RSS before and after one session sends its worst within the bounds
              (max_trace_name_bytes of op names, 2 x max_trace_events events), against the
              bound computed from bytes per event x events + name bytes + chunk bookkeeping
  accounting  --clients client processes each doing --ops mallocs and frees through a real
              session, some SIGKILLed at random (and replaced) until every slot has done its
              ops: the pools exact afterwards (leased 0, free == total) and no event of a
              process that closed normally lost
  starve      peers that would starve the others, each for --attack-seconds: --streams
              Health/Watch streams, then as many reflection streams, --flood silent
              connections to tidalpool.sock, as many idle ones to the metrics endpoint (both
              from a process of their own), and as root as many to tidalpool.sock from uid
              65534 that send the HTTP/2 preface and settings, then idle; a
              bystander checks health (admin.sock, as probes ask, and tidalpool.sock) every
              50 ms and attaches every 200 ms, and the daemon's threads, fds and RSS are
              sampled (goals: health p99 <= 1 s, attach p99 <= 100 ms); then a small
              session's plan latency alone and beside one of --heavy-allocations allocations

--seconds bounds the fuzz phase and each half of the attach phase (what ran is reported).
Progress lines go to stderr; the result is one JSON object (stdout, or --json OUT).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import secrets
import selectors
import shutil
import signal
import socket
import statistics
import struct
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the suite's kit (tests/integration) is what the soak runs

import tidalpool  # noqa: E402
from tidalclient.local import LocalDaemon  # noqa: E402
from tidalcore.v1 import pool_pb2  # noqa: E402
from tidalcore.wire import HANDLES_SOCKET  # noqa: E402
from tidalpoold.front import PREFACE  # noqa: E402

from tests.flood import NOBODY, SETTINGS_FRAME, flood  # noqa: E402
from tests.integration.test_fault_suite import Worker, events_received  # noqa: E402
from tests.integration.test_fuzz import (  # noqa: E402
    UNARY,
    Bystander,
    Outcome,
    RawStream,
    Target,
    call_raw,
    daemon_open_fds,
    daemon_rss_bytes,
    ready,
    steady_rss,
    token_metadata,
    wait_for,
)

MiB = 1 << 20
EVENT_BYTES = 1 + 8 + 8 + 8 + 4
"""Bytes the daemon stores per trace event: kind u8, block id, size, duration u64, name id u32."""
CHUNK_BOOKKEEPING = 1024
"""Bytes a stored trace chunk costs beside its events (the object and five array headers)."""
COALESCE_EVENTS = 4096
"""Stored neighbours hold more than this many events together: what bounds the chunk count."""


def mib(n: int) -> float:
    """Bytes in MiB, to a tenth."""
    return round(n / MiB, 1)


def log(phase: str, text: str) -> None:
    print(f"[soak {phase}] {text}", file=sys.stderr, flush=True)


def latency(samples_s: list[float]) -> dict[str, float | int]:
    """p50, p99 and max in milliseconds."""
    if not samples_s:
        return {"n": 0}
    ordered = sorted(samples_s)
    return {
        "n": len(ordered),
        "p50_ms": round(statistics.median(ordered) * 1e3, 2),
        "p99_ms": round(ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] * 1e3, 2),
        "max_ms": round(ordered[-1] * 1e3, 2),
    }


@contextmanager
def daemon(name: str, *extra: str, device_pool: str = "256MiB") -> Iterator[LocalDaemon]:
    """A sim daemon (chunks of 2 MiB) in a fresh socket directory, stopped and removed after."""
    directory = Path(tempfile.mkdtemp(prefix=f"tp-{name}-", dir="/tmp"))
    d = LocalDaemon.start(
        directory,
        device_pool=device_pool,
        host_pool="256MiB",
        default_lease="64MiB",
        chunk_size="2MiB",
        extra=extra,
    )
    try:
        yield ready(d)
    finally:
        d.stop()
        shutil.rmtree(directory, ignore_errors=True)


def pool_numbers(target: Target) -> dict[str, dict[str, int]]:
    status = target.pool_status()
    return {
        name: {
            "total_bytes": u.total_bytes,
            "leased_bytes": u.leased_bytes,
            "free_bytes": u.free_bytes,
        }
        for name, u in (("device", status.device), ("host", status.host))
    }


def exact(pools: dict[str, dict[str, int]]) -> bool:
    return all(
        p["leased_bytes"] == 0 and p["free_bytes"] == p["total_bytes"] for p in pools.values()
    )


def settle(target: Target) -> dict[str, Any]:
    """Wait for every session to end and the pools to come back; their numbers either way."""
    target.evict_pending()
    with suppress(AssertionError):
        wait_for(lambda: not target.sessions(), "every session to end", 60)
    with suppress(AssertionError):
        wait_for(lambda: exact(pool_numbers(target)), "every chunk back", 60)
    pools = pool_numbers(target)
    return {"sessions_left": len(target.sessions()), "pools": pools, "exact": exact(pools)}


# -- fuzz -------------------------------------------------------------------------------------
@dataclass
class Tally:
    """Codes by target, answers outside what a target may answer, failed checks."""

    codes: dict[str, Counter[str]] = field(default_factory=dict)
    unexpected: int = 0
    examples: dict[str, list[str]] = field(default_factory=dict)  # the first 3 per target
    batch_failures: int = 0
    check_failures: int = 0
    messages: int = 0

    def add(self, outcomes: list[Outcome]) -> None:
        for o in outcomes:
            self.codes.setdefault(o.target, Counter())[o.code] += 1
            if not o.expected:
                self.unexpected += 1
                self.example(o.target, o.what)

    def example(self, target: str, what: str) -> None:
        kept = self.examples.setdefault(target, [])
        if len(kept) < 3:
            kept.append(what[:400])

    def failed(self, what: str, e: BaseException) -> None:
        self.example(f"{what} (broken off)", f"{type(e).__name__}: {e}")


def fuzz(args: argparse.Namespace) -> dict[str, Any]:
    """--messages fuzzed messages round-robin over every target, batches of 50."""
    rng = random.Random(f"{args.seed}/soak-fuzz")
    tally = Tally()
    crashes: list[str] = []
    targets = [*sorted(UNARY), "Session", "handles"]
    started = time.monotonic()
    report: dict[str, Any] = {}
    while tally.messages < args.messages and time.monotonic() - started < args.seconds:
        with daemon("fuzz", "--attach-timeout-s", "15") as d:
            target, bystander = Target(d.socket_dir), Bystander(d.socket_dir)
            sent_before = tally.messages
            rss, fds = steady_rss(d.process.pid), daemon_open_fds(d.process.pid)
            last = time.monotonic()
            while tally.messages < args.messages and time.monotonic() - started < args.seconds:
                for name in targets:
                    try:
                        if name == "Session":
                            outcomes = target.fuzz_stream(rng, 50)
                        elif name == "handles":
                            outcomes = target.fuzz_handles(rng, 50)
                        else:
                            outcomes = target.fuzz_unary(UNARY[name], rng, 50)
                        tally.add(outcomes)
                    except Exception as e:  # a batch the daemon broke off: counted, go on
                        tally.batch_failures += 1
                        tally.failed(name, e)
                    tally.messages = sent_before + target.sent
                if d.process.poll() is not None:
                    crashes.append(d.log_path.read_text()[-2000:])
                    log("fuzz", f"the daemon died ({d.process.returncode}); starting another")
                    break
                try:
                    bystander.check(f"after {tally.messages} messages")
                except Exception as e:
                    tally.check_failures += 1
                    tally.failed("bystander", e)
                    bystander = Bystander(d.socket_dir)
                if time.monotonic() - last > 5:
                    last = time.monotonic()
                    rate = tally.messages / (last - started)
                    log(
                        "fuzz",
                        f"{tally.messages}/{args.messages} messages, {len(crashes)} crashes,"
                        f" {tally.unexpected} unexpected answers, {tally.batch_failures} batches"
                        f" broken off, {rate:.0f} messages/s",
                    )
            if d.process.poll() is None:
                with suppress(Exception):
                    bystander.close()
                report = settle(target)
                report["rss_mib"] = [
                    mib(rss),
                    mib(daemon_rss_bytes(d.process.pid)),
                ]
                report["fds"] = [fds, daemon_open_fds(d.process.pid)]
            target.close()
    return {
        "messages": tally.messages,
        "seconds": round(time.monotonic() - started, 1),
        "crashes": len(crashes),
        "crash_logs": crashes[:3],
        "unexpected_answers": tally.unexpected,
        "batches_broken_off": tally.batch_failures,
        "bystander_check_failures": tally.check_failures,
        "examples": tally.examples,
        "codes": {target: dict(counts) for target, counts in sorted(tally.codes.items())},
        "end": report,
    }


# -- attach latency beside hostile peers --------------------------------------------------------
class Hostile:
    """`count` connections to the handles socket, half silent, half dripping one byte every
    100 ms of a request that declares 60,000 bytes; each the daemon drops is opened again
    (and one the listen backlog has no room for is tried again every 50 ms)."""

    def __init__(self, path: Path, count: int) -> None:
        self.path, self.count = path, count
        self.dropped = 0  # connections the daemon answered or hung up on
        self.open = 0  # connections open now
        self.open_at_start = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hostile", daemon=True)

    def __enter__(self) -> Hostile:
        self._thread.start()
        with suppress(AssertionError):  # a daemon serving one peer at a time backs up
            wait_for(lambda: self.open >= self.count, f"{self.count} hostile connections", 10)
        self.open_at_start = self.open
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        selector = selectors.DefaultSelector()
        socks: dict[int, tuple[socket.socket, int]] = {}  # slot -> (socket, bytes dripped)
        payload = struct.pack("<I", 60000) + b"x" * 60000
        next_drip = time.monotonic()
        try:
            while not self._stop.is_set():
                for slot in range(self.count):
                    if slot not in socks:
                        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                        sock.setblocking(False)
                        try:
                            sock.connect(str(self.path))
                        except (BlockingIOError, InterruptedError, ConnectionRefusedError):
                            sock.close()  # the backlog is full: next round
                            continue
                        socks[slot] = (sock, 0)
                        selector.register(sock, selectors.EVENT_READ, slot)
                self.open = len(socks)
                now = time.monotonic()
                if now >= next_drip:
                    next_drip = now + 0.1
                    for slot, (sock, sent) in list(socks.items()):
                        if slot % 2 and sent < len(payload):
                            with suppress(OSError):
                                sock.send(payload[sent : sent + 1])
                                socks[slot] = (sock, sent + 1)
                for key, _ in selector.select(timeout=0.05):
                    sock = socks.pop(key.data)[0]
                    selector.unregister(sock)
                    sock.close()  # the daemon answered or hung up: drop it, open another
                    self.dropped += 1
        finally:
            for sock, _ in socks.values():
                sock.close()
            selector.close()


def timed_attaches(socket_dir: Path, n: int, seconds: float, phase: str) -> dict[str, Any]:
    """Latency of the attaches that succeeded; those that failed are counted by their error
    (the daemon's words, the socket path left out) with the time they took."""
    samples, failed, failures = [], list[float](), Counter[str]()
    started = time.monotonic()
    for i in range(n):
        if time.monotonic() - started > seconds:
            break
        t = time.monotonic()
        try:
            s = tidalpool.attach(socket_dir, device_limit="2MiB", host_limit="2MiB")
        except tidalpool.AttachError as e:
            failed.append(time.monotonic() - t)
            failures[str(e).replace(str(socket_dir), "DIR")[:160]] += 1
            continue
        samples.append(time.monotonic() - t)
        s.close()
        if i % 50 == 49:
            log("attach", f"{phase}: {i + 1}/{n}, {latency(samples)}, {len(failed)} failed")
    return {
        **latency(samples),
        "failed": len(failed),
        "failed_after": latency(failed),
        "failures": dict(failures),
    }


def attach(args: argparse.Namespace) -> dict[str, Any]:
    with daemon("attach") as d:
        target = Target(d.socket_dir)
        base = timed_attaches(d.socket_dir, args.attaches, args.seconds, "baseline")
        log("attach", f"baseline {base}")
        with Hostile(d.socket_dir / HANDLES_SOCKET, args.hostile) as hostile:
            beside = timed_attaches(d.socket_dir, args.attaches, args.seconds, "hostile")
        log("attach", f"beside {args.hostile} hostile connections {beside}")
        end = settle(target)
        target.close()
    return {
        "baseline": base,
        "hostile": {
            **beside,
            "connections": args.hostile,
            "open_at_start": hostile.open_at_start,
            "dropped_by_daemon": hostile.dropped,
        },
        "goal_p99_ms": 100,
        "end": end,
    }


# -- one session's worst ------------------------------------------------------------------------
def memory(args: argparse.Namespace) -> dict[str, Any]:
    """One session sends max_trace_name_bytes of op names (until the daemon refuses more) and
    2 x max_trace_events events in chunks of 65,536; RSS before, once all is received, and
    after the session ended, against the bound."""
    from tidalpoold.settings import Settings

    settings = Settings()
    max_events, max_names = settings.max_trace_events, settings.max_trace_name_bytes
    total = args.trace_events or 2 * max_events
    chunks_held = 2 * max_events // COALESCE_EVENTS + 1
    bound = max_events * EVENT_BYTES + max_names + chunks_held * CHUNK_BOOKKEEPING
    with daemon("memory") as d:
        pid = d.process.pid
        target = Target(d.socket_dir)
        session = target.raw_session(attach=True)
        stream = RawStream(target.pool, token_metadata(session.token), timeout=3600)
        assert stream.opened()
        before = steady_rss(pid)
        hwm_before = _status_kib(pid, "VmHWM") * 1024

        def events() -> int:
            code, reply = call_raw(
                target.pool, "/tidalpool.v1.Pool/Stats", b"", token_metadata(session.token)
            )
            assert isinstance(reply, bytes), f"Stats: {code} {reply!r}"
            return int(pool_pb2.StatsResponse.FromString(reply).session.events_received)

        def decided(errors: int, kept: int) -> bool:
            return len(stream.errors()) > errors or events() > kept

        sent, names_kept, name_id, refused = 0, 0, 1, ""
        while not refused:  # names of 512 bytes, 1,024 a chunk, until one is refused
            errors = len(stream.errors())
            names = {name_id + i: f"{name_id + i:09d}.".ljust(512, "n") for i in range(1024)}
            stream.send(_chunk(sent, 1, names))
            wait_for(partial(decided, errors, sent), "a chunk's fate")
            if len(stream.errors()) > errors:
                refused = stream.errors()[-1].code
            else:
                sent, name_id, names_kept = sent + 1, name_id + 1024, names_kept + 1024 * 512
            if names_kept > 4 * max_names:
                refused = "never"
        log("memory", f"{names_kept} bytes of op names kept, then {refused}")
        rng = random.Random(args.seed)
        started = time.monotonic()
        while sent < total:
            n = min(65536, total - sent)
            stream.send(_chunk(sent, n, {}, rng.randrange(1, name_id)))
            sent += n
            if sent % (16 * 65536) == 0:
                log("memory", f"{sent}/{total} events sent")
        wait_for(lambda: events() == sent, "every event to be received", 600)
        seconds = time.monotonic() - started
        full = steady_rss(pid)
        peak = _status_kib(pid, "VmHWM") * 1024
        stream.close()
        target.end([session])
        wait_for(lambda: not target.sessions(), "the session to end")
        after = steady_rss(pid)
        end = settle(target)
        target.close()
    return {
        "events_sent": total,
        "op_name_bytes_kept": names_kept,
        "names_refused_with": refused,
        "seconds": round(seconds, 1),
        "rss_before_mib": mib(before),
        "rss_full_mib": mib(full),
        "rss_after_end_mib": mib(after),
        "rss_growth_mib": mib(full - before),
        "peak_growth_mib": mib(peak - max(before, hwm_before)),
        "bound_mib": mib(bound),
        "bound": f"{max_events} events x {EVENT_BYTES} B + {max_names} B of names"
        f" + {chunks_held} chunks x {CHUNK_BOOKKEEPING} B",
        "within_bound": full - before <= bound,
        "end": end,
    }


def _chunk(first: int, n: int, names: dict[int, str], name_id: int = 0) -> bytes:
    """A trace chunk of `n` events from event `first`: allocations, ops (named `name_id`)
    and frees in turn; a chunk of one event is an op named by the first of `names`."""
    if n == 1:
        kinds, blocks, sizes = [pool_pb2.EVENT_KIND_OP], [0], [0]
        durations, name_ids = [1000], [min(names, default=0)]
    else:
        cycle = (pool_pb2.EVENT_KIND_ALLOC, pool_pb2.EVENT_KIND_OP, pool_pb2.EVENT_KIND_FREE)
        kinds = [cycle[(first + i) % 3] for i in range(n)]
        blocks = [(first + i) // 3 + 1 for i in range(n)]
        sizes = [4096 if k == pool_pb2.EVENT_KIND_ALLOC else 0 for k in kinds]
        durations = [1000 if k == pool_pb2.EVENT_KIND_OP else 0 for k in kinds]
        name_ids = [name_id if k == pool_pb2.EVENT_KIND_OP else 0 for k in kinds]
    return pool_pb2.ClientMessage(
        trace=pool_pb2.TraceChunk(
            first_event=first,
            kinds=kinds,
            block_ids=blocks,
            sizes=sizes,
            durations_ns=durations,
            name_ids=name_ids,
            new_names=names,
        )
    ).SerializeToString()


def _status_kib(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {key} in /proc/{pid}/status")


# -- accounting after many processes and random kills ------------------------------------------
def accounting(args: argparse.Namespace) -> dict[str, Any]:
    """--clients slots, each to be filled by a worker that does --ops operations and closes; a
    worker is SIGKILLed with probability --kill-fraction at a random moment of its run (and
    its slot refilled)."""
    rng = random.Random(f"{args.seed}/soak-accounting")
    # Every client starts at once, all of one uid: room for each to be pending (granted on the
    # handles socket, not attached yet) at the same moment.
    pending = ("--max-pending-per-uid", str(max(8, args.clients)))
    with daemon("accounting", *pending, device_pool="512MiB") as d:
        target = Target(d.socket_dir)
        rss, fds = steady_rss(d.process.pid), daemon_open_fds(d.process.pid)
        done: dict[int, tuple[str, int]] = {}  # slot -> (session id, events recorded)
        killed: list[str] = []
        starting: dict[int, Worker] = {}  # slot -> a worker not ready yet
        running: dict[int, tuple[Worker, float | None]] = {}  # slot -> (worker, kill at)
        spawned = 0
        # How long a run takes, about: 2 µs of CPU an operation, the clients sharing the cores.
        run_s = max(0.2, args.ops * 2e-6 * args.clients / (os.cpu_count() or 1))

        def spawn(slot: int) -> None:
            nonlocal spawned
            spawned += 1
            starting[slot] = Worker(d.socket_dir, 1000 * slot + spawned, "8MiB")

        def run(slot: int, w: Worker) -> None:
            """Start its operations; SIGKILL it in the middle of them if the dice say so."""
            w.send(f"run {args.ops}")
            kill_at = None
            if rng.random() < args.kill_fraction:
                kill_at = time.monotonic() + rng.uniform(0.05, run_s)
            running[slot] = (w, kill_at)

        for slot in range(args.clients):  # all attached first, then all run
            spawn(slot)
        for slot, w in list(starting.items()):
            w.start(120)
            del starting[slot]
            running[slot] = (w, None)
        started = time.monotonic()
        for slot, (w, _) in list(running.items()):
            run(slot, w)
        last = time.monotonic()
        while running or starting:
            for slot, w in list(starting.items()):  # replacements: run once ready
                said = w.said()
                if said is not None:
                    assert said.startswith("ready "), f"worker {w.seed}: {said}"
                    w.session_id = said.split()[1]
                    del starting[slot]
                    run(slot, w)
            for slot, (w, kill_at) in list(running.items()):
                said = w.said() or ""
                if said.startswith("done "):
                    done[slot] = (w.session_id, w.quit())
                    del running[slot]
                elif said:
                    raise RuntimeError(f"worker {w.seed} said {said!r}")
                elif kill_at is not None and time.monotonic() >= kill_at:
                    w.signal(signal.SIGKILL)
                    w.close()
                    killed.append(w.session_id)
                    del running[slot]
                    spawn(slot)
            time.sleep(0.05)  # the pace of this loop, not a wait for a state
            if time.monotonic() - last > 10:
                last = time.monotonic()
                log(
                    "accounting",
                    f"{len(done)}/{args.clients} slots done, {len(killed)} killed,"
                    f" {time.monotonic() - started:.0f} s",
                )
        end = settle(target)
        lost = {
            sid: recorded - events_received(d, sid)
            for sid, recorded in done.values()
            if events_received(d, sid) != recorded
        }
        report = {
            "clients": args.clients,
            "ops_per_client": args.ops,
            "workers_started": spawned,
            "killed": len(killed),
            "completed": len(done),
            "operations_completed": len(done) * args.ops,
            "events_recorded": sum(n for _, n in done.values()),
            "sessions_losing_events": len(lost),
            "events_lost": sum(lost.values()),
            "seconds": round(time.monotonic() - started, 1),
            "end": end,
            "rss_mib": [mib(rss), mib(daemon_rss_bytes(d.process.pid))],
            "fds": [fds, daemon_open_fds(d.process.pid)],
        }
        target.close()
    return report


# -- peers that would starve the others: streams, connections, the planner ---------------------
class Watcher:
    """The bystander of the starve phase: every TICK_S a health check on admin.sock (as the
    daemon's probes ask) and one on tidalpool.sock, every ATTACH_EVERY-th tick an attach and a
    detach; and the daemon's threads, open files and RSS, and its children's RSS (its planner
    process and multiprocessing's resource tracker), at their most."""

    TICK_S = 0.05
    ATTACH_EVERY = 4

    def __init__(self, d: LocalDaemon) -> None:
        self.d = d
        self.samples: dict[str, list[float]] = {"health": [], "jobs_health": [], "attach": []}
        self.failed: Counter[str] = Counter()
        self.most = {"threads": 0, "fds": 0, "rss_mib": 0.0, "children_rss_mib": 0.0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Watcher:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _timed(self, name: str, fn: Callable[[], bool]) -> None:
        t = time.monotonic()
        try:
            ok = fn()
        except Exception as e:  # counted by kind: the report says what failed
            ok = False
            why = " ".join(str(e).replace(str(self.d.socket_dir), "DIR").split())[:120]
            self.failed[f"{name}: {type(e).__name__}: {why}"] += 1
        else:
            if not ok:
                self.failed[f"{name}: not serving"] += 1
        if ok:
            self.samples[name].append(time.monotonic() - t)

    def _attach(self) -> bool:
        with tidalpool.attach(self.d.socket_dir, device_limit="2MiB", host_limit="2MiB"):
            return True

    def _run(self) -> None:
        from tidalclient.health import check
        from tidalcore.wire import GRPC_SOCKET

        pid, tick = self.d.process.pid, 0
        while not self._stop.wait(self.TICK_S):
            self._timed("health", lambda: check(self.d.socket_dir, timeout=5).serving)
            self._timed("jobs_health", lambda: _jobs_health(self.d.socket_dir / GRPC_SOCKET))
            if tick % self.ATTACH_EVERY == 0:
                self._timed("attach", self._attach)
            tick += 1
            with suppress(OSError, StopIteration):
                threads = next(
                    int(line.split()[1])
                    for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                    if line.startswith("Threads:")
                )
                self.most["threads"] = max(self.most["threads"], threads)
                self.most["fds"] = max(self.most["fds"], len(os.listdir(f"/proc/{pid}/fd")))
                self.most["rss_mib"] = max(self.most["rss_mib"], mib(daemon_rss_bytes(pid)))
                children = sum(daemon_rss_bytes(child) for child in _children(pid))
                self.most["children_rss_mib"] = max(self.most["children_rss_mib"], mib(children))

    def report(self) -> dict[str, Any]:
        return {
            **{name: latency(s) for name, s in self.samples.items()},
            "failed": dict(self.failed),
            "daemon_most": dict(self.most),
        }


@contextmanager
def _two_floods(path: str, n: int, hello: bytes) -> Iterator[dict[str, Any]]:
    """`flood` from uid 65534 and from uid 65533 at once: together they can hold every place,
    each within its share."""
    with flood(path, n, hello, NOBODY) as one, flood(path, n, hello, NOBODY - 1) as other:
        yield {"uids": [one, other]}


def _plans_logged(path: Path) -> list[dict[str, Any]]:
    """What the daemon's JSON log says of each plan it made or refused: the event, the
    allocations and the seconds it took where said."""
    plans, keep = [], ("event", "allocations", "seconds", "source", "why")
    for line in path.read_text().splitlines():
        with suppress(ValueError):
            record = json.loads(line)
            event = str(record.get("event", ""))
            if event.startswith("plan.") and event != "plan.waiting":
                plans.append({k: record[k] for k in keep if k in record})
    return plans


def _children(pid: int) -> list[int]:
    """The pids of process `pid`'s children."""
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        with suppress(OSError):
            found += [int(c) for c in (task / "children").read_text().split()]
    return found


def _jobs_health(path: Path) -> bool:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(f"unix:{path}") as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=5
        )
    return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


@contextmanager
def _held_streams(
    d: LocalDaemon, n: int, open_stream: Callable[[Any], Iterator[Any]]
) -> Iterator[dict[str, int]]:
    """`n` streams `open_stream(channel)` opens on tidalpool.sock: those served (their first
    answer read) held open, the others counted as refused."""
    import grpc

    channel = grpc.insecure_channel(f"unix:{d.socket_dir / 'tidalpool.sock'}")
    held, refused = [], 0
    for _ in range(n):
        stream = open_stream(channel)
        try:
            next(stream)
            held.append(stream)
        except grpc.RpcError:
            refused += 1
    try:
        yield {"opened": n, "served": len(held), "refused": refused}
    finally:
        for stream in held:
            stream.cancel()  # type: ignore[attr-defined]
        channel.close()


@contextmanager
def _watch_streams(d: LocalDaemon, n: int) -> Iterator[dict[str, int]]:
    """`n` Health/Watch streams on tidalpool.sock, those served held open."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    def watch(channel: Any) -> Any:
        return health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest())

    with _held_streams(d, n, watch) as about:
        yield about


@contextmanager
def _reflection_streams(d: LocalDaemon, n: int) -> Iterator[dict[str, int]]:
    """`n` server reflection streams on tidalpool.sock, those served held open."""
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    hold = threading.Event()

    def requests() -> Iterator[Any]:
        yield reflection_pb2.ServerReflectionRequest(list_services="")
        hold.wait()

    def info(channel: Any) -> Any:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        return stub.ServerReflectionInfo(requests())

    try:
        with _held_streams(d, n, info) as about:
            yield about
    finally:
        hold.set()


def _settled(d: LocalDaemon, seconds: float = 60.0) -> None:
    """Wait until an attach succeeds (leases left pending by failed attaches are reclaimed
    after attach_timeout_s)."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            with tidalpool.attach(d.socket_dir, device_limit="2MiB"):
                return
        except tidalpool.AttachError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def _plan_latency(d: LocalDaemon, salt: int) -> float:
    """Seconds from a small session's third step to its plan's arrival (its iteration of
    `salt`'s sizes: not one the plan cache has)."""
    with tidalpool.attach(d.socket_dir, device_limit="4MiB") as s:
        t = time.monotonic()
        for _ in range(3):
            s.step()
            blocks = [s.malloc(4096 * (k + 1) + 64 * salt) for k in range(4)]
            with s.op(reads=blocks[:2], writes=blocks[2:], name="mix", duration_ns=100_000):
                pass
            for b in blocks:
                s.free(b)
        s.step()
        if s.wait_for_plan(120) is None:
            raise RuntimeError(f"no plan within 120 s: {s.plan_unavailable}")
        return time.monotonic() - t


@contextmanager
def _heavy_iteration(d: LocalDaemon, allocations: int) -> Iterator[dict[str, int]]:
    """A session whose iterations make `allocations` allocations each, three of them recorded
    at once, so that the daemon plans (or refuses) it while the bystander's plan waits; in a
    process of its own, as a job is (its client decoding the plan it gets does not hold the
    bystander's interpreter)."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    ours, theirs = context.Pipe()
    child = context.Process(target=_heavy_session, args=(theirs, str(d.socket_dir), allocations))
    child.start()
    theirs.close()
    try:
        if not ours.poll(120):
            raise RuntimeError("the daemon did not take the heavy session's trace in 120 s")
        yield ours.recv()
    finally:
        with suppress(OSError):
            ours.send("close")
        child.join(60)
        if child.is_alive():
            child.kill()
        ours.close()


def _heavy_session(conn: Any, socket_dir: str, allocations: int) -> None:
    """`_heavy_iteration`'s process: its trace sent and taken, it says so on `conn` and holds
    its session until told to close."""
    from tidalcore.events import ALLOC, FREE, OP

    s = tidalpool.attach(socket_dir, device_limit="4MiB")
    try:
        block = 1 << 20
        for i in range(3):
            s.recorder.step(i + 1)
            for _ in range(allocations):
                block += 1
                s.recorder.record(ALLOC, block, 64)
                s.recorder.record(OP, 0, 0, 1000, 0)
                s.recorder.record(FREE, block)
        s.recorder.step(4)
        s.recorder.flush()
        deadline = time.monotonic() + 120
        while s.connection.events_received() < s.recorder.events_sent:  # it is planning now
            if time.monotonic() > deadline:
                return  # the parent reports it
            time.sleep(0.05)
        conn.send({"allocations": allocations, "events": s.recorder.events_sent})
        with suppress(EOFError, OSError):
            conn.recv()
    finally:
        s.close(flush_timeout_s=60)


def starve(args: argparse.Namespace) -> dict[str, Any]:
    """Each attack of hardening II for --attack-seconds, with the bystander (`Watcher`)
    measuring health on admin.sock (as probes ask) and on tidalpool.sock, and attach, and the
    daemon's threads, fds and RSS at their most; then the bystander's plan latency alone and
    beside a session whose iteration makes --heavy-allocations allocations."""
    report: dict[str, Any] = {"goals": {"health_p99_ms": 1000, "attach_p99_ms": 100}}
    with daemon(
        "starve",
        "--metrics-address",
        "127.0.0.1:0",
        "--log-format",
        "json",
        "--socket-mode",
        "0666",
    ) as d:
        from tools.prometheus import metrics_address

        metrics, jobs = metrics_address(d.log_path), d.socket_dir / "tidalpool.sock"
        attacks: list[tuple[str, Callable[[], Any]]] = [
            ("none", suppress),
            ("watch_streams", lambda: _watch_streams(d, args.streams)),
            ("reflection_streams", lambda: _reflection_streams(d, args.streams)),
            ("silent_connections", lambda: flood(str(jobs), args.flood)),
            ("metrics_idle", lambda: flood(metrics, args.flood)),
        ]
        if os.geteuid() == 0:  # another uid's connections that begin HTTP/2, then idle
            os.chmod(d.socket_dir, 0o755)
            hello = PREFACE + SETTINGS_FRAME
            attacks.append(
                ("another_uid_idle", lambda: flood(str(jobs), args.flood, hello, NOBODY))
            )
            attacks.append(("two_uids_idle", lambda: _two_floods(str(jobs), args.flood, hello)))
        for name, attack in attacks:
            with attack() as about, Watcher(d) as w:
                time.sleep(args.attack_seconds)  # the attack's length: what is measured
            report[name] = {"attack": about, **w.report()}
            log("starve", f"{name}: {json.dumps(report[name])[:300]}")
        _settled(d)  # the attacks' failed attaches left leases pending: wait them out
        _plan_latency(d, salt=0)  # the first plan starts the first planner process
        alone = _plan_latency(d, salt=1)
        with _heavy_iteration(d, args.heavy_allocations) as heavy, Watcher(d) as w:
            beside = _plan_latency(d, salt=2)
            deadline = time.monotonic() + 120  # the bystander watches till the heavy plan ends
            while len(_plans_logged(d.log_path)) < 4 and time.monotonic() < deadline:
                time.sleep(0.1)
        report["planner"] = {
            "heavy": heavy,
            "bystander_plan_s_alone": round(alone, 3),
            "bystander_plan_s_beside": round(beside, 3),
            "plans": _plans_logged(d.log_path),
            **w.report(),
        }
        log("starve", f"planner: {json.dumps(report['planner'])[:300]}")
    return report


PHASES: dict[str, Callable[[argparse.Namespace], dict[str, Any]]] = {
    "fuzz": fuzz,
    "attach": attach,
    "memory": memory,
    "accounting": accounting,
    "starve": starve,
}


def machine() -> dict[str, Any]:
    model = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    return {
        "cpu": model,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "kernel": platform.release(),
        "load_average_at_start": os.getloadavg(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=100_000, help="fuzzed messages in all")
    parser.add_argument("--attaches", type=int, default=200, help="attaches timed, per half")
    parser.add_argument("--hostile", type=int, default=100, help="hostile handles connections")
    parser.add_argument("--clients", type=int, default=32, help="client processes at once")
    parser.add_argument("--ops", type=int, default=100_000, help="operations per client")
    parser.add_argument(
        "--kill-fraction", type=float, default=0.3, help="share of clients SIGKILLed mid-run"
    )
    parser.add_argument(
        "--trace-events", type=int, default=0, help="events the memory phase sends (0: 2x max)"
    )
    parser.add_argument(
        "--seconds", type=float, default=900, help="bound on the fuzz phase and each attach half"
    )
    parser.add_argument(
        "--attack-seconds", type=float, default=10, help="how long each starve attack lasts"
    )
    parser.add_argument("--streams", type=int, default=80, help="streams a starve attack opens")
    parser.add_argument(
        "--flood", type=int, default=1000, help="silent connections a starve attack keeps open"
    )
    parser.add_argument(
        "--heavy-allocations",
        type=int,
        default=100_000,
        help="allocations an iteration of the starve phase's heavy session makes",
    )
    parser.add_argument("--seed", default=str(secrets.randbits(32)))
    parser.add_argument("--phases", default=",".join(PHASES), help="comma-separated, in order")
    parser.add_argument("--json", type=Path, default=None, help="write the result here")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the daemons on the way out
    result: dict[str, Any] = {
        "command": " ".join(sys.argv),
        "seed": args.seed,
        "date": time.strftime("%Y-%m-%d"),
        "machine": machine(),
        "phases": {},
    }
    for name in args.phases.split(","):
        log(name, "starting")
        t = time.monotonic()
        result["phases"][name] = PHASES[name](args)
        log(
            name,
            f"done in {time.monotonic() - t:.0f} s: {json.dumps(result['phases'][name])[:400]}",
        )
    text = json.dumps(result, indent=2)
    if args.json is not None:
        args.json.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
