"""Why the daemon sends no plan: the `PlanUnavailable` message and its one Python value.

    daemon (plan_worker) ──PlanUnavailable(...).message()──▶ ServerMessage.unplanned
    client (connection)  ◀──PlanUnavailable.of(message)──── the session's stats, a warning

The daemon writes it once per session when planning gives up; the client keeps the last one
until a plan arrives. Both sides use this module, so the kinds and the wording of the line a
person reads are defined once.
"""

from __future__ import annotations

from dataclasses import dataclass

from tidalcore.units import format_size
from tidalcore.v1 import pool_pb2

UNDER_OP_BOUND = "under_op_bound"
"""The limit is under the op-wise bound (the most bytes one op touches): no plan fits it."""
NO_SCHEDULE = "no_schedule"
"""No swap schedule tried left a placement within the limit."""
OVER_LEASE = "over_lease"
"""The plan's footprint is more than the session's device lease."""
FAILED = "failed"
"""The planner raised; the reason is its one line."""
TOO_LARGE = "too_large"
"""The iteration makes more allocations than the daemon plans (`max_plan_allocations`)."""
KINDS = (UNDER_OP_BOUND, NO_SCHEDULE, OVER_LEASE, FAILED, TOO_LARGE)


@dataclass(frozen=True, slots=True)
class PlanUnavailable:
    """The daemon cannot plan the session for `limit_bytes`: a `kind` in KINDS (a newer
    daemon's kind is kept as it came), a one-line `reason`, and the lowest limit that could
    work where the daemon knows one (0: not known), for the iteration shape `shape` ("": the
    session's one shape)."""

    limit_bytes: int
    kind: str
    reason: str
    lowest_limit_bytes: int = 0
    shape: str = ""

    def message(self) -> pool_pb2.PlanUnavailable:
        """This value as the wire message."""
        return pool_pb2.PlanUnavailable(
            limit_bytes=self.limit_bytes,
            kind=self.kind,
            reason=self.reason,
            lowest_limit_bytes=self.lowest_limit_bytes,
            shape=self.shape,
        )

    @classmethod
    def of(cls, message: pool_pb2.PlanUnavailable) -> PlanUnavailable:
        """The value of a wire message; a reason spread over lines is folded onto one."""
        return cls(
            int(message.limit_bytes),
            message.kind or "unknown",
            " ".join(message.reason.split()),
            int(message.lowest_limit_bytes),
            message.shape,
        )

    def line(self) -> str:
        """One line for a person: the reason, then the lowest limit that could work if known."""
        of = f" (iterations of shape {self.shape!r})" if self.shape else ""
        text = f"the daemon cannot plan this session{of}: {self.reason}"
        if self.lowest_limit_bytes:
            text += f"; the lowest limit that could work is {format_size(self.lowest_limit_bytes)}"
            text += f" ({self.lowest_limit_bytes} bytes)"
        return text
