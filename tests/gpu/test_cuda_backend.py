"""The cuda backend on a real GPU: pools, export and import of chunks across processes,
isolation between two sessions, scrub, NVML facts and the bandwidth probe."""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest
from tidalcore.cuda_driver import CudaDriver, DevicePtr
from tidalpoold.backends.base import Pool
from tidalpoold.backends.cuda import CudaBackend, CudaBackendError

DEVICE_CHUNKS = 8
HOST_CHUNKS = 4


@pytest.fixture(scope="module")
def granularity() -> int:
    driver = CudaDriver()
    driver.open_device(0)
    try:
        return driver.granularity(exportable=True)
    finally:
        driver.close_device()


@pytest.fixture
def backend(granularity: int) -> Iterator[CudaBackend]:
    b = CudaBackend(DEVICE_CHUNKS * granularity, HOST_CHUNKS * granularity, granularity)
    yield b
    b.close()


def device_bytes(backend: CudaBackend, index: int, nbytes: int) -> bytes:
    """What the daemon's own mapping of device chunk `index` holds."""
    out = ctypes.create_string_buffer(nbytes)
    ptr = DevicePtr(backend._device_base + index * backend.chunk_bytes)
    backend._driver.memcpy_dtoh(ctypes.addressof(out), ptr, nbytes)
    return out.raw


def write_device(backend: CudaBackend, index: int, data: bytes) -> None:
    src = ctypes.create_string_buffer(data, len(data))
    ptr = DevicePtr(backend._device_base + index * backend.chunk_bytes)
    backend._driver.memcpy_htod(ptr, ctypes.addressof(src), len(data))


# A client process: maps the device chunks whose fds it inherits, does what it is told, and
# prints one JSON line. Spawned fresh (CUDA does not survive fork).
CHILD = r"""
import json, os, sys
from tidalclient.devices.cuda import CudaDeviceMapping
from tidalcore.cuda_driver import CudaDriver

args = json.loads(sys.argv[1])
driver = CudaDriver()
driver.open_device(0)
m = CudaDeviceMapping(driver, args["fds"], args["chunk"], args["granularity"])
for fd in args["fds"]:
    os.close(fd)
out = {"length": m.length}
if "write" in args:
    for offset, text in args["write"]:
        m.write(offset, text.encode())
if "read" in args:
    out["read"] = [m.read(o, n).decode("latin-1") for o, n in args["read"]]
if args.get("whole"):
    out["whole_has"] = args["whole"].encode() in m.read(0, m.length)
if "fill" in args:
    m.write(0, bytes([args["fill"]]) * m.length)
m.retire()
m.close()
driver.close_device()
print(json.dumps(out))
"""


def run_client(fds: list[int], **args: object) -> dict[str, object]:
    payload = json.dumps({"fds": fds, **args})
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    done = subprocess.run(
        [sys.executable, "-c", CHILD, payload],
        pass_fds=fds,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def fds_of(pool: Pool, indices: list[int]) -> list[int]:
    return [pool.chunks[i].fd for i in indices]  # pass_fds hands exactly these to the child


def test_starts_in_vmm_mode_with_a_zeroed_pool(backend: CudaBackend) -> None:
    assert backend.mode == "vmm", backend.mode_reason
    assert len(backend.device.chunks) == DEVICE_CHUNKS
    assert all(c.fd >= 0 for c in backend.device.chunks)
    for k in range(DEVICE_CHUNKS):
        assert device_bytes(backend, k, backend.chunk_bytes) == bytes(backend.chunk_bytes)


def test_a_client_maps_its_chunks_in_lease_order(backend: CudaBackend) -> None:
    chunk = backend.chunk_bytes
    fds = fds_of(backend.device, [5, 2])
    result = run_client(
        fds,
        chunk=chunk,
        granularity=backend.granularity,
        write=[[0, "in chunk five"], [chunk + 7, "in chunk two"]],
    )
    assert result["length"] == 2 * chunk
    assert device_bytes(backend, 5, 13) == b"in chunk five"
    assert device_bytes(backend, 2, 19)[7:] == b"in chunk two"
    write_device(backend, 2, b"from the daemon")
    again = run_client(fds, chunk=chunk, granularity=backend.granularity, read=[[chunk, 15]])
    assert again["read"] == ["from the daemon"]


def test_scrub_zeroes_a_returned_chunk(backend: CudaBackend) -> None:
    chunk = backend.chunk_bytes
    write_device(backend, 3, b"\xff" * chunk)
    write_device(backend, 4, b"\xee" * chunk)
    backend.scrub(backend.device, backend.device.chunks[3])
    assert device_bytes(backend, 3, chunk) == bytes(chunk)
    assert device_bytes(backend, 4, 4) == b"\xee" * 4
    host = backend.host.chunks[1]
    os.pwrite(host.fd, b"host secret", 0)
    backend.scrub(backend.host, host)
    assert os.pread(host.fd, 11, 0) == bytes(11)


def test_two_sessions_cannot_reach_each_other(backend: CudaBackend) -> None:
    chunk, g = backend.chunk_bytes, backend.granularity
    a_fds, b_fds = fds_of(backend.device, [0, 1]), fds_of(backend.device, [2, 3])
    secret = "session A's secret"
    run_client(a_fds, chunk=chunk, granularity=g, write=[[0, secret], [chunk, secret]])
    b = run_client(b_fds, chunk=chunk, granularity=g, whole=secret, fill=0xBB)
    assert b["whole_has"] is False  # B's whole range holds nothing of A's
    # B's writes over its whole range landed in its own chunks and nowhere else
    assert device_bytes(backend, 0, len(secret)) == secret.encode()
    assert device_bytes(backend, 1, len(secret)) == secret.encode()
    for k in (2, 3):
        assert device_bytes(backend, k, chunk) == b"\xbb" * chunk
    for k in range(4, DEVICE_CHUNKS):
        assert device_bytes(backend, k, chunk) == bytes(chunk)


def test_facts_and_bandwidth(backend: CudaBackend) -> None:
    facts = backend.facts()
    assert str(facts["device"]).startswith("NVIDIA")
    assert 0 < int(facts["free_bytes"]) <= int(facts["total_bytes"])
    assert int(facts["pcie_generation"]) >= 3 and int(facts["pcie_width"]) >= 1
    assert float(facts["h2d_gbps"]) > 1.0 and float(facts["d2h_gbps"]) > 1.0
    assert facts["mode"] == "vmm" and facts["granularity_bytes"] == backend.granularity


def test_a_pool_beyond_free_memory_is_refused(granularity: int) -> None:
    import pynvml

    pynvml.nvmlInit()
    try:
        total = int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).total)
    finally:
        pynvml.nvmlShutdown()
    too_big = (total // granularity + 1) * granularity
    with pytest.raises(CudaBackendError, match=r"does not fit on GPU 0 .* free of"):
        CudaBackend(too_big, granularity, granularity)


def test_a_chunk_off_the_granularity_is_refused(granularity: int) -> None:
    chunk = granularity + 4096
    with pytest.raises(CudaBackendError, match="not a multiple of the GPU's allocation"):
        CudaBackend(2 * chunk, chunk, chunk)


def test_ipc_mode(granularity: int) -> None:
    b = CudaBackend(4 * granularity, granularity, granularity, mode="ipc")
    try:
        assert b.mode == "ipc" and len(b.device.ipc_handle) == 64
        assert all(c.fd == -1 for c in b.device.chunks)
        write_device(b, 1, b"\x01" * 64)
        b.scrub(b.device, b.device.chunks[1])
        assert device_bytes(b, 1, 64) == bytes(64)
    finally:
        b.close()
