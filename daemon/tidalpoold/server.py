"""Building, running and stopping the daemon.

`build_daemon(settings)` returns a `Daemon` whose sockets already listen;
tests call it with their own socket directory, the CLI calls it and waits.
"""

from __future__ import annotations

import logging
import os
import threading
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from tidalpoold.backends import Backend, open_backend
from tidalpoold.handles import HandlesServer
from tidalpoold.planning import Planner
from tidalpoold.services import AdminService, PoolService
from tidalpoold.sessions import Reason, Registry
from tidalpoold.settings import Settings, describe

log = logging.getLogger("tidalpoold.server")


@dataclass
class Daemon:
    settings: Settings
    backend: Backend
    registry: Registry
    grpc_server: grpc.Server
    handles: HandlesServer
    health: health.HealthServicer
    planner: Planner
    grpc_socket: Path
    handles_socket: Path
    _stop: threading.Event
    _reaper: threading.Thread
    _shutdown_lock: threading.Lock = field(default_factory=threading.Lock)

    def shutdown(self, reason: str = "daemon shutting down") -> None:
        """Tell every session, stop serving, remove the sockets, free the pools. Once."""
        with self._shutdown_lock:
            if self._stop.is_set():
                return
            self._shutdown(reason)

    def _shutdown(self, reason: str) -> None:
        log.info(
            "daemon.stopping", extra={"why": reason, "sessions": len(self.registry.sessions())}
        )
        self.health.enter_graceful_shutdown()
        self.handles.close()
        for session in self.registry.sessions():
            self.registry.end_quietly(session.id, Reason.REASON_SHUTDOWN, reason)
        self.grpc_server.stop(self.settings.shutdown_grace_s).wait()
        self.planner.close()
        self._stop.set()
        self._reaper.join(timeout=2)
        self.grpc_socket.unlink(missing_ok=True)
        self.backend.close()
        log.info("daemon.stopped")


def build_daemon(settings: Settings) -> Daemon:
    """Allocate the pools and start listening on both sockets."""
    socket_dir = settings.socket_dir
    socket_dir.mkdir(parents=True, exist_ok=True)
    for path in (settings.grpc_socket, settings.handles_socket):
        _remove_stale_socket(path)

    backend = open_backend(settings.backend, settings.device_pool, settings.host_pool)
    registry = Registry(settings, backend)
    planner = Planner(settings)
    pool, admin = PoolService(registry, planner), AdminService(registry)

    # A Session stream holds a worker for its lifetime: room for every session, and then some.
    server = grpc.server(
        futures.ThreadPoolExecutor(
            max_workers=settings.max_sessions + 16, thread_name_prefix="grpc"
        ),
        options=[("grpc.so_reuseport", 0)],
    )
    server.add_generic_rpc_handlers((pool.handler(), admin.handler()))
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (pool.name, admin.name, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    server.add_insecure_port(f"unix:{settings.grpc_socket}")
    server.start()
    os.chmod(settings.grpc_socket, settings.socket_mode)
    handles = HandlesServer(
        settings.handles_socket, registry, settings.socket_mode, settings.allowed_gids
    )
    handles.start()
    for name in ("", pool.name, admin.name):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)

    stop = threading.Event()
    reaper = threading.Thread(target=_reap, args=(registry, stop), name="reaper", daemon=True)
    reaper.start()
    log.info(
        "daemon.ready",
        extra={
            "grpc": str(settings.grpc_socket),
            "handles": str(settings.handles_socket),
            "settings": describe(settings),
        },
    )
    return Daemon(
        settings=settings,
        backend=backend,
        registry=registry,
        grpc_server=server,
        handles=handles,
        health=health_servicer,
        planner=planner,
        grpc_socket=settings.grpc_socket,
        handles_socket=settings.handles_socket,
        _stop=stop,
        _reaper=reaper,
    )


def _reap(registry: Registry, stop: threading.Event) -> None:
    period = min(0.5, registry.settings.attach_timeout_s / 4)
    while not stop.wait(period):
        registry.reap()


def _remove_stale_socket(path: Path) -> None:
    """Remove a socket left by a daemon that died; refuse if one still answers."""
    if not path.exists():
        return
    import socket

    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
    except OSError:
        path.unlink()
        return
    finally:
        probe.close()
    raise SystemExit(f"another daemon is listening on {path}; stop it or use another --socket-dir")
