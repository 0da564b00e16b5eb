"""A flag a signal handler sets and the main thread waits for.

A Python signal handler runs between two bytecodes of the main thread, whatever lock that
thread holds then: a `threading.Event` set from it deadlocks when the handler runs inside the
same Event's `wait` (which holds the Event's lock for a few bytecodes). `Flag` takes no lock:
`set` writes a byte to a pipe, `wait` selects on it (retried over EINTR, PEP 475).
"""

from __future__ import annotations

import contextlib
import os
import select


class Flag:
    """Set once from a signal handler (or anywhere), waited for on the main thread."""

    def __init__(self) -> None:
        self._r, self._w = os.pipe()
        os.set_blocking(self._w, False)
        self._set = False

    def set(self) -> None:
        self._set = True
        with contextlib.suppress(OSError):  # full: a byte is there already
            os.write(self._w, b"\0")

    def is_set(self) -> bool:
        return self._set

    def wait(self, timeout: float | None = None) -> bool:
        """Until set, or `timeout` seconds (None: until set); whether it is set."""
        if not self._set:
            select.select([self._r], [], [], timeout)
        return self._set

    def close(self) -> None:
        os.close(self._r)
        os.close(self._w)
