"""The session registry: who holds which lease, and reclaiming it when they go.

A session is born *pending* on the handles socket (lease carved, token issued,
fds passed), becomes *attached* by the `Attach` RPC, lives while its `Session`
stream is open, and *ends* exactly once, for whatever reason: Detach, stream
closed or broken (process exit, SIGKILL), eviction, missed heartbeats, an
Attach that never came, or daemon shutdown. Ending returns the session's
chunks to their pools and scrubs them, then tells its stream (if any) goodbye.

    handles socket ──open()──▶ pending ──attach()──▶ attached ──end()──▶ (gone)
                                  └──────── reap(): attach timeout ─────▲

An *elastic* session (paged, asked for on the handles socket with a floor and a ceiling) holds
its floor's chunks for life and borrows above it as `tidalpoold.quota.share` lends the pool:
the registry sends it a `QuotaChange` whenever its share moves; a session told to hold less
gives chunks back (`take_back`) within `quota_deadline_s` or is ended (`reap`); one told it
may hold more takes chunks (`grow`). A newcomer whose floor needs borrowed chunks waits in
`open` until they come back. Floors never add up to more than the pool.

    open(floor) ──▶ holds floor ──attach──▶ quota = share ──▶ QuotaChange ──┬─ lower: LeaseReturn
                                                                           └─ higher: grow()

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
from tidalpoold.quota import Claim, share
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
_QUOTA_GRACE_S = 1.0
"""An elastic open waits this long past `quota_deadline_s`: an overdue borrower's end (its
chunks scrubbed) is in it."""


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


@dataclass(slots=True)
class Elastic:
    """An elastic session's claim on the device pool, in chunks, and its pending give-back."""

    floor: int
    most: int  # its ceiling: the most it may ever hold
    quota: int  # what it may hold now (floor <= quota <= most)
    quota_id: int = 0  # of the last QuotaChange sent
    deadline: float = 0.0  # monotonic: chunks over its quota are due back by then; 0: none due
    told_to_grow: bool = False  # a QuotaChange over what it holds went, and it has not grown


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
    elastic: Elastic | None = None  # None: a fixed lease
    swap_asked: int = 0  # the swap limit its Attach asked for (swap_limit: that within its quota)
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
            **self._elastic_info(),
        )

    def _elastic_info(self) -> dict[str, int]:
        e, chunk = self.elastic, self.device.chunk_bytes
        if e is None:
            return {}
        return {
            "device_floor_bytes": e.floor * chunk,
            "device_quota_bytes": e.quota * chunk,
            "device_max_bytes": e.most * chunk,
        }

    def device_quota(self) -> int:
        """The device bytes the session may hold now: its lease, or an elastic one's quota."""
        e = self.elastic
        return self.device.length if e is None else e.quota * self.device.chunk_bytes

    def device_ceiling(self) -> int:
        """The most device bytes the session may ever hold: its lease, or an elastic one's
        ceiling (what it reports is checked against this: a peak may predate a give-back)."""
        e = self.elastic
        return self.device.length if e is None else e.most * self.device.chunk_bytes


def check_heartbeat(session: Session, beat: pool_pb2.Heartbeat) -> None:
    """InvalidArgument naming the first number of `beat` the session cannot mean: bytes in
    use or at peak beyond its lease of that pool (live bytes: beyond both leases together), a
    count past int64 or below its last."""
    device = session.device_ceiling()
    for name, value, pool, length in (
        ("device_used_bytes", beat.device_used_bytes, "device", device),
        ("device_peak_bytes", beat.device_peak_bytes, "device", device),
        ("host_used_bytes", beat.host_used_bytes, "host", session.host.length),
    ):
        if value > length:
            raise InvalidArgument(
                f"heartbeat {name} {value} exceeds the session's {pool} lease of {length} bytes"
            )
    held = device + session.host.length
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
        device=pool_lease(session.device),
        host=pool_lease(session.host),
        backend=backend.name,
        mode=backend.mode,
        pci_bus_id=backend.pci_bus_id,
    )


def pool_lease(lease: Lease) -> common_pb2.PoolLease:
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
        self._freed = threading.Condition(self._lock)  # device chunks came back to the pool
        # Elastic opens waiting for their floor, oldest first: waiter number -> floor chunks.
        self._waiting: dict[int, int] = {}
        self._waiters = 0
        # Told of an elastic session whose quota changed (the planner plans it again), and of
        # each give-back: the seconds from its QuotaChange to its chunks free.
        self.on_quota: Callable[[Session], None] | None = None
        self.on_give_back: Callable[[float], None] | None = None
        self.given_back_chunks = 0  # device chunks elastic sessions gave back
        self.quota_changes = 0  # QuotaChange messages sent
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
        self,
        device_bytes: int,
        host_bytes: int,
        job_name: str,
        pid: int,
        uid: int,
        elastic: bool = False,
        device_min: int = 0,
    ) -> Session:
        """Take a pending session's chunks (from the handles socket). `elastic`: its floor is
        `device_min` (0: `default_device_floor`, else one chunk), its ceiling `device_bytes`
        (0: the whole pool); it takes its floor's chunks now, waiting up to
        `quota_deadline_s` for borrowed ones to come back, and borrows above it once attached."""
        s = self.settings
        host_bytes = host_bytes or s.default_host_lease
        claim: Elastic | None = None
        if elastic:
            claim = self._claim(device_min, device_bytes)
            device_bytes = claim.floor * self.device.chunk_bytes
        else:
            device_bytes = device_bytes or s.default_device_lease
        with self._lock:
            self._admit(uid)
            floor = claim.floor if claim is not None else 0
            if claim is not None:
                self._guarantee(floor)
            elif (
                self._borrowed()
                and self._floors() + (n := self.device.chunks_for(device_bytes))
                <= self.device.count
            ):
                floor = n  # a fixed lease is a floor too: what is borrowed comes back for it
        waiter, device = self._take_floor(floor) if floor else (0, None)
        with self._lock:
            try:
                self._admit(uid)  # again: others may have come while the floor was freed
                if device is None:
                    device = self.device.lease(device_bytes)
                host = self.host.lease(host_bytes)
            except (PoolExhausted, ResourceExhausted) as e:
                if device is not None:
                    self.device.release(device)
                self._waiting.pop(waiter, None)
                self._device_freed()  # what borrowers gave back for it is theirs to take again
                if isinstance(e, ResourceExhausted):
                    raise
                raise ResourceExhausted(self._exhausted(str(e))) from e
            self._waiting.pop(waiter, None)  # its floor is the session's from here
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
                elastic=claim,
            )
            self._by_id[session.id] = session
            self._by_token[session.token] = session
            self._rebalance()  # a floor or a fixed lease less to lend
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
                **({"floor": claim.floor, "ceiling": claim.most} if claim else {}),
            },
        )
        return session

    def _admit(self, uid: int) -> None:
        """ResourceExhausted when the daemon serves its most sessions, or `uid` holds its most
        pending leases (under the lock)."""
        s = self.settings
        if len(self._by_id) >= s.max_sessions:
            raise ResourceExhausted(f"the daemon already serves {s.max_sessions} sessions")
        pending = sum(x.uid == uid and x.state == "pending" for x in self._by_id.values())
        if pending >= s.max_pending_per_uid:
            raise ResourceExhausted(
                f"uid {uid} already holds {pending} leases not attached, the most one uid"
                f" may (max_pending_per_uid {s.max_pending_per_uid}): attach them, or wait"
                f" {s.attach_timeout_s:g} s (attach_timeout_s) for them to be reclaimed"
            )

    def _claim(self, device_min: int, device_max: int) -> Elastic:
        """An elastic lease's floor and ceiling in chunks (a ceiling over the pool is the
        pool: no more can be lent); InvalidArgument when the floor is over the ceiling."""
        chunks = self.device.chunks_for
        floor = chunks(device_min or self.settings.default_device_floor or 1)
        most = min(chunks(device_max), self.device.count) if device_max else self.device.count
        if floor > most:
            raise InvalidArgument(
                f"an elastic lease's floor of {floor} chunks ({device_min} bytes) is over its"
                f" ceiling of {most} chunks ({device_max} bytes)"
            )
        return Elastic(floor=floor, most=most, quota=floor)

    def _floors(self) -> int:
        """Device chunks no one can be asked for (under the lock): every elastic session's
        floor, every fixed lease, the floors waiting, and the quarantined chunks."""
        held = sum(
            len(x.device.chunks) if x.elastic is None else x.elastic.floor
            for x in self._by_id.values()
        )
        return held + sum(self._waiting.values()) + len(self._quarantined["device"])

    def _guarantee(self, floor: int) -> None:
        """ResourceExhausted unless a floor of `floor` chunks fits beside every floor held."""
        taken, pool = self._floors(), self.device.count
        if taken + floor > pool:
            raise ResourceExhausted(
                f"an elastic lease's floor of {floor} chunks cannot be guaranteed: floors and"
                f" fixed leases hold {taken} of the device pool's {pool} chunks of"
                f" {self.device.chunk_bytes} bytes"
            )

    def _borrowed(self) -> int:
        """Device chunks elastic sessions hold above their floors (under the lock)."""
        return sum(
            max(0, len(x.device.chunks) - x.elastic.floor)
            for x in self._by_id.values()
            if x.elastic is not None
        )

    def _exhausted(self, why: str) -> str:
        """`why` a lease was refused, and what holds the pool (under the lock)."""
        borrowed = self._borrowed()
        if not borrowed:
            return why
        return (
            f"{why}; elastic sessions borrow {borrowed} chunks, which come back for a lease"
            " only as far as floors and fixed leases leave room"
        )

    def _take_floor(self, floor: int) -> tuple[int, Lease]:
        """Lease `floor` chunks (an elastic session's floor, or a fixed lease while elastic
        sessions borrow), asking borrowers to give chunks back
        while too few are free, and waiting for them until `quota_deadline_s` past the ask (a
        borrower overdue is ended). Returns the waiter's number, still counted among the floors
        (`open` drops it as the session takes the floor), and the lease. ResourceExhausted
        when the chunks do not come back in time."""
        s = self.settings
        with self._lock:
            self._waiters += 1
            me = self._waiters
            self._waiting[me] = floor
            self._rebalance()
        try:
            give_up = self.clock() + s.quota_deadline_s + _QUOTA_GRACE_S
            while True:
                with self._lock:
                    ahead = sum(f for w, f in self._waiting.items() if w < me)
                    if self.device.free_chunks - ahead >= floor:
                        return me, self.device.lease(floor * self.device.chunk_bytes)
                    now = self.clock()
                    overdue = self._overdue(now)
                    if not overdue:
                        if now >= give_up:
                            raise ResourceExhausted(
                                f"an elastic lease's floor of {floor} chunks was not freed within"
                                f" {s.quota_deadline_s + _QUOTA_GRACE_S:g} s:"
                                f" {self.device.free_chunks} of {self.device.count} chunks free"
                            )
                        self._freed.wait(max(0.0, min(give_up, self._next_deadline()) - now))
                        continue
                for session_id, why in overdue:
                    self.end_quietly(session_id, Reason.REASON_EVICTED, why)
        except BaseException:
            with self._lock:
                del self._waiting[me]
                self._rebalance()
            raise

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
            if session.elastic is not None and not page_bytes:
                raise InvalidArgument(
                    "an elastic lease needs pages (page_bytes and a swap limit at Attach): only a"
                    " paged session can give chunks back while it runs"
                )
            session.state = "attached"
            lease = session.device_quota()
            session.swap_asked = swap_limit
            session.swap_limit = min(swap_limit, lease) if page_bytes else swap_limit
            session.copy_gbps = copy_gbps
            session.page_bytes = page_bytes
            session.attached_unix_ns = time.time_ns()
            session.last_seen = self.clock()
            self.attached_total += 1
            if session.elastic is not None:
                self._rebalance()
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
                need = self._need(session) if session.elastic is not None else 0
                self._take(session, heartbeat)
                if session.elastic is not None and self._need(session) != need:
                    self._rebalance()
            session.last_seen = self.clock()

    def _take(self, session: Session, beat: pool_pb2.Heartbeat) -> None:
        """Check and take a heartbeat (under the lock)."""
        check_heartbeat(session, beat)
        session.device_used = beat.device_used_bytes
        session.device_peak = max(session.device_peak, beat.device_peak_bytes)
        session.live_peak = max(session.live_peak, beat.live_peak_bytes)
        session.host_used = beat.host_used_bytes
        session.counts.advance(beat, self.counts)

    # -- elastic leases -----------------------------------------------------------
    def _need(self, session: Session) -> int:
        """The chunks an elastic session would use now: its ceiling until it has run a whole
        iteration, then its live bytes at their peak (or its swap limit, if lower), within its
        floor and ceiling."""
        e = session.elastic
        assert e is not None
        if session.state != "attached":
            return e.floor
        chunks = self.device.chunks_for
        need = e.most
        if session.trace.iterations_seen >= 2 and session.live_peak:
            need = chunks(session.live_peak)
        if session.swap_asked:
            need = min(need, chunks(session.swap_asked))
        return max(e.floor, min(need, e.most))

    def _rebalance(self) -> None:
        """Share the pool among the elastic sessions again (`quota.share`; under the lock) and
        send a QuotaChange to each whose quota moved: one holding more than its new quota
        gives the rest back by `quota_deadline_s` from now (an earlier deadline still due
        stands)."""
        elastic = [(x, x.elastic) for x in self._by_id.values() if x.elastic is not None]
        claims = [Claim(x.id, e.floor, e.most, self._need(x)) for x, e in elastic]
        claims += [Claim(f"waiting {w}", f, f, f) for w, f in self._waiting.items()]
        fixed = sum(len(x.device.chunks) for x in self._by_id.values() if x.elastic is None)
        pool = self.device.count - fixed - len(self._quarantined["device"])
        # Floors fit by admission; only chunks quarantined since could crowd them: then each
        # keeps its floor, lent nothing, until the quarantine clears.
        quotas = share(max(pool, sum(c.floor for c in claims)), claims)
        now = self.clock()
        free = self.device.free_chunks - sum(self._waiting.values())
        for x, e in elastic:
            quota = quotas[x.id]
            if quota == e.quota:
                if len(x.device.chunks) < quota and free > 0 and not e.told_to_grow:
                    e.quota_id += 1  # chunks it may take came free: tell it again
                    e.told_to_grow = True
                    self._tell_quota(x, "chunks came free")
                continue
            e.quota = quota
            e.quota_id += 1
            held = len(x.device.chunks)
            if held > quota and not e.deadline:
                e.deadline = now + self.settings.quota_deadline_s
            elif held <= quota:
                e.deadline = 0.0
            if x.page_bytes:
                x.swap_limit = min(x.swap_asked, quota * self.device.chunk_bytes)
            e.told_to_grow = held < quota
            self._tell_quota(x, "the pool was shared again")
            if self.on_quota is not None:
                self.on_quota(x)

    def _device_freed(self) -> None:
        """Device chunks came back to the pool, or a floor waiting left (under the lock): wake
        the opens waiting for a floor and share the pool again."""
        self._freed.notify_all()
        self._rebalance()

    def _tell_quota(self, session: Session, why: str) -> None:
        e = session.elastic
        assert e is not None
        chunk = self.device.chunk_bytes
        due = max(0.0, e.deadline - self.clock()) if e.deadline else 0.0
        session.outbox.put(
            pool_pb2.ServerMessage(
                quota=pool_pb2.QuotaChange(
                    device_limit_bytes=e.quota * chunk,
                    reason=why,
                    quota_id=e.quota_id,
                    deadline_ms=max(1, round(due * 1000)) if e.deadline else 0,
                    device_chunks=e.quota,
                )
            )
        )
        self.quota_changes += 1
        log.info(
            "quota.changed",
            extra={
                "session": session.id,
                "quota_chunks": e.quota,
                "held_chunks": len(session.device.chunks),
                "floor": e.floor,
                "ceiling": e.most,
                "deadline_s": round(due, 3),
            },
        )

    def _overdue(self, now: float) -> list[tuple[str, str]]:
        """Elastic sessions past their give-back deadline, with why (under the lock)."""
        doomed = []
        for x in self._by_id.values():
            e = x.elastic
            if e is not None and e.deadline and now > e.deadline:
                doomed.append(
                    (
                        x.id,
                        f"did not give back {len(x.device.chunks) - e.quota} device chunks within"
                        f" {self.settings.quota_deadline_s:g} s of its QuotaChange (quota"
                        f" {e.quota} chunks, held {len(x.device.chunks)})",
                    )
                )
        return doomed

    def _next_deadline(self) -> float:
        """The earliest give-back deadline due (under the lock); infinity when none is."""
        due = [x.elastic.deadline for x in self._by_id.values() if x.elastic and x.elastic.deadline]
        return min(due, default=float("inf"))

    def set_quota(self, session_id: str, device_min: int, device_max: int) -> Session:
        """An operator's new floor and ceiling (bytes; 0: unchanged) for an elastic session;
        the pool is shared again at once. InvalidArgument when they do not make a claim, or
        the new floor does not fit beside the others; FailedPrecondition for a fixed lease."""
        with self._lock:
            session = self._by_id.get(session_id)
            if session is None:
                raise NotFound(f"no session {clip(session_id)}")
            e = session.elastic
            if e is None:
                raise FailedPrecondition(
                    f"session {session.id} has a fixed lease: only an elastic one (attached with"
                    " a floor and a ceiling) has a quota to change"
                )
            chunk = self.device.chunk_bytes
            claim = self._claim(device_min or e.floor * chunk, device_max or e.most * chunk)
            if claim.floor > e.floor:
                self._guarantee(claim.floor - e.floor)
            e.floor, e.most = claim.floor, claim.most
            self._rebalance()
        log.info("quota.set", extra={"session": session.id, "floor": e.floor, "ceiling": e.most})
        return session

    def grow(self, token: str, uid: int) -> tuple[Session, Lease]:
        """Chunks for the elastic session holding `token` (its own uid's), up to its quota:
        free ones not promised to a floor waiting. The session's lease now holds them; the
        Lease returned names only them (none when nothing is free). NotFound otherwise."""
        with self._lock:
            session = self._by_token.get(token)
            if session is None or session.uid != uid or session.state != "attached":
                raise NotFound("no attached session under that token for this uid")
            e = session.elastic
            if e is None:
                raise FailedPrecondition(f"session {session.id} has a fixed lease: it cannot grow")
            held = len(session.device.chunks)
            free = self.device.free_chunks - sum(self._waiting.values())
            n = max(0, min(e.quota - held, free))
            e.told_to_grow = False
            chunk = self.device.chunk_bytes
            added = self.device.lease(n * chunk) if n else Lease((), chunk)
            session.device = Lease(session.device.chunks + added.chunks, chunk)
        if n:
            log.info(
                "quota.grown",
                extra={"session": session.id, "chunks": list(added.chunks), "held": held + n},
            )
        return session, added

    def take_back(self, session: Session, returned: pool_pb2.LeaseReturn) -> None:
        """Device chunks an elastic session gave back: scrubbed, then free for others.
        InvalidArgument (nothing taken) when one is not the session's or comes twice."""
        chunks = tuple(returned.device_chunks)
        with self._lock:
            if session.ended:
                return
            if session.elastic is None:
                raise InvalidArgument("a lease return from a session with a fixed lease")
            mine, given = set(session.device.chunks), set(chunks)
            if len(given) != len(chunks) or not mine.issuperset(given):
                raise InvalidArgument(
                    f"lease return names chunks {list(chunks)[:16]}, not all distinct and the"
                    f" session's {sorted(mine)[:16]}"
                )
            if len(chunks) >= len(mine):
                raise InvalidArgument("lease return would leave the session no device chunk")
            session.device = Lease(
                tuple(c for c in session.device.chunks if c not in given),
                self.device.chunk_bytes,
            )
        clean, dirty = self._scrubbed("device", chunks)
        with self._lock:
            self.device.release(Lease(clean, self.device.chunk_bytes))
            self._quarantined["device"].extend(dirty)
            self.given_back_chunks += len(chunks)
            e = session.elastic
            deadline = e.deadline
            if deadline and len(session.device.chunks) <= e.quota:
                e.deadline = 0.0
            self._device_freed()
        asked_at = deadline - self.settings.quota_deadline_s
        seconds = self.clock() - asked_at if deadline else None
        log.info(
            "quota.given_back",
            extra={
                "session": session.id,
                "chunks": list(chunks),
                "held": len(session.device.chunks),
                "seconds": None if seconds is None else round(seconds, 4),
                "shortfall": clip(returned.shortfall),
            },
        )
        if seconds is not None and self.on_give_back is not None:
            self.on_give_back(seconds)

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
            self._device_freed()
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
                    if clean and name == "device":
                        self._device_freed()
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
            doomed += [d for d in self._overdue(now) if d[0] not in {x for x, _ in doomed}]
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
                    elastic=None if s.elastic is None else replace(s.elastic),
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
    elastic: Elastic | None = None  # a copy; None: a fixed lease


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
