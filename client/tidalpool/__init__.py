"""tidalpool: a per-GPU memory manager for deep-learning training.

import tidalpool
with tidalpool.attach(device_limit="2GiB") as session:
    x = session.array((1024, 1024), "float32")

This package is the public face: the names a training job or a user needs, from the packages
where they live (`tidalclient`, the client library; `tidaloffline`, the offline tools), and the
`tidalpool` command (`tidalpool.cli`). Integrations: `tidalpool.torch`, `tidalpool.cupy`,
`tidalpool.numpy`.
"""

from __future__ import annotations

from tidalclient.errors import (
    AttachError,
    InvalidBlock,
    LeaseExceeded,
    NotHostMemory,
    SessionClosed,
    TidalpoolError,
)
from tidalclient.executors.base import Block
from tidalclient.session import Session, SessionStats, attach
from tidalcore import __version__
from tidalcore.unplanned import PlanUnavailable

__all__ = [
    "AttachError",
    "Block",
    "InvalidBlock",
    "LeaseExceeded",
    "NotHostMemory",
    "PlanUnavailable",
    "Session",
    "SessionClosed",
    "SessionStats",
    "TidalpoolError",
    "__version__",
    "attach",
]
