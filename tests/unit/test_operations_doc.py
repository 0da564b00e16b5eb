"""docs/operations.md names only what exists: the options of tidalpool and tidalpoold, the
daemon's settings and TIDALPOOLD_* variables, and the files under deploy/."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
from tidalpool import cli as client_cli
from tidalpoold import cli as daemon_cli
from tidalpoold.settings import ENV_PREFIX, Settings

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs" / "operations.md").read_text()
SETTINGS = {f.name for f in dataclasses.fields(Settings)}
# Options of the other commands the doc shows (useradd, systemctl, docker, kubectl).
OTHER_TOOLS = {"--system", "--user-group", "--home-dir", "--shell", "--now", "--rm", "--gpus"}
OTHER_TOOLS |= {"--ulimit"}
OTHER_TOOLS |= {"--standalone", "--nproc"}  # torchrun's (--nproc_per_node)


def options(main: object, *argv: str, capsys: pytest.CaptureFixture[str]) -> set[str]:
    """The options `main(argv + --help)` lists."""
    with pytest.raises(SystemExit):
        main([*argv, "--help"])  # type: ignore[operator]
    return set(re.findall(r"(?<![\w-])--[a-z][a-z-]*", capsys.readouterr().out))


def test_every_option_in_the_doc_exists(capsys: pytest.CaptureFixture[str]) -> None:
    known = options(client_cli.main, capsys=capsys) | options(
        daemon_cli.main, "serve", capsys=capsys
    )
    for command in ("status", "top", "health", "quota"):
        known |= options(client_cli.main, command, capsys=capsys)
    named = set(re.findall(r"(?<![\w-])--[a-z][a-z-]*", DOC))
    assert named - known - OTHER_TOOLS == set()
    # The doc's own subjects are among them.
    assert {"--interval", "--iterations", "--once", "--timeout", "--service"} <= named & known
    assert {"--metrics-address", "--config", "--device-pool"} <= named & known


def test_every_setting_and_variable_in_the_doc_exists() -> None:
    table = DOC.split("| setting | what |")[1].split("\n\n")[0]
    in_table = set(re.findall(r"^\| (`.*?`) \|", table, re.M))
    names = {n for cell in in_table for n in re.findall(r"`(\w+)`", cell)}
    assert names and names <= SETTINGS
    variables = set(re.findall(rf"{ENV_PREFIX}[A-Z_]+", DOC)) - {ENV_PREFIX}
    assert variables <= {ENV_PREFIX + s.upper() for s in SETTINGS} | {"TIDALPOOLD_CONFIG"}
    assert "TIDALPOOLD_METRICS_ADDRESS" in variables


def test_every_deploy_file_in_the_doc_exists_and_every_one_is_in_the_doc() -> None:
    named = set(re.findall(r"deploy/[\w./@-]*[\w@]", DOC))
    assert [n for n in sorted(named) if not (ROOT / n).exists()] == []
    files = {
        p.relative_to(ROOT).as_posix()
        for p in (ROOT / "deploy").rglob("*")
        if p.is_file() and p.name != "Dockerfile.dockerignore"
    }
    directories = {n.rstrip("/") for n in named if (ROOT / n).is_dir()}
    assert {
        f for f in files if f not in named and Path(f).parent.as_posix() not in directories
    } == set()


def test_the_readme_points_here() -> None:
    assert "[docs/operations.md](docs/operations.md)" in (ROOT / "README.md").read_text()
