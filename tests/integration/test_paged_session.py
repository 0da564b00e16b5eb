"""Paged sessions against a real daemon: a client SIGKILLed while its swaps are in flight gives
every page of its lease and every host byte back, and the daemon refuses a page it cannot cut
its chunks into, naming it."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import tidalpool
from tidalclient.errors import AttachError
from tidalclient.status import fetch

from ..conftest import StartDaemon
from .test_fuzz import Target, wait_for

MiB = 1 << 20

# Three 4 MiB blocks under a 5 MiB limit, copies throttled to 0.05 GB/s (80 ms a block): every
# op brings one block in and sends another out, so copies are nearly always in flight.
CLIENT = textwrap.dedent(
    """
    import sys
    import tidalpool

    session = tidalpool.attach(
        sys.argv[1], device_limit="16MiB", host_limit="16MiB", swap_limit="5MiB",
        copy_gbps=0.05, page_bytes="64KiB",
    )
    blocks = [session.tensor((1024, 1024), "float32") for _ in range(3)]
    print(session.id, flush=True)
    n = 0
    while True:
        with session.op(writes=[blocks[n % 3]], name="touch") as (b,):
            b[0] = n
        if n == 6:
            print("swapping", session.stats().swap.swap_outs, flush=True)
        n += 1
    """
)


def test_a_paged_client_killed_mid_swap_returns_its_pages_and_host_bytes(
    start_daemon: StartDaemon, tmp_path: Path
) -> None:
    daemon = start_daemon()
    target = Target(daemon.socket_dir)
    script = tmp_path / "client.py"
    script.write_text(CLIENT)
    child = subprocess.Popen(
        [sys.executable, str(script), str(daemon.socket_dir)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        session_id = child.stdout.readline().strip()
        swapping = child.stdout.readline().split()
        assert swapping[0] == "swapping" and int(swapping[1]) > 0, swapping
        status = target.pool_status()
        assert status.device.leased_bytes == status.host.leased_bytes == 16 * MiB
        child.kill()  # copies in flight, pages mapped, host bytes held
        child.wait(timeout=30)
        wait_for(lambda: session_id not in target.sessions(), "the killed session to end")

        def returned() -> bool:
            status = target.pool_status()
            return status.device.leased_bytes == status.host.leased_bytes == 0

        wait_for(returned, "its leases to return")
        # and the pages are whole again for the next session: it maps and uses all of them
        with tidalpool.attach(
            daemon.socket_dir,
            device_limit="16MiB",
            host_limit="16MiB",
            swap_limit="16MiB",
            page_bytes="64KiB",
        ) as s:
            a = s.tensor((4 * 1024 * 1024,), "float32")  # the whole lease
            with s.op(writes=[a]) as (a_,):
                a_[:] = 7.0
            with s.op(reads=[a]) as (a_,):
                assert float(a_.sum()) == 7.0 * a_.size
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        if child.stdout is not None:
            child.stdout.close()
        target.close()


@pytest.mark.parametrize(
    ("page", "error", "why"),
    [
        ("3000", ValueError, "a power of two"),
        ("4MiB", AttachError, "do not divide the daemon's chunks"),
    ],
)
def test_a_page_the_lease_cannot_be_cut_into_is_refused(
    start_daemon: StartDaemon, page: str, error: type[Exception], why: str
) -> None:
    daemon = start_daemon()
    with pytest.raises(error, match=why):
        tidalpool.attach(
            daemon.socket_dir, device_limit="16MiB", swap_limit="8MiB", page_bytes=page
        )
    # A lease refused after it was granted went back at once, not at attach_timeout_s.
    assert not fetch(daemon.socket_dir)[1].sessions


def test_a_swap_limit_over_the_lease_plans_for_the_lease(start_daemon: StartDaemon) -> None:
    """Mapped pages cannot exceed the lease, so a paged session's limit is the lesser of the
    two, on both sides: the daemon plans for what the client keeps to, and the plan runs."""
    from .test_planning import run_until_planned

    daemon = start_daemon()
    with tidalpool.attach(
        daemon.socket_dir,
        device_limit="8MiB",
        host_limit="8MiB",
        swap_limit="64MiB",
        page_bytes="64KiB",
    ) as s:
        run_until_planned(s)
        stats = s.stats()
        assert stats.swap.limit == 8 * MiB
        assert stats.swap.peak_resident_bytes <= 8 * MiB
