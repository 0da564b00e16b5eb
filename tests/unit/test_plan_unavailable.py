"""The daemon's word that it cannot plan a session: `PlanUnavailable` on the wire and back, the
line a person reads, and how a client's stream reader and session keep it until a plan comes."""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.message import Message
from tidalclient.connection import Connection
from tidalclient.plans import Plan
from tidalclient.session import Session
from tidalcore.unplanned import KINDS, NO_SCHEDULE, UNDER_OP_BOUND, PlanUnavailable
from tidalcore.v1 import common_pb2, pool_pb2

UNDER = PlanUnavailable(
    1000,
    UNDER_OP_BOUND,
    "swap limit 1000 B is under the op-wise bound 1.3 KiB, the bytes one op needs on the device"
    " at once: no plan fits it",
    1300,
)


def test_the_message_carries_every_field_and_comes_back_equal() -> None:
    message = UNDER.message()
    assert (message.limit_bytes, message.kind, message.lowest_limit_bytes) == (
        1000,
        "under_op_bound",
        1300,
    )
    wire = pool_pb2.ServerMessage(unplanned=message).SerializeToString()
    back = pool_pb2.ServerMessage.FromString(wire)
    assert back.WhichOneof("body") == "unplanned"
    assert PlanUnavailable.of(back.unplanned) == UNDER
    assert KINDS == ("under_op_bound", "no_schedule", "over_lease", "failed", "too_large")


def test_a_reason_is_one_line_and_a_kind_a_newer_daemon_sends_is_kept() -> None:
    message = pool_pb2.PlanUnavailable(limit_bytes=5, kind="host_lease", reason="too\n small  ")
    assert PlanUnavailable.of(message) == PlanUnavailable(5, "host_lease", "too small", 0)
    assert PlanUnavailable.of(pool_pb2.PlanUnavailable()).kind == "unknown"


def test_the_line_names_the_lowest_limit_only_when_known() -> None:
    assert UNDER.line() == (
        "the daemon cannot plan this session: swap limit 1000 B is under the op-wise bound"
        " 1.3 KiB, the bytes one op needs on the device at once: no plan fits it; the lowest"
        " limit that could work is 1.3 KiB (1300 bytes)"
    )
    unknown = PlanUnavailable(1 << 30, NO_SCHEDULE, "no schedule found for limit 1 GiB")
    assert unknown.line() == (
        "the daemon cannot plan this session: no schedule found for limit 1 GiB"
    )


def old_server_message() -> type[Message]:
    """ServerMessage as a client built before `unplanned` (field 5) reads it."""
    pool = descriptor_pool.DescriptorPool()
    for stubs in (common_pb2, pool_pb2):
        proto = descriptor_pb2.FileDescriptorProto()
        stubs.DESCRIPTOR.CopyToProto(proto)
        for message in proto.message_type:
            if message.name == "ServerMessage":
                kept = [f for f in message.field if f.name != "unplanned"]
                del message.field[:]
                message.field.extend(kept)
        pool.Add(proto)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("tidalpool.v1.ServerMessage"))


def test_a_client_built_before_the_member_reads_no_body_and_goes_on() -> None:
    old = old_server_message()
    unplanned = pool_pb2.ServerMessage(unplanned=UNDER.message()).SerializeToString()
    assert old.FromString(unplanned).WhichOneof("body") is None  # skipped: not a plan, no end
    plan = pool_pb2.ServerMessage(plan=pool_pb2.PlanUpdate(plan_id=2)).SerializeToString()
    assert old.FromString(plan).WhichOneof("body") == "plan"


@pytest.fixture
def connection() -> Iterator[Connection]:
    c = Connection(Path("/nonexistent"), "s-test", "token")  # the channel is never used
    yield c
    c.close()


def test_the_stream_reader_hands_plans_and_refusals_to_their_callbacks(
    connection: Connection,
) -> None:
    plan = pool_pb2.PlanUpdate(plan_id=7)
    connection._responses = iter(
        [
            pool_pb2.ServerMessage(unplanned=UNDER.message()),
            pool_pb2.ServerMessage(plan=plan),
            pool_pb2.ServerMessage(goodbye=pool_pb2.Goodbye(message="done")),
        ]
    )
    seen: list[Any] = []
    connection._listen(seen.append, seen.append, lambda: seen.append("end"), None)
    assert seen == [UNDER.message(), plan, "end"]


class Executor:
    """What `Session._receive_plan` needs of an executor: it takes any plan."""

    def install_plan(self, plan: Plan) -> None:
        self.plan = plan


def bare_session() -> Session:
    """A Session with only what its plan callbacks touch (no lease, no daemon)."""
    s = Session.__new__(Session)
    s.id, s.executor = "s-test", Executor()  # type: ignore[assignment]
    s.plans_received = s.plans_rejected = 0
    s.plan, s.plan_unavailable = None, None
    s._shapes_lock, s._shape = threading.Lock(), ""
    s._shapes = OrderedDict()
    return s


def test_the_session_keeps_the_refusal_warns_once_and_a_plan_clears_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    s = bare_session()
    with caplog.at_level(logging.WARNING, logger="tidalpool"):
        s._receive_unplanned(UNDER.message())
        s._receive_unplanned(UNDER.message())  # the same word again: no second warning
    assert s.plan_unavailable == UNDER
    assert [r.getMessage() for r in caplog.records] == [
        f"tidalpool: session s-test: {UNDER.line()}"
    ]
    update = pool_pb2.PlanUpdate(plan_id=3, version=2, sizes=[1024], offsets=[0], height_bytes=1024)
    s._receive_plan(update)
    assert s.plans_received == 1
    assert s.plan_unavailable is None  # a plan made after all
