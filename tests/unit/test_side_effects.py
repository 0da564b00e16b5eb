"""What `make test` and the tools leave behind: `make prometheus` (tools.prometheus) installs
Debian's package only where its binaries are missing and leaves no system Prometheus enabled or
running that the install started (fake apt-get, sudo and systemctl on PATH record what it runs);
the metrics screenshot does not overwrite the committed picture by default."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

FAKE_APT = """#!/bin/sh
echo "apt-get $*" >> "$LOG"
if [ "$1" = install ]; then
    for tool in prometheus promtool; do
        printf '#!/bin/sh\\n' > "$BIN/$tool" && chmod +x "$BIN/$tool"
    done
fi
"""
FAKE_SYSTEMCTL = """#!/bin/sh
echo "systemctl $*" >> "$LOG"
"""
FAKE_SUDO = """#!/bin/sh
[ "$1" = -n ] && shift
exec "$@"
"""


def fake_bin(tmp_path: Path) -> tuple[Path, Path]:
    bin_dir, log = tmp_path / "bin", tmp_path / "log"
    bin_dir.mkdir()
    log.write_text("")
    for name, text in (("apt-get", FAKE_APT), ("systemctl", FAKE_SYSTEMCTL), ("sudo", FAKE_SUDO)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    for tool in ("env", "id", "true", "chmod"):  # what the fakes call
        (bin_dir / tool).symlink_to(subprocess.check_output(["which", tool], text=True).strip())
    return bin_dir, log


def make_prometheus(bin_dir: Path, log: Path) -> subprocess.CompletedProcess[str]:
    env = {"PATH": str(bin_dir), "LOG": str(log), "BIN": str(bin_dir), "HOME": os.environ["HOME"]}
    make = subprocess.check_output(["which", "make"], text=True).strip()
    return subprocess.run(
        [make, "-s", "-C", str(ROOT), "prometheus", f"PYTHON={sys.executable}"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_installing_stops_and_disables_the_service_it_started(tmp_path: Path) -> None:
    bin_dir, log = fake_bin(tmp_path)
    out = make_prometheus(bin_dir, log)
    assert (out.returncode, out.stdout) == (0, "prometheus and promtool are installed\n"), out
    assert log.read_text().splitlines() == [
        "apt-get install -y --no-install-recommends prometheus",
        "systemctl disable --now prometheus.service",
    ]


def test_binaries_already_there_are_left_alone_with_their_service(tmp_path: Path) -> None:
    bin_dir, log = fake_bin(tmp_path)
    for tool in ("prometheus", "promtool"):
        (bin_dir / tool).write_text("#!/bin/sh\n")
        (bin_dir / tool).chmod(0o755)
    out = make_prometheus(bin_dir, log)
    assert (out.returncode, out.stdout) == (0, "prometheus and promtool are installed\n"), out
    assert log.read_text() == ""  # nothing installed, no service stopped


def test_the_metrics_screenshot_leaves_the_committed_picture_alone() -> None:
    from tools.metrics_screenshot import arguments

    out = arguments().parse_args([]).out
    assert out.is_absolute() and not out.resolve().is_relative_to(ROOT)
    assert arguments().parse_args(["--out", "docs/metrics-dashboard.png"]).out == Path(
        "docs/metrics-dashboard.png"
    )
