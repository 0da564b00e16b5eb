"""Training jobs against a daemon that move every one of its metrics: the demo's NumPy network,
one session per job, on threads (the Prometheus test and the metrics screenshot).

    with Workload(socket_dir, [Job("mlp", 30), Job("mlp-swap", 30, swap_fraction=0.5)]) as w:
        w.wait_trained()   # every job trained; the sessions stay attached, idle
        ...                # scrape, query
    w.stats                # each job's SessionStats as it ended

A job trains `iterations` steps; a planned one (no swapping) runs from the daemon's plan after
a few steps and, with `miss`, makes one allocation the plan does not have; a swapping one keeps
its device bytes under a fraction of the network's peak, its copies throttled to `copy_gbps`.
Once trained, a job stays attached until the workload stops, detaches (not `stay`), or is
evicted (`evict`).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import grpc
import tidalpool
from tidalclient.demo.net import peak_live_bytes, train
from tidalclient.demo.run import PLAN_WAIT_AT, SessionMemory
from tidalclient.session import SessionStats
from tidalcore.units import align_up
from tidalcore.v1 import admin_pb2, admin_pb2_grpc

PLAN_WAIT_S = 60.0
"""The longest a job that needs its plan (`miss`) waits for it after `PLAN_WAIT_AT` steps."""


@dataclass(frozen=True)
class Job:
    name: str
    iterations: int
    swap_fraction: float | None = None  # swap under this fraction of the peak; None: no swap
    copy_gbps: float | None = None  # throttle of the swap copies; None: unthrottled
    page_bytes: int | None = None  # swap in pages of this size (virtual residency); None: not
    miss: bool = False  # one allocation beyond the plan, once the job runs planned
    evict: bool = False  # an operator evicts the session once it has trained
    pause_s: float = 0.0  # between iterations
    start_s: float = 0.0  # after the workload starts
    stay: bool = True  # once trained, stay attached until the workload stops; False: detach
    elastic: bool = False  # an elastic lease (with page_bytes): floor half the lease, ceiling it


def evict(socket_dir: Path, session_id: str, reason: str = "evicted by the workload") -> None:
    """End a session as an operator does (Admin.EvictSession)."""
    with grpc.insecure_channel(f"unix:{socket_dir / 'admin.sock'}") as channel:
        admin_pb2_grpc.AdminStub(channel).EvictSession(
            admin_pb2.EvictSessionRequest(session_id=session_id, reason=reason), timeout=10
        )


class Workload:
    """The jobs, each on its own thread and in its own session."""

    def __init__(self, socket_dir: Path, jobs: list[Job]) -> None:
        self.socket_dir = socket_dir
        self.jobs = jobs
        self.stats: dict[str, SessionStats] = {}
        self.errors: list[BaseException] = []
        self._stop = threading.Event()
        self._trained = {job.name: threading.Event() for job in jobs}
        self._threads = [
            threading.Thread(target=self._run, args=(job,), name=f"job-{job.name}", daemon=True)
            for job in jobs
        ]
        self._peak = peak_live_bytes()

    def __enter__(self) -> Workload:
        for t in self._threads:
            t.start()
        return self

    def wait_trained(self, timeout_s: float = 60.0) -> None:
        """Return once every job has trained (RuntimeError if one failed, TimeoutError)."""
        deadline = time.monotonic() + timeout_s
        for name, trained in self._trained.items():
            while not trained.wait(0.05):
                self._raise_errors()
                if time.monotonic() > deadline:
                    raise TimeoutError(f"job {name} did not train in {timeout_s:g} s")

    def _raise_errors(self) -> None:
        if self.errors:
            raise RuntimeError(f"job failed: {self.errors[0]!r}") from self.errors[0]

    def stop(self) -> None:
        """End the sessions still attached, and wait for the jobs."""
        self._stop.set()
        for t in self._threads:
            t.join(timeout=30)
        self._raise_errors()

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        if e is None:
            self.stop()
        else:  # the error being raised says more than the jobs' would
            self._stop.set()

    def _run(self, job: Job) -> None:
        try:
            if not self._stop.wait(job.start_s):
                self._train(job)
        except Exception as e:
            self.errors.append(e)

    def _train(self, job: Job) -> None:
        lease = align_up(2 * self._peak, 1 << 20)  # room for learning's fragmentation
        swap_limit = None if job.swap_fraction is None else int(job.swap_fraction * self._peak)
        with tidalpool.attach(
            self.socket_dir,
            device_limit=None if job.elastic else lease,
            device_min=lease // 2 if job.elastic else None,
            device_max=lease if job.elastic else None,
            host_limit=lease if swap_limit is not None else None,
            job_name=job.name,
            swap_limit=swap_limit,
            copy_gbps=job.copy_gbps,
            page_bytes=job.page_bytes if swap_limit is not None else None,
        ) as session:
            missed = False

            def between(i: int, loss: float) -> None:
                nonlocal missed
                if job.miss and i == PLAN_WAIT_AT:  # a busy machine plans slowly: wait for it
                    deadline = time.monotonic() + PLAN_WAIT_S
                    while not session.plans_received and time.monotonic() < deadline:
                        time.sleep(0.02)
                if job.miss and not missed and session.stats().mode == "planned":
                    session.free(session.malloc(4096))  # after the plan's last allocation
                    missed = True
                time.sleep(job.pause_s)

            train(SessionMemory(session), iterations=job.iterations, on_iteration=between)
            if job.miss and not missed:
                raise RuntimeError(f"job {job.name} never ran from a plan")
            self.stats[job.name] = session.stats()
            self._trained[job.name].set()
            if job.evict:
                evict(self.socket_dir, session.id)
            elif job.stay:
                self._stop.wait()
