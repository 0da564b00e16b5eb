"""PyTorch's own out-of-memory error, thrown by the native allocator's failure handler.

In planned mode the native library is PyTorch's allocator, and PyTorch's pluggable allocator
does not check for NULL, so a failed allocation must throw. PyTorch catches
`c10::OutOfMemoryError` where it can recover (cuDNN then tries a convolution with a smaller
workspace; Python sees `torch.OutOfMemoryError`), so that is the error to throw. No exported
function of PyTorch throws it, and the package build has only a C compiler, so a four-line C++
shim against PyTorch's headers is compiled here, once per PyTorch version, with the system's C++
compiler (`$CXX`, else `c++`), in about a second, and cached (`$XDG_CACHE_HOME/tidalpool`, else
`~/.cache/tidalpool`). Where it cannot be built, `handler()` returns None and the caller falls
back to `c10::detail::torchCheckFail` (a `RuntimeError`, which cuDNN does not recover from).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

log = logging.getLogger("tidalpool")

SOURCE = """\
#include <c10/util/Exception.h>
extern "C" [[noreturn]] void tidalpool_throw_oom(const char *function, const char *file,
                                                 uint32_t line, const char *message) {
    throw c10::OutOfMemoryError(c10::SourceLocation{function, file, line}, std::string(message));
}
"""
SYMBOL = "tidalpool_throw_oom"
TORCH_CHECK_FAIL = "_ZN3c106detail14torchCheckFailEPKcS2_jS2_"
"""c10::detail::torchCheckFail(const char*, const char*, uint32_t, const char*): throws
c10::Error, which reaches Python as RuntimeError; the fallback handler."""

_loaded: dict[Path, ctypes.CDLL] = {}  # kept open: the native library calls into them


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "tidalpool"


def _torch_dir() -> Path:
    return Path(torch.__file__).resolve().parent


def shim_path(directory: Path | None = None) -> Path:
    """Where the shim for this PyTorch is cached (its version, C++ ABI and the source)."""
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    key = hashlib.sha256(f"{torch.__version__}|{abi}|{_torch_dir()}|{SOURCE}".encode())
    return (directory or cache_dir()) / f"oom-{key.hexdigest()[:16]}.so"


def build(path: Path) -> None:
    """Compile the shim into `path` (atomically); CalledProcessError/OSError on failure."""
    compiler = os.environ.get("CXX") or shutil.which("c++") or "g++"
    torch_dir = _torch_dir()
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        source = Path(tmp) / "oom.cpp"
        source.write_text(SOURCE)
        target = Path(tmp) / path.name
        command = [
            compiler,
            "-O2",
            "-shared",
            "-fPIC",
            "-std=c++17",
            f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
            f"-I{torch_dir / 'include'}",
            str(source),
            "-o",
            str(target),
            f"-L{torch_dir / 'lib'}",
            "-lc10",
            f"-Wl,-rpath,{torch_dir / 'lib'}",
        ]
        subprocess.run(command, check=True, capture_output=True, text=True, timeout=300)
        os.replace(target, path)


def torch_check_fail() -> int | None:
    """The address of PyTorch's torchCheckFail in libc10, or None if it is not exported."""
    try:
        c10 = ctypes.CDLL(str(_torch_dir() / "lib" / "libc10.so"))
        address = ctypes.cast(getattr(c10, TORCH_CHECK_FAIL), ctypes.c_void_p).value
    except (OSError, AttributeError):
        return None
    return int(address) if address else None


def handler(directory: Path | None = None) -> int | None:
    """The address of `tidalpool_throw_oom(function, file, line, message)`, which throws
    c10::OutOfMemoryError; built and cached on first use. None if it cannot be built or
    loaded (the reason is logged)."""
    path = shim_path(directory)
    try:
        if not path.exists():
            log.info("tidalpool: building %s (PyTorch's out-of-memory error, once)", path)
            build(path)
        library = _loaded.get(path) or ctypes.CDLL(str(path))
        _loaded[path] = library
        address = ctypes.cast(getattr(library, SYMBOL), ctypes.c_void_p).value
    except subprocess.CalledProcessError as e:
        log.warning("tidalpool: cannot build %s: %s", path.name, (e.stderr or "").strip()[-500:])
        return None
    except (OSError, AttributeError, subprocess.TimeoutExpired) as e:
        log.warning("tidalpool: cannot build or load %s: %s", path.name, e)
        return None
    return int(address) if address else None
