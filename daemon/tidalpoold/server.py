"""Building, running and stopping the daemon.

`build_daemon(settings)` returns a `Daemon` whose sockets already listen;
tests call it with their own socket directory, the CLI calls it and waits.
"""

from __future__ import annotations

import ctypes
import logging
import os
import resource
import sys
import threading
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from wsgiref.simple_server import WSGIServer

import grpc
from grpc_health.v1 import health, health_pb2
from grpc_reflection.v1alpha import reflection, reflection_pb2_grpc

from tidalpoold import directory
from tidalpoold.backends import Backend, open_backend
from tidalpoold.front import FDS_PER_PLACE, FrontDoor
from tidalpoold.handles import HandlesServer
from tidalpoold.metrics import DaemonCollector, Metrics
from tidalpoold.plan_worker import PlanWorker, copy_gbps_of
from tidalpoold.planning import PlannerProcess
from tidalpoold.rpc import StreamSlots, service, unary, unary_stream
from tidalpoold.services import AdminService, PoolService
from tidalpoold.sessions import Reason, Registry
from tidalpoold.settings import Settings, describe

log = logging.getLogger("tidalpoold.server")

SPARE_WORKERS = 16
"""Workers of tidalpool.sock's server beyond one per session's stream: unary calls, and the
capped streams below. At most WATCHES + REFLECTIONS of them are ever held by a stream."""
WATCHES = 4  # Health/Watch streams open at once on tidalpool.sock
REFLECTIONS = 4  # server reflection streams open at once on tidalpool.sock
ADMIN_WORKERS = 4  # admin.sock's server: one Watch and one reflection stream at most
CONNECTIONS_PER_SESSION = 2  # a session's channel, and one of its job's tools beside it
SPARE_CONNECTIONS = 64  # probes, `tidalpool status`, `top`, attaches on their way
RESERVED_CONNECTIONS = 32  # of tidalpool.sock's places, what one uid never takes from the others
WAITING_CONNECTIONS = 64  # connections to tidalpool.sock without their HTTP/2 preface yet
HANDSHAKE_S = 5.0  # a connection's HTTP/2 preface and settings come within this, or it goes
IDLE_S = 60.0  # a connection to tidalpool.sock with no call for this long is closed
QUIET_S = 2.0  # with every place held, one this quiet of the uid holding the most may be taken
SWITCH_INTERVAL_S = 0.0005
"""How long a thread may hold the interpreter's lock while another waits for it (Python's
default: 5 ms). Every byte the front door relays and every call a gRPC thread serves waits for
that lock behind the thread that holds it (a trace's chunk decoded, a job handed to the
planner's process), each hop up to this long."""
INNER_SOCKET = ".grpc.sock"  # the gRPC server's own socket, beside tidalpool.sock: the daemon's
STREAMS_PER_CONNECTION = 16  # a session's channel needs its stream and a few calls at once


@dataclass
class Daemon:
    settings: Settings
    backend: Backend
    registry: Registry
    grpc_server: grpc.Server  # Pool, health, reflection, reached through `front`
    front: FrontDoor  # tidalpool.sock
    admin_server: grpc.Server  # admin.sock: Admin, health, reflection
    handles: HandlesServer
    health: health.HealthServicer  # of tidalpool.sock: the daemon and Pool
    admin_health: health.HealthServicer  # of admin.sock: the daemon and Admin
    planner: PlanWorker
    grpc_socket: Path
    handles_socket: Path
    admin_socket: Path
    claim: directory.Claim
    _stop: threading.Event
    _reaper: threading.Thread
    metrics_server: WSGIServer | None = None  # None: metrics_address ""
    _shutdown_lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def metrics_address(self) -> str:
        """host:port the metrics are served on, the port as bound ("" for nowhere)."""
        return _address_of(self.metrics_server)

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
        self.admin_health.enter_graceful_shutdown()
        self.handles.close()
        for session in self.registry.sessions():
            self.registry.end_quietly(session.id, Reason.REASON_SHUTDOWN, reason)
        self.grpc_server.stop(self.settings.shutdown_grace_s).wait()
        self.front.close()
        (self.settings.socket_dir / INNER_SOCKET).unlink(missing_ok=True)
        self.admin_server.stop(0).wait()
        self.planner.close()
        if self.metrics_server is not None:
            self.metrics_server.shutdown()
            self.metrics_server.server_close()
        self._stop.set()
        self._reaper.join(timeout=2)
        self.grpc_socket.unlink(missing_ok=True)
        self.admin_socket.unlink(missing_ok=True)
        self.backend.close()
        self.claim.release()  # last: the next daemon may start now
        log.info("daemon.stopped")


def build_daemon(settings: Settings) -> Daemon:
    """Check and claim the socket directory, allocate the pools and start listening on the
    three sockets (and the metrics address)."""
    directory.prepare(settings.socket_dir)
    directory.check_plan_cache(settings.plan_cache_dir)
    claim = directory.claim(settings.socket_dir)
    metrics_server = None
    try:
        for path in (settings.grpc_socket, settings.handles_socket, settings.admin_socket):
            _remove_stale_socket(path)
        # Metrics first: an address that cannot be served stops the start before any pool.
        metrics = Metrics(gpu=str(settings.gpu)) if settings.metrics_address else None
        metrics_server = metrics.serve(settings.metrics_address) if metrics else None
        return _build(settings, claim, metrics, metrics_server)
    except BaseException:
        if metrics_server is not None:
            metrics_server.shutdown()
            metrics_server.server_close()
        claim.release()
        raise


def _build(
    settings: Settings,
    claim: directory.Claim,
    metrics: Metrics | None,
    metrics_server: WSGIServer | None,
) -> Daemon:
    chunk = settings.chunk_size
    make_undumpable()
    trim = tame_malloc()
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    open_files = ensure_fd_room(settings.device_chunks + settings.host_chunks, settings)
    for setting, size in (
        ("device_pool", settings.device_pool),
        ("host_pool", settings.host_pool),
    ):
        if size % chunk:
            log.warning(
                "pool.rounded",
                extra={
                    "why": f"{setting} ({size} bytes) is not a multiple of chunk_size ({chunk}):"
                    f" using {size // chunk} chunks ({size // chunk * chunk} bytes)"
                },
            )
    backend = open_backend(
        settings.backend,
        settings.device_chunks * chunk,
        settings.host_chunks * chunk,
        chunk,
        gpu=settings.gpu,
        cuda_mode=settings.cuda_mode,
    )
    registry = Registry(settings, backend)
    planner = PlanWorker(
        settings,
        copy_gbps=copy_gbps_of(backend),
        on_planned=metrics.on_planned if metrics else None,
        planners=[PlannerProcess(settings, start=False) for _ in range(settings.planner_processes)],
    )
    registry.on_quota = planner.replan
    if metrics is not None:
        registry.on_give_back = metrics.on_give_back
    pool, admin = PoolService(registry, planner), AdminService(registry)

    # Two gRPC servers, one per socket: who may connect to a Unix socket is its file mode, so
    # Admin (which lists and evicts every session) has a socket of its own, by default the
    # daemon's uid's alone, while jobs of the allowed groups reach the Pool service.
    health_servicer, admin_health = health.HealthServicer(), health.HealthServicer()
    for servicer in (health_servicer, admin_health):  # serving once every socket listens
        servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    interceptors = [metrics.rpc] if metrics else []
    # A stream holds a worker for its lifetime. A Session stream: room for every session.
    # Health/Watch and reflection streams: a few of each (`StreamSlots`), so that no peer can
    # hold the workers unary calls (Attach, Health/Check, Stats) need.
    places = CONNECTIONS_PER_SESSION * settings.max_sessions + SPARE_CONNECTIONS
    server = _grpc_server(settings.max_sessions + SPARE_WORKERS, "grpc", interceptors, places)
    server.add_generic_rpc_handlers(
        (pool.handler(), health_handler(health_servicer, StreamSlots(WATCHES, "Health/Watch")))
    )
    _reflection(
        (pool.name, health.SERVICE_NAME, reflection.SERVICE_NAME),
        StreamSlots(REFLECTIONS, "ServerReflectionInfo"),
        server,
    )
    admin_server = _grpc_server(ADMIN_WORKERS, "admin", interceptors, SPARE_CONNECTIONS)
    admin_server.add_generic_rpc_handlers(
        (admin.handler(), health_handler(admin_health, StreamSlots(1, "Health/Watch")))
    )
    _reflection(
        (admin.name, health.SERVICE_NAME, reflection.SERVICE_NAME),
        StreamSlots(1, "ServerReflectionInfo"),
        admin_server,
    )
    inner = settings.socket_dir / INNER_SOCKET
    inner.unlink(missing_ok=True)  # a daemon that died left it; the claim says none serves
    for grpc_server, path, mode in (
        (server, inner, 0o600),
        (admin_server, settings.admin_socket, settings.admin_socket_mode),
    ):
        grpc_server.add_insecure_port(f"unix:{path}")
        grpc_server.start()
        os.chmod(path, mode)
    front = FrontDoor(
        settings.grpc_socket,
        inner,
        settings.socket_mode,
        places=places,
        waiting=WAITING_CONNECTIONS,
        reserved=RESERVED_CONNECTIONS,  # places >= 66: max_sessions is at least 1
        handshake_s=HANDSHAKE_S,
        quiet_s=QUIET_S,
    )
    front.start()
    if metrics is not None:
        per_session = settings.metrics_sessions == "on"
        metrics.add(
            DaemonCollector(
                registry, planner, backend.facts, per_session=per_session, connections=front.counts
            )
        )
    handles = HandlesServer(
        settings.handles_socket,
        registry,
        settings.socket_mode,
        settings.allowed_gids,
        timeout_s=settings.handles_timeout_s,
        max_connections=settings.max_handles_connections,
    )
    handles.start()
    stop = threading.Event()
    reaper = threading.Thread(target=_reap, args=(registry, stop, trim), name="reaper", daemon=True)
    reaper.start()
    log.info(
        "daemon.ready",
        extra={
            "backend": backend.name,
            "mode": backend.mode,
            "mode_reason": backend.mode_reason,
            "device_chunks": len(backend.device.chunks),
            "host_chunks": len(backend.host.chunks),
            "chunk_bytes": chunk,
            "facts": backend.facts(),
            "open_files": open_files,
            "grpc": str(settings.grpc_socket),
            "handles": str(settings.handles_socket),
            "admin": str(settings.admin_socket),
            "metrics": _address_of(metrics_server),  # the bound port, for port 0
            "settings": describe(settings),
        },
    )
    # Serving only once `daemon.ready` is written: whoever waits on health sees the ready line
    # before any line a session makes.
    for servicer, name in (
        (health_servicer, ""),
        (health_servicer, pool.name),
        (admin_health, ""),
        (admin_health, admin.name),
    ):
        servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return Daemon(
        settings=settings,
        backend=backend,
        registry=registry,
        grpc_server=server,
        front=front,
        admin_server=admin_server,
        handles=handles,
        health=health_servicer,
        admin_health=admin_health,
        planner=planner,
        grpc_socket=settings.grpc_socket,
        handles_socket=settings.handles_socket,
        admin_socket=settings.admin_socket,
        claim=claim,
        _stop=stop,
        _reaper=reaper,
        metrics_server=metrics_server,
    )


def _grpc_server(workers: int, name: str, interceptors: list[Any], connections: int) -> grpc.Server:
    """A gRPC server of `workers` threads taking at most `connections` connections at once,
    each of which must finish its HTTP/2 handshake within HANDSHAKE_S, may carry at most
    STREAMS_PER_CONNECTION streams at once and is closed after IDLE_S without a call: a peer
    that opens connections and says nothing holds neither the daemon's file descriptors nor
    its memory for long."""
    return grpc.server(
        futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name),
        options=[
            ("grpc.so_reuseport", 0),
            ("grpc.max_allowed_incoming_connections", connections),
            ("grpc.server_handshake_timeout_ms", int(HANDSHAKE_S * 1000)),
            ("grpc.max_concurrent_streams", STREAMS_PER_CONNECTION),
            ("grpc.max_connection_idle_ms", int(IDLE_S * 1000)),
        ],
        interceptors=interceptors,
    )


def health_handler(servicer: health.HealthServicer, watches: StreamSlots) -> Any:
    """grpc.health.v1.Health with requests parsed by `rpc` (a malformed one is answered
    INVALID_ARGUMENT, where the stock registration's deserializer says INTERNAL), and at most
    `watches` Watch streams open at once."""
    return service(
        health.SERVICE_NAME,
        {
            "Check": unary("Check", health_pb2.HealthCheckRequest, servicer.Check),
            "Watch": unary_stream(
                "Watch", health_pb2.HealthCheckRequest, watches.capped(servicer.Watch)
            ),
        },
    )


class _Reflection(reflection.ReflectionServicer):  # type: ignore[misc]  # untyped library
    """Server reflection with at most `slots` streams open at once."""

    def __init__(self, names: tuple[str, ...], slots: StreamSlots) -> None:
        super().__init__(names)
        self._info = slots.capped(super().ServerReflectionInfo)

    def ServerReflectionInfo(self, requests: Any, context: grpc.ServicerContext) -> Any:
        return self._info(requests, context)


def _reflection(names: tuple[str, ...], slots: StreamSlots, server: grpc.Server) -> None:
    """Register server reflection of `names` on `server` (as `enable_server_reflection`),
    under `slots`."""
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(_Reflection(names, slots), server)


def _address_of(server: WSGIServer | None) -> str:
    """Where metrics are served ("" for nowhere), with the port as bound."""
    if server is None:
        return ""
    host = str(server.server_address[0])
    return f"[{host}]:{server.server_port}" if ":" in host else f"{host}:{server.server_port}"


_PR_SET_DUMPABLE = 4


def make_undumpable() -> None:
    """The daemon holds an fd of every chunk: make it non-dumpable, so that a process of the
    same uid can neither open them through /proc/PID/fd nor ptrace the daemon (only a
    process with CAP_SYS_PTRACE can). This also turns off the daemon's core dumps."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        log.warning("daemon.dumpable", extra={"why": f"prctl failed: {os.strerror(err)}"})


_M_MMAP_THRESHOLD, _M_ARENA_MAX = -3, -8  # glibc's mallopt parameters
_MMAP_THRESHOLD = 64 * 1024


def tame_malloc() -> Callable[[], None]:
    """A long-running daemon should give back what its sessions made it allocate: glibc keeps
    freed memory in per-thread arenas (one per gRPC thread) and below a moving mmap threshold,
    so RSS stays at its high-water mark. Two arenas, allocations from 64 KiB mapped on their
    own (returned when freed), and `malloc_trim` after sessions end (the function returned:
    a no-op where the C library is not glibc)."""
    libc = ctypes.CDLL(None)
    if not hasattr(libc, "mallopt") or not hasattr(libc, "malloc_trim"):
        return lambda: None
    libc.mallopt(_M_ARENA_MAX, 2)
    libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD)

    def trim() -> None:
        libc.malloc_trim(0)

    return trim


FD_HEADROOM = 256  # fds beside the chunks': sockets, log files, gRPC, libraries
FD_PER_SESSION = FDS_PER_PLACE * CONNECTIONS_PER_SESSION + 2  # its connections, wakeup fds
FD_SPARE = FDS_PER_PLACE * SPARE_CONNECTIONS + WAITING_CONNECTIONS  # tidalpool.sock beside them


def ensure_fd_room(chunks: int, settings: Settings) -> dict[str, int]:
    """Every chunk is an open fd: raise RLIMIT_NOFILE's soft limit up to the hard limit if the
    chunks and some headroom need it; refuse to start if even the hard limit is too low.
    Returns the open-files limit in effect and what is needed, for the start-up log."""
    need = chunks + FD_HEADROOM + FD_SPARE + FD_PER_SESSION * settings.max_sessions
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= need:
        return {"limit": soft, "needed": need}
    if hard != resource.RLIM_INFINITY and hard < need:
        raise directory.SettingRefused(
            f"the pools are {chunks} chunks of chunk_size {settings.chunk_size} bytes, one open"
            f" file each, and with headroom the daemon needs {need} open files, but the hard"
            f" limit (ulimit -Hn) is {hard}: raise it (LimitNOFILE= in the systemd unit), or"
            " use a larger chunk_size or smaller pools"
        )
    new_soft = hard if hard != resource.RLIM_INFINITY else need
    resource.setrlimit(resource.RLIMIT_NOFILE, (new_soft, hard))
    return {"limit": new_soft, "raised_from": soft, "needed": need}


def _reap(registry: Registry, stop: threading.Event, trim: Callable[[], None]) -> None:
    """End sessions past their deadlines; give memory back once sessions have ended."""
    period = min(0.5, registry.settings.attach_timeout_s / 4)
    ended = 0
    while not stop.wait(period):
        registry.reap()
        now_ended = sum(registry.ended_total.values())
        if now_ended != ended:
            ended = now_ended
            trim()


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
