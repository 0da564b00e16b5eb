"""The metrics: the collector against a registry and planner built by hand (exact values), the
gRPC interceptor against a test service, and a daemon serving them over HTTP."""

from __future__ import annotations

import contextlib
import socket
import urllib.request
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from google.protobuf.message import Message
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from tidalclient.local import is_serving
from tidalcore.errors import InvalidArgument
from tidalcore.units import Bytes
from tidalcore.v1 import pool_pb2
from tidalpoold import server
from tidalpoold.backends import SimBackend
from tidalpoold.metrics import DaemonCollector, Metrics, job_label
from tidalpoold.plan_worker import PlanWorker
from tidalpoold.rpc import bidi_stream, service, unary
from tidalpoold.sessions import PlanFootprint, Reason, Registry
from tidalpoold.settings import Settings

C = 2 * 1024 * 1024  # one chunk


@pytest.fixture
def registry(tmp_path: Path) -> Iterator[Registry]:
    """Device pool of 8 chunks, host pool of 4, at most 3 sessions."""
    settings = Settings(
        device_pool=Bytes(8 * C),
        host_pool=Bytes(4 * C),
        default_device_lease=Bytes(C),
        default_host_lease=Bytes(C),
        chunk_size=Bytes(C),
        max_sessions=3,
        socket_dir=tmp_path,
        plan_cache_dir=tmp_path,
        metrics_address="",
    )
    backend = SimBackend(8 * C, 4 * C, C)
    yield Registry(settings, backend)
    backend.close()


@pytest.fixture
def planner(registry: Registry) -> Iterator[PlanWorker]:
    p = PlanWorker(registry.settings)
    yield p
    p.close()


def scrape(collector: DaemonCollector) -> CollectorRegistry:
    reg = CollectorRegistry(auto_describe=False)
    reg.register(collector)
    return reg


def value(reg: CollectorRegistry, name: str, **labels: str) -> float | None:
    return reg.get_sample_value(name, labels)


def beat(**counts: int) -> pool_pb2.Heartbeat:
    return pool_pb2.Heartbeat(**counts)


def test_pool_sessions_and_counts_have_the_registrys_exact_values(
    registry: Registry, planner: PlanWorker
) -> None:
    a = registry.open(3 * C, 2 * C, "resnet", 11, 0)
    b = registry.open(C, C, "bert", 12, 0)
    registry.attach(a)
    registry.touch(
        a,
        beat(
            device_used_bytes=5_000_000,
            device_peak_bytes=6_000_000,
            host_used_bytes=1_000,
            plan_misses=3,
            swapped_out_bytes=4096,
            swapped_in_bytes=1024,
            swap_stall_ns=250_000_000,
            on_demand_out_bytes=3072,
            on_demand_in_bytes=512,
        ),
    )
    registry.touch(  # every count again (a count never goes down), plan_misses up by 2
        a,
        beat(
            device_used_bytes=4_000_000,
            device_peak_bytes=5_000_000,
            plan_misses=5,
            swapped_out_bytes=4096,
            swapped_in_bytes=1024,
            swap_stall_ns=250_000_000,
            on_demand_out_bytes=3072,
            on_demand_in_bytes=512,
        ),
    )
    a.plan = PlanFootprint(height_bytes=3_000_000, lower_bound_bytes=2_000_000)
    planner.plans_made, planner.plans_cached, planner.plans_failed = 2, 1, 4
    planner.plans_unfit = 3
    reg = scrape(DaemonCollector(registry, planner, registry.backend.facts, started=1000.0))

    for pool, size, leased, used in (
        ("device", 8 * C, 4 * C, 4_000_000),
        ("host", 4 * C, 3 * C, 0),  # the second heartbeat said host_used 0
    ):
        assert value(reg, "tidalpool_pool_size_bytes", pool=pool) == size
        assert value(reg, "tidalpool_pool_bytes", pool=pool, state="leased") == leased
        assert value(reg, "tidalpool_pool_bytes", pool=pool, state="free") == size - leased
        assert value(reg, "tidalpool_pool_bytes", pool=pool, state="used") == used
    assert value(reg, "tidalpool_sessions", state="attached") == 1
    assert value(reg, "tidalpool_sessions", state="pending") == 1
    assert value(reg, "tidalpool_sessions_max") == 3
    assert value(reg, "tidalpool_sessions_attached_total") == 1

    ka = {"session_id": a.id, "job_name": "resnet"}
    kb = {"session_id": b.id, "job_name": "bert"}
    assert value(reg, "tidalpool_session_lease_bytes", pool="device", **ka) == 3 * C
    assert value(reg, "tidalpool_session_lease_bytes", pool="host", **ka) == 2 * C
    assert value(reg, "tidalpool_session_lease_bytes", pool="device", **kb) == C
    assert value(reg, "tidalpool_session_used_bytes", pool="device", **ka) == 4_000_000
    assert value(reg, "tidalpool_session_peak_bytes", **ka) == 6_000_000  # the peak stays
    assert value(reg, "tidalpool_session_plan_footprint_bytes", **ka) == 3_000_000
    assert value(reg, "tidalpool_session_plan_lower_bound_bytes", **ka) == 2_000_000
    assert value(reg, "tidalpool_session_plan_fragmentation_ratio", **ka) == 1.5
    assert value(reg, "tidalpool_session_plan_footprint_bytes", **kb) is None  # no plan yet
    assert value(reg, "tidalpool_session_plan_misses_total", **ka) == 5
    assert value(reg, "tidalpool_session_swapped_bytes_total", direction="out", **ka) == 4096
    assert value(reg, "tidalpool_session_swapped_bytes_total", direction="in", **ka) == 1024
    assert value(reg, "tidalpool_session_swap_stall_seconds_total", **ka) == 0.25
    on_demand = "tidalpool_session_swapped_on_demand_bytes_total"
    assert value(reg, on_demand, direction="out", **ka) == 3072
    assert value(reg, on_demand, direction="in", **ka) == 512
    assert value(reg, on_demand, direction="out", **kb) == 0  # attached or not, from 0

    assert value(reg, "tidalpool_plan_misses_total") == 5
    assert value(reg, "tidalpool_swapped_bytes_total", direction="out") == 4096
    assert value(reg, "tidalpool_swap_stall_seconds_total") == 0.25
    assert value(reg, "tidalpool_swapped_on_demand_bytes_total", direction="out") == 3072
    assert value(reg, "tidalpool_swapped_on_demand_bytes_total", direction="in") == 512
    assert value(reg, "tidalpool_plans_total", outcome="solved") == 2
    assert value(reg, "tidalpool_plans_total", outcome="unfit") == 3
    assert value(reg, "tidalpool_plans_total", outcome="cached") == 1
    assert value(reg, "tidalpool_plans_total", outcome="failed") == 4
    assert value(reg, "tidalpool_start_time_seconds") == 1000.0
    # Per-session series off (metrics_sessions = "off"): the totals, and no session's id, job
    # or usage anywhere.
    quiet = scrape(
        DaemonCollector(registry, planner, registry.backend.facts, 1000.0, per_session=False)
    )
    assert value(quiet, "tidalpool_plan_misses_total") == 5
    assert value(quiet, "tidalpool_session_lease_bytes", pool="device", **ka) is None
    text = generate_latest(quiet).decode()
    assert a.id not in text and "resnet" not in text and "session_id" not in text
    facts = registry.backend.facts()
    for direction in ("h2d", "d2h"):  # sim measures memmove at start, as cuda probes PCIe
        bandwidth = "tidalpool_copy_bandwidth_bytes_per_second"
        measured = float(facts[f"{direction}_gbps"])
        assert measured > 0
        assert value(reg, bandwidth, direction=direction, source="probe") == pytest.approx(
            measured * 1e9
        )
        assert value(reg, bandwidth, direction=direction, source="assumed") is None
    sim = {"device": "sim (memfd chunks)", "pcie_generation": "", "pcie_width": ""}
    assert value(reg, "tidalpool_device_info", pci_bus_id="", **sim) == 1
    assert value(reg, "tidalpool_device_memory_total_bytes") == 8 * C  # sim: the device pool
    facts = registry.backend.facts()
    used = value(reg, "tidalpool_device_memory_used_bytes")
    assert used == facts["resident_bytes"] == int(facts["total_bytes"]) - int(facts["free_bytes"])
    assert 'tidalpool_build_info{backend="sim",mode="memfd"' in generate_latest(reg).decode()
    registry.end(a.id, Reason.REASON_DETACHED, "test")
    registry.end(b.id, Reason.REASON_DETACHED, "test")


def test_an_ended_sessions_series_vanish_and_the_totals_keep_its_counts(
    registry: Registry, planner: PlanWorker
) -> None:
    a = registry.open(C, C, "a", 1, 0)
    b = registry.open(C, C, "b", 2, 0)
    for s in (a, b):
        registry.attach(s)
    registry.touch(a, beat(swapped_out_bytes=100, swap_stall_ns=1_000_000_000, plan_misses=2))
    registry.touch(
        a,
        beat(
            swapped_out_bytes=100,
            swap_stall_ns=1_000_000_000,
            plan_misses=2,
            on_demand_in_bytes=60,
        ),
    )
    registry.touch(b, beat(swapped_out_bytes=50, on_demand_in_bytes=30))
    with pytest.raises(InvalidArgument, match="swapped_out_bytes 40 is below the 50"):
        registry.touch(b, beat(swapped_out_bytes=40, on_demand_in_bytes=20))  # going down
    a.trace.events_received = 70  # as if 70 events had arrived
    b.trace.events_received = 30
    collector = DaemonCollector(registry, planner, dict)
    before = scrape(collector)
    assert value(before, "tidalpool_trace_events_received_total") == 100
    registry.end(a.id, Reason.REASON_EVICTED, "test")
    after = scrape(collector)

    assert value(after, "tidalpool_session_lease_bytes", pool="device", session_id=a.id,
                 job_name="a") is None  # fmt: skip
    assert a.id not in generate_latest(after).decode()
    assert value(after, "tidalpool_sessions", state="attached") == 1
    assert value(after, "tidalpool_sessions_ended_total", reason="evicted") == 1
    assert value(after, "tidalpool_sessions_ended_total", reason="detached") == 0
    assert value(after, "tidalpool_sessions_ended_total", reason="shutdown") == 0
    assert value(after, "tidalpool_swapped_bytes_total", direction="out") == 150
    assert value(after, "tidalpool_swapped_on_demand_bytes_total", direction="in") == 90
    assert value(after, "tidalpool_swap_stall_seconds_total") == 1.0
    assert value(after, "tidalpool_plan_misses_total") == 2
    assert value(after, "tidalpool_trace_events_received_total") == 100  # never goes down
    assert value(after, "tidalpool_pool_bytes", pool="device", state="leased") == C
    registry.end(b.id, Reason.REASON_SHUTDOWN, "test")


def test_cuda_facts_become_device_gauges_and_the_probe_replaces_the_assumption(
    registry: Registry, planner: PlanWorker
) -> None:
    facts = {
        "device": "NVIDIA H100",
        "total_bytes": 80 * 2**30,
        "free_bytes": 70 * 2**30,
        "pcie_generation": 5,
        "pcie_width": 16,
        "h2d_gbps": 25.5,
        "d2h_gbps": 26.25,
    }
    calls: list[int] = []

    def live() -> dict[str, str | int | float]:
        calls.append(1)
        return facts

    reg = scrape(DaemonCollector(registry, planner, live))
    assert value(reg, "tidalpool_device_memory_total_bytes") == 80 * 2**30
    assert value(reg, "tidalpool_device_memory_used_bytes") == 10 * 2**30
    facts["free_bytes"] = 60 * 2**30
    calls.clear()
    assert value(reg, "tidalpool_device_memory_used_bytes") == 20 * 2**30  # now, not at start
    assert calls == [1]  # the facts (one NVML query) once per scrape
    link = {"pcie_generation": "5", "pcie_width": "16"}
    assert value(reg, "tidalpool_device_info", device="NVIDIA H100", pci_bus_id="", **link) == 1
    bandwidth = "tidalpool_copy_bandwidth_bytes_per_second"
    assert value(reg, bandwidth, direction="h2d", source="probe") == 25.5e9
    assert value(reg, bandwidth, direction="d2h", source="probe") == 26.25e9
    assert value(reg, bandwidth, direction="h2d", source="assumed") is None


def test_the_front_doors_connections_are_gauges_and_its_refusals_a_counter(
    registry: Registry, planner: PlanWorker
) -> None:
    counts = {"waiting": 3, "relayed": 7, "refused": 11}
    reg = scrape(DaemonCollector(registry, planner, dict, connections=lambda: counts))
    assert value(reg, "tidalpool_connections", state="waiting") == 3
    assert value(reg, "tidalpool_connections", state="relayed") == 7
    assert value(reg, "tidalpool_connections_refused_total") == 11
    counts["refused"] = 12
    assert value(reg, "tidalpool_connections_refused_total") == 12  # now, at each scrape
    reg = scrape(DaemonCollector(registry, planner, dict))  # no front door: no such series
    assert value(reg, "tidalpool_connections", state="waiting") is None


def test_job_names_become_bounded_plain_label_values() -> None:
    assert job_label("resnet50/bs-32@node:1") == "resnet50/bs-32@node:1"
    assert job_label('a b"c\n{}ü') == "a_b_c____"
    assert job_label("x" * 500) == "x" * 64


def test_plan_durations_are_a_histogram_by_outcome() -> None:
    m = Metrics(gpu="0")
    m.on_planned("solved", 0.3)
    m.on_planned("solved", 7.0)
    m.on_planned("cached", 0.002)
    reg = m.registry
    count = "tidalpool_plan_duration_seconds_count"
    bucket = "tidalpool_plan_duration_seconds_bucket"
    solved, cached = {"gpu": "0", "outcome": "solved"}, {"gpu": "0", "outcome": "cached"}
    assert value(reg, count, **solved) == 2
    assert value(reg, "tidalpool_plan_duration_seconds_sum", **solved) == pytest.approx(7.3)
    assert value(reg, bucket, le="0.5", **solved) == 1
    assert value(reg, bucket, le="10.0", **solved) == 2
    assert value(reg, bucket, le="0.005", **cached) == 1
    assert value(reg, bucket, le="0.005", **solved) == 0


def test_an_address_in_use_is_refused_naming_it() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        address = f"127.0.0.1:{taken.getsockname()[1]}"
        with pytest.raises(OSError, match=f"metrics_address '{address}'.*in use"):
            Metrics(gpu="0").serve(address)


def test_every_served_sample_carries_the_gpu_label(registry: Registry, planner: PlanWorker) -> None:
    m = Metrics(gpu="3")
    m.add(DaemonCollector(registry, planner, registry.backend.facts))
    session = registry.open(C, C, "job", 1, 0)
    families = list(m.registry.collect())
    names = {f.name for f in families}
    assert {"tidalpool_pool_bytes", "tidalpool_session_lease_bytes"} <= names
    assert {"tidalpool_plan_duration_seconds", "tidalpool_grpc_requests"} <= names
    samples = [s for f in families for s in f.samples]
    assert samples and all(s.labels.get("gpu") == "3" for s in samples)
    key = {"gpu": "3", "session_id": session.id, "job_name": "job", "pool": "device"}
    assert value(m.registry, "tidalpool_session_lease_bytes", **key) == C
    registry.end(session.id, Reason.REASON_DETACHED, "test")


@pytest.fixture
def rpc_server(tmp_path: Path) -> Iterator[tuple[Metrics, grpc.Channel]]:
    """A gRPC server with the metrics interceptor and a test service: Echo answers, Refuse
    aborts INVALID_ARGUMENT, Crash raises, Count streams three replies."""

    def echo(request: pool_pb2.StatsRequest, context: grpc.ServicerContext) -> Message:
        return pool_pb2.StatsResponse()

    def refuse(request: pool_pb2.StatsRequest, context: grpc.ServicerContext) -> Message:
        raise InvalidArgument("no")

    def crash(raw: bytes, context: grpc.ServicerContext) -> bytes:
        raise RuntimeError("bug")

    def count(requests: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[Message]:
        for _ in requests:
            pass
        yield from (pool_pb2.ServerMessage() for _ in range(3))

    m = Metrics(gpu="0")
    server = grpc.server(futures.ThreadPoolExecutor(4), interceptors=[m.rpc])
    methods = {
        "Echo": unary("Echo", pool_pb2.StatsRequest, echo),
        "Refuse": unary("Refuse", pool_pb2.StatsRequest, refuse),
        "Crash": grpc.unary_unary_rpc_method_handler(crash),
        "Count": bidi_stream("Count", count),
    }
    server.add_generic_rpc_handlers((service("test.T", methods),))
    address = f"unix:{tmp_path}/rpc.sock"
    server.add_insecure_port(address)
    server.start()
    with grpc.insecure_channel(address) as channel:
        yield m, channel
    server.stop(None).wait()


def test_grpc_calls_are_counted_by_method_and_code_and_unary_ones_timed(
    rpc_server: tuple[Metrics, grpc.Channel],
) -> None:
    m, channel = rpc_server
    for method, times in (("Echo", 2), ("Refuse", 1), ("Crash", 1), ("Nothing", 1)):
        call = channel.unary_unary(f"/test.T/{method}")
        for _ in range(times):
            with contextlib.suppress(grpc.RpcError):
                call(b"")
    replies = list(channel.stream_stream("/test.T/Count")(iter([b"", b""])))
    assert len(replies) == 3

    reg = m.registry

    def calls(method: str, code: str) -> float | None:
        return value(reg, "tidalpool_grpc_requests_total", gpu="0", method=method, code=code)

    def timed(method: str, code: str) -> float | None:
        labels = {"gpu": "0", "method": method, "code": code}
        return value(reg, "tidalpool_grpc_request_duration_seconds_count", **labels)

    assert calls("test.T/Echo", "OK") == timed("test.T/Echo", "OK") == 2
    assert calls("test.T/Refuse", "INVALID_ARGUMENT") == 1
    assert timed("test.T/Refuse", "INVALID_ARGUMENT") == 1
    assert calls("test.T/Crash", "UNKNOWN") == 1
    assert calls("test.T/Count", "OK") == 1
    assert timed("test.T/Count", "OK") is None  # streams are counted, not timed
    text = generate_latest(reg).decode()
    assert "Nothing" not in text  # an unknown method is no label value


def test_a_daemon_serves_its_metrics_over_http_until_it_stops(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(server, "make_undumpable", lambda: None)  # a test process, not a daemon
    settings = Settings(
        device_pool=Bytes(4 * C),
        host_pool=Bytes(4 * C),
        default_device_lease=Bytes(C),
        default_host_lease=Bytes(C),
        chunk_size=Bytes(C),
        socket_dir=tmp_path / "run",
        plan_cache_dir=tmp_path / "plans",
        metrics_address="127.0.0.1:0",
        gpu=2,
    )
    daemon = server.build_daemon(settings)
    try:
        assert is_serving(settings.socket_dir)  # one gRPC health check
        host, port = daemon.metrics_address.split(":")
        assert host == "127.0.0.1" and int(port) > 0
        with urllib.request.urlopen(f"http://{daemon.metrics_address}/metrics") as reply:
            text = reply.read().decode()
    finally:
        daemon.shutdown()
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    assert samples[("tidalpool_pool_size_bytes", (("gpu", "2"), ("pool", "device")))] == 4 * C
    assert samples[("tidalpool_connections_refused_total", (("gpu", "2"),))] == 0
    assert ("tidalpool_connections", (("gpu", "2"), ("state", "waiting"))) in samples
    check = (("code", "OK"), ("gpu", "2"), ("method", "grpc.health.v1.Health/Check"))
    assert samples[("tidalpool_grpc_requests_total", check)] == 1
    assert "_created" not in text
    with pytest.raises(OSError), socket.create_connection(("127.0.0.1", int(port)), timeout=2):
        pass  # the metrics server stopped with the daemon
