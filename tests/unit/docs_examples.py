"""The Python examples of the docs, run as written by the tests that check what they print."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

DOCS = Path(__file__).resolve().parents[2] / "docs"


def run_example(page: str, containing: str) -> dict[str, Any]:
    """Run the one ```python block of docs/`page` that contains `containing`; its namespace."""
    path = DOCS / page
    blocks = re.findall(r"```python\n(.*?)```", path.read_text(), re.S)
    (example,) = [b for b in blocks if containing in b]
    namespace: dict[str, Any] = {}
    exec(compile(example, str(path), "exec"), namespace)
    return namespace
