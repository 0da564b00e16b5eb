"""CuPy arrays in a tidalpool lease (`tidalpool.cupy.use(session)`): the public names of
`tidalclient.cupy`, where they live and are described."""

from __future__ import annotations

from tidalclient.cupy import Allocator, blocks_of, current, device_view, op, stop, use

__all__ = ["Allocator", "blocks_of", "current", "device_view", "op", "stop", "use"]
