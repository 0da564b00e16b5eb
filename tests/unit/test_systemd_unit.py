"""deploy/systemd: the unit passes `systemd-analyze verify`, and what it hands the daemon (its
environment, the example TOML file, the command line) makes the settings of the GPU it names."""

from __future__ import annotations

import grp
import os
import shlex
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
from tidalpoold import settings as settings_module
from tidalpoold.settings import load_settings

ROOT = Path(__file__).resolve().parents[2]
SYSTEMD = ROOT / "deploy" / "systemd"
UNIT = SYSTEMD / "tidalpoold@.service"
INSTALLED_DAEMON = "/opt/tidalpool/bin/tidalpoold"


def directives(instance: str) -> list[tuple[str, str]]:
    """(key, value) of every directive of the unit, in order, with %i and $$ as systemd
    resolves them for `instance` (the unit uses no other specifier)."""
    out = []
    for line in UNIT.read_text().splitlines():
        if line.strip() and not line.startswith(("#", "[")):
            key, _, value = line.partition("=")
            out.append((key, value.replace("%i", instance).replace("$$", "$")))
    return out


def values(instance: str, key: str) -> list[str]:
    return [v for k, v in directives(instance) if k == key]


def test_systemd_analyze_verify_finds_nothing_to_say(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed")
    shutil.copy(UNIT, tmp_path / UNIT.name)
    out = subprocess.run(
        [analyze, "verify", "--man=no", str(tmp_path / "tidalpoold@0.service")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    # verify exits 0 on unknown keys and unparsable values: any line it prints is a failure.
    assert (out.returncode, out.stdout + out.stderr) == (0, "")


def test_the_hardening_stays_at_an_exposure_of_at_most_2_5(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed")
    shutil.copy(UNIT, tmp_path / UNIT.name)
    unit = str(tmp_path / "tidalpoold@0.service")
    out = subprocess.run(
        [analyze, "security", "--offline=yes", "--threshold=25", "--no-pager", unit],
        capture_output=True,
        text=True,
        timeout=60,
    )
    # --threshold=25: exit status 1 above an exposure of 2.5 (systemd 252 rates the unit 2.1).
    assert out.returncode == 0, out.stdout + out.stderr
    assert "Overall exposure level for tidalpoold@0.service" in out.stdout
    # What the GPU needs stays allowed: its device nodes, and no PrivateDevices= to hide them.
    assert values("0", "DevicePolicy") == ["closed"]
    assert values("0", "DeviceAllow") == [
        "char-nvidia-frontend rw",
        "char-nvidia rw",
        "char-nvidia-uvm rw",
        "char-nvidia-caps rw",
    ]
    assert values("0", "PrivateDevices") == []


def test_the_instance_is_the_gpu_and_its_socket_dir_is_its_runtime_directory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert values("3", "Type") == ["notify"]
    assert values("3", "RuntimeDirectory") == ["tidalpool/gpu3"]
    assert values("3", "User") == values("3", "Group") == ["tidalpool"]
    assert values("3", "Restart") == ["on-failure"]
    env = dict(v.partition("=")[::2] for v in values("3", "Environment"))
    assert env["TIDALPOOLD_CONFIG"] == "/etc/tidalpool/tidalpoold.toml"
    assert env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"  # instance N is nvidia-smi's GPU N
    env["TIDALPOOLD_CONFIG"] = str(SYSTEMD / "tidalpoold.toml")  # the example installed there
    tidalpool_group = grp.struct_group(("tidalpool", "x", 4242, []))
    monkeypatch.setattr(settings_module.grp, "getgrnam", lambda name: tidalpool_group)
    s = load_settings(env={k: v for k, v in env.items() if k.startswith("TIDALPOOLD_")})
    assert (s.gpu, s.socket_dir, s.backend, s.allowed_gids) == (
        3,
        Path("/run/tidalpool/gpu3"),
        "cuda",
        (4242,),
    )
    assert s.socket_mode == 0o660
    assert s.plan_cache_dir == Path("/var/cache/tidalpool")
    assert values("3", "CacheDirectory") == ["tidalpool"]


def test_each_gpu_serves_metrics_on_its_own_port_unless_told_otherwise() -> None:
    (command,) = values("3", "ExecStart")
    shell, flag, script = shlex.split(command)
    assert (shell, flag) == ("/bin/sh", "-c")
    assert f"exec {INSTALLED_DAEMON} serve " in script
    echo = script.replace(INSTALLED_DAEMON, "printf '%s\\n'")
    env = {k: v for k, v in os.environ.items() if k != "TIDALPOOLD_METRICS_ADDRESS"}
    out = subprocess.run([shell, flag, echo], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.split() == ["serve", "--metrics-address", "127.0.0.1:9480"]
    env["TIDALPOOLD_METRICS_ADDRESS"] = "0.0.0.0:9600"
    out = subprocess.run([shell, flag, echo], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.split() == ["serve", "--metrics-address", "0.0.0.0:9600"]


def test_the_daemon_command_is_the_package_console_script() -> None:
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts[Path(INSTALLED_DAEMON).name] == "tidalpoold.cli:main"
