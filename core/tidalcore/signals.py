"""A flag a signal handler sets and the main thread waits for.

A Python signal handler runs between two bytecodes of the main thread, whatever lock that
thread holds then: a `threading.Event` set from it deadlocks when the handler runs inside the
same Event's `wait` (which holds the Event's lock for a few bytecodes). `Flag` takes no lock:
`set` writes a byte to a pipe, `wait` selects on it. The kernel may deliver a signal to any
thread (gRPC's, say), and then the main thread's `select` is not interrupted and the handler
does not run until something wakes it: `wake_on_signals` makes the pipe the process's wakeup fd
(`signal.set_wakeup_fd`), which the interpreter writes to whichever thread took the signal;
`wait` drains what it wakes to and waits again until the handler has set the flag.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import time


class Flag:
    """Set once from a signal handler (or anywhere), waited for on the main thread."""

    def __init__(self) -> None:
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)
        os.set_blocking(self._w, False)
        self._set = False

    def wake_on_signals(self) -> int:
        """Wake `wait` on every signal the process gets, on whatever thread (main thread
        only; one fd per process); the wakeup fd it replaces (-1: none), to restore."""
        return signal.set_wakeup_fd(self._w, warn_on_full_buffer=False)

    def set(self) -> None:
        self._set = True
        with contextlib.suppress(OSError):  # full: a byte is there already
            os.write(self._w, b"\0")

    def is_set(self) -> bool:
        return self._set

    def wait(self, timeout: float | None = None) -> bool:
        """Until set, or `timeout` seconds (None: until set); whether it is set."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._set:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                break
            if select.select([self._r], [], [], left)[0]:
                with contextlib.suppress(OSError):  # a wake-up: the handler sets the flag
                    os.read(self._r, 512)
        return self._set

    def close(self) -> None:
        os.close(self._r)
        os.close(self._w)
