"""Elastic leases under churn, on sim: jobs replaying the sample traces attach, run, are killed
(SIGKILL) and come back, on a device pool smaller than the sum of their peaks. The same jobs on
the same schedule with fixed leases are the baselines, in the same run: the pool split evenly
among them (`fixed`: what a job must guess up front without elastic leases), and each job's
steady allowance (`allowance`: the median quota the elastic run gave it, as a fixed lease, so
each job's step time is compared with what its share would give it for good).

    python bench/churn.py [--seconds 90] [--pool 512MiB] [--out bench/results/churn-DATE-sim.json]

Measured, per mode: pool utilization (the device bytes the sessions have mapped, as their
heartbeats report them, over the pool, sampled every 0.25 s), each job's steady step time,
give-back latency (QuotaChange to chunks free, from the daemon's log), out-of-memory failures
(a replay whose iteration found no room), corrupt bytes (every replay checks its stamps), and
the pool's accounting once every job is gone (nothing leased, nothing quarantined).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tidalclient.local import LocalDaemon
from tidalclient.status import fetch
from tidalcore.units import format_size, parse_size

REPO = Path(__file__).resolve().parent.parent
MiB = 1 << 20


@dataclass(frozen=True)
class JobSpec:
    name: str
    trace: Path | None  # None: the demo (`tidalpool demo --limit 0.7`, its own fixed lease)
    floor: str  # an elastic lease's floor (the demo's: its fixed lease, in both modes)


# Floors at least each job's op-wise bound (the most one op touches: no limit under it runs;
# `tidalpool simulate` prints it): the MLP needs nearly all its 21.8 MiB peak at once.
JOBS = (
    JobSpec("mlp", REPO / "traces/mlp.b64.trace.csv", "24MiB"),
    JobSpec("resnet18-a", REPO / "traces/resnet18.b8.trace.csv", "64MiB"),
    JobSpec("resnet18-b", REPO / "traces/resnet18.b8.trace.csv", "64MiB"),
    JobSpec("resnet18-c", REPO / "traces/resnet18.b8.trace.csv", "64MiB"),
    JobSpec("demo", None, "4MiB"),  # it asks for twice its 1.1 MiB peak: 2 chunks
)


@dataclass
class Runs:
    """What one job's runs came to."""

    runs: int = 0
    killed: int = 0
    completed: int = 0
    out_of_memory: int = 0
    other_failures: list[str] = field(default_factory=list)
    mismatches: int = 0
    not_resident: int = 0
    stamps_checked: int = 0
    steps_ms: list[float] = field(default_factory=list)


def fixed_leases(pool: int) -> dict[str, int]:
    """The baseline's leases: the best even split a user could guess up front. Each job gets
    its floor, and the jobs bigger than that share what is left evenly, in whole chunks."""
    floors = {j.name: parse_size(j.floor) for j in JOBS}
    small = {"mlp", "demo"}
    rest = (pool - sum(floors[n] for n in small)) // (len(JOBS) - len(small))
    return {n: floors[n] if n in small else rest // (2 * MiB) * (2 * MiB) for n in floors}


def replay_args(spec: JobSpec, socket_dir: Path, mode: str, fixed: int) -> list[str]:
    if spec.trace is None:  # the demo: bit-identical losses or exit status 1
        demo = ["demo", "--iterations", "40", "--limit", "0.7"]
        return [sys.executable, "-m", "tidalpool", "--socket-dir", str(socket_dir), *demo]
    lease = ["--device-min", spec.floor] if mode == "elastic" else ["--device-lease", str(fixed)]
    return [
        sys.executable,
        "-m",
        "tidalpool",
        "replay",
        str(spec.trace),
        "--socket-dir",
        str(socket_dir),
        "--page",
        "64KiB",
        "--limit",
        "1.0",
        "--iterations",
        "10",
        "--json",
        *lease,
    ]


def run_job(
    spec: JobSpec, socket_dir: Path, mode: str, fixed: int, until: float, seed: int, out: Runs
) -> None:
    """Replay `spec` again and again until `until`; one run in three is killed at a random
    moment of its first seconds. Its sessions are named after it (TIDALPOOL_JOB_NAME)."""
    rng = random.Random(seed)
    env = {**os.environ, "TIDALPOOL_JOB_NAME": spec.name}
    while time.monotonic() < until:
        kill_after = rng.uniform(1.0, 4.0) if rng.random() < 1 / 3 else None
        child = subprocess.Popen(
            replay_args(spec, socket_dir, mode, fixed),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        out.runs += 1
        try:
            stdout, stderr = child.communicate(timeout=kill_after)
        except subprocess.TimeoutExpired:
            child.send_signal(signal.SIGKILL)
            child.communicate()
            out.killed += 1
            continue
        if "does not fit under the limit" in stderr or "failed under plan" in stderr:
            out.out_of_memory += 1
            continue
        if spec.trace is None:  # the demo says whether its losses were bit-identical
            if child.returncode == 0:
                out.completed += 1
            elif "LeaseExceeded" in stderr or "cannot place" in stderr:
                out.out_of_memory += 1
            elif child.returncode == 1 and "losses differ" in stdout:
                out.mismatches += 1
            else:
                out.other_failures.append(_last_line(stderr or stdout))
            continue
        try:
            report: dict[str, Any] = json.loads(stdout.splitlines()[-1])
        except (IndexError, json.JSONDecodeError):
            out.other_failures.append(_last_line(stderr))
            continue
        out.completed += 1
        checks = report["checks"]
        out.mismatches += checks["mismatches"]
        out.not_resident += checks["not_resident"]
        out.stamps_checked += checks["stamps_checked"]
        out.steps_ms += [
            r["step_ns"] / 1e6 for r in report["per_iteration"] if r["phase"] == "steady"
        ]


def _last_line(text: str) -> str:
    return text.strip().splitlines()[-1] if text.strip() else "?"


def sample(
    socket_dir: Path,
    pool: int,
    stop: threading.Event,
    into: list[float],
    quotas: dict[str, list[int]],
) -> None:
    """Every 0.25 s: the pool's utilization into `into`, each elastic session's quota into
    `quotas` by job name."""
    while not stop.wait(0.25):
        try:
            _, sessions = fetch(socket_dir)
        except Exception:  # the daemon is busy answering others: the next sample counts
            continue
        into.append(sum(s.device_used_bytes for s in sessions.sessions) / pool)
        for s in sessions.sessions:
            if s.device_quota_bytes:
                quotas.setdefault(s.job_name, []).append(s.device_quota_bytes)


def allowances(quotas: dict[str, list[int]], pool: int) -> dict[str, int]:
    """Each job's steady allowance: the median quota it was sampled at, in whole chunks,
    scaled down together if they sum to more than the pool (the demo keeps its own lease)."""
    chunk = 2 * MiB
    median = {n: int(quantile([float(q) for q in qs], 0.5) or 0) for n, qs in quotas.items()}
    demo = parse_size(next(j.floor for j in JOBS if j.trace is None))
    scale = min(1.0, (pool - demo) / max(1, sum(median.values())))
    return {n: max(chunk, int(q * scale) // chunk * chunk) for n, q in median.items()}


def give_backs(log: Path) -> list[float]:
    seconds = []
    for line in log.read_text().splitlines():
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            continue
        if entry.get("event") == "quota.given_back" and entry.get("seconds") is not None:
            seconds.append(float(entry["seconds"]))
    return seconds


def quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run_mode(
    mode: str, pool: int, seconds: float, keep_log: Path | None, fixed: dict[str, int]
) -> dict[str, Any]:
    """One mode's churn: `elastic` (each job's floor), else fixed leases of `fixed` bytes."""
    directory = Path(tempfile.mkdtemp(prefix="tp-churn-", dir="/tmp"))
    daemon = LocalDaemon.start(
        directory,
        device_pool=str(pool),
        host_pool="4GiB",
        default_lease="2MiB",
        extra=("--log-format", "json", "--plan-after-iterations", "3"),
        chunk_size="2MiB",
    )
    try:
        runs = {spec.name: Runs() for spec in JOBS}
        utilization: list[float] = []
        quotas: dict[str, list[int]] = {}
        stop = threading.Event()
        sampler = threading.Thread(target=sample, args=(directory, pool, stop, utilization, quotas))
        sampler.start()
        until = time.monotonic() + seconds
        threads = [
            threading.Thread(
                target=run_job,
                args=(spec, directory, mode, fixed.get(spec.name, 0), until, k, runs[spec.name]),
            )
            for k, spec in enumerate(JOBS)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        stop.set()
        sampler.join()
        deadline = time.monotonic() + 30
        while True:  # every session gone: the pool's accounting
            status, sessions = fetch(directory)
            if not sessions.sessions or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        latencies = give_backs(daemon.log_path)
        if keep_log is not None:
            shutil.copy(daemon.log_path, keep_log / f"churn-{mode}.log")
    finally:
        daemon.stop()
        shutil.rmtree(directory, ignore_errors=True)
    return {
        "mode": mode,
        "fixed_lease_bytes": fixed if mode != "elastic" else None,
        "allowance_bytes": allowances(quotas, pool) if mode == "elastic" else None,
        "other_failures": {n: r.other_failures for n, r in runs.items() if r.other_failures},
        "utilization_mean": sum(utilization) / len(utilization) if utilization else None,
        "utilization_p50": quantile(utilization, 0.5),
        "utilization_samples": len(utilization),
        "give_back_s": {
            "count": len(latencies),
            "p50": quantile(latencies, 0.5),
            "p99": quantile(latencies, 0.99),
        },
        "end": {
            "sessions": len(sessions.sessions),
            "device_leased_bytes": status.device.leased_bytes,
            "device_free_bytes": status.device.free_bytes,
            "device_quarantined_bytes": status.device.quarantined_bytes,
            "device_total_bytes": status.device.total_bytes,
        },
        "jobs": {
            name: {
                **{k: v for k, v in vars(r).items() if k != "steps_ms"},
                "steady_steps": len(r.steps_ms),
                "step_ms_median": quantile(r.steps_ms, 0.5),
            }
            for name, r in runs.items()
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=90.0, help="each mode's churn (90)")
    parser.add_argument("--pool", default="512MiB", help="the device pool (512MiB)")
    parser.add_argument(
        "--modes",
        nargs="+",
        default=["elastic", "fixed", "allowance"],
        choices=["elastic", "fixed", "allowance"],
        help="allowance needs elastic before it",
    )
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON")
    parser.add_argument("--logs", type=Path, default=None, help="keep the daemon's logs here")
    args = parser.parse_args()
    pool = parse_size(args.pool)
    results: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"),
        "pool_bytes": pool,
        "jobs": [
            {"name": j.name, "trace": j.trace.name if j.trace else "demo", "floor": j.floor}
            for j in JOBS
        ],
        "modes": [],
    }
    allowance: dict[str, int] | None = None
    for mode in args.modes:
        if mode == "allowance":
            if allowance is None:
                parser.error("--modes: allowance needs elastic before it")
            fixed = {**fixed_leases(pool), **allowance}  # the demo keeps its own lease
        else:
            fixed = fixed_leases(pool) if mode == "fixed" else {}
        result = run_mode(mode, pool, args.seconds, args.logs, fixed)
        allowance = result["allowance_bytes"] or allowance
        results["modes"].append(result)
    steps = {
        m["mode"]: {n: j["step_ms_median"] for n, j in m["jobs"].items()} for m in results["modes"]
    }
    if "elastic" in steps and "allowance" in steps:
        allowed = steps["allowance"]
        results["elastic_over_allowance_step"] = {
            n: round(e / allowed[n], 3) if e and allowed[n] else None
            for n, e in steps["elastic"].items()
        }
        print("elastic / allowance step:", results["elastic_over_allowance_step"])
    for m in results["modes"]:
        print(
            f"{m['mode']:8} utilization mean {m['utilization_mean']:.3f}"
            f"  give-back p50 {m['give_back_s']['p50']} p99 {m['give_back_s']['p99']}"
            f"  end: leased {format_size(m['end']['device_leased_bytes'])}"
        )
        for name, j in m["jobs"].items():
            print(
                f"   {name:11} runs {j['runs']:3} killed {j['killed']:2} done {j['completed']:2}"
                f" oom {j['out_of_memory']} other {len(j['other_failures'])}"
                f" corrupt {j['mismatches'] + j['not_resident']} step {j['step_ms_median']}"
            )
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
