"""A newcomer's pages point only into the repository: every relative link of README.md,
docs/architecture.md, docs/torch.md and traces/README.md names a file of the repository, and no
page leans on a design document kept elsewhere."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = ["README.md", "docs/architecture.md", "docs/torch.md", "traces/README.md"]


@pytest.mark.parametrize("page", PAGES)
def test_relative_links_name_files_of_the_repository(page: str) -> None:
    path = ROOT / page
    text = path.read_text()
    links = [t.split("#")[0] for t in re.findall(r"\]\(([^)\s]+)\)", text)]
    relative = [t for t in links if t and not re.match(r"[a-z]+:", t)]
    for target in relative:
        resolved = (path.parent / target).resolve()
        assert resolved.is_relative_to(ROOT), f"{page}: {target} is outside the repository"
        assert resolved.exists(), f"{page}: {target} does not exist"
    assert "DESIGN.md" not in text
