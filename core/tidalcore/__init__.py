"""The shared core of tidalpool: what the client, the daemon, the planner and the offline tools
all speak, importing none of them.

- `units`: `Bytes`, `Offset`, `Tick`, `BlockId`, sizes parsed and formatted.
- `events`: the event kinds of a trace (the protocol's `EventKind`) and `Events`, a columnar
  event stream: what a session records, the daemon stores and the planner learns from.
- `wire`: names both ends of a connection agree on (sockets, metadata keys, versions).
- `framing`: length-prefixed messages with file descriptors on the handles socket.
- `errors`: the typed failures a request can get, each with its gRPC status code.
- `chunks`: memfd chunks mapped side by side (a sim lease, any host lease, page-locked for a
  GPU); `cuda_driver`: the typed CUDA driver and NVML bindings.
- `v1`: the generated protobuf and gRPC stubs of `proto/tidalpool/v1`.
"""

__version__ = "0.1.0"
