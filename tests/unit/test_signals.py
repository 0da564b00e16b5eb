"""tidalcore.signals.Flag: set from a signal handler, it wakes the main thread's wait."""

from __future__ import annotations

import os
import signal
import threading
import time

from tidalcore.signals import Flag


def test_a_flag_set_by_a_signal_handler_wakes_its_waiter() -> None:
    flag = Flag()
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: flag.set())
    try:
        assert not flag.wait(0) and not flag.is_set()
        os.kill(os.getpid(), signal.SIGUSR1)
        assert flag.wait(30) and flag.is_set()
        assert flag.wait()  # set: at once, however long it may wait
    finally:
        signal.signal(signal.SIGUSR1, previous)
        flag.close()


def test_a_signal_taken_by_another_thread_wakes_the_waiter() -> None:
    """The kernel may give a process's signal to any of its threads; the main thread's wait
    must not sleep on until its timeout then."""
    flag = Flag()
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: flag.set())
    wakeup = flag.wake_on_signals()
    done = threading.Event()
    other = threading.Thread(target=done.wait)
    other.start()
    try:
        assert other.ident is not None
        signal.pthread_kill(other.ident, signal.SIGUSR1)
        started = time.monotonic()
        assert flag.wait(20)
        assert time.monotonic() - started < 19  # woken, not timed out
    finally:
        done.set()
        other.join()
        signal.set_wakeup_fd(wakeup)
        signal.signal(signal.SIGUSR1, previous)
        flag.close()
