"""GPU benchmarks of the cuda backend (needs an NVIDIA GPU, CuPy and cuda-bindings).

    python bench/gpu.py [--json PATH] [--skip copy,attach,train]

Starts its own `tidalpoold --backend cuda` daemons on GPU 0. Each number stands beside a
baseline measured in the same run on the same GPU:
  copy      the swap engine's streams (CudaStream, pinned host lease <-> device lease) vs plain
            cudaMemcpyAsync on a CuPy non-blocking stream between cudaMallocHost and cudaMalloc
            memory, the same sizes and counts, each way
  attach    tidalpool.attach of a 10 GiB device lease (lease RPC, fd passing, import and mapping
            of every chunk) at two chunk sizes, vs one cudaMalloc of 10 GiB
  train     the demo's MLP made big and deep enough for the GPU to bound it (8 hidden layers of
            4096, batch 2048: half its peak still holds the largest op), CuPy arrays: step time
            with tidalpool (every array in the lease, the daemon's plan followed) vs plain CuPy
            with its default memory pool; and under swap limits (--limits, fractions of the
            network's peak), each variant's measured step beside the step the daemon's
            simulator predicted for its plan (`Plan.prediction`); with --page SIZE the sessions
            under a limit are paged (virtual residency: every array at one address, pages of
            SIZE, the daemon's chunk size, moving beneath it)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import cupy
import tidalclient.cupy as tpc
import tidalpool
from tidalclient import status
from tidalclient.demo.net import CupyMemory, Memory, peak_live_bytes, persistent_bytes, train
from tidalclient.demo.run import SessionMemory
from tidalclient.devices.cuda import swap_streams
from tidalclient.local import LocalDaemon
from tidalcore.units import parse_size

MiB, GiB = 1 << 20, 1 << 30


def log(*args: object) -> None:
    print(*args, file=sys.stderr, flush=True)


# -- copy bandwidth ---------------------------------------------------------------------------


def _rate(run: Callable[[], None], nbytes: int, repeats: int = 5) -> float:
    """The best of `repeats` timings of `run` (which moves `nbytes`), in GB/s."""
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - t)
    return nbytes / best / 1e9


def bench_copy(socket_dir: Path, sizes: list[int], total: int) -> list[dict[str, Any]]:
    rows = []
    with tidalpool.attach(socket_dir, device_limit=total, host_limit=total) as s:
        assert s.cuda is not None
        driver = s.cuda.driver
        out, into = swap_streams(driver)
        dev, host = s.device.address, s.host.address
        # the baseline's memory, outside tidalpool
        cupy.cuda.Device(s.cuda.ordinal).use()
        b_dev = cupy.cuda.runtime.malloc(total)
        b_host = cupy.cuda.runtime.hostAlloc(total, 0)
        stream = cupy.cuda.Stream(non_blocking=True)
        rt = cupy.cuda.runtime
        try:
            for size in sizes:
                n = total // size

                def engine(d2h: bool = True, size: int = size, n: int = n) -> None:
                    s_ = out if d2h else into
                    for i in range(n):
                        if d2h:
                            s_.copy(host + i * size, dev + i * size, size)
                        else:
                            s_.copy(dev + i * size, host + i * size, size)
                    s_.synchronize()

                def plain(d2h: bool = True, size: int = size, n: int = n) -> None:
                    kind = rt.memcpyDeviceToHost if d2h else rt.memcpyHostToDevice
                    for i in range(n):
                        dst, src = (b_host, b_dev) if d2h else (b_dev, b_host)
                        rt.memcpyAsync(dst + i * size, src + i * size, size, kind, stream.ptr)
                    stream.synchronize()

                row: dict[str, Any] = {"size_bytes": size, "copies": n}
                for way, d2h in (("d2h", True), ("h2d", False)):
                    e = _rate(lambda d2h=d2h: engine(d2h=d2h), n * size)
                    p = _rate(lambda d2h=d2h: plain(d2h=d2h), n * size)
                    row[way] = {"engine_gbps": e, "plain_gbps": p, "ratio": e / p}
                log(f"copy {size // 1024} KiB x {n}: {row}")
                rows.append(row)
        finally:
            out.close()
            into.close()
            rt.free(b_dev)
            rt.freeHost(b_host)
    return rows


# -- attach -----------------------------------------------------------------------------------


def bench_attach(lease: int, chunk: str, repeats: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="tp-bench-") as tmp:
        t = time.perf_counter()
        with LocalDaemon.start(
            Path(tmp),
            device_pool=f"{lease + GiB}B",
            host_pool="1GiB",
            default_lease="64MiB",
            backend="cuda",
            chunk_size=chunk,
            timeout=300,
        ) as d:
            started = time.perf_counter() - t
            mode = status.fetch(d.socket_dir)[0].mode
            times = []
            for _ in range(repeats):
                t = time.perf_counter()
                s = tidalpool.attach(d.socket_dir, device_limit=lease, host_limit="64MiB")
                times.append(time.perf_counter() - t)
                assert s.device.length == lease
                s.close()
    # baseline: one cudaMalloc of the same size in this process
    base = []
    for _ in range(repeats):
        t = time.perf_counter()
        p = cupy.cuda.runtime.malloc(lease)
        base.append(time.perf_counter() - t)
        cupy.cuda.runtime.free(p)
    row = {
        "lease_bytes": lease,
        "chunk": chunk,
        "mode": mode,
        "daemon_start_s": started,
        "attach_median_ms": statistics.median(times) * 1e3,
        "attach_max_ms": max(times) * 1e3,
        "cudaMalloc_median_ms": statistics.median(base) * 1e3,
    }
    log(f"attach: {row}")
    return row


# -- training step ----------------------------------------------------------------------------


def _step_times(mem: Memory, iterations: int, shape: dict[str, int], on: Any = None) -> list[float]:
    stamps: list[float] = []

    def each(i: int, loss: float) -> None:  # the loss is on the host: the step has ended
        if on is not None:
            on(i)
        stamps.append(time.perf_counter())

    t0 = time.perf_counter()
    train(mem, iterations=iterations, on_iteration=each, **shape)
    return [b - a for a, b in zip([t0, *stamps[:-1]], stamps, strict=True)]


def bench_train(
    socket_dir: Path,
    shape: dict[str, int],
    iterations: int,
    warmup: int,
    rounds: int,
    limits: list[float],
    page: int = 0,
) -> dict[str, Any]:
    peak = peak_live_bytes(1, **shape, base=CupyMemory())
    persistent = persistent_bytes(**shape, base=CupyMemory())
    lease = 2 * peak + 256 * MiB

    def plain() -> list[float]:
        cupy.get_default_memory_pool().free_all_blocks()
        return _step_times(CupyMemory(), iterations, shape)[warmup:]

    def pooled(limit: int | None) -> tuple[list[float], dict[str, Any]]:
        with tidalpool.attach(
            socket_dir,
            device_limit=lease,
            host_limit=lease if limit is not None else "64MiB",
            job_name="bench-train",
            swap_limit=limit,
            page_bytes=page if limit is not None and page else None,
        ) as s:
            tpc.use(s, pinned=False)
            try:

                def wait_for_plan(i: int) -> None:
                    if i == 4:  # the daemon plans after 3 step marks
                        deadline = time.monotonic() + 60
                        while not s.plans_received and time.monotonic() < deadline:
                            time.sleep(0.01)

                times = _step_times(SessionMemory(s), iterations, shape, wait_for_plan)
                st = s.stats()
                plan = s.plan
            finally:
                tpc.stop()
        info = {
            "mode": st.mode,
            "plans_received": st.plans_received,
            "plan_hits": st.plan_hits,
            "plan_misses": st.plan_misses,
        }
        if plan is not None and plan.prediction is not None:
            p = plan.prediction  # the simulator's timeline of the plan the steps followed
            info |= {
                "predicted_step_ms": p.step_ns / 1e6,
                "predicted_baseline_ms": p.baseline_ns / 1e6,
                "predicted_stall_ms": p.stall_ns / 1e6,
                "predicted_out_bytes": p.out_bytes,
                "predicted_in_bytes": p.in_bytes,
                "predicted_copy_gbps": p.copy_gbps,
            }
        if st.swap is not None:
            info |= {
                "swap_limit_bytes": st.swap.limit,
                "peak_resident_bytes": st.swap.peak_resident_bytes,
                "swapped_out_bytes": st.swap.swapped_out_bytes,
                "swapped_in_bytes": st.swap.swapped_in_bytes,
                "stall_ms": st.swap.stall_ns / 1e6,
                "scheduled_swaps": st.swap.scheduled_swaps,
            }
        return times[warmup:], info

    result: dict[str, Any] = {
        **shape,
        "peak_bytes": peak,
        "persistent_bytes": persistent,
        "iterations": iterations,
        "warmup": warmup,
        "rounds": rounds,
        "page_bytes": page,  # 0: the limit sessions' leases are contiguous
    }
    runs: dict[str, list[float]] = {"plain": [], "tidalpool": []}
    runs |= {f"limit {f:g}": [] for f in limits}
    infos: dict[str, Any] = {}
    for r in range(rounds):  # interleaved, so drift hits every variant alike
        runs["plain"] += plain()
        t, infos["tidalpool"] = pooled(None)
        runs["tidalpool"] += t
        for f in limits:
            t, infos[f"limit {f:g}"] = pooled(int(peak * f))
            runs[f"limit {f:g}"] += t
        medians = (f"{k} {statistics.median(v) * 1e3:.3f} ms" for k, v in runs.items())
        log(f"train round {r}: " + ", ".join(medians))
    med = {k: statistics.median(v) for k, v in runs.items()}
    result |= {
        "step_ms_median": {k: v * 1e3 for k, v in med.items()},
        # The daemon's prediction for each variant's plan, beside the measured median above.
        "step_ms_predicted": {k: i.get("predicted_step_ms") for k, i in infos.items()},
        "throughput_vs_plain": med["plain"] / med["tidalpool"],
        "limit_overhead": {f: med[f"limit {f:g}"] / med["plain"] - 1 for f in limits},
        "info": infos,
    }
    log(f"train: {result}")
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    ap.add_argument("--skip", default="", help="comma-separated: copy, attach, train")
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=2048)
    ap.add_argument("--depth", type=int, default=8, help="hidden layers")
    ap.add_argument(
        "--limits", default="0.5", help="swap limits to train under, as fractions of the peak"
    )
    ap.add_argument("--iterations", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--page",
        default=None,
        help="page the sessions under a limit in pages of this size (e.g. 2MiB), the chunk"
        " size of the daemon this starts (CUDA maps a VMM handle only whole)",
    )
    args = ap.parse_args()
    page = parse_size(args.page) if args.page is not None else 0
    skip = set(filter(None, args.skip.split(",")))
    gpu = cupy.cuda.runtime.getDeviceProperties(0)
    results: dict[str, Any] = {
        "device": gpu["name"].decode(),
        "driver": cupy.cuda.runtime.driverGetVersion(),
        "cupy": cupy.__version__,
        "date": time.strftime("%Y-%m-%d"),
    }

    def save() -> None:  # after every section: a run stopped midway keeps what it measured
        if args.json is not None:
            args.json.write_text(json.dumps(results, indent=2, default=str))

    if "attach" not in skip:
        results["attach"] = [bench_attach(10 * GiB, c, 5) for c in ("64MiB", "2MiB")]
        save()
    if not {"copy", "train"} <= skip:
        with (
            tempfile.TemporaryDirectory(prefix="tp-bench-") as tmp,
            LocalDaemon.start(
                Path(tmp),
                device_pool="16GiB",
                host_pool="8GiB",
                backend="cuda",
                timeout=300,
                chunk_size=str(page) if page else None,
            ) as d,
        ):
            pool = status.fetch(d.socket_dir)[0]
            results["daemon"] = {"mode": pool.mode, "facts": dict(pool.facts)}
            if "copy" not in skip:
                results["copy"] = bench_copy(
                    d.socket_dir, [256 << 10, 4 * MiB, 64 * MiB, 256 * MiB], 2 * GiB
                )
                save()
            if "train" not in skip:
                results["train"] = bench_train(
                    d.socket_dir,
                    {"width": args.width, "batch": args.batch, "depth": args.depth},
                    args.iterations,
                    args.warmup,
                    args.rounds,
                    [float(f) for f in args.limits.split(",")],
                    page,
                )
    save()
    print(json.dumps(results, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
