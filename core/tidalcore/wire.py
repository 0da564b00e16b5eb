"""Names both ends of a connection agree on: socket files, gRPC metadata keys, versions."""

from __future__ import annotations

GRPC_SOCKET = "tidalpool.sock"
"""The daemon's gRPC socket, in its socket directory."""
HANDLES_SOCKET = "handles.sock"
"""The handles socket (leases and their fds), in the same directory."""
ADMIN_SOCKET = "admin.sock"
"""The Admin service's gRPC socket (mode 0600 by default: the daemon's uid), same directory."""
LOCK_FILE = "tidalpoold.lock"
"""Held (flock) by the one daemon serving the directory."""

HANDLES_VERSION = 2
"""Version of the handles protocol (proto/tidalpool/v1/handles.proto)."""

PLAN_VERSION = 2
"""The PlanUpdate version of a plan for a contiguous lease: every piece of memory at an offset
of the plan's arena (pool.proto's version rule)."""
PAGED_PLAN_VERSION = 3
"""The PlanUpdate version of a plan for a session under virtual residency: every allocation
at an address for life, the limit counting mapped pages. The newest a client knows."""

TOKEN_KEY = "tidalpool-token"
"""gRPC metadata key of a session's token on every session RPC."""
STREAM_OPEN_KEY = "tidalpool-stream"
"""Header the daemon sends once a session stream is the session's (value "1")."""
