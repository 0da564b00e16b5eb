"""The sim backend: device and host pools are memfd segments, no GPU needed.

The memfd is sized with ftruncate and left sparse: pages are only backed when
a client touches them, so a 4 GiB "device" costs nothing until used. Clients
map their lease's range from the fd passed over the handles socket, exactly as
a CUDA VMM client maps chunks from exported fds.
"""

from __future__ import annotations

import ctypes
import os

from tidalpoold.backends.base import Segment


def _memfd(name: str, size: int) -> Segment:
    fd = os.memfd_create(f"tidalpool-{name}", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, size)
    except OSError:
        os.close(fd)
        raise
    return Segment(name, fd, size)


class SimBackend:
    name = "sim"

    def __init__(self, device_bytes: int, host_bytes: int) -> None:
        self.device = _memfd("device", device_bytes)
        try:
            self.host = _memfd("host", host_bytes)
        except OSError:
            os.close(self.device.fd)
            raise

    def scrub(self, segment: Segment, offset: int, length: int) -> None:
        """Give the range's pages back to the kernel: the memory is really free again,
        and the next session to lease it reads zeros, never another session's data."""
        _punch_hole(segment.fd, offset, length)

    def close(self) -> None:
        os.close(self.device.fd)
        os.close(self.host.fd)


_LIBC = ctypes.CDLL(None, use_errno=True)
_FALLOC_FL_KEEP_SIZE = 0x01
_FALLOC_FL_PUNCH_HOLE = 0x02


def _punch_hole(fd: int, offset: int, length: int) -> None:
    mode = _FALLOC_FL_KEEP_SIZE | _FALLOC_FL_PUNCH_HOLE
    rc = _LIBC.fallocate(
        ctypes.c_int(fd), ctypes.c_int(mode), ctypes.c_long(offset), ctypes.c_long(length)
    )
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"fallocate(PUNCH_HOLE) failed: {os.strerror(err)}")
