"""The session registry: who holds which lease, and reclaiming it when they go.

A session is born *pending* on the handles socket (lease carved, token issued,
fds passed), becomes *attached* by the `Attach` RPC, lives while its `Session`
stream is open, and *ends* exactly once, for whatever reason: Detach, stream
closed or broken (process exit, SIGKILL), eviction, missed heartbeats, an
Attach that never came, or daemon shutdown. Ending returns the session's
chunks to their pools and scrubs them, then tells its stream (if any) goodbye.

    handles socket ──open()──▶ pending ──attach()──▶ attached ──end()──▶ (gone)
                                  └──────── reap(): attach timeout ─────▲

A session under virtual residency (`page_bytes` > 0 at attach) keeps every block at one
address of a range it reserves, and tells the daemon at each step mark, until it has a plan,
where its live blocks are (`live_at`): its plans keep its persistent blocks there.

What a client reports is checked before it is taken: a heartbeat's bytes lie within the
session's leases, its counts within int64 and never below the last ones (`check_heartbeat`);
a heartbeat that breaks a rule is refused whole. A chunk whose scrub fails is *quarantined*:
out of the pool, counted apart (`PoolUsage.quarantined_bytes`), and scrubbed again by every
`reap()` until it succeeds and the chunk is free again.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import secrets
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace
from typing import TypeAlias

from tidalcore.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from tidalcore.v1 import common_pb2, pool_pb2

from tidalpoold.backends.base import Backend
from tidalpoold.pool import Lease, PoolAccount, PoolExhausted
from tidalpoold.settings import Settings
from tidalpoold.trace import TraceStore

log = logging.getLogger("tidalpoold.sessions")

Reason: TypeAlias = pool_pb2.Goodbye.Reason

SESSION_ID_PREFIX = "s-"
SESSION_ID_CHARS = len(SESSION_ID_PREFIX) + 12
"""A session id is "s-" and 12 hex digits; a longer one names no session."""
CLIP_CHARS = 64
"""Characters of a client's string kept where an error or a log line repeats it."""
INT64_MAX = 2**63 - 1
"""The most a heartbeat count may say (the counts are summed as int64 downstream)."""
HOST_PAGE = 4096
"""A session's page is a whole number of these: the host's page, the least a mapping moves."""


def clip(text: str, limit: int = CLIP_CHARS) -> str:
    """`text` for an error message or a log line: whole if short, else its first `limit`
    characters and its length, so that no client makes the daemon repeat a long string."""
    if len(text) <= limit:
        return repr(text)
    return f"{text[:limit]!r}… ({len(text.encode())} bytes)"


@dataclass
class Counts:
    """What a client counts from its attach on and reports in its heartbeats."""

    plan_misses: int = 0
    swapped_out_bytes: int = 0
    swapped_in_bytes: int = 0
    swap_stall_ns: int = 0
    # Of the bytes swapped: those no plan scheduled (the LRU cache's, before a plan and after
    # a miss).
    on_demand_out_bytes: int = 0
    on_demand_in_bytes: int = 0

    def check(self, beat: pool_pb2.Heartbeat) -> None:
        """InvalidArgument naming the first count of `beat` past int64 or below this one."""
        for name in _COUNTS:
            new, old = getattr(beat, name), getattr(self, name)
            if new > INT64_MAX:
                raise InvalidArgument(
                    f"heartbeat {name} {new} exceeds the bound of a count ({INT64_MAX})"
                )
            if new < old:
                raise InvalidArgument(
                    f"heartbeat {name} {new} is below the {old} reported before: a count since"
                    " attach never decreases"
                )

    def advance(self, beat: pool_pb2.Heartbeat, totals: Counts) -> None:
        """Take the heartbeat's counts (checked by `check`), adding what each grew by to
        `totals`."""
        for name in _COUNTS:
            new, old = getattr(beat, name), getattr(self, name)
            setattr(totals, name, getattr(totals, name) + new - old)
            setattr(self, name, new)


_COUNTS = tuple(f.name for f in fields(Counts))


@dataclass(frozen=True, slots=True)
class PlanFootprint:
    """The height of a session's latest plan (its arena: blocks and the pieces of swapped
    blocks; persistent blocks that never swap are outside) and the lower bound of its
    placement problem. A paged plan (virtual residency) has no arena: both are the most bytes
    it maps at once, as its pages are mapped only while blocks on them need them."""

    height_bytes: int
    lower_bound_bytes: int


@dataclass(eq=False)
class Session:
    """One client's session; its fields change only under the registry's lock."""

    id: str
    token: str
    job_name: str
    pid: int
    uid: int
    device: Lease
    host: Lease
    trace: TraceStore
    created: float  # monotonic seconds
    state: str = "pending"
    attached_unix_ns: int = 0
    last_seen: float = 0.0
    stream_open: bool = False
    device_used: int = 0
    device_peak: int = 0  # device-resident bytes at their most
    live_peak: int = 0  # live bytes at their most, those swapped to the host included
    host_used: int = 0
    swap_limit: int = 0  # device bytes the client keeps itself under by swapping; 0: no swapping
    copy_gbps: float = 0.0  # the client's swap copy bandwidth; 0: not throttled
    page_bytes: int = 0  # virtual residency: its pages' bytes; 0: contiguous (no pages)
    # Virtual residency: the blocks live at its latest step mark that carried any, by trace
    # block id: (address in its range, owns whole pages). Set by the stream's reader, as one
    # value.
    live_at: Mapping[int, tuple[int, bool]] = field(default_factory=dict)
    counts: Counts = field(default_factory=Counts)
    plan: PlanFootprint | None = None  # set by the planner's thread, as one value
    ended: bool = False  # end() took it out of the registry: what it reports now is ignored
    bad_messages: int = 0  # stream messages refused (counted by the stream's reader)
    # What the Session stream sends to the client; None closes the stream.
    outbox: queue.SimpleQueue[pool_pb2.ServerMessage | None] = field(
        default_factory=queue.SimpleQueue
    )

    def info(self, backend: Backend) -> common_pb2.SessionInfo:
        return common_pb2.SessionInfo(
            session_id=self.id,
            job_name=self.job_name,
            pid=self.pid,
            uid=self.uid,
            lease=lease_message(self, backend),
            device_used_bytes=self.device_used,
            device_peak_bytes=self.device_peak,
            live_peak_bytes=self.live_peak,
            host_used_bytes=self.host_used,
            events_received=self.trace.events_received,
            iterations_seen=self.trace.iterations_seen,
            attached_unix_ns=self.attached_unix_ns,
            state=self.state,
            swap_limit_bytes=self.swap_limit,
            swapped_out_bytes=self.counts.swapped_out_bytes,
            swapped_in_bytes=self.counts.swapped_in_bytes,
            swap_stall_ns=self.counts.swap_stall_ns,
            plan_misses=self.counts.plan_misses,
        )


def check_heartbeat(session: Session, beat: pool_pb2.Heartbeat) -> None:
    """InvalidArgument naming the first number of `beat` the session cannot mean: bytes in
    use or at peak beyond its lease of that pool (live bytes: beyond both leases together), a
    count past int64 or below its last."""
    for name, value, pool, lease in (
        ("device_used_bytes", beat.device_used_bytes, "device", session.device),
        ("device_peak_bytes", beat.device_peak_bytes, "device", session.device),
        ("host_used_bytes", beat.host_used_bytes, "host", session.host),
    ):
        if value > lease.length:
            raise InvalidArgument(
                f"heartbeat {name} {value} exceeds the session's {pool} lease of"
                f" {lease.length} bytes"
            )
    held = session.device.length + session.host.length
    if beat.live_peak_bytes > held:
        raise InvalidArgument(
            f"heartbeat live_peak_bytes {beat.live_peak_bytes} exceeds the session's device and"
            f" host leases together ({held} bytes)"
        )
    session.counts.check(beat)


def check_page(page_bytes: int, swap_limit: int, chunk_bytes: int, granularity: int) -> None:
    """InvalidArgument naming why a session cannot have pages of `page_bytes` (0: contiguous,
    always fine): a page is a power of two and a whole number of host pages (HOST_PAGE), whole
    pages make a chunk of its lease (`chunk_bytes`), whole mapping units of the backend
    (`granularity`; 0: not known) make a page, and a paged session swaps (`swap_limit`)."""
    if not page_bytes:
        return
    if page_bytes % HOST_PAGE or page_bytes & (page_bytes - 1):
        raise InvalidArgument(
            f"page_bytes {page_bytes} is not a power of two of at least {HOST_PAGE} bytes (the"
            " host page)"
        )
    if chunk_bytes % page_bytes:
        raise InvalidArgument(
            f"page_bytes {page_bytes} does not divide the lease's chunks of {chunk_bytes} bytes"
        )
    if granularity and page_bytes % granularity:
        raise InvalidArgument(
            f"page_bytes {page_bytes} is not a multiple of the device's mapping granularity"
            f" ({granularity} bytes)"
        )
    if not swap_limit:
        raise InvalidArgument(
            f"page_bytes {page_bytes} needs a swap limit: pages move only under"
            " swap_limit_bytes, which is 0"
        )


def live_blocks(session: Session, mark: pool_pb2.StepMark) -> dict[int, tuple[int, bool]] | None:
    """The live blocks a step mark carries, by trace block id: (address, owns whole pages);
    None when it carries none. InvalidArgument when its three columns differ in length, a
    block comes twice, a page-owning block lies off a page, or the session is not paged."""
    ids, addresses, owning = mark.live_block_ids, mark.live_addresses, mark.live_owning
    if not (ids or addresses or owning):
        return None
    if not session.page_bytes:
        raise InvalidArgument(
            "step mark carries live blocks, but the session has no pages (page_bytes 0 at attach)"
        )
    if not len(ids) == len(addresses) == len(owning):
        raise InvalidArgument(
            f"step mark's live columns differ in length: {len(ids)} ids, {len(addresses)}"
            f" addresses, {len(owning)} owning"
        )
    live: dict[int, tuple[int, bool]] = {}
    for block, address, own in zip(ids, addresses, owning, strict=True):
        if block in live:
            raise InvalidArgument(f"step mark lists live block {block} twice")
        if own and address % session.page_bytes:
            raise InvalidArgument(
                f"step mark's live block {block} owns pages at {address}, off the session's"
                f" pages of {session.page_bytes} bytes"
            )
        live[block] = (address, own)
    return live


def lease_message(session: Session, backend: Backend) -> common_pb2.Lease:
    return common_pb2.Lease(
        device=_pool_lease(session.device),
        host=_pool_lease(session.host),
        backend=backend.name,
        mode=backend.mode,
        pci_bus_id=backend.pci_bus_id,
    )


def _pool_lease(lease: Lease) -> common_pb2.PoolLease:
    return common_pb2.PoolLease(
        length=lease.length, chunks=lease.chunks, chunk_bytes=lease.chunk_bytes
    )


class Registry:
    """All sessions of the daemon, and the accounting of both pools."""

    def __init__(
        self, settings: Settings, backend: Backend, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.settings = settings
        self.backend = backend
        self.clock = clock
        self.device = PoolAccount(
            "device",
            backend.device.chunk_bytes,
            len(backend.device.chunks),
            consecutive=backend.mode == "ipc",  # one IPC allocation: a lease is used at an offset
        )
        self.host = PoolAccount("host", backend.host.chunk_bytes, len(backend.host.chunks))
        self._lock = threading.Lock()
        # Chunks whose scrub failed, by pool: still leased in the account, held by no session.
        self._quarantined: dict[str, list[int]] = {"device": [], "host": []}
        self._rescrubbing = threading.Lock()  # one retry of the quarantine at a time
        self._by_id: dict[str, Session] = {}
        self._by_token: dict[str, Session] = {}
        self.attached_total = 0
        self.ended_total: dict[str, int] = {}
        self.counts = Counts()  # of every session, ended ones included
        self.ended_events = 0  # trace events received from sessions that ended

    # -- birth ------------------------------------------------------------------
    def open(
        self, device_bytes: int, host_bytes: int, job_name: str, pid: int, uid: int
    ) -> Session:
        """Take a pending session's chunks (from the handles socket)."""
        s = self.settings
        device_bytes = device_bytes or s.default_device_lease
        host_bytes = host_bytes or s.default_host_lease
        with self._lock:
            if len(self._by_id) >= s.max_sessions:
                raise ResourceExhausted(f"the daemon already serves {s.max_sessions} sessions")
            pending = sum(x.uid == uid and x.state == "pending" for x in self._by_id.values())
            if pending >= s.max_pending_per_uid:
                raise ResourceExhausted(
                    f"uid {uid} already holds {pending} leases not attached, the most one uid"
                    f" may (max_pending_per_uid {s.max_pending_per_uid}): attach them, or wait"
                    f" {s.attach_timeout_s:g} s (attach_timeout_s) for them to be reclaimed"
                )
            try:
                device = self.device.lease(device_bytes)
            except PoolExhausted as e:
                raise ResourceExhausted(str(e)) from e
            try:
                host = self.host.lease(host_bytes)
            except PoolExhausted as e:
                self.device.release(device)
                raise ResourceExhausted(str(e)) from e
            session = Session(
                id="s-" + secrets.token_hex(6),
                token=secrets.token_urlsafe(32),
                job_name=job_name[:128],
                pid=pid,
                uid=uid,
                device=device,
                host=host,
                trace=TraceStore(s.max_trace_events, s.max_trace_name_bytes, s.max_plan_shapes),
                created=self.clock(),
            )
            self._by_id[session.id] = session
            self._by_token[session.token] = session
        log.info(
            "session.opened",
            extra={
                "session": session.id,
                "job": session.job_name,
                "pid": pid,
                "uid": uid,
                "device_bytes": device.length,
                "host_bytes": host.length,
                "device_chunks": len(device.chunks),
                "host_chunks": len(host.chunks),
            },
        )
        return session

    def by_token(self, token: str) -> Session | None:
        with self._lock:
            return self._by_token.get(token)

    def give_back(self, token: str, uid: int) -> Session:
        """End the pending session holding `token` at its client's word (its Attach failed),
        instead of at `attach_timeout_s`: its chunks go back to the pools now. Only a pending
        session, and only to its own uid: NotFound otherwise (an attached one detaches)."""
        with self._lock:
            session = self._by_token.get(token)
            if session is None or session.uid != uid or session.state != "pending":
                raise NotFound("no lease pending under that token for this uid")
        self.end_quietly(session.id, Reason.REASON_DETACHED, "given back before it was attached")
        return session

    def attach(
        self, session: Session, swap_limit: int = 0, copy_gbps: float = 0.0, page_bytes: int = 0
    ) -> None:
        """Attach a pending session; InvalidArgument (`check_page`) when it cannot have pages
        of `page_bytes`, and it stays pending. A paged session's limit counts mapped pages of
        its lease, so a swap limit over the lease is the lease (its client keeps to the same)."""
        granularity = self.backend.facts().get("granularity_bytes", 0) if page_bytes else 0
        with self._lock:
            if session.state != "pending":
                raise FailedPrecondition(f"session {session.id} is already attached")
            check_page(
                page_bytes,
                swap_limit,
                session.device.chunk_bytes,
                granularity if isinstance(granularity, int) else 0,
            )
            session.state = "attached"
            lease = session.device.length
            session.swap_limit = min(swap_limit, lease) if page_bytes else swap_limit
            session.copy_gbps = copy_gbps
            session.page_bytes = page_bytes
            session.attached_unix_ns = time.time_ns()
            session.last_seen = self.clock()
            self.attached_total += 1
        log.info("session.attached", extra={"session": session.id})

    def open_stream(self, session: Session) -> None:
        with self._lock:
            if session.state != "attached":
                raise FailedPrecondition(f"session {session.id} must Attach before its stream")
            if session.stream_open:
                raise FailedPrecondition(f"session {session.id} already has a stream")
            session.stream_open = True
            session.last_seen = self.clock()

    def touch(self, session: Session, heartbeat: pool_pb2.Heartbeat | None = None) -> None:
        """The session is alive; take its heartbeat's numbers, or refuse them all
        (InvalidArgument, see `check_heartbeat`) and keep the previous ones. A heartbeat that
        comes after the session ended (behind its Detach) is ignored."""
        with self._lock:
            if session.ended:
                return
            if heartbeat is not None:
                self._take(session, heartbeat)
            session.last_seen = self.clock()

    def _take(self, session: Session, beat: pool_pb2.Heartbeat) -> None:
        """Check and take a heartbeat (under the lock)."""
        check_heartbeat(session, beat)
        session.device_used = beat.device_used_bytes
        session.device_peak = max(session.device_peak, beat.device_peak_bytes)
        session.live_peak = max(session.live_peak, beat.live_peak_bytes)
        session.host_used = beat.host_used_bytes
        session.counts.advance(beat, self.counts)

    # -- death ------------------------------------------------------------------
    def end(
        self,
        session_id: str,
        reason: Reason,
        message: str,
        last: pool_pb2.Heartbeat | None = None,
    ) -> Session:
        """End a session (once), taking its `last` heartbeat first (a bad one is refused, and
        the session goes on): its chunks are scrubbed and return to the pools, its stream
        says goodbye. Scrubbing runs outside the lock (other sessions' opens never wait on it)
        but before the chunks are free: a chunk is never leased while it holds old bytes."""
        with self._lock:
            session = self._by_id.get(session_id)
            if session is None:
                raise NotFound(f"no session {clip(session_id)}")
            if last is not None:
                self._take(session, last)
            del self._by_id[session_id]
            del self._by_token[session.token]
            session.ended = True
            name = Reason.Name(reason).removeprefix("REASON_").lower()
            self.ended_total[name] = self.ended_total.get(name, 0) + 1
            self.ended_events += session.trace.events_received
        device, device_dirty = self._scrubbed("device", session.device.chunks)
        host, host_dirty = self._scrubbed("host", session.host.chunks)
        with self._lock:
            self.device.release(Lease(device, session.device.chunk_bytes))
            self.host.release(Lease(host, session.host.chunk_bytes))
            self._quarantined["device"].extend(device_dirty)
            self._quarantined["host"].extend(host_dirty)
        session.outbox.put(
            pool_pb2.ServerMessage(goodbye=pool_pb2.Goodbye(reason=reason, message=message))
        )
        session.outbox.put(None)
        log.info(
            "session.ended",
            extra={
                "session": session.id,
                "reason": name,
                "why": message,
                "events": session.trace.events_received,
            },
        )
        return session

    def _scrubbed(
        self, name: str, chunks: tuple[int, ...], quiet: bool = False
    ) -> tuple[tuple[int, ...], list[int]]:
        """Scrub `chunks` of pool `name`: those scrubbed, and those that could not be (their
        bytes might reach the next holder: they are to stay out of the pool), which the log
        names unless `quiet`. The pool is read for every chunk: a backend may renew a chunk
        (a new fd) as it scrubs it."""
        clean, dirty = [], []
        for index in chunks:
            pool = self.backend.device if name == "device" else self.backend.host
            try:
                self.backend.scrub(pool, pool.chunks[index])
            except OSError as e:
                dirty.append(index)
                if not quiet:
                    log.error(
                        "chunk.quarantined",
                        extra={
                            "pool": name,
                            "chunk": index,
                            "why": str(e),
                            "retry": "scrubbed again by the reaper until it succeeds",
                        },
                    )
            else:
                clean.append(index)
        return tuple(clean), dirty

    def rescrub(self) -> int:
        """Scrub the quarantined chunks again; those scrubbed now are free again. Returns how
        many were freed."""
        freed = 0
        with self._rescrubbing:
            for name, account in (("device", self.device), ("host", self.host)):
                with self._lock:
                    waiting = tuple(self._quarantined[name])
                if not waiting:
                    continue
                clean, _ = self._scrubbed(name, waiting, quiet=True)
                with self._lock:
                    for index in clean:
                        self._quarantined[name].remove(index)
                    account.release(Lease(clean, account.chunk_bytes))
                for index in clean:
                    log.info("chunk.restored", extra={"pool": name, "chunk": index})
                freed += len(clean)
        return freed

    def end_quietly(self, session_id: str, reason: Reason, message: str) -> None:
        """end(), for callers racing others to it (stream callbacks, the reaper)."""
        with contextlib.suppress(NotFound):
            self.end(session_id, reason, message)

    def reap(self) -> list[str]:
        """End sessions that never attached or stopped sending heartbeats, then scrub the
        quarantined chunks again (`rescrub`). Returns the ids of the sessions ended."""
        now, s = self.clock(), self.settings
        doomed: list[tuple[str, str]] = []
        with self._lock:
            for session in self._by_id.values():
                if session.state == "pending" and now - session.created > s.attach_timeout_s:
                    doomed.append((session.id, f"not attached within {s.attach_timeout_s:g} s"))
                elif (
                    session.state == "attached"
                    and not session.stream_open
                    and (now - session.last_seen > s.attach_timeout_s)
                ):
                    doomed.append(
                        (session.id, f"no session stream within {s.attach_timeout_s:g} s")
                    )
                elif (
                    session.state == "attached" and now - session.last_seen > s.heartbeat_timeout_s
                ):
                    doomed.append((session.id, f"no heartbeat for {s.heartbeat_timeout_s:g} s"))
        for session_id, why in doomed:
            self.end_quietly(session_id, Reason.REASON_EVICTED, why)
        self.rescrub()
        return [session_id for session_id, _ in doomed]

    # -- views ------------------------------------------------------------------
    def sessions(self) -> list[Session]:
        with self._lock:
            return sorted(self._by_id.values(), key=lambda s: s.created)

    def get(self, session_id: str) -> Session:
        with self._lock:
            session = self._by_id.get(session_id)
        if session is None:
            raise NotFound(f"no session {clip(session_id)}")
        return session

    def usage(self) -> tuple[common_pb2.PoolUsage, common_pb2.PoolUsage]:
        with self._lock:
            used_device = sum(s.device_used for s in self._by_id.values())
            used_host = sum(s.host_used for s in self._by_id.values())
            return (
                self._usage(self.device, used_device),
                self._usage(self.host, used_host),
            )

    def _usage(self, account: PoolAccount, used: int) -> common_pb2.PoolUsage:
        """A pool's bytes by state (under the lock): leased to sessions, quarantined, free;
        the sessions' reported `used` is held within what they lease whatever it says."""
        quarantined = len(self._quarantined[account.name]) * account.chunk_bytes
        leased = account.leased_bytes - quarantined
        return common_pb2.PoolUsage(
            total_bytes=account.total,
            leased_bytes=leased,
            free_bytes=account.free_bytes,
            used_bytes=min(max(used, 0), leased),
            quarantined_bytes=quarantined,
        )

    def snapshot(self) -> Snapshot:
        """A consistent copy of the registry's numbers, for metrics."""
        with self._lock:
            sessions = sorted(self._by_id.values(), key=lambda s: s.created)
            views = tuple(
                SessionNumbers(
                    id=s.id,
                    job_name=s.job_name,
                    state=s.state,
                    device_lease=s.device.length,
                    host_lease=s.host.length,
                    device_used=s.device_used,
                    device_peak=s.device_peak,
                    live_peak=s.live_peak,
                    host_used=s.host_used,
                    events_received=s.trace.events_received,
                    counts=replace(s.counts),
                    plan=s.plan,
                )
                for s in sessions
            )
            return Snapshot(
                device=self._usage(self.device, sum(s.device_used for s in sessions)),
                host=self._usage(self.host, sum(s.host_used for s in sessions)),
                sessions=views,
                attached_total=self.attached_total,
                ended_total=dict(self.ended_total),
                counts=replace(self.counts),
                events_received=self.ended_events + sum(v.events_received for v in views),
            )


@dataclass(frozen=True, slots=True)
class SessionNumbers:
    """One live session's numbers at a snapshot."""

    id: str
    job_name: str
    state: str  # pending or attached
    device_lease: int
    host_lease: int
    device_used: int
    device_peak: int  # device-resident bytes at their most
    live_peak: int  # live bytes at their most, device and swapped out together (0: not told)
    host_used: int
    events_received: int
    counts: Counts  # a copy
    plan: PlanFootprint | None


@dataclass(frozen=True)
class Snapshot:
    """The registry at one instant: pool usage, the live sessions' numbers, totals."""

    device: common_pb2.PoolUsage
    host: common_pb2.PoolUsage
    sessions: tuple[SessionNumbers, ...]  # oldest first
    attached_total: int
    ended_total: dict[str, int]  # by reason: detached, evicted, shutdown
    counts: Counts  # heartbeat counts of every session, ended ones included
    events_received: int  # trace events of every session, ended ones included
