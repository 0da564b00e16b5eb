"""`make demo` installs the package alone (no extras: no PyTorch, no CUDA wheels); `make test`
installs the dev extras. Read from what make would run (`make -n`) and from pyproject.toml."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "cupy", "cuda-bindings", "nvidia-", "matplotlib")
"""Packages the demo does not need: the GPU integrations and the pictures."""


def installs(target: str, venv: Path) -> list[str]:
    """The `pip install` lines `make TARGET` would run to make the virtual environment `venv`."""
    if shutil.which("make") is None:
        pytest.skip("no make on this machine")
    dry = subprocess.run(
        ["make", "-n", target, f"VENV={venv}"],
        cwd=ROOT,
        env={k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return [line for line in dry.stdout.splitlines() if " -m pip install " in line]


def test_make_demo_installs_the_package_without_extras(tmp_path: Path) -> None:
    (line,) = installs("demo", tmp_path / "venv")
    assert line == (
        f"{tmp_path / 'venv'}/bin/python -m pip install --quiet --disable-pip-version-check -e ."
    )


def test_make_test_installs_the_dev_extras(tmp_path: Path) -> None:
    (line,) = installs("unit", tmp_path / "venv")
    assert line.endswith(' -e ".[dev]"')


def test_the_packages_own_dependencies_pull_no_gpu_or_plotting_package() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = [re.split(r"[\s\[<>=~!;]", r, maxsplit=1)[0].lower() for r in project["dependencies"]]
    assert [n for n in names if n.startswith(HEAVY)] == []
    dev = project["optional-dependencies"]["dev"]
    assert any(r.startswith("torch") for r in dev)  # `make test` runs the torch tests
