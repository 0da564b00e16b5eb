"""Session benchmarks: attach latency, malloc+free in learning mode, trace upload.

    python bench/session.py [--json] [--attaches 200] [--events 1000000]

Starts its own sim daemon. Each number stands beside a baseline measured in
the same run on the same machine:
  attach           vs one gRPC health Check round trip on the same socket
  malloc+free      vs NumPy's np.empty + release of the same size
  trace upload     vs packing the same events into TraceChunks with no transport
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import numpy as np
import tidalpool
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tidalclient import status
from tidalclient.local import LocalDaemon
from tidalclient.recorder import Recorder
from tidalcore.events import ALLOC, FREE, OP


def percentiles(samples_ns: list[float]) -> dict[str, float]:
    ordered = sorted(samples_ns)
    return {
        "median_us": statistics.median(ordered) / 1e3,
        "p99_us": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] / 1e3,
        "n": len(ordered),
    }


def timed(fn: Callable[[], object], n: int) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter_ns()
        fn()
        out.append(time.perf_counter_ns() - t)
    return out


def bench_attach(socket_dir: Path, n: int) -> dict[str, object]:
    sessions: list[tidalpool.Session] = []

    def one() -> None:
        sessions.append(tidalpool.attach(socket_dir, device_limit="64MiB", host_limit="64MiB"))

    samples = []
    for _ in range(n):
        samples += timed(one, 1)
        sessions.pop().close()
    with grpc.insecure_channel(f"unix:{socket_dir / 'tidalpool.sock'}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        request = health_pb2.HealthCheckRequest(service="")
        stub.Check(request)
        baseline = timed(lambda: stub.Check(request), n)
    return {"attach": percentiles(samples), "baseline_grpc_round_trip": percentiles(baseline)}


def per_pair_ns(pair: Callable[[], None], pairs: int, batches: int) -> dict[str, float]:
    """Median and p99 over batches of the mean time per pair (timer cost amortized)."""
    means = []
    for _ in range(batches):
        t = time.perf_counter_ns()
        for _ in range(pairs):
            pair()
        means.append((time.perf_counter_ns() - t) / pairs)
    means.sort()
    return {"median_ns": statistics.median(means), "p99_ns": means[int(0.99 * (len(means) - 1))]}


def bench_malloc(socket_dir: Path, size: int) -> dict[str, object]:
    with tidalpool.attach(socket_dir, device_limit="64MiB") as s:
        # a realistic heap: a few hundred live blocks of mixed sizes around the churn
        rng = np.random.default_rng(0)
        keep = [s.malloc(int(x)) for x in rng.integers(256, 1 << 16, 300)]
        malloc, free = s.malloc, s.free
        session = per_pair_ns(lambda: free(malloc(size)), 1000, 200)
        for b in keep:
            s.free(b)
    empty = np.empty
    baseline = per_pair_ns(lambda: empty(size, np.uint8), 1000, 200)
    return {"size": size, "session_malloc_free": session, "baseline_numpy_empty": baseline}


def bench_upload(socket_dir: Path, events: int) -> dict[str, object]:
    with tidalpool.attach(socket_dir, device_limit="64MiB") as s:
        record, name = s.recorder.record, s.recorder.name_id("aten.mm")
        t0 = time.perf_counter()
        for i in range(events // 4):
            record(ALLOC, i, 4096)
            record(OP, i, 0, 1000, name)
            record(OP, i, 0, 1000, name)
            record(FREE, i)
        t_recorded = time.perf_counter()
        while s.stats().events_received < s.recorder.events_recorded:
            time.sleep(0.001)
        t_received = time.perf_counter()
        received = s.stats().events_received

    packed = []
    packer = Recorder(packed.append, chunk_events=4096, period_s=3600)
    t1 = time.perf_counter()
    for i in range(events // 4):
        packer.record(ALLOC, i, 4096)
        packer.record(OP, i, 0, 1000, 1)
        packer.record(OP, i, 0, 1000, 1)
        packer.record(FREE, i)
    packer.flush()
    t2 = time.perf_counter()
    packer.close()
    assert sum(len(m.trace.kinds) for m in packed if m.HasField("trace")) == events
    wire = sum(m.ByteSize() for m in packed)
    return {
        "events": received,
        "record_only_s": t_recorded - t0,
        "end_to_end_s": t_received - t0,
        "events_per_s": received / (t_received - t0),
        "baseline_pack_only_events_per_s": events / (t2 - t1),
        "wire_bytes_per_event": wire / events,
    }


_SLEEPER = """
import sys, time, tidalpool
s = tidalpool.attach(sys.argv[1], device_limit="16MiB")
s.malloc(1 << 20)
print("ready", flush=True)
time.sleep(60)
"""


def bench_reclaim(socket_dir: Path, repeats: int) -> dict[str, object]:
    """Seconds from SIGKILL of a client to its lease being back in the pool."""
    samples = []
    for _ in range(repeats):
        proc = subprocess.Popen(
            [sys.executable, "-c", _SLEEPER, str(socket_dir)], stdout=subprocess.PIPE, text=True
        )
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        before = status.fetch(socket_dir)[0].device.leased_bytes
        proc.kill()
        t = time.perf_counter()
        while status.fetch(socket_dir)[0].device.leased_bytes == before:
            time.sleep(0.001)
        samples.append(time.perf_counter() - t)
        proc.wait()
        proc.stdout.close()
    return {
        "median_ms": statistics.median(samples) * 1e3,
        "max_ms": max(samples) * 1e3,
        "n": repeats,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--attaches", type=int, default=200)
    parser.add_argument("--events", type=int, default=1_000_000)
    args = parser.parse_args()
    with (
        tempfile.TemporaryDirectory(prefix="tpb-", dir="/tmp") as tmp,
        LocalDaemon.start(Path(tmp), device_pool="1GiB", host_pool="1GiB") as d,
    ):
        result = {
            "machine": f"{platform.machine()}, Python {platform.python_version()}",
            "attach": bench_attach(d.socket_dir, args.attaches),
            "malloc_free": bench_malloc(d.socket_dir, 4096),
            "trace_upload": bench_upload(d.socket_dir, args.events),
            "reclaim_after_sigkill": bench_reclaim(d.socket_dir, 10),
        }
    if args.json:
        print(json.dumps(result, indent=2))
        return
    a, m, u = result["attach"], result["malloc_free"], result["trace_upload"]
    rows = [
        ("attach (handles + Attach + stream)", a["attach"], "us"),
        ("  baseline: one gRPC round trip", a["baseline_grpc_round_trip"], "us"),
        ("malloc+free 4 KiB, learning mode", m["session_malloc_free"], "ns"),
        ("  baseline: np.empty + release", m["baseline_numpy_empty"], "ns"),
    ]
    print(f"machine: {result['machine']}")
    for label, r, unit in rows:
        median, p99 = r[f"median_{unit}"], r[f"p99_{unit}"]
        print(f"{label:38} median {median:9.1f} {unit}   p99 {p99:9.1f} {unit}")
    rate, base = u["events_per_s"] / 1e6, u["baseline_pack_only_events_per_s"] / 1e6
    print(
        f"{'trace upload, one client':38} {rate:6.2f} M events/s end to end "
        f"({u['events']:,} events, {u['wire_bytes_per_event']:.1f} B/event on the wire)"
    )
    print(f"{'  baseline: packing only':38} {base:6.2f} M events/s")
    r = result["reclaim_after_sigkill"]
    print(
        f"{'lease back after SIGKILL of a client':38} median {r['median_ms']:.1f} ms, "
        f"max {r['max_ms']:.1f} ms over {r['n']} kills (bound: 2000 ms)"
    )


if __name__ == "__main__":
    main()
