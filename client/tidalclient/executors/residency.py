"""Residency: which of a session's blocks have pages beneath them, under virtual residency.

Every block keeps the address its layout gave it (`tidalplan.paged.Layout`) from malloc to free;
this part owns the physical pages mapped beneath those addresses and the copies that move a
block's bytes to the host lease and back, nothing else. When a block moves is its caller's
decision (the plan runner, or an LRU fallback): the pool apart from the policy.

    place ─▶ DEVICE ──evict: copy out on the out stream──▶ LEAVING ──its event done (poll)──▶ HOST
               ▲  ◀──── restore before the copy ends: kept, the pages were never unmapped ──┘  │
               └──── its event done (poll): host bytes freed ◀── ARRIVING ◀── restore: pages ──┘
                                                                            mapped, copy in

A page-owning block (`owning`) maps whole pages of its own, in one mapping, and is the only kind
that moves: a swap copies its whole pages (what the planner counted) and, once the copy's event
has completed, unmaps them and gives their frames back (`poll`: never a stall). A packed block
shares pages with its neighbours; a packed page is mapped while any block on it is live. So the
mapped bytes here are exactly what `tidalplan.paged.validate_pages` counts for the same layout.

A block freed while compute work that uses it may still run (`drop(after=)`, the compute
stream's event) keeps its pages mapped until that work is done: its pages are then unmapped by
`poll`, unless a page-owning block placed at the same pages meanwhile takes them as they are
(stream order makes that safe). Packed pages simply stay mapped while such a block is on them.

"Does not fit" is a return value: `place` and `restore` return False, changing nothing, when
the lease has too few free pages; `reclaim` waits for the oldest copy out to free its pages.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from tidalclient.devices.pages import Frames, PageSpace
from tidalclient.devices.streams import Completion, CopyStream
from tidalclient.executors.base import ARRIVING, DEVICE, HOST, LEAVING
from tidalclient.executors.bestfit import BestFit


@dataclass(slots=True, eq=False)
class _Held:
    offset: int  # in the range
    size: int
    owning: bool
    where: str = DEVICE
    frames: list[int] = field(default_factory=list)  # an owning block's pages while mapped
    host: int = -1  # host offset while LEAVING, HOST or ARRIVING
    event: Completion | None = None  # its copy in flight (LEAVING, ARRIVING)
    dropped: bool = False  # freed while a copy was in flight: let go once it completes


class Residency:
    """The pages of one session's range: `space` maps them, `frames` are the lease's free
    pages; swapped bytes wait in the host lease mapped at `host_address` (`host_capacity`
    bytes), copied on `out` and `into` (the streams' events say when a copy is done)."""

    def __init__(
        self,
        space: PageSpace,
        frames: Frames,
        host_address: int,
        host_capacity: int,
        out: CopyStream,
        into: CopyStream,
    ) -> None:
        self.space = space
        self.page = space.page
        self._frames = frames
        self._host_address = host_address
        self._host = BestFit(host_capacity)
        self._out, self._in = out, into
        self._held: dict[int, _Held] = {}
        self._packed: dict[int, tuple[int, int]] = {}  # page index -> (blocks on it, frame)
        self._flights: deque[tuple[int, _Held]] = deque()  # copies in flight, oldest first
        # Freed blocks whose pages compute work may still use, oldest first.
        self._freed: deque[tuple[Completion, _Held]] = deque()
        self.peak_mapped_bytes = 0
        self.out_bytes = self.in_bytes = 0
        self.swap_outs = self.swap_ins = 0

    @property
    def mapped_bytes(self) -> int:
        return self.space.mapped_pages * self.page

    def _mapped(self) -> None:
        self.peak_mapped_bytes = max(self.peak_mapped_bytes, self.mapped_bytes)

    def _map_own(self, h: _Held) -> bool:
        """Map free pages beneath owning block `h`'s whole pages; False when too few are free."""
        got = self._frames.take(-(-h.size // self.page))
        if got is None:
            return False
        self.space.map(h.offset, got)
        h.frames = got
        return True

    def _unmap_own(self, h: _Held) -> None:
        """Unmap owning block `h`'s pages and give their frames back."""
        self.space.unmap(h.offset, len(h.frames))
        self._frames.give(h.frames)
        h.frames = []

    def where(self, key: int) -> str:
        return self._held[key].where

    def new_pages(self, offset: int, size: int, owning: bool) -> int:
        """How many pages placing a block of `size` bytes at `offset` would map."""
        if owning:
            return 0 if self._reusable(offset, size) is not None else -(-size // self.page)
        pages = range(offset // self.page, (offset + size - 1) // self.page + 1)
        return sum(1 for p in pages if p not in self._packed)

    def pages_back(self, key: int) -> int:
        """How many pages `restore(key)` would map (0 for a block still leaving)."""
        h = self._held[key]
        return -(-h.size // self.page) if h.where == HOST else 0

    @property
    def in_flight(self) -> int:
        """What `reclaim` can wait for: copies in flight (out and in), and freed blocks whose
        compute work may still run."""
        return len(self._flights) + len(self._freed)

    def _reusable(self, offset: int, size: int) -> _Held | None:
        """A freed page-owning block still mapped at exactly these pages."""
        pages = -(-size // self.page)
        for _, f in self._freed:
            if f.owning and f.offset == offset and len(f.frames) == pages:
                return f
        return None

    def _clear(self, offset: int, size: int) -> None:
        """Let go of the freed page-owning blocks still mapped on [offset, offset + size),
        once their compute work is done."""
        end = offset + size
        for after, f in list(self._freed):
            if f.owning and f.offset < end and offset < f.offset + len(f.frames) * self.page:
                after.wait()
                self._freed.remove((after, f))
                self._let_go(f)

    @property
    def host_used_bytes(self) -> int:
        return self._host.used_bytes

    # -- live and dead ---------------------------------------------------------------------
    def place(self, key: int, offset: int, size: int, owning: bool) -> bool:
        """Block `key` becomes live at `offset` (bytes into the range) with pages beneath it;
        False, with nothing changed, when the lease has too few free pages."""
        if key in self._held:
            raise ValueError(f"block {key} is already placed")
        if size <= 0 or offset < 0 or offset + size > self.space.length:
            raise ValueError(f"block {key}: {size} bytes at {offset} are not in the range")
        h = _Held(offset, size, owning)
        if owning:
            if offset % self.page:
                raise ValueError(f"block {key}: a page-owning block at {offset}, not on a page")
            reused = self._reusable(offset, size)
            if reused is not None:  # its pages, as they are: the new block's work comes after
                self._freed = deque(x for x in self._freed if x[1] is not reused)
                h.frames, reused.frames = reused.frames, []
            else:
                self._clear(offset, size)
                if not self._map_own(h):
                    return False
        else:
            first = offset // self.page
            pages = range(first, (offset + size - 1) // self.page + 1)
            new = [p for p in pages if p not in self._packed]
            got = self._frames.take(len(new))
            if got is None:
                return False
            for p, frame in zip(new, got, strict=True):
                self.space.map(p * self.page, [frame])
                self._packed[p] = (0, frame)
            for p in pages:
                count, frame = self._packed[p]
                self._packed[p] = (count + 1, frame)
        self._held[key] = h
        self._mapped()
        return True

    def drop(self, key: int, after: Completion | None = None) -> None:
        """Block `key` is freed: its pages and host bytes go back, at once or, while a copy of
        it is in flight, once that copy completes, or once `after` (the compute work that last
        used it) has (`poll`)."""
        h = self._held.pop(key)
        if h.event is not None:
            h.dropped = True  # `_land` lets go of it
            return
        if after is not None and h.where == DEVICE and not after.query():
            self._freed.append((after, h))
            return
        self._let_go(h)

    def _let_go(self, h: _Held) -> None:
        if h.host >= 0:
            self._host.release(h.host)
            h.host = -1
        if h.owning:
            if h.frames:
                self._unmap_own(h)
            return
        for p in range(h.offset // self.page, (h.offset + h.size - 1) // self.page + 1):
            count, frame = self._packed[p]
            if count > 1:
                self._packed[p] = (count - 1, frame)
                continue
            del self._packed[p]
            self.space.unmap(p * self.page, 1)
            self._frames.give([frame])

    # -- moves -----------------------------------------------------------------------------
    def evict(self, key: int, after: Completion | None = None) -> bool:
        """Copy block `key`'s pages to the host lease on the out stream (after `after`, the
        compute work that last wrote it, when given); its pages are unmapped once the copy is
        done. False when the host lease has no room for it (nothing changed)."""
        h = self._held[key]
        if not h.owning:
            raise ValueError(f"block {key} shares its pages: only page-owning blocks move")
        if h.where != DEVICE:
            raise ValueError(f"block {key} is {h.where}, not on the device")
        if h.event is not None:  # came back while its last copy out still runs: finish that
            h.event.wait()
            self._land(key, h)
        nbytes = len(h.frames) * self.page
        host = self._host.allocate(nbytes)
        if host is None:
            return False
        if after is not None:
            self._out.wait_event(after)
        self._out.copy(self._host_address + host, self.space.address + h.offset, nbytes)
        h.host, h.where, h.event = host, LEAVING, self._out.record()
        self._flights.append((key, h))
        self.out_bytes += nbytes
        self.swap_outs += 1
        return True

    def restore(self, key: int) -> bool:
        """Bring block `key` back: pages mapped at its address and its bytes copied in on the
        in stream (`ready` gives the copy's event); a block still leaving just stays. False,
        with nothing changed, when the lease has too few free pages (see `reclaim`)."""
        h = self._held[key]
        if h.where == LEAVING:
            h.where = DEVICE  # its pages were never unmapped; the host bytes go when the copy ends
            return True
        if h.where != HOST:
            raise ValueError(f"block {key} is {h.where}, not on the host")
        if not self._map_own(h):
            return False
        nbytes = len(h.frames) * self.page
        self._in.copy(self.space.address + h.offset, self._host_address + h.host, nbytes)
        h.where, h.event = ARRIVING, self._in.record()
        self._flights.append((key, h))
        self.in_bytes += nbytes
        self.swap_ins += 1
        self._mapped()
        return True

    def ready(self, key: int) -> Completion | None:
        """The event an op using block `key` waits on (its copy in), None when it is there. A
        block on the host or still leaving must be restored first: an op that wrote a leaving
        block would lose the write when its pages go."""
        h = self._held[key]
        if h.where in (HOST, LEAVING):
            raise ValueError(f"block {key} is {h.where}: restore it first")
        return h.event if h.where == ARRIVING else None

    # -- completions -----------------------------------------------------------------------
    def poll(self) -> None:
        """Finish every copy whose event has completed: a copy out's pages are unmapped and
        their frames freed (unless the block came back meanwhile), a copy in's host bytes
        freed. Never waits."""
        for key, h in list(self._flights):
            if h.event is not None and h.event.query():
                self._land(key, h)
        while self._freed and self._freed[0][0].query():
            self._let_go(self._freed.popleft()[1])

    def reclaim(self) -> bool:
        """Wait for the oldest copy in flight and finish it, or else for the oldest freed
        block's compute work and let go of its pages; False when there is neither."""
        if not self._flights:
            if not self._freed:
                return False
            after, h = self._freed.popleft()
            after.wait()
            self._let_go(h)
            return True
        key, h = self._flights[0]
        assert h.event is not None
        h.event.wait()
        self._land(key, h)
        return True

    def _land(self, key: int, h: _Held) -> None:
        self._flights.remove((key, h))
        h.event = None
        if h.dropped:
            self._let_go(h)
        elif h.where == LEAVING:  # out and still away: the pages go
            self._unmap_own(h)
            h.where = HOST
        else:  # in, or out but kept: the host copy goes
            self._host.release(h.host)
            h.host, h.where = -1, DEVICE

    def close(self) -> None:
        """Wait for every copy in flight and finish it."""
        while self.reclaim():
            pass
