"""Plans on disk by iteration signature: the next run of the same job skips the solve."""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path

from tidalcore.v1 import pool_pb2

log = logging.getLogger("tidalpoold.planning")


class PlanCache:
    """Plans on disk by iteration signature; a cache that cannot be written is skipped."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def _path(self, signature: bytes) -> Path:
        return self.directory / f"{signature.hex()}.plan"

    def get(self, signature: bytes) -> pool_pb2.PlanUpdate | None:
        try:
            return pool_pb2.PlanUpdate.FromString(self._path(signature).read_bytes())
        except (OSError, ValueError):
            return None

    def put(self, plan: pool_pb2.PlanUpdate) -> None:
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.directory, suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                f.write(plan.SerializeToString())
            os.replace(tmp, self._path(plan.signature))
        except OSError as e:
            log.warning("plan.cache_unwritable", extra={"dir": str(self.directory), "why": str(e)})
