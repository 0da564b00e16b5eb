"""The sim backend's facts are read while sessions' chunks are scrubbed (an elastic session gives
chunks back while others attach): reading them never touches a descriptor a scrub closed."""

from __future__ import annotations

import threading

from tidalpoold.backends import SimBackend

C = 2 * 1024 * 1024


def test_facts_read_while_chunks_are_scrubbed_never_fail() -> None:
    backend = SimBackend(8 * C, 2 * C, C, probe_bytes=0)
    errors: list[BaseException] = []
    done = threading.Event()

    def scrub() -> None:
        try:
            for k in range(400):
                backend.scrub(backend.device, backend.device.chunks[k % 8])
        except BaseException as e:
            errors.append(e)
        finally:
            done.set()

    scrubber = threading.Thread(target=scrub)
    scrubber.start()
    reads = 0
    try:
        while not done.is_set():
            assert backend.facts()["total_bytes"] == 8 * C
            reads += 1
    finally:
        scrubber.join()
        backend.close()
    assert errors == [] and reads > 0
