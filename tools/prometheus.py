"""A Prometheus of our own: installed when missing, started on a free loopback port with a
temporary config and storage, asked through its HTTP API (tests and the metrics screenshot).

    with Prometheus.start(tmp, targets=["127.0.0.1:9477"], rule_files=[...]) as prom:
        prom.wait_for('up{job="tidalpool"} == 1')
        prom.query("tidalpool_pool_bytes")      # the result's series; PromQLError on an error

Debian's package also enables and starts a system Prometheus (prometheus.service, on :9090);
where this module installs the package it stops and disables that service at once (the tests
need only the binaries), and a service that was there before is never touched.

    python -m tools.prometheus   # install if missing (what `make prometheus` runs)
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

JOB = "tidalpool"
"""The scrape job of the daemons: the alert rules select `up{job="tidalpool"}`."""

PACKAGE = "prometheus"
"""Debian's package with both `prometheus` and `promtool`."""


class PromQLError(RuntimeError):
    """Prometheus answered a query with an error (its type and message in the text)."""


def _installed() -> bool:
    return all(shutil.which(tool) for tool in ("prometheus", "promtool"))


@functools.cache
def ensure_prometheus() -> str | None:
    """None when `prometheus` and `promtool` run here, after installing Debian's package if they
    are missing and this process may (root, or sudo without a password); else why they do not."""
    if _installed():
        return None
    if shutil.which("apt-get") is None:
        return "prometheus and promtool are not installed, and there is no apt-get to install them"
    if os.geteuid() == 0:
        sudo: list[str] = []
    elif shutil.which("sudo") and subprocess.run(["sudo", "-n", "true"]).returncode == 0:
        sudo = ["sudo", "-n"]
    else:
        return (
            "prometheus and promtool are not installed, and installing Debian's prometheus"
            " package needs root or password-less sudo: sudo apt-get install -y prometheus"
        )
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = [*sudo, "apt-get", "install", "-y", "--no-install-recommends", PACKAGE]
    out = subprocess.run(install, capture_output=True, text=True, env=env)
    if out.returncode != 0:  # the package lists may be missing or stale
        subprocess.run([*sudo, "apt-get", "update"], capture_output=True, env=env)
        out = subprocess.run(install, capture_output=True, text=True, env=env)
    _quiet_service(sudo)
    if _installed():
        return None
    return f"`{' '.join(install)}` failed (exit {out.returncode}): {out.stderr.strip()[-500:]}"


def _quiet_service(sudo: list[str]) -> None:
    """Stop and disable the system Prometheus that installing the package enabled and started
    (a machine without systemd has none)."""
    if shutil.which("systemctl") is not None:
        stop = [*sudo, "systemctl", "disable", "--now", f"{PACKAGE}.service"]
        subprocess.run(stop, capture_output=True)


def main() -> int:
    """Install prometheus and promtool if missing; a warning, not a failure, when they cannot
    be (their tests skip, saying why)."""
    why_not = ensure_prometheus()
    if why_not is None:
        print("prometheus and promtool are installed")
    else:
        print(f"WARNING: {why_not}; their tests will skip, saying why")
    return 0


def free_port() -> int:
    """A loopback TCP port free now (another process may take it before it is used)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def metrics_address(daemon_log: Path, timeout_s: float = 10.0) -> str:
    """Where a daemon serves its metrics (the port as bound, for port 0), read from the
    `daemon.ready` line of its JSON log (--log-format json)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for line in daemon_log.read_text().splitlines():
            record = json.loads(line) if line.startswith("{") else {}
            if record.get("event") == "daemon.ready":
                return str(record["metrics"])
        time.sleep(0.05)
    raise TimeoutError(f"no daemon.ready line in {daemon_log}")


def _get(url: str, timeout: float = 10.0) -> Any:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as reply:
            return json.load(reply)
    except urllib.error.HTTPError as e:  # a bad query: 400 or 422 with a JSON error body
        return json.load(e)


@dataclass
class Prometheus:
    url: str
    process: subprocess.Popen[bytes]
    directory: Path

    @classmethod
    def start(
        cls,
        directory: Path,
        targets: Sequence[str],
        rule_files: Sequence[Path] = (),
        scrape_interval_s: float = 0.5,
        timeout_s: float = 30.0,
    ) -> Prometheus:
        """Start Prometheus scraping `targets` (host:port) as job "tidalpool" and evaluating
        `rule_files`, every `scrape_interval_s`; its config, data and log in `directory`."""
        directory.mkdir(parents=True, exist_ok=True)
        interval = f"{round(scrape_interval_s * 1000)}ms"
        config = {  # JSON is YAML
            "global": {"scrape_interval": interval, "evaluation_interval": interval},
            "rule_files": [str(Path(p).resolve()) for p in rule_files],
            "scrape_configs": [{"job_name": JOB, "static_configs": [{"targets": list(targets)}]}],
        }
        config_path = directory / "prometheus.yml"
        config_path.write_text(json.dumps(config, indent=2))
        port = free_port()
        log = open(directory / "prometheus.log", "wb")  # noqa: SIM115 (the process holds it)
        process = subprocess.Popen(
            [
                "prometheus",
                f"--config.file={config_path}",
                f"--storage.tsdb.path={directory / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--log.level=warn",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()
        prom = cls(f"http://127.0.0.1:{port}", process, directory)
        deadline = time.monotonic() + timeout_s
        while not prom.ready():
            if process.poll() is not None or time.monotonic() > deadline:
                prom.stop()
                text = (directory / "prometheus.log").read_text(errors="replace")
                raise RuntimeError(f"prometheus did not start:\n{text[-2000:]}")
            time.sleep(0.1)
        return prom

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=1) as reply:
                return bool(reply.status == 200)
        except OSError:
            return False

    def _api(self, path: str, **params: str) -> Any:
        answer = _get(f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}")
        if answer.get("status") != "success":
            query = params.get("query", "")
            raise PromQLError(f"{answer.get('errorType')}: {answer.get('error')} in {query!r}")
        return answer["data"]

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        """The series of an instant query (now, or at `at`): [{"metric": {...}, "value": ...}]."""
        params = {"query": expr} if at is None else {"query": expr, "time": f"{at:.3f}"}
        data = self._api("query", **params)
        if data["resultType"] in ("scalar", "string"):
            return [{"metric": {}, "value": data["result"]}]
        return list(data["result"])

    def query_range(
        self, expr: str, start: float, end: float, step_s: float
    ) -> list[dict[str, Any]]:
        """The series of a range query: [{"metric": {...}, "values": [[t, "v"], ...]}]."""
        data = self._api(
            "query_range", query=expr, start=f"{start:.3f}", end=f"{end:.3f}", step=f"{step_s}"
        )
        return list(data["result"])

    def rules(self) -> list[dict[str, Any]]:
        """Every rule Prometheus evaluates, with its health and last error."""
        return [rule for group in self._api("rules")["groups"] for rule in group["rules"]]

    def wait_for(self, expr: str, timeout_s: float = 30.0) -> list[dict[str, Any]]:
        """Query `expr` until it has a series; its series."""
        deadline = time.monotonic() + timeout_s
        while not (result := self.query(expr)):
            if time.monotonic() > deadline:
                raise TimeoutError(f"no series for {expr!r} after {timeout_s:g} s")
            time.sleep(0.2)
        return result

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def __enter__(self) -> Prometheus:
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


if __name__ == "__main__":
    raise SystemExit(main())
