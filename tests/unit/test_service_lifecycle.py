"""Shutdown with work in flight, draining, and an event loop that keeps running."""

from __future__ import annotations

import socket

import anyio
import pytest
import torch

from kvservice import FailureReason, KVPoll, ServiceConfig, TransferHandle, TransferService
from kvservice.testing import FakeDoor, FakeFabric
from tests.helpers import SMALL, Ticker, eventually

from .harness import GUARD_S, door_of, fill, unit_config


def shut_down_first() -> ServiceConfig:
    """A service whose requests' own deadlines (bootstrap, transfer, arrival) outlast each test's
    hang guard, so that only the shutdown under test ends them: on a loaded machine a test
    here has run past the 30 s bootstrap deadline, and the request still bootstrapping ended
    TIMEOUT instead of SHUTDOWN."""
    outlast = 2 * GUARD_S
    return unit_config(bootstrap_timeout_s=outlast, transfer_timeout_s=outlast, arrival_timeout_s=outlast)


async def start_work(tx: TransferService, rx: TransferService, txd: FakeDoor) -> list[TransferHandle]:
    """Three sending requests on ``tx``: one chunked with both chunks in flight, one in
    flight, one still bootstrapping; plus an expect on ``rx`` nothing was ever sent for."""
    txd.hang()
    await rx.expect("chunked", [10, 11, 12], sender=tx.address)
    await rx.expect("single", [20], sender=tx.address)
    await rx.expect("unsent", [30], sender=tx.address)
    handles = [
        await tx.send("chunked", [1]),
        await tx.send("chunked", [2, 3], last=True),
        await tx.send("single", [4], last=True),
        await tx.send("bootstrapping", [5], last=True),
    ]
    await eventually(lambda: txd.live_xfers() == 3, GUARD_S)
    assert [h.poll() for h in handles] == [KVPoll.Transferring] * 3 + [KVPoll.Bootstrapping]
    return handles


async def test_shutdown_of_the_sender_fails_everything_shutdown() -> None:
    fabric = FakeFabric()
    with anyio.fail_after(GUARD_S):
        async with TransferService(shut_down_first(), door_factory=fabric.factory) as rx:
            async with TransferService(shut_down_first(), door_factory=fabric.factory) as tx:
                txd = door_of(fabric, tx)
                handles = await start_work(tx, rx, txd)
                xids = txd.live_ids()
            assert all(h.result is not None and h.result.reason is FailureReason.SHUTDOWN for h in handles)
            assert txd.closed and txd.live_xfers() == 0
            assert all(txd.release_counts[x] >= 1 for x in xids)
            for rid in ("chunked", "single"):
                assert (await rx.await_arrival(rid)).reason is FailureReason.SHUTDOWN
            # the sender never got to send this one: its goodbye ends the expect too
            assert (await rx.await_arrival("unsent")).reason is FailureReason.SHUTDOWN
    assert rx.status()["receiving"] == 0
    fabric.assert_clean()


async def test_shutdown_of_the_receiver_fails_everything_shutdown() -> None:
    fabric = FakeFabric()
    with anyio.fail_after(GUARD_S):
        async with TransferService(shut_down_first(), door_factory=fabric.factory) as tx:
            txd = door_of(fabric, tx)
            async with TransferService(shut_down_first(), door_factory=fabric.factory) as rx:
                handles = await start_work(tx, rx, txd)
                xids = txd.live_ids()
            for rid in ("chunked", "single", "unsent"):
                assert (await rx.await_arrival(rid)).reason is FailureReason.SHUTDOWN
            for h in handles[:3]:
                assert (await tx.await_completion(h)).reason is FailureReason.SHUTDOWN
            # a lost receiver's WRITEs are checked until each ends (up to proofs.drain_limit): end them
            txd.finish_hung()
            await eventually(lambda: txd.live_xfers() == 0, GUARD_S)
            assert all(txd.release_counts[x] >= 1 for x in xids)
            assert handles[3].poll() is KVPoll.Bootstrapping  # never bound to that receiver
    assert handles[3].result is not None and handles[3].result.reason is FailureReason.SHUTDOWN
    fabric.assert_clean()


async def test_shutdown_drains_work_that_completes_within_the_grace_period() -> None:
    fabric = FakeFabric()
    with anyio.fail_after(GUARD_S):
        async with TransferService(unit_config(), door_factory=fabric.factory) as rx:
            async with TransferService(unit_config(drain_grace_s=GUARD_S), door_factory=fabric.factory) as tx:
                txd = door_of(fabric, tx)
                txd.complete_after(20)
                data = fill(tx, "drain", [1, 2])
                await rx.expect("drain", [7, 8], sender=tx.address)
                h = await tx.send("drain", [1, 2], last=True)
                assert h.result is None
            assert h.result is not None and h.result.ok, h.result
            assert (await rx.await_arrival("drain")).ok
            assert torch.equal(rx.kv.pages([7, 8]), data)
    fabric.assert_clean()


@pytest.mark.parametrize("exit_first", ["sender", "receiver"])
async def test_no_live_handles_and_nothing_pending_after_shutdown(exit_first: str) -> None:
    fabric = FakeFabric()
    with anyio.fail_after(GUARD_S):
        async with (
            TransferService(shut_down_first(), door_factory=fabric.factory) as outer,
            TransferService(shut_down_first(), door_factory=fabric.factory) as inner,
        ):
            tx, rx = (inner, outer) if exit_first == "sender" else (outer, inner)
            await start_work(tx, rx, door_of(fabric, tx))
    for svc in (tx, rx):
        status = svc.status()
        assert status["sending"] == status["receiving"] == status["inflight_handles"] == 0
    assert all(door.closed for door in fabric.created)
    fabric.assert_clean()


async def test_event_loop_keeps_ticking_while_posts_are_slow() -> None:
    """Posts that hold the door thread 50 ms each never hold the event loop."""
    fabric = FakeFabric()
    ticker = Ticker()
    nchunks = 6
    with anyio.fail_after(GUARD_S):
        async with (
            TransferService(unit_config(), door_factory=fabric.factory) as tx,
            TransferService(unit_config(), door_factory=fabric.factory) as rx,
            anyio.create_task_group() as tg,
        ):
            tg.start_soon(ticker.run)
            txd = door_of(fabric, tx)
            txd.post_delay = 0.05
            txd.post_probe = lambda: ticker.ticks
            src = list(range(nchunks))
            data = fill(tx, "slow", src)
            await rx.expect("slow", [40 + p for p in src], sender=tx.address)
            handles = [await tx.send("slow", [p], last=p == src[-1]) for p in src]
            result = await tx.await_completion(handles[-1])
            tg.cancel_scope.cancel()
    assert result.ok
    assert torch.equal(rx.kv.pages([40 + p for p in src]), data)
    probes = [p.probe for p in txd.posts]
    assert len(probes) == nchunks
    # while each post slept on the door thread, the loop ran the ticker
    assert all(p is not None and p[1] > p[0] for p in probes), probes
    assert result.bytes == nchunks * SMALL.page_bytes
    fabric.assert_clean()


async def test_the_control_port_closes_only_after_the_nixl_agent() -> None:
    """A peer that finds the port refusing may take this service's agent for gone and
    settle what it held (docs/settle.md): the port must stay open (refusing new
    peers) until the agent is closed, and close right after."""
    fabric = FakeFabric()
    seen: list[str] = []
    with anyio.fail_after(GUARD_S):
        async with TransferService(unit_config(), door_factory=fabric.factory) as svc:
            host, port = svc.address.rsplit(":", 1)
            door = fabric.door(svc.agent_name)
            close = door.close

            def close_and_dial() -> None:
                with socket.create_connection((host, int(port)), timeout=2):
                    seen.append("open while the agent closed")
                close()

            door.close = close_and_dial  # type: ignore[method-assign]
    assert seen == ["open while the agent closed"]
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((host, int(port)), timeout=2).close()
