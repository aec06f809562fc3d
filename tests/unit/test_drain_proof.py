"""A lost receiver's request is let go at ``peer_timeout_s`` (its sender's
``await_completion`` returns) while its WRITE is still in flight: the watchdog checks that
handle on (the drain), and an ``Ask`` about the request gets no ``Settled`` until the
handle has ended ``DONE``; then it does.  (Real TCP between services; NIXL faked, its
WRITE held ``PROC`` as a stopped receiver's would be.)"""

from __future__ import annotations

import structlog

from kvservice import FailureReason, TransferService
from kvservice.testing import FakeFabric
from tests.helpers import eventually

from .harness import GUARD_S, door_of, fill, unit_config

FAST = {"heartbeat_interval_s": 0.1, "peer_timeout_s": 0.5}


def asked(logs: list[dict[str, object]]) -> list[object]:
    return [e["proven"] for e in logs if e["event"] == "transfer.asked"]


async def test_a_request_let_go_while_its_write_drains_is_proven_only_once_it_ended() -> None:
    fabric = FakeFabric()
    async with TransferService(unit_config(**FAST), door_factory=fabric.factory) as tx, \
            TransferService(unit_config(**FAST), door_factory=fabric.factory) as rx:
        fill(tx, "r1", [0, 1])
        await rx.expect("r1", [2, 3], sender=tx.address)
        door = door_of(fabric, tx)
        door.hang()  # its WRITE stays PROC
        handle = await tx.send("r1", [0, 1], last=True)
        assert tx._plane is not None
        plane = tx._plane
        await eventually(lambda: plane.watchdog.inflight >= 1, timeout=GUARD_S)
        plane.control.drop_peer(rx.agent_name, ConnectionResetError("the link is cut"))
        sent = await tx.await_completion(handle, timeout=GUARD_S)  # let go at peer_timeout_s
        assert sent.reason is FailureReason.PEER_LOST, sent
        assert plane.watchdog.draining_requests(rx.agent_name) == {"r1"}
        heal = plane.inbound._heal
        with structlog.testing.capture_logs() as logs:
            heal.on_ask(rx.agent_name, ["r1"])
        assert asked(logs) == [0], logs  # still in flight: not proven
        assert door.finish_hung() >= 1
        await eventually(lambda: not plane.watchdog.draining_requests(rx.agent_name), timeout=GUARD_S)
        heal._answered.pop(rx.agent_name)  # (an Ask per half heartbeat)
        with structlog.testing.capture_logs() as logs:
            heal.on_ask(rx.agent_name, ["r1"])
        assert asked(logs) == [1], logs  # ended DONE: proven over
