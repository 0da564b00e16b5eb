"""Backends: where the daemon's pools live (sim: memfd chunks; cuda: device memory chunks)."""

from __future__ import annotations

import importlib

from tidalpoold.backends.base import Backend, Chunk, Pool
from tidalpoold.backends.sim import SimBackend


def open_backend(
    name: str,
    device_bytes: int,
    host_bytes: int,
    chunk_bytes: int,
    gpu: int = 0,
    cuda_mode: str = "auto",
) -> Backend:
    """Create the pools of the named backend: `device_bytes // chunk_bytes` device chunks and
    `host_bytes // chunk_bytes` host chunks (the settings make both exact multiples).
    `gpu` and `cuda_mode` ("auto", "vmm" or "ipc") are the cuda backend's; sim ignores them."""
    if name == "sim":
        return SimBackend(device_bytes, host_bytes, chunk_bytes)
    if name == "cuda":
        try:
            cuda = importlib.import_module("tidalpoold.backends.cuda")
        except ImportError as e:
            raise SystemExit(f"the cuda backend cannot be loaded ({e}); use --backend sim") from e
        backend: Backend = cuda.CudaBackend(
            device_bytes, host_bytes, chunk_bytes, gpu=gpu, mode=cuda_mode
        )
        return backend
    raise ValueError(f"unknown backend {name!r} (known: sim, cuda)")


__all__ = ["Backend", "Chunk", "Pool", "SimBackend", "open_backend"]
