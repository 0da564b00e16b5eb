"""The planner does no I/O. import-linter keeps I/O modules out of it (pyproject.toml's
contracts); this test catches the builtins that need no import: no planner module opens a file,
prints, reads input, or runs code from strings."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PLANNER = Path(__file__).resolve().parents[2] / "planner" / "tidalplan"
FORBIDDEN = {"open", "print", "input", "exec", "eval", "compile", "breakpoint", "__import__"}


def calls_to_forbidden_builtins(source: str) -> list[str]:
    return [
        f"line {node.lineno}: {node.func.id}()"
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in FORBIDDEN
    ]


@pytest.mark.parametrize("module", sorted(PLANNER.glob("*.py")), ids=lambda p: p.name)
def test_no_planner_module_calls_an_io_builtin(module: Path) -> None:
    assert calls_to_forbidden_builtins(module.read_text()) == []


def test_the_check_sees_a_call() -> None:
    assert calls_to_forbidden_builtins(
        "def f():\n    with open('x') as g:\n        print(g)\n"
    ) == [
        "line 2: open()",
        "line 3: print()",
    ]
