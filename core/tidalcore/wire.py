"""Names both ends of a connection agree on: socket files, gRPC metadata keys, the handles
protocol's version (a plan's versions: `tidalcore.planupdate`)."""

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
"""Version of the handles protocol's lease request (proto/tidalpool/v1/handles.proto)."""
HANDLES_GIVE_BACK_VERSION = 3
"""Version of its give-back request (`HandlesRequest.give_back_token`): a daemon that knows only
version 2 refuses it instead of taking it for a lease request."""
HANDLES_ELASTIC_VERSION = 4
"""Version of an elastic lease request (`HandlesRequest.elastic`) and of a grow request
(`grow_token`): an older daemon refuses both rather than grant a fixed lease."""

TOKEN_KEY = "tidalpool-token"
"""gRPC metadata key of a session's token on every session RPC."""
STREAM_OPEN_KEY = "tidalpool-stream"
"""Header the daemon sends once a session stream is the session's (value "1")."""
MAX_SHAPE_BYTES = 128
"""Longest iteration shape (StepMark.shape, UTF-8 bytes) a session may name."""
