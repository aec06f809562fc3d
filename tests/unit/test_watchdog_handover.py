"""Posts handed over to a lingering watchdog tick (``TickPlan.late``), and a send's wait.

A send that waits for its receiver's expect keeps no tick polling: it needs nothing of NIXL
until its expect comes, which queues its post in a tick of its own at once.  While the
watchdog lingers for something else (a receive under way on the same service), the post is
handed to that tick instead: its WRITE must go out from it, not after a round trip through
the loop (the tick ending, its empty outcome digested, a new tick planned).  That round trip
was two thread wake-ups on a lone hand-off's path.
"""

from __future__ import annotations

import threading
import time
from collections import deque

import anyio
import pytest
import torch

from kvservice import KVPoll
from kvservice._nixl import door as door_mod
from kvservice._nixl.door import Door, PostOp, TickOutcome, TickPlan
from kvservice._transfer import watchdog as watchdog_mod
from kvservice.testing import FakeFabric
from kvservice.testing.inspect import inside
from tests.helpers import eventually

from .harness import GUARD_S, door_of, fill, two_services, unit_config
from .test_fake_door import indices, pair

#: (agent, the plan's linger, posts in its outcome) of every tick, appended on the door thread
Seen = list[tuple[str, float, int]]


@pytest.fixture
def ticks(monkeypatch: pytest.MonkeyPatch) -> Seen:
    """Every tick recorded; lingers last 2 s, so that one cannot end on its own between a
    post's hand-over and the door thread's wake-up (the race the next tick covers)."""
    seen: Seen = []

    def recording(door: Door, plan: TickPlan) -> TickOutcome:
        out = door_mod.run_tick(door, plan)
        seen.append((door.agent_name, plan.linger, len(out.posted)))
        return out

    monkeypatch.setattr(watchdog_mod, "LINGER_S", 2.0)
    monkeypatch.setattr(watchdog_mod, "run_tick", recording)
    return seen


async def test_a_send_waiting_for_its_expect_keeps_no_tick_polling(ticks: Seen) -> None:
    """Nothing of NIXL is needed until the expect comes: the sender's watchdog plans no
    lingering tick meanwhile, and the expect's arrival has the WRITE posted by a tick queued
    at once (not lingering, the only one posting)."""
    fabric = FakeFabric()
    with anyio.fail_after(GUARD_S):
        async with two_services(fabric) as (tx, rx):
            fill(tx, "warm", [1])  # the link up first: its set-up calls the door too
            await rx.expect("warm", [40], sender=tx.address)
            assert (await tx.await_completion(await tx.send("warm", [1], last=True))).ok

            data = fill(tx, "waits", [2, 3])
            handle = await tx.send("waits", [2, 3], last=True)  # waits for its expect
            lingered = inside(tx).plane.watchdog.lingered
            before = len(ticks)
            await anyio.sleep(0.3)  # many poll intervals: a lingering tick would show
            assert inside(tx).plane.watchdog.lingered == lingered
            assert not [t for t in ticks[before:] if t[0] == tx.agent_name and t[1] > 0], ticks[before:]
            assert not inside(tx).plane.moving()  # the loop-lag monitor samples coarsely too
            before = len(ticks)
            await rx.expect("waits", [50, 51], sender=tx.address)
            result = await tx.await_completion(handle)
            arrived = await rx.await_arrival("waits")
            posting = [(linger, n) for a, linger, n in ticks[before:] if a == tx.agent_name and n]
    assert result.ok and arrived.ok, (result, arrived)
    assert torch.equal(rx.kv.pages([50, 51]), data)
    assert posting == [(0.0, 1)], posting
    fabric.assert_clean()


async def test_a_send_bound_while_the_watchdog_lingers_is_posted_by_that_tick(ticks: Seen) -> None:
    """The sender lingers for a receive of its own under way (its first chunk landed, the
    rest to come); a send bound meanwhile is posted by that lingering tick."""
    fabric = FakeFabric()
    with anyio.fail_after(GUARD_S):
        async with two_services(fabric) as (tx, rx):
            warm = fill(tx, "warm", [1])  # the link up first: its set-up calls the door too
            await rx.expect("warm", [40], sender=tx.address)
            assert (await tx.await_completion(await tx.send("warm", [1], last=True))).ok
            assert torch.equal(rx.kv.pages([40]), warm)

            back = fill(rx, "back", [4, 5])
            await tx.expect("back", [60, 61], sender=rx.address)
            await rx.send("back", [4])  # half of it: tx polls for the rest
            recvs = inside(tx).plane.recvs
            await eventually(lambda: recvs["back"].chunks_seen >= 1, GUARD_S, what="the first chunk's arrival")
            data = fill(tx, "bound", [2, 3])
            handle = await tx.send("bound", [2, 3], last=True)  # waits for its expect
            await eventually(lambda: any(a == tx.agent_name and linger > 0 for a, linger, *_ in ticks[-3:]),
                             GUARD_S, what="a tick lingering while the receive is under way")
            before = len(ticks)
            await rx.expect("bound", [50, 51], sender=tx.address)
            result = await tx.await_completion(handle)
            arrived = await rx.await_arrival("bound")
            posting = [(linger, n) for a, linger, n in ticks[before:] if a == tx.agent_name and n]
            back_last = await rx.send("back", [5], last=True)
            assert (await rx.await_completion(back_last)).ok
            assert (await tx.await_arrival("back")).ok
            assert torch.equal(tx.kv.pages([60, 61]), back)
    assert result.ok and arrived.ok, (result, arrived)
    assert torch.equal(rx.kv.pages([50, 51]), data)
    assert posting and all(linger > 0 for linger, _ in posting), posting
    assert door_of(fabric, tx).live_xfers() == 0
    fabric.assert_clean()


async def test_many_sends_bound_while_lingering_all_land_byte_exact(ticks: Seen) -> None:
    """Expects arriving one after another, each binding a waiting send: every WRITE goes
    out once, in order, and nothing is left on the door."""
    fabric = FakeFabric()
    n = 12
    with anyio.fail_after(GUARD_S):
        async with two_services(fabric, sender=unit_config(max_posts_per_tick=2)) as (tx, rx):
            data = {i: fill(tx, f"r{i}", [i]) for i in range(n)}
            handles = [await tx.send(f"r{i}", [i], last=True) for i in range(n)]
            for i in range(n):
                await rx.expect(f"r{i}", [30 + i], sender=tx.address)
            results = [await tx.await_completion(h) for h in handles]
            arrivals = [await rx.await_arrival(f"r{i}") for i in range(n)]
    assert all(r.ok for r in results + arrivals), [r for r in results + arrivals if not r.ok]
    for i in range(n):
        assert torch.equal(rx.kv.pages([30 + i]), data[i])
    posted = sum(k for a, _, k in ticks if a == tx.agent_name)
    assert posted == n, posted  # every chunk posted once: none twice, none dropped
    assert door_of(fabric, tx).live_xfers() == 0
    fabric.assert_clean()


def _lingering(a: Door, plan: TickPlan) -> tuple[threading.Thread, list[TickOutcome]]:
    out: list[TickOutcome] = []
    thread = threading.Thread(target=lambda: out.append(door_mod.run_tick(a, plan)))
    thread.start()
    return thread, out


def test_a_lingering_tick_posts_what_is_handed_over_and_returns_at_once() -> None:
    fabric, a, b, *_pools = pair()
    interrupt = threading.Event()
    late: deque[PostOp] = deque()
    thread, out = _lingering(a, TickPlan(linger=30.0, poll=0.001, interrupt=interrupt, late=late))
    late.append(PostOp("k", "b", indices([1]), indices([2]), b"n"))
    interrupt.set()
    thread.join(GUARD_S)
    assert not thread.is_alive(), "the tick lingered on past the hand-over"
    assert [(key, state) for key, _, state in out[0].posted] == [("k", door_mod.XferState.DONE)]
    assert not late and b.notifs() == {"a": [b"n"]}
    fabric.assert_clean()


def test_handed_over_posts_go_after_the_ticks_own() -> None:
    """What is handed over was planned after the tick's own posts (a request's next chunk
    after its first): it is posted after them, even when the tick had not begun yet."""
    fabric, a, b, *_pools = pair()
    late: deque[PostOp] = deque([PostOp("second", "b", indices([3]), indices([4]), b"2")])
    plan = TickPlan(posts=[PostOp("first", "b", indices([1]), indices([2]), b"1")], late=late)
    out = door_mod.run_tick(a, plan)
    assert [key for key, _, _ in out.posted] == ["first", "second"]
    assert b.notifs() == {"a": [b"1", b"2"]} and not late
    fabric.assert_clean()


async def test_chunks_sent_one_after_another_are_posted_in_order(ticks: Seen, monkeypatch: pytest.MonkeyPatch) -> None:
    """A request's chunks sent back to back: the first planned into a tick, the next ones
    handed over to it before (or while) it runs; the door sees them in the order sent."""
    fabric = FakeFabric()
    order: list[bytes] = []
    with anyio.fail_after(GUARD_S):
        async with two_services(fabric) as (tx, rx):
            txd = door_of(fabric, tx)
            post = txd.post

            def recording(peer: str, local, remote, notif: bytes):  # type: ignore[no-untyped-def]
                order.append(bytes(local[:1].tobytes()))
                return post(peer, local, remote, notif)

            monkeypatch.setattr(txd, "post", recording)
            for r in range(5):
                data = fill(tx, f"c{r}", list(range(8)))
                order.clear()
                # the door thread busy for a moment, so the first chunk's tick is queued behind
                # this and the later chunks are handed over to it before it begins
                blocker = tx._thread.submit(time.sleep, 0.3)  # type: ignore[union-attr]
                first = await tx.send(f"c{r}", [0])
                await rx.expect(f"c{r}", list(range(20, 28)), sender=tx.address)
                await eventually(lambda h=first: h.poll() is not KVPoll.Bootstrapping, GUARD_S)  # bound
                handles = [first] + [await tx.send(f"c{r}", [p], last=p == 7) for p in range(1, 8)]
                await blocker
                assert (await tx.await_completion(handles[-1])).ok
                assert (await rx.await_arrival(f"c{r}")).ok
                assert torch.equal(rx.kv.pages(list(range(20, 28))), data)
                assert order == sorted(order, key=lambda x: int.from_bytes(x, "little")), (r, order)
    fabric.assert_clean()
