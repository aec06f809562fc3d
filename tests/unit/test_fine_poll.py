"""A WRITE just posted is polled finely (``TickPlan.fine_for``, ``cadence.FINE_WINDOW_S``).

A post that returns in flight ends, on this transport, at its receiver's next poll; a sender
that looks again only every ``poll_interval`` (0.5 ms) sees it up to that much later, and at
one request in flight sends its next request that much later (raw NIXL's sender spins). So
for ``FINE_WINDOW_S`` after such a post the lingering ticks poll every ``FINE_POLL_S``, then
at the usual cadence again: a sender whose WRITE hangs, or an idle service, pays nothing more.
Its receiver, told by the sender's ``Posted``, polls the same way until the first notification
comes (``Watchdog.poll_finely``).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import anyio
import pytest

from kvservice import KVPoll
from kvservice._control.protocol import Posted
from kvservice._nixl import door as door_mod
from kvservice._nixl.door import Door, FineWindow, TickOutcome, TickPlan
from kvservice._transfer import cadence
from kvservice._transfer import watchdog as watchdog_mod
from kvservice.testing import FakeFabric
from kvservice.testing.inspect import inside
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


def _linger(clock: VirtualTime, fine: FineWindow | None = None) -> list[float]:
    fabric, _a, b, *_pools = pair()
    plan = TickPlan(linger=0.01, poll=0.0005, interrupt=clock, fine=fine)  # type: ignore[arg-type]
    out = door_mod.run_tick(b, plan)
    assert not (out.posted or out.checked or out.notifs)  # nothing happened: it lingered to the end
    fabric.assert_clean()
    return clock.waits


def test_a_lingering_tick_polls_finely_for_its_window_then_at_its_cadence(virtual: VirtualTime) -> None:
    waits = _linger(virtual, FineWindow(poll=0.00005, until=virtual.now + 0.002))
    fine = [w for w in waits if w == 0.00005]
    assert waits[:len(fine)] == fine  # the fine polls first, all of them
    assert 0.002 <= sum(fine) <= 0.002 + 0.00005 + 1e-9  # for the window, and no longer
    rest = waits[len(fine):]
    assert rest and all(w == 0.0005 for w in rest[:-1]) and 0 < rest[-1] <= 0.0005, rest
    assert abs(sum(waits) - 0.01) < 1e-9  # the linger's length is unchanged


@pytest.mark.parametrize("fine", [None, FineWindow(poll=0.00005, until=0.0)], ids=["none", "closed"])
def test_without_an_open_window_a_lingering_tick_polls_at_its_cadence(
        virtual: VirtualTime, fine: FineWindow | None) -> None:
    waits = _linger(virtual, fine)
    assert all(w == 0.0005 for w in waits[:-1]) and 0 < waits[-1] <= 0.0005, waits  # the last: what was left
    assert abs(sum(waits) - 0.01) < 1e-9


class Notifying:
    """A door whose ``notifs()`` brings one notification on its ``at``-th call, else none."""

    agent_name = "b"

    def __init__(self, at: int) -> None:
        self.calls, self.at = 0, at

    def notifs(self) -> dict[str, list[bytes]]:
        self.calls += 1
        return {"a": [b"n"]} if self.calls == self.at else {}

    def live_xfers(self) -> int:
        return 0


def test_a_window_opened_while_a_tick_lingers_is_taken_up_at_its_next_poll(virtual: VirtualTime) -> None:
    """The loop opens the window (a peer's ``Posted``) without ending the lingering tick."""
    fine = FineWindow(poll=0.00005)

    class Opening(Notifying):
        def notifs(self) -> dict[str, list[bytes]]:
            if self.calls == 2:  # the loop, meanwhile
                fine.until = virtual.now + 0.001
            return super().notifs()

    plan = TickPlan(linger=0.01, poll=0.0005, interrupt=virtual, fine=fine)  # type: ignore[arg-type]
    door_mod.run_tick(Opening(at=0), plan)  # type: ignore[arg-type]
    waits = virtual.waits
    assert waits[:2] == [0.0005, 0.0005]  # before it was opened
    fine_waits = [w for w in waits[2:] if w == 0.00005]
    assert waits[2:2 + len(fine_waits)] == fine_waits and 0.001 <= sum(fine_waits) <= 0.001 + 0.00005 + 1e-9, waits
    assert all(w == 0.0005 for w in waits[2 + len(fine_waits):-1]), waits


def test_the_first_notification_ends_the_fine_polling(virtual: VirtualTime) -> None:
    """A receiver polls finely until what it was told of comes (a notification handed to the
    loop, the tick lingering on); then at the usual cadence, however long the window."""
    delivered: list[object] = []
    fine = FineWindow(poll=0.00005, until=virtual.now + 0.005)
    plan = TickPlan(linger=0.01, poll=0.0005, interrupt=virtual, fine=fine,  # type: ignore[arg-type]
                    deliver=delivered.append)
    door_mod.run_tick(Notifying(at=4), plan)  # type: ignore[arg-type]
    assert delivered == [{"a": [b"n"]}] and fine.until == 0.0  # closed for the ticks after it too
    waits = virtual.waits
    assert waits[:3] == [0.00005] * 3  # calls 2-4 came after a fine wait each; the 4th brought it
    assert all(w == 0.0005 for w in waits[3:-1]) and 0 < waits[-1] <= 0.0005, waits


#: (agent, how long its fine window stays open, its poll) of every tick that lingered, as it
#: began; appended on the door thread
Plans = list[tuple[str, float, float]]


@pytest.fixture
def plans(monkeypatch: pytest.MonkeyPatch) -> Iterator[Plans]:
    seen: Plans = []

    def recording(door: Door, plan: TickPlan) -> TickOutcome:
        if plan.linger > 0:
            fine = plan.fine
            assert fine is not None  # the watchdog's lingering ticks always share its window
            seen.append((door.agent_name, fine.until - time.monotonic(), fine.poll))
        return door_mod.run_tick(door, plan)

    monkeypatch.setattr(watchdog_mod, "run_tick", recording)
    yield seen


async def test_the_sender_polls_finely_only_just_after_a_post_left_in_flight(
        plans: Plans, monkeypatch: pytest.MonkeyPatch) -> None:
    # The window opens once, when the hung post is digested; a loop held longer than the
    # window (2 ms: a loaded 2-core machine does that) would miss it.  Widened, the test
    # reads the rule, not the scheduler.
    monkeypatch.setattr(cadence, "FINE_WINDOW_S", 0.5)
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
            assert all(0 < f <= cadence.FINE_WINDOW_S and poll == cadence.FINE_POLL_S
                       for f, poll in fine), fine
            # The WRITE hangs past the window: the ticks after it poll at the usual cadence.
            await anyio.sleep(cadence.FINE_WINDOW_S * 2)
            before = len(plans)
            await eventually(lambda: sum(a == tx.agent_name for a, _, _ in plans[before:]) >= 2, GUARD_S,
                             what="lingering ticks after the window")
            assert not [p for p in plans[before:] if p[0] == tx.agent_name and p[1] > 0], plans[before:]
            txd.finish_hung()
            assert (await tx.await_completion(handle)).ok
    fabric.assert_clean()


async def test_a_repeated_posted_polls_finely_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only a request's first ``Posted`` wakes its receiver's watchdog to poll finely: a peer
    that repeats it (or floods it) costs the frames' reading, no polling."""
    fabric = FakeFabric()
    with anyio.fail_after(GUARD_S):
        async with two_services(fabric) as (tx, rx):
            asked: list[float] = []
            watchdog = inside(rx).plane.watchdog
            poll_finely = watchdog.poll_finely
            monkeypatch.setattr(watchdog, "poll_finely", lambda: (asked.append(1.0), poll_finely())[1])
            fill(tx, "warm", [1])
            await rx.expect("warm", [40], sender=tx.address)
            assert (await tx.await_completion(await tx.send("warm", [1], last=True))).ok
            await rx.expect("told", [41], sender=tx.address)
            await eventually(lambda: tx.status()["expects_before_send"] == 1, GUARD_S)
            before = len(asked)
            for _ in range(50):
                inside(tx).plane.control.send_to(rx.agent_name, Posted(["told"]))
            await eventually(lambda: len(asked) > before, GUARD_S, what="the first Posted's fine polling")
            await anyio.sleep(0.1)  # the rest of the frames are read meanwhile
            assert len(asked) == before + 1, asked
            fill(tx, "told", [2])
            assert (await tx.await_completion(await tx.send("told", [2], last=True))).ok
            assert (await rx.await_arrival("told")).ok
    fabric.assert_clean()
