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

An elastic lease (`ElasticPages`) changes under a running session: `grow` takes in frames a
chunk added, and `vacate` empties the frames of chunks to give back, every block keeping its
address and bytes: a page beneath a block moves to a free frame elsewhere (`remap`), a stale
page showing one is unmapped, and the frames leave the lease (`Frames.withdraw`).
"""

from __future__ import annotations

from array import array
from collections import deque
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field
from itertools import repeat
from typing import TYPE_CHECKING

from tidalclient.devices.pages import ElasticPages, Frames, PageSpace
from tidalclient.devices.streams import Completion, CopyStream, Waits
from tidalclient.errors import LeaseExceeded
from tidalclient.executors.base import ARRIVING, DEVICE, HOST, LEAVING
from tidalclient.executors.bestfit import BestFit

if TYPE_CHECKING:
    from tidalclient.timeline import Timeline

_NONE = array("i", [-1])  # no frame, no page


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
        # The books are arrays, read and written a run of pages at a time (a block's pages
        # are one run): page -> the frame it still shows while stale (NONE: not stale), and
        # the work that may still use it; frame -> the stale page it is parked for while it is
        # free (NONE: none), and the compute work that may still use it. They cost 20 bytes a
        # page of the range and 12 a frame: with a range of 16 leases (`paged.range_bytes`),
        # 0.5% of the lease's bytes in host memory at 64 KiB pages, 8% at 4 KiB.
        pages, count = space.length // space.page, frames.count
        self._shows = array("i", _NONE) * pages
        self._stale_after: list[Completion | None] = [None] * pages
        self._parked_for = array("i", _NONE) * count
        self._fences: list[Completion | None] = [None] * count
        # Runs of pages made stale together, oldest first: (page, count, stamp); a page is
        # still of its run while its `_since` is the run's stamp.
        self._stale_runs: deque[tuple[int, int, int]] = deque()
        self._since = array("q", [0]) * pages
        self._stamp = 0
        self._runs_kept = 64  # how many `_stale_runs` may hold before it is pruned
        self._doomed: set[int] = set()  # stale pages whose frames another block took
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
        return (self._frames.usable - self._frames.free) * self.page

    @property
    def held_pages(self) -> int:
        return self._frames.usable - self._frames.free

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

    def _give(self, frames: list[int], first: int, after: Completion | None) -> None:
        """Frames back to the free ones, parked (their mapping stays, stale); `after`: the
        work that may still use them. `first`: `_run(frames)`."""
        self._frames.give(frames, parked=True)
        if after is not None:
            if first >= 0:
                self._fences[first : first + len(frames)] = [after] * len(frames)
            else:
                for f in frames:
                    self._fences[f] = after

    def _taken(self, frames: list[int], first: int, copied: bool) -> None:
        """`frames` were taken for a block: a copy into them (`copied`, on the in stream)
        first waits for the work that last used them; a block's compute comes after it in
        stream order anyway. `first`: `_run(frames)`."""
        n = len(frames)
        if first >= 0:
            events = dict.fromkeys(self._fences[first : first + n])  # each once
            self._fences[first : first + n] = [None] * n
        else:
            events = dict.fromkeys(self._fences[f] for f in frames)
            for f in frames:
                self._fences[f] = None
        if copied:
            for event in events:
                if event is not None:
                    self._in.wait_event(event)

    def _map(self, page: int, count: int, copied: bool) -> list[int] | None:
        """A frame mapped at each of the `count` pages from `page`, one call a page: a stale
        page whose frame is still free keeps it as it is (no call); another page gets a free
        frame, once a stale mapping there is unmapped (when its work is done). None when too
        few frames are free (nothing changed)."""
        if count > self._frames.free:
            return None
        end = page + count
        shows = self._shows[page:end]
        if (
            min(shows) >= 0
            and (not self._doomed or self._doomed.isdisjoint(range(page, end)))
            and self._frames.take_these(frames := shows.tolist())
        ):  # the block's pages, as they are
            self._shows[page:end] = array("i", _NONE) * count
            self._stale_after[page:end] = [None] * count
            first = _run(frames)
            parked = self._parked_for
            if first >= 0 and parked[first : first + count] == array("i", range(page, end)):
                parked[first : first + count] = array("i", _NONE) * count  # each parked for it
            else:
                for p, f in zip(range(page, end), frames, strict=True):
                    if parked[f] == p:
                        parked[f] = -1
            self._taken(frames, first, copied)
            return frames
        got: list[int] = []
        for p in range(page, end):
            stale = self._shows[p]
            if stale >= 0 and p not in self._doomed and self._frames.take_these([stale]):
                self._forget(p)
                got.append(stale)
                continue
            fresh = self._frames.take(1, parked=False)
            if fresh is None:  # every free frame is a stale page's: the longest stale goes
                fresh = [self._take_longest_stale(now=False)]
            if stale >= 0:
                self._unmap_stale(p)
            self.space.map(p * self.page, fresh)
            got.append(fresh[0])
        self._taken(got, _run(got), copied)
        return got

    def _take_longest_stale(self, now: bool) -> int:
        """Take the free frame parked for a stale page longest. That page is unmapped now
        when no work uses it any more (`now`: once that work is done, waited for), else
        once it is done (`poll`)."""
        frame, shown = self._longest_stale()
        taken = self._frames.take_these([frame])
        assert taken
        self._parked_for[frame] = -1
        after = self._stale_after[shown]
        if after is None or after.query() or now:
            if after is not None:
                self.wait(after, "compute on a page to unmap")
            self._forget(shown)
            self.space.unmap(shown * self.page, 1)
        else:
            self._doomed.add(shown)
        return frame

    def _longest_stale(self) -> tuple[int, int]:
        """The free frame parked for a stale page longest, and that page."""
        runs = self._stale_runs
        while runs:
            page, count, stamp = runs[0]
            for p in range(page, page + count):
                f = self._shows[p]
                if f >= 0 and self._since[p] == stamp and self._parked_for[f] == p:
                    runs[0] = (p, page + count - p, stamp)  # what went before it is gone
                    return f, p
            runs.popleft()
        raise AssertionError("no free frame is parked for a stale page")

    def _forget(self, p: int) -> None:
        """Drop stale page `p` from the books (it is unmapped, or its mapping taken)."""
        frame = self._shows[p]
        self._shows[p] = -1
        self._stale_after[p] = None
        self._doomed.discard(p)
        if self._parked_for[frame] == p:
            self._parked_for[frame] = -1

    def _unmap_stale(self, p: int) -> None:
        frame, after = self._shows[p], self._stale_after[p]
        shown = self._parked_for[frame] == p  # its frame is free still, parked for it
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
        first = _run(frames)
        self._give(frames, first, after)
        n = len(frames)
        self._shows[page : page + n] = array("i", frames)
        self._stale_after[page : page + n] = [after] * n
        if first >= 0:
            self._parked_for[first : first + n] = array("i", range(page, page + n))
        else:
            for p, f in enumerate(frames, page):
                self._parked_for[f] = p
        self._stamp += 1
        self._since[page : page + n] = array("q", [self._stamp]) * n
        runs = self._stale_runs
        runs.append((page, n, self._stamp))
        if len(runs) > self._runs_kept:  # drop the runs none of whose pages are theirs any more
            since = self._since
            kept = [(p, c, st) for p, c, st in runs if st in since[p : p + c]]
            runs.clear()
            runs.extend(kept)
            self._runs_kept = max(64, 2 * len(kept))

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
            for run, count in _runs(new):  # the new pages, a run at a time
                got = self._map(run, count, copied=False)
                assert got is not None
                self._packed.update(zip(range(run, run + count), zip(repeat(0), got), strict=True))
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
        gone: list[int] = []
        frames: list[int] = []
        for p in range(h.offset // self.page, (h.offset + h.size - 1) // self.page + 1):
            count, frame = self._packed[p]
            if count > 1:
                self._packed[p] = (count - 1, frame)
                continue
            del self._packed[p]
            gone.append(p)
            frames.append(frame)
        at = 0
        for run, count in _runs(gone):  # the pages no block is on any more, a run at a time
            self._unmapped(run, frames[at : at + count], after)
            at += count

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
            after = self._stale_after[p]
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

    # -- an elastic lease ------------------------------------------------------------------
    def grow(self, n: int) -> None:
        """The lease grew by `n` frames, already added to the free ones (`Frames.add`)."""
        if n < 0 or len(self._fences) + n != self._frames.count:
            raise ValueError(
                f"{n} frames more than {len(self._fences)} is not the lease's {self._frames.count}:"
                " add them to the frames first"
            )
        self._parked_for.extend(array("i", _NONE) * n)
        self._fences.extend(repeat(None, n))

    def vacate(self, frames: Collection[int], after: Completion | None = None) -> None:
        """`frames` leave the lease for good (chunks given back); every block keeps its address
        and its bytes. Each page mapped on one of them beneath a live block (page-owning,
        pinned or not, or a packed page) moves to a free frame outside them (`remap`), each
        stale page showing one is unmapped (once its work is done), then all are withdrawn.
        `after`: the compute work that may still use the blocks, waited for before a byte
        moves. No copy may be in flight (`reclaim` them first). LeaseExceeded, with nothing
        changed, when too few free frames lie outside `frames` for the moves."""
        space = self.space
        if not isinstance(space, ElasticPages):
            raise TypeError(f"a {type(space).__name__} cannot move a page onto another frame")
        if self._flights:
            raise ValueError(f"copies are in flight ({len(self._flights)}): reclaim them first")
        gone = set(frames)
        taken = self._frames.taken(gone)  # ValueError for a frame withdrawn or not the lease's
        moves: list[tuple[int, _Held | None, int, int]] = []  # page, block (None: packed), i, frame
        for h in self._held.values():
            if h.frames and not gone.isdisjoint(h.frames):
                first = h.offset // self.page
                moves.extend((first + i, h, i, f) for i, f in enumerate(h.frames) if f in gone)
        moves.extend((p, None, 0, f) for p, (_, f) in self._packed.items() if f in gone)
        if len(moves) != taken:
            raise AssertionError(f"{taken} of the frames are taken, {len(moves)} beneath blocks")
        spare = self._frames.free - (len(gone) - taken)
        if spare < taken:
            raise LeaseExceeded(
                f"cannot give back {len(gone)} pages: {taken} of them are beneath blocks, and"
                f" {spare} free pages lie outside them to move those to"
            )
        if after is not None:
            self.wait(after, "compute on the pages to move")
        # Every other mapping of them goes: stale pages (which unparks the free frames they
        # showed), and those a block took while work still used them (doomed).
        stale = {self._parked_for[f] for f in gone} | {
            p for p in self._doomed if self._shows[p] in gone
        }
        stale.discard(-1)
        for p in sorted(stale):
            self._unmap_stale(p)
        for event in dict.fromkeys(self._fences[f] for f in gone):  # work on the free ones
            if event is not None:
                self.wait(event, "compute on the pages to give back")
        for f in gone:
            self._fences[f] = None
        olds = sorted(f for _, _, _, f in moves)
        self._frames.withdraw(sorted(gone.difference(olds)))  # no move takes them now
        for page, held, i, _ in moves:
            frame = self._spare_frame()
            space.remap(page * self.page, frame)
            if held is not None:
                held.frames[i] = frame
            else:
                count, _ = self._packed[page]
                self._packed[page] = (count, frame)
        self._frames.give(olds)
        self._frames.withdraw(olds)

    def _spare_frame(self) -> int:
        """A free frame to move a page onto, taken, with no work using it any more."""
        got = self._frames.take(1, parked=False)
        frame = got[0] if got is not None else self._take_longest_stale(now=True)
        event, self._fences[frame] = self._fences[frame], None
        if event is not None:
            self.wait(event, "compute on a frame to move a page onto")
        return frame

    def close(self) -> None:
        """Wait for every copy in flight and finish it, then unmap every stale mapping."""
        while self.reclaim():
            pass
        for p in [p for p, f in enumerate(self._shows) if f >= 0]:
            self._unmap_stale(p)


def _runs(pages: list[int]) -> Iterator[tuple[int, int]]:
    """The runs of consecutive pages in ascending `pages`: (first, count) each."""
    start = 0
    for k in range(1, len(pages) + 1):
        if k == len(pages) or pages[k] != pages[k - 1] + 1:
            yield pages[start], k - start
            start = k


def _run(frames: list[int]) -> int:
    """The first of `frames` when they are one ascending run (f, f + 1, ...), else -1."""
    if not frames:
        return -1
    first = frames[0]
    return (
        first
        if frames[-1] - first == len(frames) - 1
        and frames == list(range(first, first + len(frames)))
        else -1
    )
