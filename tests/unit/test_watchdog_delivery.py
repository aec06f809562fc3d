"""Notifications handed to the loop by a lingering watchdog tick (``TickPlan.deliver``).

A receiver's watchdog lingers on the door thread while anything is expected, polling
NIXL's notifications.  Each batch used to end the tick: the door thread woke the loop,
the loop digested the outcome and queued a new tick, waking the door thread again.  Now
the tick hands the batch to the loop and lingers on: one wake-up per batch, no new tick.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping

import anyio
import pytest
import torch

from kvservice._nixl import door as door_mod
from kvservice._nixl.door import Door, TickOutcome, TickPlan
from kvservice._transfer import watchdog as watchdog_mod
from kvservice.testing import FakeFabric
from kvservice.testing.inspect import inside
from tests.helpers import eventually

from .harness import GUARD_S, door_of, fill, two_services
from .test_fake_door import indices, pair


def test_a_lingering_tick_hands_notifications_over_and_lingers_on() -> None:
    fabric, a, b, *_pools = pair()
    interrupt = threading.Event()
    delivered: list[Mapping[str, list[bytes]]] = []
    out: list[TickOutcome] = []
    plan = TickPlan(linger=30.0, poll=0.001, interrupt=interrupt, deliver=delivered.append)
    thread = threading.Thread(target=lambda: out.append(door_mod.run_tick(b, plan)))
    thread.start()
    try:
        for n in (b"1", b"2"):
            a.release(a.post("b", indices([1]), indices([2]), n)[0])
            deadline = time.monotonic() + GUARD_S
            while sum(len(m) for batch in delivered for m in batch.values()) < int(n):
                assert time.monotonic() < deadline, f"notification {n!r} not handed over"
                time.sleep(0.001)
        assert thread.is_alive(), "the tick ended on a notification it could hand over"
    finally:
        interrupt.set()
        thread.join(GUARD_S)
    assert not thread.is_alive()
    assert [m for batch in delivered for m in batch["a"]] == [b"1", b"2"]
    assert out[0].notifs == {} and not out[0].checked  # nothing handed over comes back twice
    fabric.assert_clean()


def test_without_deliver_a_notification_still_ends_the_tick() -> None:
    """The plan's choice: a tick not given ``deliver`` (the simulation's, a non-lingering
    one) brings notifications back in its outcome, as before."""
    fabric, a, b, *_pools = pair()
    out: list[TickOutcome] = []
    plan = TickPlan(linger=30.0, poll=0.001, interrupt=threading.Event())
    thread = threading.Thread(target=lambda: out.append(door_mod.run_tick(b, plan)))
    thread.start()
    a.release(a.post("b", indices([1]), indices([2]), b"n")[0])
    thread.join(GUARD_S)
    assert not thread.is_alive() and out[0].notifs == {"a": [b"n"]}
    fabric.assert_clean()


async def test_arrivals_reach_the_receiver_without_a_tick_each(monkeypatch: pytest.MonkeyPatch) -> None:
    """Requests landing one after another on an expecting receiver: every one arrives
    byte-exact, and the receiver's watchdog does not end a tick per arrival (lingers last
    2 s here, so only its own work ends one)."""
    ticks: list[str] = []

    def counting(door: Door, plan: TickPlan) -> TickOutcome:
        out = door_mod.run_tick(door, plan)
        ticks.append(door.agent_name)
        return out

    monkeypatch.setattr(watchdog_mod, "LINGER_S", 2.0)
    monkeypatch.setattr(watchdog_mod, "run_tick", counting)
    fabric = FakeFabric()
    n = 16
    with anyio.fail_after(GUARD_S):
        async with two_services(fabric) as (tx, rx):
            data = {i: fill(tx, f"r{i}", [i]) for i in range(n)}
            for i in range(n):
                await rx.expect(f"r{i}", [30 + i], sender=tx.address)
            await eventually(lambda: ticks[-1:] == [rx.agent_name] or rx.agent_name in ticks[-3:],
                             GUARD_S, what="the receiver's watchdog lingering")
            before = ticks.count(rx.agent_name)
            for i in range(n):  # one at a time: each arrival is news of its own
                assert (await tx.await_completion(await tx.send(f"r{i}", [i], last=True))).ok
                assert (await rx.await_arrival(f"r{i}")).ok
            rx_ticks = ticks.count(rx.agent_name) - before
    for i in range(n):
        assert torch.equal(rx.kv.pages([30 + i]), data[i])
    assert rx_ticks < n // 2, f"{rx_ticks} receiver ticks for {n} arrivals"
    assert door_of(fabric, rx).live_xfers() == 0
    fabric.assert_clean()


async def test_a_lingering_tick_ends_once_the_last_arrival_it_polled_for_is_taken(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The receiver's tick lingers while its one expected request is under way, and hands
    its notification over; with nothing left to poll for, it ends then (its linger here lasts
    600 s: only the arrival can end it), not polling on for nothing while the engine computes
    beside it.  The next request still lands byte-exact."""
    monkeypatch.setattr(watchdog_mod, "LINGER_S", 600.0)
    fabric = FakeFabric()
    with anyio.fail_after(GUARD_S * 2):
        async with two_services(fabric) as (tx, rx):
            watchdog = inside(rx).plane.watchdog
            delivered = watchdog.deliveries
            for i, rid in enumerate(("one", "two")):
                data = fill(tx, rid, [1 + i])
                await rx.expect(rid, [30 + i], sender=tx.address)
                assert (await tx.await_completion(await tx.send(rid, [1 + i], last=True))).ok
                assert (await rx.await_arrival(rid)).ok
                assert torch.equal(rx.kv.pages([30 + i]), data)
                await eventually(lambda: not watchdog.lingering, GUARD_S,
                                 what="the receiver's tick ending once nothing is left to poll for")
            assert watchdog.deliveries >= delivered + 2  # each arrival handed over by a lingering tick
    assert door_of(fabric, rx).live_xfers() == 0
    fabric.assert_clean()
