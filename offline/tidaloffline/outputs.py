"""Output paths checked before any work: a command refuses one it cannot write at once,
not after a solve or a simulation of many seconds."""

from __future__ import annotations

from pathlib import Path


def plural(count: int, noun: str, nouns: str | None = None) -> str:
    """`count` and `noun`, in the plural (`nouns`, or the noun and an s) unless the count is
    one: "1 buffer", "2 buffers", "3 accesses"."""
    return f"{count} {noun if count == 1 else nouns or noun + 's'}"


def output_problem(option: str, path: Path | None) -> str | None:
    """Why `path`, given to `option`, cannot be written (its folder is missing, or it is a
    folder); None when it can be tried (or was not given)."""
    if path is None:
        return None
    if path.is_dir():
        return f"{option} {path}: a directory, not a file"
    if not path.parent.is_dir():
        return f"{option} {path}: no such directory {path.parent}"
    return None
