"""Backends: where the daemon's pools live (sim: memfd segments; cuda: device memory)."""

from __future__ import annotations

from tidalpoold.backends.base import Backend, Segment
from tidalpoold.backends.sim import SimBackend


def open_backend(name: str, device_bytes: int, host_bytes: int) -> Backend:
    """Create the pools of the named backend."""
    if name == "sim":
        return SimBackend(device_bytes, host_bytes)
    if name == "cuda":
        raise NotImplementedError("the cuda backend is not built yet; use --backend sim")
    raise ValueError(f"unknown backend {name!r} (known: sim, cuda)")


__all__ = ["Backend", "Segment", "SimBackend", "open_backend"]
