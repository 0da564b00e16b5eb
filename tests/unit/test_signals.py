"""tidalcore.signals.Flag: set from a signal handler, it wakes the main thread's wait."""

from __future__ import annotations

import os
import signal

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
