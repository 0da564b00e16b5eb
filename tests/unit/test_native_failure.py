"""The failure handler: what tidalpool_alloc calls when it returns NULL, so that a framework
that does not check for NULL (PyTorch's pluggable allocator) raises instead."""

from __future__ import annotations

import ctypes
import gc
import shutil
import subprocess
import weakref
from collections.abc import Iterator
from pathlib import Path

import pytest
from tidalclient.hotpath import FailureHandler, HotPath, library_path, on_failure

DEVICE = 41  # a device index no other test uses
BASE = 1 << 30  # a lease nobody dereferences


@pytest.fixture
def calls() -> Iterator[list[tuple[bytes, bytes, int, bytes]]]:
    got: list[tuple[bytes, bytes, int, bytes]] = []
    on_failure(FailureHandler(lambda *args: got.append(args)))
    yield got
    on_failure(None)
    HotPath(DEVICE).reset()


def test_a_failed_allocation_calls_the_handler_with_the_lease_state(
    calls: list[tuple[bytes, bytes, int, bytes]],
) -> None:
    hp = HotPath(DEVICE)
    hp.configure(BASE, 8192)
    first = hp.alloc(3000)
    assert first is not None and not calls  # success: no call
    assert hp.alloc(6000) is None
    ((function, _, line, message),) = calls
    assert function == b"tidalpool_alloc" and line > 0
    assert message.decode() == (
        f"tidalpool: out of memory in the lease of device {DEVICE}: 6000 bytes asked; lease 8192"
        " bytes, 3000 live in 1 blocks, 5120 free, largest free range 5120"
    )
    assert hp.alloc(1 << 40) is None  # beyond the lease
    assert b"1099511627776 bytes asked" in calls[-1][3]
    assert hp.stats().failures == 2


def test_size_zero_does_not_call_the_handler_and_no_lease_does(
    calls: list[tuple[bytes, bytes, int, bytes]],
) -> None:
    lib = ctypes.CDLL(str(library_path()))
    lib.tidalpool_alloc.restype = ctypes.c_void_p
    lib.tidalpool_alloc.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    HotPath(DEVICE).configure(BASE, 8192)
    assert lib.tidalpool_alloc(0, DEVICE, None) is None  # as cudaMalloc(0): not a failure
    assert not calls
    HotPath(DEVICE).reset()
    assert lib.tidalpool_alloc(64, DEVICE, None) is None
    assert calls[-1][3].decode() == (
        f"tidalpool: 64 bytes asked on device {DEVICE}, which has no lease (no session"
        " attached, or it ended)"
    )


def test_removing_the_handler_returns_null_silently(
    calls: list[tuple[bytes, bytes, int, bytes]],
) -> None:
    on_failure(None)
    hp = HotPath(DEVICE)
    hp.configure(BASE, 4096)
    assert hp.alloc(8192) is None
    assert not calls
    with pytest.raises(ValueError, match="not a function"):
        on_failure(0)
    with pytest.raises(TypeError, match="a failure handler is an address"):
        on_failure("torchCheckFail")  # type: ignore[arg-type]


def test_a_replaced_callback_stays_alive_for_a_thread_that_already_loaded_it() -> None:
    first = FailureHandler(lambda *args: None)
    gone = weakref.ref(first)
    on_failure(first)
    on_failure(FailureHandler(lambda *args: None))  # another thread may still call `first`
    del first
    gc.collect()
    assert gone() is not None
    on_failure(None)


THROWER = r"""
#include <dlfcn.h>
#include <cstdint>
#include <cstdio>
#include <stdexcept>

extern "C" [[noreturn]] void fail(const char *, const char *, uint32_t, const char *message) {
    throw std::runtime_error(message);
}

int main(int argc, char **argv) {
    void *lib = dlopen(argv[1], RTLD_NOW);
    if (!lib) return 2;
    auto on_failure = (void (*)(void *))dlsym(lib, "tidalpool_on_failure");
    auto configure = (int (*)(int, uint64_t, uint64_t, uint64_t, uint64_t, uint32_t, uint32_t))
        dlsym(lib, "tidalpool_configure");
    auto alloc = (void *(*)(size_t, int, void *))dlsym(lib, "tidalpool_alloc");
    on_failure((void *)&fail);
    configure(7, 1 << 30, 4096, 256, 16, 8, 0);
    for (int round = 0; round < 2; round++) {  // the lock was released before the throw
        try {
            alloc(8192, 7, nullptr);
            std::puts("no exception");
        } catch (const std::runtime_error &e) {
            std::printf("caught: %s\n", e.what());
        }
    }
    std::printf("then: %p\n", alloc(256, 7, nullptr));
    return 0;
}
"""


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs a C++ compiler (g++)")
def test_a_cxx_exception_from_the_handler_unwinds_through_the_allocator(tmp_path: Path) -> None:
    source = tmp_path / "thrower.cc"
    source.write_text(THROWER)
    binary = tmp_path / "thrower"
    subprocess.run(["g++", "-std=c++17", "-o", binary, source, "-ldl"], check=True)
    run = subprocess.run(
        [binary, library_path()], capture_output=True, text=True, timeout=30, check=True
    )
    lines = run.stdout.splitlines()
    expected = (
        "caught: tidalpool: out of memory in the lease of device 7: 8192 bytes asked; lease"
        " 4096 bytes, 0 live in 0 blocks, 4096 free, largest free range 4096"
    )
    assert lines[:2] == [expected, expected]
    assert lines[2] == f"then: {hex(1 << 30)}"
