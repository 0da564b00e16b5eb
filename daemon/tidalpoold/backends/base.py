"""The daemon's half of a backend: it makes the two pools and exports them as fds."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class Segment:
    """A pool's memory as a file a client can map: `fd` of `size` bytes."""

    name: str
    fd: int
    size: int


class Backend(Protocol):
    name: str
    device: Segment
    host: Segment

    def scrub(self, segment: Segment, offset: int, length: int) -> None:
        """Free the physical memory behind a returned lease; it reads as zeros after."""
        ...

    def close(self) -> None:
        """Release the pools (after every session has ended)."""
        ...
