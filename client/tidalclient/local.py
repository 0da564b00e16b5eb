"""Starting a tidalpoold process on this machine (the demo, tests and benchmarks).

with LocalDaemon.start(socket_dir, device_pool="1GiB") as daemon:
    session = tidalpool.attach(daemon.socket_dir)
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from tidalclient.health import check


def is_serving(socket_dir: Path, timeout: float = 1.0) -> bool:
    """True if a daemon answers gRPC health checks in `socket_dir`."""
    return check(socket_dir, timeout=timeout).serving


@dataclass
class LocalDaemon:
    socket_dir: Path
    process: subprocess.Popen[bytes]
    log_path: Path

    @classmethod
    def start(
        cls,
        socket_dir: Path,
        device_pool: str = "1GiB",
        host_pool: str = "1GiB",
        default_lease: str = "256MiB",
        extra: tuple[str, ...] = (),
        timeout: float = 30.0,
        backend: str = "sim",
        chunk_size: str | None = None,
    ) -> LocalDaemon:
        """Start `tidalpoold serve` and wait until it answers; `chunk_size` None keeps the
        daemon's default."""
        socket_dir.mkdir(mode=0o755, parents=True, exist_ok=True)  # the daemon's alone to write
        log_path = socket_dir / "tidalpoold.log"
        args = [
            sys.executable,
            "-m",
            "tidalpoold",
            "serve",
            "--backend",
            backend,
            "--socket-dir",
            str(socket_dir),
            "--device-pool",
            device_pool,
            "--host-pool",
            host_pool,
            "--default-device-lease",
            default_lease,
            "--default-host-lease",
            default_lease,
            "--metrics-address",
            "",
            "--plan-cache-dir",
            str(socket_dir / "plans"),
            *(("--chunk-size", chunk_size) if chunk_size is not None else ()),
            *extra,
        ]
        env = {k: v for k, v in os.environ.items() if not k.startswith("TIDALPOOLD_")}
        with open(log_path, "wb") as log:
            process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env)
        daemon = cls(socket_dir, process, log_path)
        deadline = time.monotonic() + timeout
        while not is_serving(socket_dir, timeout=0.5):
            if process.poll() is not None or time.monotonic() > deadline:
                daemon.stop()
                raise RuntimeError(f"tidalpoold did not start:\n{log_path.read_text()}")
            time.sleep(0.05)
        return daemon

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM, then wait; returns the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode

    def __enter__(self) -> LocalDaemon:
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
