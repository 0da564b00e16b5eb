"""The one failure of a replay that the command turns into its exit status."""

from __future__ import annotations


class ReplayError(Exception):
    """The replay cannot go on; the message says why. `status` is the command's exit status:
    2 for what the user can change (no daemon, a limit too low), 1 for a plan that failed."""

    def __init__(self, message: str, status: int = 2) -> None:
        super().__init__(message)
        self.status = status
