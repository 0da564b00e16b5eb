"""`tidalpool demo` and the daemon it starts run with none of the extras importable (PyTorch,
CuPy, the CUDA bindings, NVML, matplotlib): what `make demo` installs is enough."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

ABSENT = ("torch", "cupy", "cuda", "pynvml", "matplotlib")

# Imported by every Python process started with its folder on PYTHONPATH (the demo's daemon too).
SITECUSTOMIZE = f'''
import importlib.abc
import sys

ABSENT = {ABSENT!r}


class Absent(importlib.abc.MetaPathFinder):
    """Every import of an extra's package fails, as when it is not installed."""

    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in ABSENT:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None


sys.meta_path.insert(0, Absent())
'''


def run(tmp_path: Path, *args: str, socket_dir: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "TIDALPOOL_SOCKET_DIR": socket_dir}
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=120, env=env
    )


def test_the_demo_imports_no_extra(tmp_path: Path) -> None:
    with tempfile.TemporaryDirectory(prefix="tp-", dir="/tmp") as missing:
        blocked = run(tmp_path, "-c", "import torch", socket_dir=missing)
        assert "ModuleNotFoundError: No module named 'torch'" in blocked.stderr  # in force
        out = run(tmp_path, "-m", "tidalpool", "demo", "--iterations", "3", socket_dir=missing)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "starting a sim daemon" in out.stdout
    assert "losses bit-identical to plain NumPy over 3 iterations" in " ".join(out.stdout.split())
