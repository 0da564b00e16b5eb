"""Plans on disk by what they were made for: the next run of the same job skips the planning.

A plan depends on the iteration (its signature) and on the session's swap limit, the copy
bandwidth its swaps were planned at and the wire version it is written in; its file is named
by all four (`key`), so a session with another limit or bandwidth plans anew. A paged plan
(virtual residency) depends on the session's page and on where the session put its persistent
blocks too, and is named by them as well.

The directory may hold what another local user put there, so an entry is read as untrusted:
opened without following a link and without blocking (a FIFO cannot hold the planning
thread), taken only when it is a regular file of at most MAX_PLAN_BYTES (larger ones are not
read), and parsed as a PlanUpdate. Anything else is a `Defect`, which the caller logs and
plans past; the plan it makes then replaces the entry. A plan is written to a fresh temporary
file and renamed over its name, so neither a link planted at either name is followed nor a
reader ever sees half a plan:

    get:  open(O_NOFOLLOW | O_NONBLOCK) ─▶ fstat: regular, ≤ MAX_PLAN_BYTES ─▶ read ─▶ parse
          ─▶ its time set to now (it was used)
    put:  mkstemp (O_EXCL, 0600) ─▶ write ─▶ os.replace(temp, name) ─▶ evict

The plans take at most `limit` bytes on disk (`plan_cache_bytes`): after each put, the least
recently used plan files (by modification time: written, or read by `get`) go until the rest
fit; the one just written stays, whatever its size.

The daemons of one node (one per GPU) share the directory, and the ranks of a job, one per
GPU, run the same iteration: so that N ranks cost one solve, a daemon plans under `solving`, an
exclusive lock (flock) on one of `LOCK_STRIPES` files picked by the plan's name, and looks in
the cache again once it holds it: a daemon that needs a plan another is making waits for it
(at most its planning deadline) and takes it from the cache. A lock is released when its
holder closes it or dies, so a killed daemon never holds one; a lock file that is not a regular
file, or cannot be opened, is planned past.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import logging
import os
import stat
import struct
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from google.protobuf.message import DecodeError
from tidalcore.v1 import pool_pb2

log = logging.getLogger("tidalpoold.planning")

MAX_PLAN_BYTES = 64 * 1024 * 1024
"""The largest plan file read (64 MiB); a larger one is refused unread. The plans the daemon
makes for the model traces in ../shared/traces (up to 1945 allocations and 376 swaps an
iteration; no limit, and 0.7, 0.5 and 0.3 of the peak) take at most 17,839 bytes: about 8
bytes an allocation and 18 a swap. At those rates 64 MiB holds a plan of two million
allocations each swapped once, the most one iteration can have in a session's trace of
`max_trace_events` (4 million) events, an alloc and a free each: over 3,000 times the largest
plan measured, and no real plan comes near it."""

_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY
_LOCK_FLAGS = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY
LOCK_STRIPES = 64
"""Lock files a cache directory holds at most (`solving-NN.lock`): plans of different names
share one in 64, and wait for each other only while both are being made at once."""
LOCK_POLL_S = 0.01


MEASURED = -1.0
"""The `copy_gbps` of the key of a plan for a session whose copies are not throttled: they run
at the bandwidth the backend measured at start, which differs a little from one start to the
next, so one plan serves every daemon that measured about as much (`PlanWorker.make`)."""


def key(
    signature: bytes,
    swap_limit: int,
    copy_gbps: float,
    version: int,
    page: int = 0,
    persistent_at: Sequence[tuple[int, bool]] = (),
) -> str:
    """A plan's name in the cache: the signature in hex, then a hash of the swap limit (0: no
    swapping), the copy bandwidth in GB/s (`MEASURED`: whatever the backend measured) and the
    PlanUpdate version, and for a paged plan (`page` > 0) of the page and of each persistent
    block's address and page ownership (`persistent_at`, in the iteration's order)."""
    made_for = hashlib.blake2b(struct.pack("<QdI", swap_limit, copy_gbps, version), digest_size=8)
    if page:
        made_for.update(struct.pack("<Q", page))
        for address, owning in persistent_at:
            made_for.update(struct.pack("<Q?", address, owning))
    return f"{signature.hex()}-{made_for.hexdigest()}"


@dataclass(frozen=True, slots=True)
class Defect:
    """A cache entry that cannot be used: where it is and why. The caller logs it once
    (`plan.cache_defect`) and plans as if there were no entry."""

    path: Path
    why: str


class PlanCache:
    """Plans on disk by `key`, at most `limit` bytes of them (the least recently used go); a
    cache that cannot be written is skipped."""

    def __init__(self, directory: Path, limit: int = 256 * 1024 * 1024) -> None:
        if limit <= 0:
            raise ValueError(f"a plan cache of {limit} bytes")
        self.directory = directory
        self.limit = limit
        self.evicted = 0  # plan files removed to keep the cache under its limit

    def path(self, name: str) -> Path:
        """Where the plan named `name` is kept."""
        return self.directory / f"{name}.plan"

    def get(self, name: str) -> pool_pb2.PlanUpdate | Defect | None:
        """The plan stored under `name`; None when there is none; a Defect when what is there
        is not a readable regular file of at most MAX_PLAN_BYTES holding a PlanUpdate."""
        path = self.path(name)
        data = _read(path)
        if data is None or isinstance(data, Defect):
            return data
        try:
            plan = pool_pb2.PlanUpdate.FromString(data)
        except DecodeError as e:
            return Defect(path, f"not a PlanUpdate ({len(data)} bytes): {e}")
        with contextlib.suppress(OSError):  # used now: the last to go (a link is not touched)
            os.utime(path, follow_symlinks=False)
        return plan

    @contextlib.contextmanager
    def solving(self, name: str, wait_s: float) -> Iterator[bool]:
        """Held while this daemon makes the plan named `name`: another daemon sharing the
        directory that needs a plan of the same lock waits (at most its own `wait_s`) and
        finds it in the cache. Yields whether this daemon waited for another; it plans without
        the lock (logging `plan.cache_unlocked` why) when the lock file cannot be used or
        `wait_s` passed."""
        stripe = int(name[:4], 16) % LOCK_STRIPES  # a `key`: the signature in hex first
        path = self.directory / f"solving-{stripe:02d}.lock"
        fd, waited = -1, False
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, _LOCK_FLAGS, 0o600)
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise OSError(errno.EINVAL, f"not a regular file but a {_kind(st.st_mode)}")
            deadline = time.monotonic() + wait_s
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    waited = True
                    if time.monotonic() >= deadline:
                        raise OSError(errno.ETIMEDOUT, f"held past {wait_s:g} s") from None
                    time.sleep(LOCK_POLL_S)
        except OSError as e:
            log.warning("plan.cache_unlocked", extra={"path": str(path), "why": str(e)})
            if fd >= 0:
                os.close(fd)
                fd = -1
        try:
            yield waited
        finally:
            if fd >= 0:
                os.close(fd)  # the lock goes with it

    def put(self, name: str, plan: pool_pb2.PlanUpdate) -> None:
        """Store `plan` under `name`, replacing whatever entry is there (a link is replaced,
        not followed); logs `plan.cache_unwritable` and keeps nothing when it cannot."""
        tmp: str | None = None
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.directory, suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                f.write(plan.SerializeToString())
            os.replace(tmp, self.path(name))
            tmp = None
        except OSError as e:
            log.warning("plan.cache_unwritable", extra={"dir": str(self.directory), "why": str(e)})
            return
        finally:
            if tmp is not None:
                with contextlib.suppress(OSError):  # already gone: nothing else to undo
                    os.unlink(tmp)
        self._evict(keep=self.path(name))

    def _evict(self, keep: Path) -> None:
        """Remove the least recently used plan files but `keep` until the rest take at most
        `limit` bytes. Only regular `*.plan` files count and go (a link or another kind of
        entry is neither followed nor removed)."""
        plans: list[tuple[int, str, int]] = []  # (mtime, name, bytes)
        try:
            with os.scandir(self.directory) as entries:
                for entry in entries:
                    if not entry.name.endswith(".plan"):
                        continue
                    with contextlib.suppress(OSError):  # gone meanwhile
                        st = entry.stat(follow_symlinks=False)
                        if stat.S_ISREG(st.st_mode):
                            plans.append((st.st_mtime_ns, entry.name, st.st_size))
        except OSError as e:
            log.warning("plan.cache_unwritable", extra={"dir": str(self.directory), "why": str(e)})
            return
        total = sum(size for _, _, size in plans)
        gone, freed = 0, 0
        for _, name, size in sorted(plans):
            if total <= self.limit:
                break
            if name == keep.name:
                continue
            try:
                os.unlink(self.directory / name)
            except FileNotFoundError:  # another daemon took it first
                pass
            except OSError as e:  # not ours to remove: the cache stays over its limit
                log.warning(
                    "plan.cache_unwritable", extra={"dir": str(self.directory), "why": str(e)}
                )
                break
            else:
                gone += 1
                freed += size
            total -= size
        if gone:
            self.evicted += gone
            log.info(
                "plan.cache_evicted",
                extra={"dir": str(self.directory), "plans": gone, "bytes": freed},
            )


def _read(path: Path) -> bytes | Defect | None:
    """The bytes of the regular file at `path`, read without following a link or blocking;
    None when there is no such entry."""
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno == errno.ELOOP:
            return Defect(path, "a symbolic link, not a plan file: not followed")
        return Defect(path, f"cannot be opened: {e.strerror or e}")
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return Defect(path, f"not a regular file but a {_kind(st.st_mode)}")
        if st.st_size > MAX_PLAN_BYTES:
            return Defect(
                path, f"{st.st_size} bytes, over the {MAX_PLAN_BYTES} a plan may take: not read"
            )
        chunks: list[bytes] = []
        left = MAX_PLAN_BYTES + 1  # one more: a file that grew past the cap is seen to
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        if left <= 0:
            return Defect(path, f"grew past the {MAX_PLAN_BYTES} bytes a plan may take")
        return b"".join(chunks)
    except OSError as e:
        return Defect(path, f"cannot be read: {e.strerror or e}")
    finally:
        os.close(fd)


def _kind(mode: int) -> str:
    """What a file that is not regular is, in words."""
    for test, name in (
        (stat.S_ISDIR, "directory"),
        (stat.S_ISFIFO, "FIFO"),
        (stat.S_ISSOCK, "socket"),
        (stat.S_ISCHR, "character device"),
        (stat.S_ISBLK, "block device"),
    ):
        if test(mode):
            return name
    return f"file of mode {stat.S_IFMT(mode):#o}"
