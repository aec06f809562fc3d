"""The peer table under interleavings a test forces: a drop of a peer and the same
peer reconnecting, in either order; and ``expect()`` while the service shuts down.

Whatever the order, the reconnected link keeps its NIXL agent and layout, its
requests succeed, and nothing crashes.  (Real TCP between two services; NIXL
faked, with gates that hold a door call until the test opens them.)"""

from __future__ import annotations

import threading
from collections.abc import Awaitable, Callable

import anyio
import anyio.abc
import torch

from kvservice import FailureReason, TransferService
from kvservice._control.links import PeerLink
from kvservice.testing import FakeFabric
from kvservice.testing.inspect import inside
from tests.helpers import eventually

from .harness import GUARD_S, door_of, fill, two_services, unit_config


async def transfer(tx: TransferService, rx: TransferService, rid: str, src: list[int], dst: list[int]) -> None:
    data = fill(tx, rid, src)
    await rx.expect(rid, dst, sender=tx.address)
    result = await tx.await_completion(await tx.send(rid, src, last=True), timeout=GUARD_S)
    assert result.ok, result
    arrived = await rx.await_arrival(rid, timeout=GUARD_S)
    assert arrived.ok, arrived
    assert torch.equal(rx.kv.pages(dst), data)


def linked(svc: TransferService, agent: str) -> PeerLink | None:
    return inside(svc).link(agent)


async def test_drop_in_progress_then_the_same_agent_reconnects() -> None:
    """The sender is still unloading the receiver's agent when the receiver dials
    again: the new handshake waits, then loads the agent afresh."""
    fabric = FakeFabric()
    with anyio.fail_after(GUARD_S):
        async with two_services(fabric, receiver=unit_config(heartbeat_interval_s=0.05)) as (tx, rx):
            txd = door_of(fabric, tx)
            await transfer(tx, rx, "before", [1], [10])
            old = linked(tx, rx.agent_name)
            assert old is not None

            txd.gates["remove_peer"] = gate = threading.Event()
            inside(tx).drop_link(rx.agent_name, ConnectionResetError("test drops the link"))
            await anyio.to_thread.run_sync(txd.arrived["remove_peer"].wait, GUARD_S)
            await eventually(lambda: linked(rx, tx.agent_name) is None, GUARD_S)  # rx saw the EOF

            async with anyio.create_task_group() as tg:
                tg.start_soon(transfer, tx, rx, "after", [2], [20])  # re-dials while the drop is stuck
                await anyio.sleep(0.2)
                assert linked(tx, rx.agent_name) is None  # the new link waits for the drop
                gate.set()
            new = linked(tx, rx.agent_name)
            assert new is not None and new is not old and new.generation > old.generation
            assert txd.loaded_peers() == [rx.agent_name]  # the fresh agent, not removed
            kv = inside(tx).control.peer_kv(rx.agent_name)
            assert kv is not None and kv.memory.regions == rx.memory.regions
            await transfer(tx, rx, "again", [3], [30])
    fabric.assert_clean()


async def test_reconnect_overtakes_the_old_links_loss_report() -> None:
    """The old link has ended but its loss report is late (held here); the same
    agent's new handshake drops the old incarnation itself, then loads; the late
    report then finds a newer link and leaves it alone."""
    fabric = FakeFabric()
    with anyio.fail_after(GUARD_S):
        async with two_services(fabric, receiver=unit_config(heartbeat_interval_s=0.05),
                                sender=unit_config(heartbeat_interval_s=0.05)) as (tx, rx):
            control = inside(tx).control
            held = anyio.Event()
            reports: list[PeerLink] = []
            original: Callable[[PeerLink, BaseException | None, bool], Awaitable[None]] = control._on_lost

            async def late_report(link: PeerLink, cause: BaseException | None, graceful: bool) -> None:
                reports.append(link)
                await held.wait()
                await original(link, cause, graceful)

            control._on_lost = late_report  # type: ignore[method-assign]  # links made from now on
            txd = door_of(fabric, tx)
            await transfer(tx, rx, "before", [1], [10])
            old = linked(tx, rx.agent_name)
            assert old is not None

            inside(rx).drop_link(tx.agent_name, ConnectionResetError("receiver drops the link"))
            await eventually(lambda: old in reports, GUARD_S)  # ended on tx, report held
            await transfer(tx, rx, "after", [2], [20])  # reconnects meanwhile
            new = linked(tx, rx.agent_name)
            assert new is not None and new is not old
            held.set()
            await eventually(lambda: old.ended.is_set(), GUARD_S)
            assert linked(tx, rx.agent_name) is new  # the late report did not drop the new link
            assert txd.loaded_peers() == [rx.agent_name]
            assert txd.peers_removed.count(rx.agent_name) == 1  # the old incarnation, once
            await transfer(tx, rx, "again", [3], [30])
            assert tx.status()["outcomes"].get("send.PEER_LOST", 0) == 0
    fabric.assert_clean()


async def test_expect_returns_when_the_service_shuts_down_mid_dial() -> None:
    """A sender that accepts the connection and never answers: the dial waits on it;
    leaving the service ends that ``expect()`` (and the request is SHUTDOWN), no hang."""
    fabric = FakeFabric()
    accepted: list[anyio.abc.SocketStream] = []

    async def mute(stream: anyio.abc.SocketStream) -> None:
        accepted.append(stream)
        await anyio.sleep_forever()

    with anyio.fail_after(GUARD_S):
        listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
        port = listener.extra(anyio.abc.SocketAttribute.local_port)
        async with listener, anyio.create_task_group() as outer:
            outer.start_soon(listener.serve, mute)
            returned = anyio.Event()
            svc = TransferService(unit_config(connect_timeout_s=60.0), door_factory=fabric.factory)
            async with svc:

                async def expecting() -> None:
                    await svc.expect("stuck", [1], sender=f"127.0.0.1:{port}")
                    returned.set()

                outer.start_soon(expecting)
                await eventually(lambda: bool(accepted), GUARD_S)
            with anyio.fail_after(2.0):
                await returned.wait()
            result = await svc.await_arrival("stuck")
            assert result.reason is FailureReason.SHUTDOWN, result
            outer.cancel_scope.cancel()
    for stream in accepted:
        await stream.aclose()
