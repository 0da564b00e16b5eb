"""`tidalpool health` against a real daemon: the exit status and the line a probe logs."""

from __future__ import annotations

from tidalclient.local import LocalDaemon

from .test_cli import run_cli


def test_a_serving_daemon_exits_0_and_a_stopped_one_1(daemon: LocalDaemon) -> None:
    path = daemon.socket_dir / "tidalpool.sock"
    # The daemon's own uid (a probe) asks on admin.sock, which the jobs cannot flood.
    admin = daemon.socket_dir / "admin.sock"
    out = run_cli("--socket-dir", str(daemon.socket_dir), "health")
    assert (out.returncode, out.stdout, out.stderr) == (0, f"serving: the daemon at {admin}\n", "")
    # The socket directory as a job finds it, and one of the daemon's own services.
    out = run_cli(
        "health",
        "--service",
        "tidalpool.v1.Admin",
        env={"TIDALPOOL_SOCKET_DIR": str(daemon.socket_dir)},
    )
    assert (out.returncode, out.stdout) == (0, f"serving: service tidalpool.v1.Admin at {admin}\n")
    out = run_cli("--socket-dir", str(daemon.socket_dir), "health", "--service", "nope")
    assert (out.returncode, out.stderr) == (
        1,
        f"tidalpool: the daemon at {path} has no service 'nope'\n",
    )

    assert daemon.stop() == 0
    out = run_cli("--socket-dir", str(daemon.socket_dir), "health")
    assert (out.returncode, out.stdout, out.stderr) == (
        1,
        "",
        f"tidalpool: no daemon at {daemon.socket_dir}: {path} does not exist\n",
    )


def test_a_timeout_that_is_not_a_positive_number_is_a_usage_error() -> None:
    out = run_cli("--socket-dir", "/tmp/tp-none-here", "health", "--timeout", "0")
    assert out.returncode == 2
    assert out.stderr == (
        "tidalpool health: error: --timeout must be a positive number of seconds"
        " (see tidalpool health --help)\n"
    )
