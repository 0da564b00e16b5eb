"""Is a daemon serving? The standard gRPC health check (grpc.health.v1) over its Unix socket.

`tidalpool health` prints the answer and exits 0 when the daemon serves, 1 otherwise: the
contract of a container HEALTHCHECK and of a Kubernetes exec probe.

The daemon as a whole is asked on admin.sock when this process may connect to it (the daemon's
own uid, as its probes run, or root), else on the jobs' tidalpool.sock: admin.sock's server is
apart from the jobs' and only its uid reaches it, so a job that floods tidalpool.sock with
connections or streams cannot fail the daemon's probes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tidalcore.wire import ADMIN_SOCKET, GRPC_SOCKET

SERVING = health_pb2.HealthCheckResponse.SERVING
ADMIN_SERVICE = "tidalpool.v1.Admin"


@dataclass(frozen=True, slots=True)
class Health:
    """The answer to one check: serving or not, and a sentence that says which and why."""

    serving: bool
    message: str


def check(socket_dir: Path, service: str = "", timeout: float = 5.0) -> Health:
    """Ask the daemon in `socket_dir` whether `service` ("" for the daemon as a whole; or
    tidalpool.v1.Pool, tidalpool.v1.Admin) is serving, waiting at most `timeout` seconds.
    Admin is asked on its own socket (admin.sock), Pool on the jobs' (tidalpool.sock), the
    daemon on admin.sock when this process may connect to it, else on tidalpool.sock."""
    admin = socket_dir / ADMIN_SOCKET
    if service == ADMIN_SERVICE or (not service and os.access(admin, os.W_OK)):
        path = admin
    else:
        path = socket_dir / GRPC_SOCKET
    what = "the daemon" if not service else f"service {service}"
    if not path.exists():
        return Health(False, f"no daemon at {socket_dir}: {path} does not exist")
    with grpc.insecure_channel(f"unix:{path}") as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout
            )
        except grpc.RpcError as e:
            code = e.code()
            if code == grpc.StatusCode.NOT_FOUND:
                return Health(False, f"the daemon at {path} has no service {service!r}")
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                return Health(False, f"no answer from {path} within {timeout:g} s")
            return Health(False, f"no daemon answers at {path}: {e.details()}")
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    if reply.status == SERVING:
        return Health(True, f"serving: {what} at {path}")
    return Health(False, f"not serving: {what} at {path} is {status}")
