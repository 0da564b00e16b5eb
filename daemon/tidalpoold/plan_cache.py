"""Plans on disk by what they were made for: the next run of the same job skips the planning.

A plan depends on the iteration (its signature) and on the session's swap limit, the copy
bandwidth its swaps were planned at and the wire version it is written in; its file is named
by all four (`key`), so a session with another limit or bandwidth plans anew.
"""

from __future__ import annotations

import hashlib
import logging
import os
import struct
import tempfile
from pathlib import Path

from google.protobuf.message import DecodeError
from tidalcore.v1 import pool_pb2

log = logging.getLogger("tidalpoold.planning")


def key(signature: bytes, swap_limit: int, copy_gbps: float, version: int) -> str:
    """A plan's name in the cache: the signature in hex, then a hash of the swap limit (0: no
    swapping), the copy bandwidth in GB/s and the PlanUpdate version."""
    made_for = hashlib.blake2b(struct.pack("<QdI", swap_limit, copy_gbps, version), digest_size=8)
    return f"{signature.hex()}-{made_for.hexdigest()}"


class PlanCache:
    """Plans on disk by `key`; a cache that cannot be written is skipped."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def _path(self, name: str) -> Path:
        return self.directory / f"{name}.plan"

    def get(self, name: str) -> pool_pb2.PlanUpdate | None:
        """The plan stored under `name`; None when there is none or it is not a PlanUpdate."""
        try:
            return pool_pb2.PlanUpdate.FromString(self._path(name).read_bytes())
        except (OSError, DecodeError):
            return None

    def put(self, name: str, plan: pool_pb2.PlanUpdate) -> None:
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.directory, suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                f.write(plan.SerializeToString())
            os.replace(tmp, self._path(name))
        except OSError as e:
            log.warning("plan.cache_unwritable", extra={"dir": str(self.directory), "why": str(e)})
