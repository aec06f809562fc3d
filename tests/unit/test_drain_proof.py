"""A lost receiver's request is let go at ``peer_timeout_s`` (its sender's
``await_completion`` returns) while its WRITE is still in flight: the watchdog checks that
handle on (the drain), and an ``Ask`` about the request gets no ``Settled`` until the
handle has ended ``DONE``; then it does.  (Real TCP between services; NIXL faked, its
WRITE held ``PROC`` as a stopped receiver's would be.)"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import pytest
import structlog

from kvservice import FailureReason, TransferService
from kvservice._transfer import drain
from kvservice.testing import FakeDoor, FakeFabric
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


async def _aborted_in_flight(fabric: FakeFabric, tx: TransferService, rx: TransferService, rid: str,
                             dst: list[int]) -> None:
    """``rid`` sent to ``rx`` (pages ``dst``) with its WRITE held ``PROC``, then aborted on the sender."""
    fill(tx, rid, [0, 1])
    await rx.expect(rid, dst, sender=tx.address)
    door = door_of(fabric, tx)
    before = door.post_count()
    handle = await tx.send(rid, [0, 1], last=True)
    await eventually(lambda: door.post_count() > before, timeout=GUARD_S)  # its WRITE, held PROC
    aborted = await tx.abort(rid)
    assert aborted is not None and aborted.reason is FailureReason.ABORTED, aborted
    # settled once the receiver answered (its Outcome: it failed), not held by its WRITE
    sent = await tx.await_completion(handle, timeout=GUARD_S)
    assert sent.settled, sent


@contextlib.asynccontextmanager
async def _hung_pair() -> AsyncIterator[tuple[FakeFabric, TransferService, TransferService, FakeDoor]]:
    """A sender and a receiver over a fake fabric, the sender's WRITEs held ``PROC``; clean at the end."""
    fabric = FakeFabric()
    async with TransferService(unit_config(**FAST), door_factory=fabric.factory) as tx, \
            TransferService(unit_config(**FAST), door_factory=fabric.factory) as rx:
        door = door_of(fabric, tx)
        door.hang()
        yield fabric, tx, rx, door
    fabric.assert_clean()


async def test_a_write_of_an_aborted_request_is_let_go_and_proven_once_it_ends_done() -> None:
    """An abort (a deadline, a failed chunk alike) on a live link does not release the WRITE
    in flight: a release would not stop it, and an ``Ask`` could then never be answered.  It is
    checked on; while it runs the request is not proven, once it ended ``DONE`` it is."""
    async with _hung_pair() as (fabric, tx, rx, door):
        with structlog.testing.capture_logs() as unproven:
            await _aborted_in_flight(fabric, tx, rx, "r1", [2, 3])
        assert tx._plane is not None
        plane, heal = tx._plane, tx._plane.inbound._heal
        assert plane.watchdog.draining_requests(rx.agent_name) == {"r1"}
        (xid,) = [x for x in door.live_ids() if door.release_counts[x] == 0][:1]
        with structlog.testing.capture_logs() as logs:
            heal.on_ask(rx.agent_name, ["r1"])
        assert asked(logs) == [0], logs
        assert door.finish_hung() >= 1
        await eventually(lambda: not plane.watchdog.draining_requests(rx.agent_name), timeout=GUARD_S)
        assert door.release_counts[xid] == 1
        heal._answered.pop(rx.agent_name)
        with structlog.testing.capture_logs() as logs:
            heal.on_ask(rx.agent_name, ["r1"])
        assert asked(logs) == [1], logs
        assert not [e for e in unproven if e["event"] == "transfer.unproven"], unproven


async def test_a_let_go_write_that_never_ends_is_given_up_unproven(monkeypatch: pytest.MonkeyPatch) -> None:
    """Checked for at most ``DRAIN_S``: then released, and the request is never proven to a
    receiver that asks (its pages stay held until this process exits, as they must)."""
    monkeypatch.setattr(drain, "DRAIN_S", 0.3)
    async with _hung_pair() as (fabric, tx, rx, door):
        with structlog.testing.capture_logs() as logs:
            await _aborted_in_flight(fabric, tx, rx, "r2", [2, 3])
            assert tx._plane is not None
            plane, heal = tx._plane, tx._plane.inbound._heal
            await eventually(lambda: not plane.watchdog.draining_requests(rx.agent_name), timeout=GUARD_S)
        assert any(e["event"] == "transfer.unproven" and e["why"] == "drain ended unfinished" for e in logs), logs
        with structlog.testing.capture_logs() as logs:
            heal.on_ask(rx.agent_name, ["r2"])
        assert asked(logs) == [0], logs
        door.complete_immediately()
        door.finish_hung()  # the settle fence, posted behind it


async def test_let_go_handles_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """A receiver that keeps its link and never lets a WRITE end cannot pile handles up: past
    ``MAX_LET_GO`` the oldest is released, its request unproven; the newest is still checked."""
    monkeypatch.setattr(drain, "MAX_LET_GO", 2)
    async with _hung_pair() as (fabric, tx, rx, door):
        with structlog.testing.capture_logs() as logs:
            for k, rid in enumerate(("b1", "b2", "b3")):
                await _aborted_in_flight(fabric, tx, rx, rid, [2 + 2 * k, 3 + 2 * k])
        assert tx._plane is not None
        assert tx._plane.watchdog.draining_requests(rx.agent_name) == {"b2", "b3"}
        given_up = [e["request_id"] for e in logs if e["event"] == "transfer.unproven"]
        assert given_up == ["b1"], logs
        door.complete_immediately()
        door.finish_hung()
