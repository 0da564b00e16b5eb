"""Reclaim after SIGKILL and isolation between sessions, the same on every backend."""

from __future__ import annotations

import contextlib
import os
import signal
import time

import pytest
import tidalpool
from tidalclient import status
from tidalclient.handles import request_lease
from tidalclient.local import LocalDaemon

from ..integration.test_faults import ask, spawn_worker
from .conftest import CHUNK, block_bytes, mapped_files, physical_device_probe

MiB = 1 << 20


def test_sigkill_returns_the_chunks_within_2s_and_spares_the_other_client(
    backend: str, pool_daemon: LocalDaemon
) -> None:
    daemon = pool_daemon
    probe = physical_device_probe(backend)
    survivor, _ = spawn_worker(daemon, seed=2)
    survivor_bytes = probe(daemon) if probe else 0
    victim, victim_id = spawn_worker(daemon, seed=1)
    try:
        assert ask(victim, "churn") == "churned"
        if probe:  # the victim's arrays (366,536 bytes) are pages behind its chunks now
            assert probe(daemon) >= survivor_bytes + 366_536
        assert status.fetch(daemon.socket_dir)[0].device.leased_bytes == 2 * 16 * MiB
        victim.send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        victim.wait()
        while time.monotonic() - killed_at < 2.0:
            pool, sessions = status.fetch(daemon.socket_dir)
            if pool.device.leased_bytes == 16 * MiB:
                break
            time.sleep(0.01)
        reclaimed_after = time.monotonic() - killed_at
        assert pool.device.leased_bytes == 16 * MiB, f"lease not back after {reclaimed_after:.2f} s"
        assert pool.host.leased_bytes == 64 * MiB
        assert [s.job_name for s in sessions.sessions] == ["worker-2"]
        if probe:  # the chunks were really freed, not only accounted free
            assert probe(daemon) == survivor_bytes
        assert ask(survivor, "check") == "ok"
        assert ask(survivor, "churn") == "churned"
        assert ask(survivor, "check") == "ok"
        assert "session stream" in daemon.log_path.read_text().split(victim_id)[-1]
    finally:
        for proc in (victim, survivor):
            proc.communicate("quit\n" if proc.poll() is None else None, timeout=10)
    assert survivor.returncode == 0
    assert status.fetch(daemon.socket_dir)[0].device.leased_bytes == 0
    if probe is None:
        pytest.skip(f"chunks are back; no probe of physical {backend} memory in this suite yet")


def open_files() -> list[str]:
    links = []
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(FileNotFoundError):  # the listing's own fd
            links.append(os.readlink(f"/proc/self/fd/{name}"))
    return links


def file_of(fd: int) -> tuple[int, int]:
    st = os.fstat(fd)
    return st.st_dev, st.st_ino


def test_a_session_holds_and_sees_only_its_own_chunks(
    backend: str, pool_daemon: LocalDaemon
) -> None:
    d = pool_daemon
    a = tidalpool.attach(d.socket_dir, device_limit="6MiB", host_limit="2MiB", job_name="a")
    mine = a.malloc(a.device.length)
    block_bytes(a, mine)[:] = b"\xa5" * a.device.length
    a_files = {f[:2] for f in mapped_files(a.device.address, a.device.length)}
    a_files |= {f[:2] for f in mapped_files(a.host.address, a.host.length)}
    try:
        # What another client receives on the handles socket: the fds of its own chunks, no
        # other. Without an fd of A's chunks, the kernel gives it no way to map them.
        grant = request_lease(d.socket_dir / "handles.sock", 4 * MiB, 4 * MiB, "b")
        try:
            lease = grant.response.lease
            device_fds = 0 if lease.mode == "ipc" else len(lease.device.chunks)
            assert (len(grant.device_fds), len(grant.host_fds)) == (device_fds, 2)
            # One file per chunk. The fds of exported CUDA allocations (vmm) are all one
            # anonymous inode to fstat: only memfd chunks can be told apart this way.
            files = grant.host_fds if lease.mode == "vmm" else (*grant.device_fds, *grant.host_fds)
            got = [file_of(fd) for fd in files]
            assert len(set(got)) == len(got)
            assert a_files.isdisjoint(got)
            a_lease = status.fetch(d.socket_dir)[1].sessions[0].lease
            assert set(a_lease.device.chunks).isdisjoint(lease.device.chunks)
            assert set(a_lease.host.chunks).isdisjoint(lease.host.chunks)
            if lease.mode == "memfd":
                assert len(a_files) == 3 + 1  # each of A's chunks is its own file
                names = [os.readlink(f"/proc/self/fd/{fd}") for fd in grant.device_fds]
                assert names == [f"/memfd:tidalpool-device-{i} (deleted)" for i in (3, 4)]
        finally:
            grant.close()
        # A client never keeps a chunk's fd once it is mapped.
        assert not [link for link in open_files() if "tidalpool-" in link]
        # Through the API: B reads zeros only, and its writes never reach A.
        with tidalpool.attach(d.socket_dir, device_limit="8MiB", job_name="b") as b:
            theirs = b.malloc(b.device.length)
            assert bytes(block_bytes(b, theirs)) == bytes(8 * MiB)
            block_bytes(b, theirs)[:] = b"\x5a" * (8 * MiB)
            assert bytes(block_bytes(a, mine)) == b"\xa5" * a.device.length
            b_files = {f[:2] for f in mapped_files(b.device.address, b.device.length)}
            assert a_files.isdisjoint(b_files)
            if backend == "sim":
                assert len(b_files) == 8 * MiB // CHUNK
        assert bytes(block_bytes(a, mine)) == b"\xa5" * a.device.length
    finally:
        a.close()
