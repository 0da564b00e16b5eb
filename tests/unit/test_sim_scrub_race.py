"""The sim backend's facts are read while sessions' chunks are scrubbed (an elastic session gives
chunks back while others attach): reading them never touches a descriptor a scrub closed."""

from __future__ import annotations

import threading

from tidalpoold.backends import SimBackend

C = 2 * 1024 * 1024
READS = 300


def test_facts_read_while_chunks_are_scrubbed_never_fail() -> None:
    backend = SimBackend(8 * C, 2 * C, C, probe_bytes=0)
    errors: list[BaseException] = []
    scrubbing, stop = threading.Event(), threading.Event()
    scrubs = 0

    def scrub() -> None:
        nonlocal scrubs
        try:
            while not stop.is_set():
                backend.scrub(backend.device, backend.device.chunks[scrubs % 8])
                scrubs += 1
                scrubbing.set()
        except BaseException as e:
            errors.append(e)
        finally:
            scrubbing.set()

    scrubber = threading.Thread(target=scrub)
    scrubber.start()
    try:
        scrubbing.wait()  # reads start once scrubs have: the two run together from here
        for _ in range(READS):
            assert backend.facts()["total_bytes"] == 8 * C
    finally:
        stop.set()
        scrubber.join()
        backend.close()
    assert errors == [] and scrubs > 0
