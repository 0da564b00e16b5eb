"""Pages under virtual residency: which blocks own whole pages, shared by the planner that
lays a session's range out and the client that places blocks in it, so both count the same
mapped pages."""

from __future__ import annotations

from tidalcore.units import Bytes, align_up

PAGE = Bytes(2 << 20)
"""The default page: CUDA's VMM allocation granularity on current GPUs (the sim backend's too)."""

MAX_WASTE = 0.125
"""The most a page-owning block's rounding to whole pages may add, over its size, as a session
places blocks before it has a plan. Its persistent blocks stay where it put them, so this
decides which can ever leave the device: 12.5% lets a 9 MiB weight own 5 pages of 2 MiB (the
GPT-2 weights and Adam states whose leaving lets a plan fit at 0.9 of its peak)."""


def pages_of(size: int, page: int) -> int:
    """The bytes of the whole pages a block of `size` bytes maps when it owns its pages."""
    return align_up(size, page)


def owns_pages(size: int, page: int, max_waste: float = MAX_WASTE) -> bool:
    """A block of `size` bytes gets whole pages of its own: it is a page or more, and rounding
    it up to whole pages wastes at most `max_waste` of it (rounding a 2.1 MiB block up to 4 MiB
    would cost nearly twice its bytes: such a block shares pages instead)."""
    return size >= page and pages_of(size, page) - size <= max_waste * size
