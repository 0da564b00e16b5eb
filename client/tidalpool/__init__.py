"""tidalpool: a per-GPU memory manager for deep-learning training.

import tidalpool
with tidalpool.attach(device_limit="2GiB") as session:
    x = session.array((1024, 1024), "float32")
"""

from __future__ import annotations

__version__ = "0.1.0"

from tidalpool.errors import (
    AttachError,
    InvalidBlock,
    LeaseExceeded,
    NotHostMemory,
    SessionClosed,
    TidalpoolError,
)
from tidalpool.executor import Block
from tidalpool.session import Session, SessionStats, attach

__all__ = [
    "AttachError",
    "Block",
    "InvalidBlock",
    "LeaseExceeded",
    "NotHostMemory",
    "Session",
    "SessionClosed",
    "SessionStats",
    "TidalpoolError",
    "__version__",
    "attach",
]
