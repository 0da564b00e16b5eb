"""Prometheus metrics: read from the daemon's state when scraped, served over HTTP.

    scrape ──HTTP──▶ prometheus_client server ──▶ Metrics.registry (the daemon's own)
                                                   └─ WithLabel: adds gpu="N" to every sample of
                                                       ├─ DaemonCollector: Registry.snapshot()
                                                       │    (one lock hold), the planner's
                                                       │    counts, the backend's facts
                                                       ├─ RpcMetrics: calls by method and code
                                                       │    (a gRPC server interceptor)
                                                       └─ plan durations (PlanWorker.on_planned)

The daemon's own paths do no more for metrics than a gRPC call's or a plan's counter and
histogram update: the collector copies, at scrape time, what the registry and planner already
keep, under the registry's lock. A scrape asks the backend for its
facts: on cuda one NVML memory query (the PCIe link and copy bandwidths are those found at
start); on sim one fstat per chunk. Per-session series exist for live sessions only, at most
`max_sessions` of them (the daemon refuses sessions beyond it), and vanish when a session ends.
"""

from __future__ import annotations

import logging
import math
import re
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import grpc
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    make_wsgi_app,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from tidalpoold import __version__
from tidalpoold.plan_worker import PlanWorker
from tidalpoold.sessions import Registry, Snapshot

log = logging.getLogger("tidalpoold.metrics")

Facts = Mapping[str, str | int | float]

JOB_NAME_MAX = 64
"""Characters of a job name kept in the `job_name` label."""

REASONS = ("detached", "evicted", "shutdown")
"""Why sessions end (`tidalpool_sessions_ended_total`'s `reason`), each exported from 0."""

PLAN_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
"""Seconds: a cached plan takes milliseconds, a solve up to plan_time_limit_s (5 s) and more."""
GIVE_BACK_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
"""Seconds: a session gives chunks back once its job is between ops, within quota_deadline_s."""


def job_label(job_name: str) -> str:
    """A job name as a label value: letters, digits and `_.:/@+-` kept, anything else `_`,
    at most JOB_NAME_MAX characters."""
    return re.sub(r"[^A-Za-z0-9_.:/@+-]", "_", job_name[:JOB_NAME_MAX])


class DaemonCollector(Collector):
    """Every metric of the daemon's state, made from one registry snapshot per scrape.

    `facts` is called once per scrape: the backend's facts (`Backend.facts`)."""

    def __init__(
        self,
        registry: Registry,
        planner: PlanWorker,
        facts: Callable[[], Facts],
        started: float | None = None,
        per_session: bool = True,
        connections: Callable[[], Mapping[str, int]] | None = None,
    ) -> None:
        self.registry = registry
        self.planner = planner
        self.facts = facts
        self.started = time.time() if started is None else started
        self.per_session = per_session  # series labelled with each session's id and job
        self.connections = connections  # tidalpool.sock's: waiting, relayed, refused

    def describe(self) -> Iterable[Metric]:
        return ()  # registering must not scrape

    def collect(self) -> Iterator[Metric]:
        snap = self.registry.snapshot()
        yield from self._pools(snap)
        yield from self._sessions(snap)
        if self.per_session:
            yield from self._per_session(snap)
        yield from self._planner()
        if self.connections is not None:
            yield from self._connections(self.connections())
        yield from self._device(dict(self.facts()))

    @staticmethod
    def _connections(counts: Mapping[str, int]) -> Iterator[Metric]:
        held = GaugeMetricFamily(
            "tidalpool_connections",
            "Connections to tidalpool.sock: waiting for their HTTP/2 preface, or relayed to the"
            " gRPC server.",
            labels=["state"],
        )
        for state in ("waiting", "relayed"):
            held.add_metric([state], counts[state])
        yield held
        yield CounterMetricFamily(
            "tidalpool_connections_refused",
            "Connections to tidalpool.sock the daemon closed: no place for their uid or all held,"
            " the waiting room full, no HTTP/2 preface in time, not HTTP/2, or a quiet one's"
            " place taken by a lighter uid.",
            value=counts["refused"],
        )

    def _pools(self, snap: Snapshot) -> Iterator[Metric]:
        size = GaugeMetricFamily(
            "tidalpool_pool_size_bytes", "Bytes of the pool (whole chunks).", labels=["pool"]
        )
        state = GaugeMetricFamily(
            "tidalpool_pool_bytes",
            "Bytes of the pool by state: free (not leased), leased (to sessions), used (live"
            " bytes the sessions report, part of leased).",
            labels=["pool", "state"],
        )
        quarantined = GaugeMetricFamily(
            "tidalpool_pool_quarantined_bytes",
            "Bytes of the pool out of it because their scrub failed (neither free nor leased;"
            " scrubbed again until they are free).",
            labels=["pool"],
        )
        for pool, usage in (("device", snap.device), ("host", snap.host)):
            size.add_metric([pool], usage.total_bytes)
            state.add_metric([pool, "free"], usage.free_bytes)
            state.add_metric([pool, "leased"], usage.leased_bytes)
            state.add_metric([pool, "used"], usage.used_bytes)
            quarantined.add_metric([pool], usage.quarantined_bytes)
        yield size
        yield state
        yield quarantined

    def _sessions(self, snap: Snapshot) -> Iterator[Metric]:
        live = GaugeMetricFamily("tidalpool_sessions", "Live sessions by state.", labels=["state"])
        for name in ("pending", "attached"):
            live.add_metric([name], sum(s.state == name for s in snap.sessions))
        yield live
        yield GaugeMetricFamily(
            "tidalpool_sessions_max",
            "Most sessions at once (max_sessions): the bound of every per-session series.",
            value=self.registry.settings.max_sessions,
        )
        yield CounterMetricFamily(
            "tidalpool_sessions_attached", "Sessions attached.", value=snap.attached_total
        )
        ended = CounterMetricFamily(
            "tidalpool_sessions_ended", "Sessions ended, by reason.", labels=["reason"]
        )
        for reason in REASONS:
            ended.add_metric([reason], snap.ended_total.get(reason, 0))
        yield ended
        yield CounterMetricFamily(
            "tidalpool_trace_events_received",
            "Trace events received from sessions.",
            value=snap.events_received,
        )
        c = snap.counts
        yield CounterMetricFamily(
            "tidalpool_plan_misses",
            "Allocations a plan could not serve (placed online), as clients report them.",
            value=c.plan_misses,
        )
        swapped = CounterMetricFamily(
            "tidalpool_swapped_bytes",
            "Bytes clients swapped: out (device to host), in (host to device).",
            labels=["direction"],
        )
        swapped.add_metric(["out"], c.swapped_out_bytes)
        swapped.add_metric(["in"], c.swapped_in_bytes)
        yield swapped
        on_demand = CounterMetricFamily(
            "tidalpool_swapped_on_demand_bytes",
            "Of the bytes clients swapped, those no plan scheduled (their LRU caches').",
            labels=["direction"],
        )
        on_demand.add_metric(["out"], c.on_demand_out_bytes)
        on_demand.add_metric(["in"], c.on_demand_in_bytes)
        yield on_demand
        yield CounterMetricFamily(
            "tidalpool_quota_changes",
            "QuotaChange messages sent to elastic sessions.",
            value=self.registry.quota_changes,
        )
        yield CounterMetricFamily(
            "tidalpool_quota_given_back_chunks",
            "Device chunks elastic sessions gave back.",
            value=self.registry.given_back_chunks,
        )
        yield CounterMetricFamily(
            "tidalpool_swap_stall_seconds",
            "Time clients' ops and mallocs waited for swap copies.",
            value=c.swap_stall_ns / 1e9,
        )

    def _per_session(self, snap: Snapshot) -> Iterator[Metric]:
        keys = ["session_id", "job_name"]

        def gauge(name: str, doc: str, *extra: str) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, labels=[*keys, *extra])

        def counter(name: str, doc: str, *extra: str) -> CounterMetricFamily:
            return CounterMetricFamily(name, doc, labels=[*keys, *extra])

        lease = gauge("tidalpool_session_lease_bytes", "Bytes leased to the session.", "pool")
        used = gauge("tidalpool_session_used_bytes", "Live bytes the session reports.", "pool")
        peak = gauge(
            "tidalpool_session_peak_bytes",
            "Peak device-resident bytes of the session (its blocks swapped to the host are not"
            " counted: see tidalpool_session_live_peak_bytes).",
        )
        live_peak = gauge(
            "tidalpool_session_live_peak_bytes",
            "Peak live bytes of the session, device-resident and swapped to the host together.",
        )
        footprint = gauge(
            "tidalpool_session_plan_footprint_bytes",
            "Height of the session's latest plan (its arena, the pieces of swapped blocks"
            " included).",
        )
        bound = gauge(
            "tidalpool_session_plan_lower_bound_bytes",
            "Lower bound of the latest plan's problem (peak of aligned live bytes).",
        )
        ratio = gauge(
            "tidalpool_session_plan_fragmentation_ratio",
            "Plan height over its lower bound (1: no fragmentation).",
        )
        events = counter("tidalpool_session_trace_events_received", "Trace events received.")
        misses = counter("tidalpool_session_plan_misses", "Allocations the plan could not serve.")
        swapped = counter("tidalpool_session_swapped_bytes", "Bytes swapped.", "direction")
        on_demand = counter(
            "tidalpool_session_swapped_on_demand_bytes",
            "Of the bytes swapped, those no plan scheduled (the LRU cache's).",
            "direction",
        )
        stall = counter("tidalpool_session_swap_stall_seconds", "Time waited for swap copies.")
        elastic = gauge(
            "tidalpool_session_device_quota_bytes",
            "An elastic session's device lease bounds: floor (guaranteed), quota (what it may"
            " hold now), ceiling (the most it asked for), borrowed (held above its floor).",
            "bound",
        )
        for s in snap.sessions:
            key = [s.id, job_label(s.job_name)]
            lease.add_metric([*key, "device"], s.device_lease)
            lease.add_metric([*key, "host"], s.host_lease)
            used.add_metric([*key, "device"], s.device_used)
            used.add_metric([*key, "host"], s.host_used)
            peak.add_metric(key, s.device_peak)
            live_peak.add_metric(key, s.live_peak)
            if s.plan is not None:
                footprint.add_metric(key, s.plan.height_bytes)
                bound.add_metric(key, s.plan.lower_bound_bytes)
                if s.plan.lower_bound_bytes > 0:
                    ratio.add_metric(key, s.plan.height_bytes / s.plan.lower_bound_bytes)
            events.add_metric(key, s.events_received)
            misses.add_metric(key, s.counts.plan_misses)
            swapped.add_metric([*key, "out"], s.counts.swapped_out_bytes)
            swapped.add_metric([*key, "in"], s.counts.swapped_in_bytes)
            on_demand.add_metric([*key, "out"], s.counts.on_demand_out_bytes)
            on_demand.add_metric([*key, "in"], s.counts.on_demand_in_bytes)
            stall.add_metric(key, s.counts.swap_stall_ns / 1e9)
            if s.elastic is not None:
                chunk = self.registry.device.chunk_bytes
                elastic.add_metric([*key, "floor"], s.elastic.floor * chunk)
                elastic.add_metric([*key, "quota"], s.elastic.quota * chunk)
                elastic.add_metric([*key, "ceiling"], s.elastic.most * chunk)
                elastic.add_metric(
                    [*key, "borrowed"], max(0, s.device_lease - s.elastic.floor * chunk)
                )
        yield from (lease, used, peak, live_peak, footprint, bound, ratio, events, misses, swapped)
        yield from (on_demand, stall, elastic)

    def _planner(self) -> Iterator[Metric]:
        plans = CounterMetricFamily(
            "tidalpool_plans",
            "Plans computed, by outcome: solved (a placement search), cached (from the plan"
            " cache), unfit (a swap plan whose placement did not fit the limit: not sent) or"
            " failed.",
            labels=["outcome"],
        )
        p = self.planner
        plans.add_metric(["solved"], p.plans_made)
        plans.add_metric(["cached"], p.plans_cached)
        plans.add_metric(["unfit"], p.plans_unfit)
        plans.add_metric(["failed"], p.plans_failed)
        plans.add_metric(["too_large"], p.plans_too_large)
        yield plans

    def _device(self, facts: dict[str, str | int | float]) -> Iterator[Metric]:
        backend = self.registry.backend
        info = GaugeMetricFamily(
            "tidalpool_build_info",
            "The daemon's version, Python and backend (always 1).",
            labels=["version", "python", "backend", "mode"],
        )
        python = ".".join(map(str, sys.version_info[:3]))
        info.add_metric([__version__, python, backend.name, backend.mode], 1)
        yield info
        device = GaugeMetricFamily(
            "tidalpool_device_info",
            "The device this daemon manages and its PCIe link at start ('' where none, as on"
            " sim) (always 1).",
            labels=["device", "pci_bus_id", "pcie_generation", "pcie_width"],
        )
        link = [str(facts.get(key, "")) for key in ("pcie_generation", "pcie_width")]
        device.add_metric([str(facts.get("device", "")), backend.pci_bus_id, *link], 1)
        yield device
        yield GaugeMetricFamily(
            "tidalpool_start_time_seconds",
            "When the daemon started, in seconds since the epoch.",
            value=self.started,
        )
        total, free = _number(facts.get("total_bytes")), _number(facts.get("free_bytes"))
        if total is not None and free is not None:
            yield GaugeMetricFamily(
                "tidalpool_device_memory_total_bytes",
                "Memory of the device (cuda: the GPU's, from NVML; sim: the device pool).",
                value=total,
            )
            yield GaugeMetricFamily(
                "tidalpool_device_memory_used_bytes",
                "Memory of the device in use now (cuda: by any process, the pool included, from"
                " NVML; sim: the device pool's resident pages).",
                value=total - free,
            )
        bandwidth = GaugeMetricFamily(
            "tidalpool_copy_bandwidth_bytes_per_second",
            "Copy bandwidth between host and device: measured by the backend's probe at start"
            " (source=probe), else what the swap planner assumes (source=assumed).",
            labels=["direction", "source"],
        )
        for direction in ("h2d", "d2h"):
            measured = _number(facts.get(f"{direction}_gbps"))
            if measured is not None and measured > 0:
                bandwidth.add_metric([direction, "probe"], measured * 1e9)
            else:
                bandwidth.add_metric([direction, "assumed"], self.planner.copy_gbps * 1e9)
        yield bandwidth


def _number(value: object) -> float | None:
    """A fact as a finite number, or None."""
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        return None
    try:
        number = float(value)
    except ValueError:
        return None
    return number if math.isfinite(number) else None


class WithLabel(Collector):
    """The metrics of `inner` with one more label on every sample (the daemon's `gpu`)."""

    def __init__(self, inner: CollectorRegistry, name: str, value: str) -> None:
        self.inner = inner
        self.name = name
        self.value = value

    def describe(self) -> Iterable[Metric]:
        return ()

    def collect(self) -> Iterator[Metric]:
        for metric in self.inner.collect():  # fresh objects every scrape: safe to change
            metric.samples = [
                s._replace(labels={self.name: self.value, **s.labels}) for s in metric.samples
            ]
            yield metric


class RpcMetrics(grpc.ServerInterceptor):  # type: ignore[misc]
    """Counts every call of a method the server knows by method and status code, and times
    the calls whose reply is one message.

    Unknown methods are not counted (their names would be unbounded label values). Calls that
    stream replies are counted, not timed: `Pool/Session` lasts the session's life."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            "tidalpool_grpc_requests",
            "gRPC calls handled, by method and status code.",
            ["method", "code"],
            registry=registry,
        )
        self.seconds = Histogram(
            "tidalpool_grpc_request_duration_seconds",
            "Time from a gRPC call's start to its status, by method and status code (calls"
            " with one reply message only).",
            ["method", "code"],
            registry=registry,
        )

    def intercept_service(self, continuation: Callable[[Any], Any], details: Any) -> Any:
        handler = continuation(details)
        if handler is None:
            return None
        method = str(details.method).lstrip("/")
        for kind in ("unary_unary", "stream_unary", "unary_stream", "stream_stream"):
            behaviour = getattr(handler, kind)
            if behaviour is not None:
                wrap = self._stream if kind.endswith("stream") else self._unary
                return handler._replace(**{kind: wrap(method, behaviour)})
        return handler

    def _done(self, method: str, context: Any, otherwise: grpc.StatusCode) -> str:
        """Count a call ended with the code its context holds (abort, set_code), else
        `otherwise`; return the code's name."""
        code = (context.code() or otherwise).name
        self.requests.labels(method, code).inc()
        return str(code)

    def _unary(self, method: str, behaviour: Callable[..., Any]) -> Callable[..., Any]:
        def call(request: Any, context: Any) -> Any:
            started, code = time.perf_counter(), grpc.StatusCode.UNKNOWN  # raised: UNKNOWN
            try:
                reply = behaviour(request, context)
                code = grpc.StatusCode.OK
                return reply
            finally:
                name = self._done(method, context, code)
                self.seconds.labels(method, name).observe(time.perf_counter() - started)

        return call

    def _stream(self, method: str, behaviour: Callable[..., Any]) -> Callable[..., Any]:
        def call(request: Any, context: Any) -> Iterator[Any]:
            code = grpc.StatusCode.UNKNOWN
            try:
                yield from behaviour(request, context)
                code = grpc.StatusCode.OK
            except GeneratorExit:  # closed before its end: the client went away
                code = grpc.StatusCode.CANCELLED
                raise
            finally:
                self._done(method, context, code)

        return call


class Metrics:
    """The daemon's metrics: what is served (`registry`), the collectors it holds, and the
    parts that observe events as they happen. Every sample carries the label gpu=`gpu`."""

    def __init__(self, gpu: str) -> None:
        disable_created_metrics()  # type: ignore[no-untyped-call]  # no `_created` series
        self.registry = CollectorRegistry(auto_describe=False)
        self._own = CollectorRegistry(auto_describe=False)
        self.registry.register(WithLabel(self._own, "gpu", gpu))
        self.rpc = RpcMetrics(self._own)
        self.plan_seconds = Histogram(
            "tidalpool_plan_duration_seconds",
            "Time the planner took for a plan, from the session's trace to the plan on its"
            " stream, by outcome: solved (a placement search) or cached (from the plan cache).",
            ["outcome"],
            buckets=PLAN_BUCKETS,
            registry=self._own,
        )
        for outcome in ("solved", "cached"):
            self.plan_seconds.labels(outcome)
        self.give_back_seconds = Histogram(
            "tidalpool_quota_give_back_seconds",
            "Time from a QuotaChange asking an elastic session for chunks to those chunks free"
            " in the pool (scrubbed).",
            buckets=GIVE_BACK_BUCKETS,
            registry=self._own,
        )

    def add(self, collector: Collector) -> None:
        """Serve `collector`'s metrics too (with the gpu label)."""
        self._own.register(collector)

    def on_give_back(self, seconds: float) -> None:
        self.give_back_seconds.observe(seconds)

    def on_planned(self, outcome: str, seconds: float) -> None:
        self.plan_seconds.labels(outcome).observe(seconds)

    def serve(self, address: str) -> WSGIServer:
        """Serve the registry on `address` (host:port, IPv6 as [::1]:port; port 0: any free
        port, the returned server's `server_port`); an address that cannot be bound raises
        OSError naming it."""
        host, _, port = address.rpartition(":")
        host = host.strip("[]")
        server_class = _MetricsServer6 if ":" in host else _MetricsServer
        try:
            server = make_server(
                host, int(port), make_wsgi_app(self.registry), server_class, _QuietHandler
            )
        except OSError as e:
            raise OSError(
                f"cannot serve metrics on metrics_address {address!r}: {e.strerror or e}"
                ' (choose another with --metrics-address HOST:PORT, or "" for none)'
            ) from e
        threading.Thread(
            target=server.serve_forever, name="tidalpoold-metrics", daemon=True
        ).start()
        return server


METRICS_CONNECTIONS = 32
"""Connections the metrics endpoint serves at once, a thread each; one past them is closed
at once. A Prometheus scrapes on one."""
METRICS_IDLE_S = 5.0
"""How long a metrics connection may send nothing before it is closed (a scrape's request
comes at once)."""


class _QuietHandler(WSGIRequestHandler):
    """Answers a scrape; closes a connection idle for METRICS_IDLE_S; logs nothing."""

    timeout = METRICS_IDLE_S

    def log_message(self, format: str, *args: Any) -> None:
        """Nothing: a scrape a second would fill the log."""


class _MetricsServer(ThreadingMixIn, WSGIServer):
    """A thread per connection, at most METRICS_CONNECTIONS of them: one more is closed at
    once, so that idle or slow peers hold neither unbounded threads nor file descriptors."""

    daemon_threads = True
    request_queue_size = 128  # the listen backlog (5 by default: a burst waits on SYN retries)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._slots = threading.BoundedSemaphore(METRICS_CONNECTIONS)
        self.refused = 0
        super().__init__(*args, **kwargs)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.refused += 1
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)  # starts its thread
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A peer that timed out or went away mid-request is nothing to say; anything else is
        one line in the log (the stock server prints a traceback on stderr)."""
        error = sys.exc_info()[1]
        if not isinstance(error, OSError):
            log.warning("metrics.request_failed", extra={"why": f"{type(error).__name__}: {error}"})


class _MetricsServer6(_MetricsServer):
    address_family = socket.AF_INET6
