"""docs/torch.md names the PyTorch that `make test` installs: the series pyproject.toml's dev
extra pins, which is the series installed here, and the least version the `torch` extra takes."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TORCH_DOC = ROOT / "docs" / "torch.md"


def extras() -> dict[str, list[str]]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    optional: dict[str, list[str]] = project["optional-dependencies"]
    return optional


def torch_requirement(requirements: list[str]) -> str:
    (found,) = [r for r in requirements if re.match(r"torch\s*[=<>~!]", r)]
    return found


def pinned_series() -> str:
    """The PyTorch series the dev extra pins (`torch==X.Y.*`)."""
    pin = torch_requirement(extras()["dev"])
    series = re.fullmatch(r"torch==(\d+\.\d+)\.\*", pin)
    assert series, f"the dev extra asks for {pin!r}: expected a pinned series, torch==X.Y.*"
    return series[1]


def test_the_torch_doc_names_the_series_make_test_installs() -> None:
    text = " ".join(TORCH_DOC.read_text().split())
    stated = re.search(
        r"`make test` installs PyTorch (\d+\.\d+) \(the dev extra pins `torch==(\d+\.\d+)\.\*`\)",
        text,
    )
    assert stated, "docs/torch.md no longer says which PyTorch `make test` installs"
    assert (stated[1], stated[2]) == (pinned_series(), pinned_series())


def test_the_torch_doc_names_the_least_version_the_torch_extra_takes() -> None:
    least = re.fullmatch(r"torch>=(\d+\.\d+)", torch_requirement(extras()["torch"]))
    assert least, "the torch extra should ask for torch>=X.Y"
    assert f"(PyTorch ≥ {least[1]}:" in TORCH_DOC.read_text()


def test_the_installed_torch_is_the_pinned_series() -> None:
    torch = pytest.importorskip("torch")
    release = torch.__version__.split("+")[0]
    assert release.startswith(pinned_series() + "."), (
        f"PyTorch {torch.__version__} is installed, the dev extra pins {pinned_series()}.*:"
        " run `make test` (it reinstalls when pyproject.toml changes)"
    )
