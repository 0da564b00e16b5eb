"""An elastic lease on the client: a paged session's device chunks grow and shrink with the
quota the daemon sends (`QuotaChange`), while its job runs.

    daemon ── QuotaChange(quota) ──▶ listener thread
                                      │ quota above the chunks held: grow on the handles
                                      │ socket now (the daemon counts them held from here)
                                      ▼
                                   executor.defer(_apply) ──▶ the job's thread at its next
                                      op, allocation or step, or a helper thread as soon as
                                      the job is between ops: map the new chunks, or give
                                      chunks back (blocks on them swapped out or moved to
                                      other pages, the chunks closed) ──▶ LeaseReturn

Every block keeps its address: giving chunks back is swapping some blocks out and moving
pages beneath others (`Paged.give_back`). The executor runs under its swap limit within the
chunks it holds. Only a job inside one op for longer than `quota_deadline_s` after being asked
cannot give back in time: the daemon ends its session, as it says in its goodbye.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path

from tidalcore.v1 import pool_pb2

from tidalclient.errors import AttachError, LeaseExceeded
from tidalclient.executors.paged import Paged
from tidalclient.handles import grow

log = logging.getLogger("tidalpool")

_IDLE_WAIT_S = 0.05
"""How long one try to run deferred work waits for the job's thread to leave the executor."""


class ElasticLease:
    """The chunks of one elastic session: which slot of the executor's page space is which
    chunk of the daemon's pool, the quota last told, and the moves between them."""

    def __init__(
        self,
        executor: Paged,
        chunks: list[int],
        chunk_bytes: int,
        swap_limit: int,
        send: Callable[[pool_pb2.ClientMessage], None],
        handles: Path,
        token: str,
        daemon_users: str | None,
        closed: Callable[[], bool],
    ) -> None:
        self.executor = executor
        executor.elastic = True
        self.chunk_bytes = chunk_bytes
        self.swap_limit = swap_limit
        self._send = send
        self._handles, self._token, self._users = handles, token, daemon_users
        self._chunk_of = dict(enumerate(chunks))  # executor slot -> the pool's chunk index
        self._lock = threading.Lock()
        self._kicking = False
        self.closed = closed
        self._held = len(chunks)  # chunks the daemon counts as this session's (granted)
        self._quota = len(chunks)
        self._quota_id = 0

    @property
    def held_chunks(self) -> int:
        with self._lock:
            return self._held

    def on_quota(self, change: pool_pb2.QuotaChange) -> None:
        """A QuotaChange (the listener's thread): take chunks up to a higher quota now; map
        them, or give chunks back, as soon as the job is between ops (`_kick`) or at its next
        op, allocation or step, whichever comes first."""
        with self._lock:
            if change.quota_id <= self._quota_id:
                return  # an older change, overtaken
            self._quota_id, self._quota = change.quota_id, change.device_chunks
            wanted = self._quota - self._held
        if wanted > 0:
            try:
                granted = grow(self._handles, self._token, daemon_users=self._users)
            except AttachError as e:
                log.warning("tidalpool: could not take chunks up to the new quota: %s", e)
                return
            chunks = list(granted.response.lease.device.chunks)
            fds = list(granted.device_fds)
            with self._lock:
                self._held += len(chunks)
            self.executor.defer(lambda ex: self._add(ex, chunks, fds))
        else:
            self.executor.defer(self._give_back)
        self._kick()

    def _kick(self) -> None:
        """Have the deferred work run soon even if the job makes no op for a while: a thread
        runs it once the job's thread is between ops (`Paged.run_if_idle`). One at a time."""
        with self._lock:
            if self._kicking:
                return
            self._kicking = True
        threading.Thread(target=self._run_when_idle, name="tidalpool-quota", daemon=True).start()

    def _run_when_idle(self) -> None:
        try:
            while self.executor.deferred and not self.closed():
                try:
                    if self.executor.run_if_idle(_IDLE_WAIT_S):
                        break
                except Exception:  # the job's thread would have raised it; here, it is said
                    log.exception("tidalpool: giving chunks back or taking them failed")
                    break
        finally:
            with self._lock:
                self._kicking = False
            if self.executor.deferred and not self.closed():
                self._kick()  # deferred while it was ending: not left waiting for an op

    def _limit(self, chunks: int) -> int:
        return min(self.swap_limit, chunks * self.chunk_bytes)

    def _add(self, executor: Paged, chunks: list[int], fds: list[int]) -> None:
        """Map granted chunks beneath the range and run under the higher limit."""
        try:
            if not chunks:
                return
            with self._lock:
                held = self._held
            slots = executor.add_chunks(fds, self._limit(min(held, self._quota)))
            self._chunk_of.update(zip(slots, chunks, strict=True))
        finally:
            for fd in fds:
                os.close(fd)

    def _give_back(self, executor: Paged) -> None:
        """Give back the chunks over the latest quota (between the job's ops)."""
        with self._lock:
            over, quota, quota_id = self._held - self._quota, self._quota, self._quota_id
        if over <= 0:
            executor.set_limit(self._limit(min(self.held_chunks, quota)))
            return
        shortfall = ""
        try:
            slots = executor.give_back(over, self._limit(quota))
        except LeaseExceeded as e:
            slots, shortfall = [], str(e)
            log.warning("tidalpool: cannot give %d chunks back to the daemon: %s", over, e)
        chunks = [self._chunk_of.pop(slot) for slot in slots]
        with self._lock:
            self._held -= len(chunks)
        self._send(
            pool_pb2.ClientMessage(
                lease_return=pool_pb2.LeaseReturn(
                    device_chunks=chunks, quota_id=quota_id, shortfall=shortfall
                )
            )
        )
