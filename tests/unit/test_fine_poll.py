"""A WRITE just posted is polled finely (``TickPlan.fine_for``, ``watchdog.FINE_WINDOW_S``).

A post that returns in flight ends, on this transport, at its receiver's next poll; a sender
that looks again only every ``poll_interval`` (0.5 ms) sees it up to that much later, and at
one request in flight sends its next request that much later (raw NIXL's sender spins). So
for ``FINE_WINDOW_S`` after such a post the lingering ticks poll every ``FINE_POLL_S``, then
at the usual cadence again: a sender whose WRITE hangs, or an idle service, pays nothing more.
"""

from __future__ import annotations

from collections.abc import Iterator

import anyio
import pytest

from kvservice import KVPoll
from kvservice._nixl import door as door_mod
from kvservice._nixl.door import Door, TickOutcome, TickPlan
from kvservice._transfer import watchdog as watchdog_mod
from kvservice.testing import FakeFabric
from tests.helpers import eventually

from .harness import GUARD_S, door_of, fill, two_services
from .test_fake_door import pair


class VirtualTime:
    """Stands in for ``door.time`` and the plan's interrupt: every wait is recorded and
    moves the clock on by itself, so the cadence is read exactly, not timed."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.waits: list[float] = []

    def monotonic(self) -> float:
        return self.now

    def wait(self, seconds: float) -> bool:  # the interrupt: never set
        self.waits.append(seconds)
        self.now += seconds
        return False


@pytest.fixture
def virtual(monkeypatch: pytest.MonkeyPatch) -> VirtualTime:
    clock = VirtualTime()
    monkeypatch.setattr(door_mod, "time", clock)
    return clock


def _linger(clock: VirtualTime, **fine: float) -> list[float]:
    fabric, _a, b, *_pools = pair()
    plan = TickPlan(linger=0.01, poll=0.0005, interrupt=clock, **fine)  # type: ignore[arg-type]
    out = door_mod.run_tick(b, plan)
    assert not (out.posted or out.checked or out.notifs)  # nothing happened: it lingered to the end
    fabric.assert_clean()
    return clock.waits


def test_a_lingering_tick_polls_finely_for_its_window_then_at_its_cadence(virtual: VirtualTime) -> None:
    waits = _linger(virtual, fine_for=0.002, fine_poll=0.00005)
    fine = [w for w in waits if w == 0.00005]
    assert waits[:len(fine)] == fine  # the fine polls first, all of them
    assert 0.002 <= sum(fine) < 0.002 + 0.00005  # for the window, and no longer
    rest = waits[len(fine):]
    assert rest and all(w == 0.0005 for w in rest[:-1]) and 0 < rest[-1] <= 0.0005, rest
    assert abs(sum(waits) - 0.01) < 1e-9  # the linger's length is unchanged


def test_without_a_window_a_lingering_tick_polls_at_its_cadence(virtual: VirtualTime) -> None:
    waits = _linger(virtual)
    assert all(w == 0.0005 for w in waits[:-1]) and 0 < waits[-1] <= 0.0005, waits  # the last: what was left
    assert abs(sum(waits) - 0.01) < 1e-9


#: (agent, the plan's fine_for, fine_poll) of every tick that lingered, appended on the door thread
Plans = list[tuple[str, float, float]]


@pytest.fixture
def plans(monkeypatch: pytest.MonkeyPatch) -> Iterator[Plans]:
    seen: Plans = []

    def recording(door: Door, plan: TickPlan) -> TickOutcome:
        if plan.linger > 0:
            seen.append((door.agent_name, plan.fine_for, plan.fine_poll))
        return door_mod.run_tick(door, plan)

    monkeypatch.setattr(watchdog_mod, "run_tick", recording)
    yield seen


async def test_the_sender_polls_finely_only_just_after_a_post_left_in_flight(plans: Plans) -> None:
    fabric = FakeFabric()
    with anyio.fail_after(GUARD_S):
        async with two_services(fabric) as (tx, rx):
            fill(tx, "warm", [1])
            await rx.expect("warm", [40], sender=tx.address)
            assert (await tx.await_completion(await tx.send("warm", [1], last=True))).ok  # DONE within its post
            assert not [p for p in plans if p[1] > 0], plans  # no post was left in flight
            txd = door_of(fabric, tx)
            txd.hang()  # the next post returns in flight and stays so
            await rx.expect("hung", [41], sender=tx.address)
            handle = await tx.send("hung", [2], last=True)
            await eventually(lambda: handle.poll() is KVPoll.Transferring and bool(txd.live_ids()), GUARD_S)
            await eventually(lambda: any(a == tx.agent_name and f > 0 for a, f, _ in plans), GUARD_S,
                             what="a finely polling tick after the post")
            fine = [(f, poll) for a, f, poll in plans if a == tx.agent_name and f > 0]
            assert all(0 < f <= watchdog_mod.FINE_WINDOW_S and poll == watchdog_mod.FINE_POLL_S
                       for f, poll in fine), fine
            assert not [p for p in plans if p[0] == rx.agent_name and p[1] > 0], plans  # the receiver: never
            # The WRITE hangs past the window: the ticks after it poll at the usual cadence.
            await anyio.sleep(watchdog_mod.FINE_WINDOW_S * 10)
            before = len(plans)
            await eventually(lambda: sum(a == tx.agent_name for a, _, _ in plans[before:]) >= 2, GUARD_S,
                             what="lingering ticks after the window")
            assert not [p for p in plans[before:] if p[0] == tx.agent_name and p[1] > 0], plans[before:]
            txd.finish_hung()
            assert (await tx.await_completion(handle)).ok
    fabric.assert_clean()
