"""Residency: which of a session's blocks have pages beneath them, under virtual residency.

Every block keeps the address its layout gave it (`tidalplan.paged.Layout`) from malloc to free;
this part owns the physical pages (frames of the lease) mapped beneath those addresses and the
copies that move a block's bytes to the host lease and back, nothing else. When a block moves
is its caller's decision (the plan runner, or an LRU fallback): the pool apart from the policy.

    place ─▶ DEVICE ──evict: copy out on the out stream──▶ LEAVING ──its event done (poll)──▶ HOST
               ▲  ◀──── restore before the copy ends: kept, its frames were never given up ─┘  │
               └──── its event done (poll): host bytes freed ◀── ARRIVING ◀── restore: frames ─┘
                                                                            mapped, copy in

A page-owning block (`owning`) maps whole pages of its own, one map call a page (so that any
page can later be unmapped or kept alone), and is the only kind that moves: a swap copies its
whole pages (what the planner counted) and, once the copy's event has completed, gives its
frames back (`poll`: never a stall). A packed block shares pages with its neighbours; a packed
page holds a frame while any block on it is live. So the frames held here (`mapped_bytes`) are
exactly what `tidalplan.paged.validate_pages` counts for the same layout, tick by tick.

Frames are reused in stream order, as a caching allocator reuses bytes: a block freed while the
compute work that used it may still run (`drop(after=)`, an event of the compute stream) gives
its frames back at once. A block placed on them next is written by compute work enqueued later
on that stream; a copy into them (a swap-in) first waits for `after`. The freed block's
addresses stay mapped, *stale*, until that work is done (unmapping them earlier would fault
it), as do a swapped-out block's once its copy out is done. A block placed (or brought back)
at stale pages whose frames are still free takes the mapping as it is, with no call to map it
(as a plan places the next iteration's blocks). Frames that stale pages show are handed out last
(`Frames` parks them), the longest stale first; a stale page whose frame another block takes is
unmapped then, or, while work that used it may still run, by `poll` once that work is done. So
an access outside an op to a block that is away reads its own last bytes, or faults (sim).

"Does not fit" is a return value: `place` and `restore` return False, changing nothing, when
the lease has too few free frames; `reclaim` waits for the oldest copy to free its frames.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tidalclient.devices.pages import Frames, PageSpace
from tidalclient.devices.streams import Completion, CopyStream, Waits
from tidalclient.executors.base import ARRIVING, DEVICE, HOST, LEAVING
from tidalclient.executors.bestfit import BestFit

if TYPE_CHECKING:
    from tidalclient.timeline import Timeline


@dataclass(slots=True, eq=False)
class _Held:
    offset: int  # in the range
    size: int
    owning: bool
    where: str = DEVICE
    frames: list[int] = field(default_factory=list)  # an owning block's frames while it has them
    host: int = -1  # host offset while LEAVING, HOST or ARRIVING
    event: Completion | None = None  # its copy in flight (LEAVING, ARRIVING)
    dropped: bool = False  # freed while a copy was in flight: let go once it completes
    after: Completion | None = None  # when dropped: the compute work that last used it


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
        # Stale pages: page -> (the frame it still shows, the work that may still use it).
        self._stale: dict[int, tuple[int, Completion | None]] = {}
        self._stale_frame: dict[int, int] = {}  # a free frame a stale page shows -> the page
        self._doomed: set[int] = set()  # stale pages whose frames another block took
        self._fences: dict[int, Completion] = {}  # frame -> compute work that may still use it
        self.peak_mapped_bytes = 0
        self.out_bytes = self.in_bytes = 0
        self.swap_outs = self.swap_ins = 0
        self.waits = Waits(out, into)  # the calling thread's stalls; the timeline

    @property
    def stall_ns(self) -> int:
        """Time the calling thread blocked in `wait`."""
        return self.waits.stall_ns

    @property
    def timeline(self) -> Timeline | None:
        """Where the copies and the waits go as spans (None: nowhere)."""
        return self.waits.timeline

    @timeline.setter
    def timeline(self, timeline: Timeline | None) -> None:
        self.waits.timeline = timeline

    def wait(self, event: Completion, why: str) -> None:
        """Block until `event` has completed: the calling thread's stall, counted in
        `stall_ns` and, with a timeline, a span on its host track named `why`."""
        self.waits.wait(event, why)
        event.wait()  # raises if the work before it failed (at once: it has completed)

    @property
    def mapped_bytes(self) -> int:
        """The frames held: beneath live blocks, and by copies out still running."""
        return (self._frames.count - self._frames.free) * self.page

    @property
    def held_pages(self) -> int:
        return self._frames.count - self._frames.free

    def _mapped(self) -> None:
        self.peak_mapped_bytes = max(self.peak_mapped_bytes, self.mapped_bytes)

    def where(self, key: int) -> str:
        return self._held[key].where

    @property
    def in_flight(self) -> int:
        """Copies in flight (out and in): what `reclaim` can wait for."""
        return len(self._flights)

    @property
    def host_used_bytes(self) -> int:
        return self._host.used_bytes

    # -- frames and mappings -----------------------------------------------------------------
    def new_pages(self, offset: int, size: int, owning: bool) -> int:
        """How many free frames placing a block of `size` bytes at `offset` would take."""
        if owning:
            return -(-size // self.page)
        pages = range(offset // self.page, (offset + size - 1) // self.page + 1)
        return sum(1 for p in pages if p not in self._packed)

    def pages_back(self, key: int) -> int:
        """How many free frames `restore(key)` would take (0 for a block still leaving)."""
        h = self._held[key]
        return -(-h.size // self.page) if h.where == HOST else 0

    def _give(self, frames: list[int], after: Completion | None) -> None:
        """Frames back to the free ones, parked (their mapping stays, stale); `after`: the
        work that may still use them."""
        self._frames.give(frames, parked=True)
        if after is not None:
            for f in frames:
                self._fences[f] = after

    def _taken(self, frames: list[int], copied: bool) -> None:
        """`frames` were taken for a block: a copy into them (`copied`, on the in stream)
        first waits for the work that last used them; a block's compute comes after it in
        stream order anyway."""
        if not self._fences:
            return
        pop = self._fences.pop
        events = {id(e): e for f in frames if (e := pop(f, None)) is not None}
        if copied:
            for event in events.values():
                self._in.wait_event(event)

    def _map(self, page: int, count: int, copied: bool) -> list[int] | None:
        """A frame mapped at each of the `count` pages from `page`, one call a page: a stale
        page whose frame is still free keeps it as it is (no call); another page gets a free
        frame, once a stale mapping there is unmapped (when its work is done). None when too
        few frames are free (nothing changed)."""
        if count > self._frames.free:
            return None
        pages = range(page, page + count)
        held = [self._stale.get(p) for p in pages]
        if None not in held and self._doomed.isdisjoint(pages):  # the block's pages, as they are
            frames = [h[0] for h in held if h is not None]
            if self._frames.take_these(frames):
                for p, f in zip(pages, frames, strict=True):
                    del self._stale[p]
                    if self._stale_frame.get(f) == p:
                        del self._stale_frame[f]
                self._taken(frames, copied)
                return frames
        got: list[int] = []
        for p in pages:
            stale = self._stale.get(p)
            if stale is not None and p not in self._doomed and self._frames.take_these(stale[:1]):
                self._forget(p)
                got.append(stale[0])
                continue
            fresh = self._frames.take(1, parked=False)
            if fresh is None:  # every free frame is a stale page's: the longest stale goes
                frame, shown = next(iter(self._stale_frame.items()))
                taken = self._frames.take_these([frame])
                assert taken
                fresh = [frame]
                del self._stale_frame[frame]
                after = self._stale[shown][1]
                if after is None or after.query():  # nothing uses it: it goes now
                    self._forget(shown)
                    self.space.unmap(shown * self.page, 1)
                else:  # it goes once the work that used it is done (`poll`)
                    self._doomed.add(shown)
            if stale is not None:
                self._unmap_stale(p)
            self.space.map(p * self.page, fresh)
            got.append(fresh[0])
        self._taken(got, copied)
        return got

    def _forget(self, p: int) -> tuple[int, Completion | None]:
        """Drop stale page `p` from the books (it is unmapped, or its mapping taken)."""
        stale = self._stale.pop(p)
        self._doomed.discard(p)
        if self._stale_frame.get(stale[0]) == p:
            del self._stale_frame[stale[0]]
        return stale

    def _unmap_stale(self, p: int) -> None:
        frame, after = self._stale[p]
        shown = self._stale_frame.get(frame) == p  # its frame is free still, parked for it
        self._forget(p)
        if after is not None:
            self.wait(after, "compute on a page to unmap")
        self.space.unmap(p * self.page, 1)
        if shown:
            self._frames.unpark(frame)

    def _clear(self, page: int, count: int) -> None:
        """A block freed on pages [page, page + count) while a copy of it runs is let go
        once the copy ends (its pages are then stale, for `_map`)."""
        start, end = page * self.page, (page + count) * self.page
        for key, h in list(self._flights):
            if h.dropped and h.frames and h.offset < end and start < h.offset + h.size:
                assert h.event is not None
                self.wait(h.event, "copy of a freed block on the pages")
                self._land(key, h)

    def _unmapped(self, page: int, frames: list[int], after: Completion | None) -> None:
        """Pages from `page` no longer hold `frames`: the frames go back at once, each page
        stays mapped, stale, until `after` is done and its frame is taken."""
        self._give(frames, after)
        for k, f in enumerate(frames):
            self._stale[page + k] = (f, after)
            self._stale_frame[f] = page + k

    # -- live and dead ---------------------------------------------------------------------
    def place(self, key: int, offset: int, size: int, owning: bool) -> bool:
        """Block `key` becomes live at `offset` (bytes into the range) with frames beneath it;
        False, with nothing changed, when the lease has too few free frames."""
        if key in self._held:
            raise ValueError(f"block {key} is already placed")
        if size <= 0 or offset < 0 or offset + size > self.space.length:
            raise ValueError(f"block {key}: {size} bytes at {offset} are not in the range")
        h = _Held(offset, size, owning)
        if owning:
            if offset % self.page:
                raise ValueError(f"block {key}: a page-owning block at {offset}, not on a page")
            self._clear(offset // self.page, -(-size // self.page))
            got = self._map(offset // self.page, -(-size // self.page), copied=False)
            if got is None:
                return False
            h.frames = got
        else:
            first = offset // self.page
            pages = range(first, (offset + size - 1) // self.page + 1)
            new = [p for p in pages if p not in self._packed]
            if len(new) > self._frames.free:
                return False
            for p in new:
                got = self._map(p, 1, copied=False)
                assert got is not None
                self._packed[p] = (0, got[0])
            for p in pages:
                count, frame = self._packed[p]
                self._packed[p] = (count + 1, frame)
        self._held[key] = h
        self._mapped()
        return True

    def drop(self, key: int, after: Completion | None = None) -> None:
        """Block `key` is freed (`after`: the compute work that last used it): its frames and
        host bytes go back at once or, while a copy of it is in flight, once that copy
        completes (`poll`)."""
        h = self._held.pop(key)
        if h.event is not None:
            h.dropped, h.after = True, after  # `_land` lets go of it
            return
        self._let_go(h, after)

    def _let_go(self, h: _Held, after: Completion | None) -> None:
        if h.host >= 0:
            self._host.release(h.host)
            h.host = -1
        if h.owning:
            if h.frames:
                self._unmapped(h.offset // self.page, h.frames, after)
                h.frames = []
            return
        for p in range(h.offset // self.page, (h.offset + h.size - 1) // self.page + 1):
            count, frame = self._packed[p]
            if count > 1:
                self._packed[p] = (count - 1, frame)
                continue
            del self._packed[p]
            self._unmapped(p, [frame], after)

    # -- moves -----------------------------------------------------------------------------
    def evict(self, key: int, after: Completion | None = None) -> bool:
        """Copy block `key`'s pages to the host lease on the out stream (after `after`, the
        compute work that last wrote it, when given); its frames go back once the copy is
        done. False when the host lease has no room for it (nothing changed)."""
        h = self._held[key]
        if not h.owning:
            raise ValueError(f"block {key} shares its pages: only page-owning blocks move")
        if h.where != DEVICE:
            raise ValueError(f"block {key} is {h.where}, not on the device")
        if h.event is not None:  # came back while its last copy out still runs: finish that
            self.wait(h.event, "its copy out, to send it out again")
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
        """Bring block `key` back: frames mapped at its address and its bytes copied in on the
        in stream (`ready` gives the copy's event); a block still leaving just stays. False,
        with nothing changed, when the lease has too few free frames (see `reclaim`)."""
        h = self._held[key]
        if h.where == LEAVING:
            h.where = DEVICE  # its frames were never given up; the host bytes go when the copy ends
            return True
        if h.where != HOST:
            raise ValueError(f"block {key} is {h.where}, not on the host")
        got = self._map(h.offset // self.page, -(-h.size // self.page), copied=True)
        if got is None:
            return False
        h.frames = got
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
        block would lose the write when its frames go."""
        h = self._held[key]
        if h.where in (HOST, LEAVING):
            raise ValueError(f"block {key} is {h.where}: restore it first")
        return h.event if h.where == ARRIVING else None

    # -- completions -----------------------------------------------------------------------
    def poll(self) -> None:
        """Finish every copy whose event has completed (a copy out's frames go back, unless
        the block came back meanwhile; a copy in's host bytes go), and unmap the stale
        mappings whose work is done and whose frames another block took. Never waits."""
        for key, h in list(self._flights):
            if h.event is not None and h.event.query():
                self._land(key, h)
        for p in list(self._doomed):
            after = self._stale[p][1]
            if after is None or after.query():
                self._unmap_stale(p)

    def reclaim(self) -> bool:
        """Wait for the oldest copy in flight and finish it; False when there is none."""
        if not self._flights:
            return False
        key, h = self._flights[0]
        assert h.event is not None
        self.wait(h.event, "the oldest copy, for its pages")
        self._land(key, h)
        return True

    def _land(self, key: int, h: _Held) -> None:
        self._flights.remove((key, h))
        h.event = None
        if h.dropped:
            self._let_go(h, h.after)
        elif h.where == LEAVING:  # out and still away: its frames go (the copy read them last)
            self._unmapped(h.offset // self.page, h.frames, None)
            h.frames = []
            h.where = HOST
        else:  # in, or out but kept: the host copy goes
            self._host.release(h.host)
            h.host, h.where = -1, DEVICE

    def close(self) -> None:
        """Wait for every copy in flight and finish it, then unmap every stale mapping."""
        while self.reclaim():
            pass
        for p in list(self._stale):
            self._unmap_stale(p)
