"""Types of the C core (_exact.c); exact.py is its only caller."""

from typing_extensions import Buffer

def search(
    lowers: Buffer,
    uppers: Buffer,
    sizes: Buffer,
    capacity: int,
    time_limit_s: float,
    /,
) -> tuple[str, tuple[int, ...] | None]:
    """Native int64 arrays in alignment units; ("feasible", offsets) | (status, None)."""
