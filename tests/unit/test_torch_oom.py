"""The planned mode's failure handler: a C++ shim, built once against PyTorch's headers, that
throws c10::OutOfMemoryError; thrown through the native allocator, it is caught as that type."""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

from tidalclient.hotpath import library_path
from tidalclient.torch import oom

needs_cxx = pytest.mark.skipif(shutil.which("g++") is None, reason="needs a C++ compiler (g++)")


@needs_cxx
def test_the_shim_is_built_once_and_then_loaded_from_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    address = oom.handler(tmp_path)
    assert address is not None and address > 0
    (built,) = tmp_path.glob("oom-*.so")
    assert built == oom.shim_path(tmp_path)

    def no_compiler(*args: object, **kwargs: object) -> None:
        raise AssertionError("compiled again")

    monkeypatch.setattr(oom, "build", no_compiler)
    assert oom.handler(tmp_path) == address


def test_without_a_compiler_there_is_no_handler_and_a_warning_says_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("CXX", "/bin/false")
    with caplog.at_level(logging.WARNING, logger="tidalpool"):
        assert oom.handler(tmp_path) is None
    assert "cannot build" in caplog.text
    assert not list(tmp_path.glob("oom-*.so"))  # nothing half-built left behind


CALLER = r"""
#include <cxxabi.h>
#include <dlfcn.h>
#include <cstdint>
#include <cstdio>
#include <exception>

int main(int argc, char **argv) {
    void *lib = dlopen(argv[1], RTLD_NOW), *shim = dlopen(argv[2], RTLD_NOW);
    if (!lib || !shim) { std::puts(dlerror()); return 2; }
    auto on_failure = (void (*)(void *))dlsym(lib, "tidalpool_on_failure");
    auto configure = (int (*)(int, uint64_t, uint64_t, uint64_t, uint64_t, uint32_t, uint32_t))
        dlsym(lib, "tidalpool_configure");
    auto alloc = (void *(*)(size_t, int, void *))dlsym(lib, "tidalpool_alloc");
    on_failure(dlsym(shim, "tidalpool_throw_oom"));
    configure(9, 1 << 30, 4096, 256, 16, 8, 0);
    try {
        alloc(8192, 9, nullptr);
        std::puts("no exception");
    } catch (const std::exception &e) {
        std::printf("%s\n%s\n", abi::__cxa_current_exception_type()->name(), e.what());
    }
    return 0;
}
"""


@needs_cxx
def test_a_failed_allocation_throws_pytorchs_out_of_memory_error(tmp_path: Path) -> None:
    shim = oom.shim_path(tmp_path)
    assert oom.handler(tmp_path) is not None
    source = tmp_path / "caller.cc"
    source.write_text(CALLER)
    binary = tmp_path / "caller"
    subprocess.run(["g++", "-std=c++17", "-o", binary, source, "-ldl"], check=True)
    run = subprocess.run(
        [binary, library_path(), shim], capture_output=True, text=True, timeout=60, check=True
    )
    kind, message = run.stdout.splitlines()[:2]
    assert kind == "N3c1016OutOfMemoryErrorE"  # what PyTorch and cuDNN catch as out of memory
    assert message.startswith(
        "tidalpool: out of memory in the lease of device 9: 8192 bytes asked; lease 4096 bytes"
    )


def test_hotpath_alloc_does_not_call_a_throwing_handler_through_ctypes(tmp_path: Path) -> None:
    """A C++ exception cannot cross ctypes (the process would abort): with PyTorch's throwing
    handler installed by address, HotPath.alloc gets None, and the process goes on."""
    script = tmp_path / "probe.py"
    script.write_text(
        "from tidalclient.hotpath import HotPath, on_failure\n"
        "from tidalclient.torch import oom\n"
        "handler = oom.torch_check_fail()\n"
        "assert handler is not None\n"
        "on_failure(handler)\n"
        "hp = HotPath(41)\n"
        "hp.configure(1 << 32, 1 << 20)\n"
        "print(hp.alloc(1 << 30), hp.stats().failures)\n"
    )
    root = Path(__file__).resolve().parents[2]
    env = {"PYTHONPATH": f"{root / 'client'}:{root / 'daemon'}", "PATH": "/usr/bin:/bin"}
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["None", "1"]
