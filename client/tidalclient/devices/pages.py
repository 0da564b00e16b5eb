"""Virtual residency's page layer: a reserved virtual range, with physical pages of the lease
mapped beneath it on demand and unmapped when a block is swapped out.

    virtual range (reserved once: a block keeps its address for life)
    address ─▶ | v0 | v1 | v2 | v3 | v4 | v5 | ... |   `page` bytes each; unmapped pages fault
                      │    │    │
                      ▼    ▼    ▼          map(offset=1*page, frames=[2, 3, 4])
    lease      | p0 | p1 | p2 | p3 | p4 | p5 | p6 | p7 |
               └────── chunk 0 ────┘└────── chunk 1 ────┘   pages_per_chunk = 4

Physical page p of the lease is byte (p % pages_per_chunk) * page of chunk p // pages_per_chunk.
A `map` call maps each run of frames that is consecutive within one chunk with one system or
driver call (above: p2-p3 of chunk 0 at v1, then p4 of chunk 1 at v3), and `unmap` undoes
whole `map` calls only, run by run, because CUDA cannot unmap part of one cuMemMap.

`Frames` is the pool of free physical pages; it decides nothing. `SimPageSpace` maps memfd
chunks with mmap(MAP_FIXED) into a PROT_NONE reservation; `CudaPageSpace` maps VMM handles, a
whole chunk a page (CUDA maps a handle only from its start), with cuMemMap into a
cuMemAddressReserve range. Both follow `PageSpace`.

An elastic lease (`ElasticPages`, sim only) grows by chunks appended as new slots and gives
whole chunks back while the session runs; a slot given back stays empty for good, so the
formula above holds for every frame ever handed out:

    slots      | chunk 0 | chunk 1 (given back) | chunk 2 | chunk 3 (added) |
    frames       p0..p3    p4..p7: withdrawn       p8..p11   p12..p15
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import re
from abc import abstractmethod
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import NamedTuple, Protocol, runtime_checkable

from tidalcore.chunks import map_none, map_shared, map_zero, reserve, unmap
from tidalcore.cuda_driver import DevicePtr, Driver, MemHandle

OS_PAGE = mmap.PAGESIZE


_ANY_FREE = bytes.maketrans(b"\x02", b"\x01")  # parked pages read as free


class Frames:
    """The free physical pages of a lease, indexes 0..count-1. `take` hands out the lowest run
    of consecutive free pages long enough (one mapping call maps it), and only when there is
    none, the fewest runs, longest first: every run costs a system or driver call to map and
    another to unmap. Pages given back `parked` (still mapped at their old addresses, which a
    block placed there again could take as they are) are handed out last. An elastic lease
    `add`s pages at the end and `withdraw`s free ones for good (their indexes stay taken)."""

    def __init__(self, count: int) -> None:
        if count < 0:
            raise ValueError(f"a lease of {count} pages")
        self.count = count  # the indexes 0..count-1, withdrawn ones included
        self._free = bytearray(b"\x01") * count  # 0: taken (or withdrawn), 1: free, 2: parked
        self._gone = bytearray(count)  # 1: withdrawn, for good (it reads as taken in `_free`)
        self._left = count
        self._withdrawn = 0

    @property
    def free(self) -> int:
        """Free pages (parked ones too); never a withdrawn one."""
        return self._left

    @property
    def usable(self) -> int:
        """The pages of the lease still: `count` less the withdrawn ones."""
        return self.count - self._withdrawn

    def add(self, n: int) -> range:
        """`n` new free pages, at the end of the indexes (a chunk the lease grew by)."""
        if n < 0:
            raise ValueError(f"cannot add {n} pages")
        first = self.count
        self._free += b"\x01" * n
        self._gone += bytes(n)
        self.count += n
        self._left += n
        return range(first, self.count)

    def withdraw(self, frames: Sequence[int]) -> None:
        """Free `frames` leave the lease for good (a chunk given back): never handed out,
        given or counted again. A parked page is refused: the stale page that shows it must be
        unmapped first (`unpark`). All of them or none."""
        seen: set[int] = set()
        for p in frames:
            if not 0 <= p < self.count:
                raise ValueError(f"page {p} is not a page of this lease (0..{self.count - 1})")
            if self._gone[p] or p in seen:
                raise ValueError(f"page {p} is withdrawn already")
            if self._free[p] == 0:
                raise ValueError(f"page {p} is taken")
            if self._free[p] == 2:
                raise ValueError(f"page {p} is parked: unmap the stale page that shows it first")
            seen.add(p)
        for p in frames:
            self._free[p] = 0
            self._gone[p] = 1
        self._left -= len(frames)
        self._withdrawn += len(frames)

    def taken(self, frames: Iterable[int]) -> int:
        """How many of `frames` are taken (ValueError for a page withdrawn or not of the
        lease)."""
        n = 0
        for p in frames:
            if not 0 <= p < self.count:
                raise ValueError(f"page {p} is not a page of this lease (0..{self.count - 1})")
            if self._gone[p]:
                raise ValueError(f"page {p} is withdrawn")
            n += self._free[p] == 0
        return n

    def take(self, n: int, parked: bool = True) -> list[int] | None:
        """`n` free pages, or None when fewer than `n` are free (nothing is taken then);
        `parked=False`: only pages not parked, one run."""
        if n < 0:
            raise ValueError(f"cannot take {n} pages")
        if n > self._left:
            return None
        if n == 0:
            return []
        at = self._free.find(b"\x01" * n)
        if at >= 0:
            got = list(range(at, at + n))
        elif not parked:
            return None
        else:
            free = self._free.translate(_ANY_FREE)
            at = free.find(b"\x01" * n)
            if at >= 0:
                got = list(range(at, at + n))
            else:
                runs = sorted(
                    (m.span() for m in re.finditer(b"\x01+", free)),
                    key=lambda span: span[0] - span[1],  # longest first
                )
                got = []
                for start, end in runs:
                    got.extend(range(start, min(end, start + n - len(got))))
                    if len(got) == n:
                        break
        for p in got:
            self._free[p] = 0
        self._left -= n
        return got

    def take_these(self, frames: Sequence[int]) -> bool:
        """Take exactly `frames` when every one is free (True); else take nothing (False)."""
        if not frames:
            return True
        lo, hi, n = min(frames), max(frames), len(frames)
        if lo < 0 or hi >= self.count:
            return False
        if hi - lo + 1 == n and len(set(frames)) == n:  # one run (a block's, mostly): bytewise
            if self._free.find(0, lo, hi + 1) >= 0:
                return False
            self._free[lo : hi + 1] = bytes(n)
            self._left -= n
            return True
        if not all(map(self._free.__getitem__, frames)) or len(set(frames)) != n:
            return False
        for p in frames:
            self._free[p] = 0
        self._left -= n
        return True

    def unpark(self, frame: int) -> None:
        """A parked free page is an ordinary free page again (nothing shows it any more)."""
        if self._free[frame] == 2:
            self._free[frame] = 1

    def give(self, frames: Sequence[int], parked: bool = False) -> None:
        """Return `frames` to the free pages (`parked`: handed out last); a page already free
        (or given twice), or withdrawn, is refused before anything changes."""
        value = 2 if parked else 1
        if not frames:
            return
        lo, hi, n = min(frames), max(frames), len(frames)
        if self._withdrawn and self._gone.find(1, max(lo, 0), hi + 1) >= 0:
            for p in frames:
                if 0 <= p < self.count and self._gone[p]:
                    raise ValueError(f"page {p} is withdrawn")
        run = hi - lo + 1 == n and len(set(frames)) == n  # one run: checked and set bytewise
        if run and lo >= 0 and hi < self.count and self._free.count(0, lo, hi + 1) == n:
            self._free[lo : hi + 1] = bytes((value,)) * n
            self._left += n
            return
        if (
            lo < 0
            or hi >= self.count
            or any(map(self._free.__getitem__, frames))
            or len(set(frames)) != n
        ):
            seen: set[int] = set()  # find the first page at fault, to name it
            for p in frames:
                if not 0 <= p < self.count:
                    raise ValueError(f"page {p} is not a page of this lease (0..{self.count - 1})")
                if self._free[p] or p in seen:
                    raise ValueError(f"page {p} is already free")
                seen.add(p)
        for p in frames:
            self._free[p] = value
        self._left += n


class PageSpace(Protocol):
    """A reserved virtual range of `length` bytes at `address`, in pages of `page` bytes, over
    a lease of `frames` physical pages. Offsets are bytes from `address`, multiples of `page`.
    Arguments out of bounds, or that would map over a mapped page or one physical page twice
    in one call, raise ValueError; any call but `close` on a retired space raises RuntimeError.
    A physical page may be mapped at several addresses at once (a freed block's mapping that
    work may still use, and the block that took its page next)."""

    address: int
    length: int
    page: int
    frames: int

    @property
    def mapped_pages(self) -> int:
        """How many virtual pages are mapped now."""
        ...

    def map(self, offset: int, frames: Sequence[int]) -> None:
        """Map the len(frames) virtual pages from `offset` onto those physical pages, in order,
        read/write. All of them or none: on a failure nothing stays mapped."""
        ...

    def unmap(self, offset: int, count: int) -> None:
        """Unmap the `count` pages from `offset`; they must be made of whole `map` calls. The
        addresses stay reserved, and an access to them faults."""
        ...

    def retire(self) -> None:
        """Session end: no chunk of the lease stays reachable through the range."""
        ...

    def close(self) -> None:
        """Retire, then give the range back (only when no pointer into it is left)."""
        ...


@runtime_checkable
class ElasticPages(PageSpace, Protocol):
    """A `PageSpace` whose lease grows and shrinks by whole chunks while it runs; only
    `SimPageSpace` is one (on CUDA, moving a page onto another handle would need a copy on
    the device). Chunk slot k holds frames k*per_chunk .. (k+1)*per_chunk-1; a slot is never
    reused."""

    per_chunk: int

    @property
    def slots(self) -> list[int]:
        """The chunk slots of the lease now, ascending (those given back are not)."""
        ...

    def add_chunk(self, fd: int) -> int:
        """Add a chunk (the space keeps a duplicate of `fd`; the caller closes its own):
        its slot, and `frames` grows by `per_chunk`."""
        ...

    def drop_chunk(self, slot: int) -> None:
        """Give chunk `slot` back for good: ValueError naming a page that still maps one of
        its frames; once dropped, `map` and `remap` refuse its frames."""
        ...

    def remap(self, offset: int, frame: int) -> None:
        """The page at `offset` (mapped by one `map` call of that page alone) shows physical
        page `frame` instead, with the bytes it shows now (copied into `frame` first)."""
        ...


class _Run(NamedTuple):
    """`pages` pages mapped with one call: virtual page `page` onwards shows pages `first`
    onwards of chunk `chunk`."""

    page: int
    chunk: int
    first: int
    pages: int


def _runs(page: int, frames: Sequence[int], per_chunk: int) -> list[_Run]:
    """The runs that map `frames` from virtual page `page`: frames consecutive in one chunk."""
    out: list[_Run] = []
    i = 0
    while i < len(frames):
        j = i + 1
        while j < len(frames) and frames[j] == frames[j - 1] + 1 and frames[j] % per_chunk:
            j += 1
        out.append(_Run(page + i, frames[i] // per_chunk, frames[i] % per_chunk, j - i))
        i = j
    return out


def _check_geometry(chunks: int, chunk_bytes: int, page: int, length: int) -> None:
    if chunks <= 0 or chunk_bytes <= 0:
        raise ValueError(f"a lease of {chunks} chunks of {chunk_bytes} bytes maps nothing")
    if page <= 0 or chunk_bytes % page:
        raise ValueError(f"page of {page} bytes does not divide the chunk of {chunk_bytes} bytes")
    if length <= 0 or length % page:
        raise ValueError(f"range of {length} bytes is not a positive number of {page}-byte pages")


class _PageTable(PageSpace):
    """What is mapped at each virtual page, the checks of `PageSpace`, and the rollback; the
    subclasses only map and unmap runs."""

    def __init__(self, address: int, length: int, page: int, chunks: int, chunk_bytes: int) -> None:
        self.address = address
        self.length = length
        self.page = page
        self.per_chunk = chunk_bytes // page
        self.frames = chunks * self.per_chunk
        self.retired = False
        self._closed = False
        self._frame = [-1] * (length // page)  # the physical page at each virtual page, or -1
        self._calls: dict[int, int] = {}  # first virtual page of each map call -> its pages
        self._mapped = 0
        self._slot_pages = [0] * chunks  # virtual pages mapped on each chunk's frames
        self._dropped: set[int] = set()  # chunks given back: their frames are never mapped

    @property
    def mapped_pages(self) -> int:
        return self._mapped

    # -- what a backend does -------------------------------------------------------------------
    @abstractmethod
    def _map_run(self, run: _Run) -> None:
        """Map one run with one call (mmap, or cuMemMap)."""

    def _grant(self, page: int, count: int) -> None:
        """After the runs of one map call: give the device access (CUDA); nothing on sim."""

    @abstractmethod
    def _unmap_run(self, run: _Run) -> None:
        """Undo `_map_run(run)`: the pages stay reserved and fault."""

    @abstractmethod
    def _retire(self) -> None:
        """Leave no chunk reachable through the range."""

    @abstractmethod
    def _release(self) -> None:
        """Give the reserved range back."""

    # -- the interface -------------------------------------------------------------------------
    def _pages(self, offset: int, count: int) -> int:
        """The first virtual page of [offset, offset + count pages), checked."""
        if self.retired:
            raise RuntimeError("the page space is retired")
        if offset % self.page:
            raise ValueError(f"offset {offset} is not a multiple of the page ({self.page} bytes)")
        if count <= 0:
            raise ValueError(f"{count} pages at offset {offset}: nothing to do")
        end = offset + count * self.page
        if offset < 0 or end > self.length:
            raise ValueError(f"bytes [{offset}, {end}) are outside the range of {self.length}")
        return offset // self.page

    def map(self, offset: int, frames: Sequence[int]) -> None:
        first = self._pages(offset, len(frames))
        seen: set[int] = set()
        for k, p in enumerate(frames):
            v = first + k
            if self._frame[v] >= 0:
                raise ValueError(f"page {v} (offset {v * self.page}) is already mapped")
            if not 0 <= p < self.frames:
                raise ValueError(f"frame {p} is outside the lease of {self.frames} pages")
            if self._dropped and p // self.per_chunk in self._dropped:
                raise ValueError(f"frame {p} is of chunk {p // self.per_chunk}, given back")
            if p in seen:
                raise ValueError(f"frame {p} appears twice")
            seen.add(p)
        done: list[_Run] = []
        try:
            for run in _runs(first, frames, self.per_chunk):
                self._map_run(run)
                done.append(run)
            self._grant(first, len(frames))
        except BaseException:
            for run in reversed(done):
                self._unmap_run(run)
            raise
        for run in done:
            self._slot_pages[run.chunk] += run.pages
        for k, p in enumerate(frames):
            self._frame[first + k] = p
        self._calls[first] = len(frames)
        self._mapped += len(frames)

    def unmap(self, offset: int, count: int) -> None:
        first = self._pages(offset, count)
        end = first + count
        calls: list[tuple[int, int]] = []
        v = first
        while v < end:
            n = self._calls.get(v)
            if n is None:
                if self._frame[v] < 0:
                    raise ValueError(f"page {v} (offset {v * self.page}) is not mapped")
                start = max(s for s in self._calls if s < v)
                raise ValueError(f"page {v} is inside the map call of page {start}: unmap it all")
            if v + n > end:
                raise ValueError(f"pages [{first}, {end}) would split the map call [{v}, {v + n})")
            calls.append((v, n))
            v += n
        for v, n in calls:
            self._unmap_call(v, n)

    def _unmap_call(self, v: int, n: int) -> None:
        frames = self._frame[v : v + n]
        for run in _runs(v, frames, self.per_chunk):
            self._unmap_run(run)
            self._slot_pages[run.chunk] -= run.pages
        for k in range(len(frames)):
            self._frame[v + k] = -1
        del self._calls[v]
        self._mapped -= n

    def _mapped_calls(self) -> Iterator[tuple[int, int]]:
        """(first page, pages) of each map call still mapped, in address order."""
        yield from sorted(self._calls.items())

    def retire(self) -> None:
        if self.retired:
            return
        self._retire()
        self.retired = True
        self._frame = [-1] * len(self._frame)
        self._calls.clear()
        self._mapped = 0
        self._slot_pages = [0] * len(self._slot_pages)

    def close(self) -> None:
        if self._closed:
            return
        self.retire()
        self._release()
        self._closed = True


def _too_many_maps(error: OSError, page: int) -> OSError:
    """`error`, said plainly when it is the system's limit on mappings: every page mapped apart
    from its neighbours is one mapping of this process (and the range between two, another)."""
    if error.errno != errno.ENOMEM:
        return error
    try:
        limit = Path("/proc/sys/vm/max_map_count").read_text().strip()
    except OSError:
        limit = "unknown"
    return OSError(
        errno.ENOMEM,
        f"{error.strerror}: this process has as many mappings as the system allows"
        f" (vm.max_map_count {limit}); pages of {page} bytes are too small for this lease:"
        " use larger pages, or raise vm.max_map_count",
    )


class SimPageSpace(_PageTable, ElasticPages):
    """`PageSpace` over memfd chunks: a PROT_NONE reservation aligned to `page`, and pages of the
    chunk fds mapped shared into it with MAP_FIXED. `chunk_fds` stay the caller's (it keeps
    duplicates). `page` is a multiple of the OS page and divides `chunk_bytes`.

    It is `ElasticPages`: a chunk added takes the next slot, a chunk dropped closes its
    duplicate (its slot stays empty), and `remap` copies a page's bytes with pread/pwrite on
    the fds, then maps the new frame over the old one with one mmap(MAP_FIXED).

    An unmapped page is PROT_NONE again, so a stale access faults (SIGSEGV) rather than reading
    old bytes. `retire()` puts private zero pages over the whole range and closes the fds, as
    `tidalcore.chunks.ChunkMapping.retire` does: stale pointers read zeros and reach no chunk.
    """

    def __init__(self, chunk_fds: Sequence[int], chunk_bytes: int, page: int, length: int) -> None:
        _check_geometry(len(chunk_fds), chunk_bytes, page, length)
        if page % OS_PAGE:
            raise ValueError(f"page of {page} bytes is not a multiple of the OS page ({OS_PAGE})")
        for k, fd in enumerate(chunk_fds):
            size = os.fstat(fd).st_size
            if size < chunk_bytes:
                raise ValueError(f"chunk {k} holds {size} bytes, fewer than {chunk_bytes}")
        self._fds: list[int] = []
        try:
            self._fds.extend(os.dup(fd) for fd in chunk_fds)
            address = reserve(length, page)
        except OSError:
            self._close_fds()
            raise
        super().__init__(address, length, page, len(chunk_fds), chunk_bytes)
        self._chunk_bytes = chunk_bytes

    @property
    def slots(self) -> list[int]:
        return [k for k, fd in enumerate(self._fds) if fd >= 0]

    def add_chunk(self, fd: int) -> int:
        if self.retired:
            raise RuntimeError("the page space is retired")
        size = os.fstat(fd).st_size
        slot = len(self._fds)
        if size < self._chunk_bytes:
            raise ValueError(f"chunk {slot} holds {size} bytes, fewer than {self._chunk_bytes}")
        self._fds.append(os.dup(fd))
        self._slot_pages.append(0)
        self.frames += self.per_chunk
        return slot

    def drop_chunk(self, slot: int) -> None:
        if self.retired:
            raise RuntimeError("the page space is retired")
        if not 0 <= slot < len(self._fds) or self._fds[slot] < 0:
            raise ValueError(f"chunk {slot} is not a chunk of this lease (slots {self.slots})")
        if self._slot_pages[slot]:
            lo, hi = slot * self.per_chunk, (slot + 1) * self.per_chunk
            v = next(v for v, f in enumerate(self._frame) if lo <= f < hi)
            raise ValueError(
                f"page {v} (offset {v * self.page}) maps frame {self._frame[v]} of chunk {slot}:"
                " unmap or remap it first"
            )
        fd, self._fds[slot] = self._fds[slot], -1
        self._dropped.add(slot)
        os.close(fd)

    def remap(self, offset: int, frame: int) -> None:
        v = self._pages(offset, 1)
        old = self._frame[v]
        if old < 0:
            raise ValueError(f"page {v} (offset {offset}) is not mapped")
        if self._calls.get(v) != 1:
            raise ValueError(f"page {v} is not mapped by a map call of its own: cannot remap it")
        if not 0 <= frame < self.frames:
            raise ValueError(f"frame {frame} is outside the lease of {self.frames} pages")
        chunk, first = divmod(frame, self.per_chunk)
        if chunk in self._dropped:
            raise ValueError(f"frame {frame} is of chunk {chunk}, given back")
        if frame == old:
            return
        src, at = self._fds[old // self.per_chunk], (old % self.per_chunk) * self.page
        dst, to = self._fds[chunk], first * self.page
        done = 0
        while done < self.page:  # the bytes the page shows: its frame's, in the page cache
            data = os.pread(src, self.page - done, at + done)
            if not data:
                raise OSError(errno.EIO, f"frame {old} ends before its page is read")
            written = 0
            while written < len(data):
                written += os.pwrite(dst, data[written:], to + done + written)
            done += len(data)
        self._map_run(_Run(v, chunk, first, 1))  # MAP_FIXED: over the old frame at once
        self._slot_pages[old // self.per_chunk] -= 1
        self._slot_pages[chunk] += 1
        self._frame[v] = frame

    def buffer(self, offset: int, nbytes: int) -> memoryview:
        """The bytes [offset, offset+nbytes) of the range (their pages must be mapped to be
        read: an unmapped page faults)."""
        if offset < 0 or nbytes < 0 or offset + nbytes > self.length:
            raise ValueError(f"range {offset}+{nbytes} is outside the range of {self.length} bytes")
        return memoryview((ctypes.c_ubyte * nbytes).from_address(self.address + offset)).cast("B")

    def _map_run(self, run: _Run) -> None:
        at, size = self.address + run.page * self.page, run.pages * self.page
        what = f"map {run.pages} pages of chunk {run.chunk} at page {run.page}"
        try:
            map_shared(at, size, self._fds[run.chunk], run.first * self.page, what)
        except OSError as e:
            raise _too_many_maps(e, self.page) from e

    def _unmap_run(self, run: _Run) -> None:
        at, size = self.address + run.page * self.page, run.pages * self.page
        try:
            map_none(at, size, f"unmap {run.pages} pages at page {run.page}")
        except OSError as e:
            raise _too_many_maps(e, self.page) from e

    def _retire(self) -> None:
        map_zero(self.address, self.length, "retire the page space")
        self._close_fds()

    def _close_fds(self) -> None:
        while self._fds:
            fd = self._fds.pop()
            if fd >= 0:
                os.close(fd)

    def _release(self) -> None:
        unmap(self.address, self.length)


class CudaPageSpace(_PageTable):
    """`PageSpace` over CUDA VMM handles (one per chunk, imported by the caller): a
    cuMemAddressReserve range aligned to `page`, cuMemMap of each page's whole chunk, then
    cuMemSetAccess over the pages of the call. A page here is a whole chunk (`page ==
    chunk_bytes`, a multiple of the allocation granularity, 2 MiB): cuMemMap maps a handle
    only from its first byte (its `offset` "must be zero"; the driver 580.159.04 of an H200
    answered CUDA_ERROR_NOT_SUPPORTED to any other), so a part of a chunk cannot be mapped on
    its own. A daemon with 2 MiB chunks gives 2 MiB pages.

    The handles stay the caller's: keep them until `retire()` (mapping needs them), release
    them after. `retire()` unmaps every page; unlike sim, nothing is mapped over the range
    afterwards (a scratch page under every page of a range of hundreds of GiB would cost one
    cuMemMap per page), so a stale device pointer faults like any unmapped page.
    """

    def __init__(
        self, driver: Driver, handles: Sequence[MemHandle], chunk_bytes: int, page: int, length: int
    ) -> None:
        _check_geometry(len(handles), chunk_bytes, page, length)
        if page != chunk_bytes:
            raise ValueError(
                f"pages of {page} bytes on cuda: a page must be a whole chunk of {chunk_bytes}"
                " bytes, because cuMemMap maps a VMM handle only from its first byte"
            )
        address = int(driver.address_reserve(length, page))
        super().__init__(address, length, page, len(handles), chunk_bytes)
        self._driver = driver
        self._handles = list(handles)

    def _map_run(self, run: _Run) -> None:
        ptr = DevicePtr(self.address + run.page * self.page)
        self._driver.mem_map(ptr, self.page, self._handles[run.chunk])  # one page: a chunk

    def _grant(self, page: int, count: int) -> None:
        self._driver.set_access(DevicePtr(self.address + page * self.page), count * self.page)

    def _unmap_run(self, run: _Run) -> None:
        ptr = DevicePtr(self.address + run.page * self.page)
        self._driver.mem_unmap(ptr, run.pages * self.page)

    def _retire(self) -> None:
        for v, n in list(self._mapped_calls()):
            self._unmap_call(v, n)

    def _release(self) -> None:
        self._driver.address_free(DevicePtr(self.address), self.length)
