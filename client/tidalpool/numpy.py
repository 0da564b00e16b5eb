"""NumPy arrays and tensors over a session's lease (the sim backend): the public names of
`tidalclient.numpy`, where they live and are described."""

from __future__ import annotations

from tidalclient.numpy import Tensor, array, block_of, release, view

__all__ = ["Tensor", "array", "block_of", "release", "view"]
