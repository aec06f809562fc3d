"""A tick that posted to receivers known to be polling follows its WRITEs left in flight
(``TickPlan.follow``, ``cadence.FOLLOW_S``).

On this transport a WRITE a post leaves in flight ends at its receiver's next poll.  A sender
that returned such a post to the loop needed a second tick to see it end; following it on the
door thread for up to ``FOLLOW_S`` (while nothing else waits for that thread) brings the end
back with the post, so a hand-off costs the sending loop one tick.  Only where the receiver is
known to poll (``cadence.Warmth``): a cold one ends the WRITE only once the sender's ``Posted``
has woken it, which a follow would hold back.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import anyio
import anyio.to_thread
import pytest

from kvservice import FailureReason
from kvservice._nixl import door as door_mod
from kvservice._nixl.door import Door, DoorError, DoorThread, PostOp, TickOutcome, TickPlan, XferState
from kvservice._transfer import cadence
from kvservice._transfer import plane as plane_mod
from kvservice._transfer import watchdog as watchdog_mod
from kvservice.testing import FakeFabric
from kvservice.testing.fake_door import FakeDoor
from kvservice.testing.inspect import inside

from .harness import GUARD_S, door_of, fill, two_services
from .test_fake_door import indices, pair
from .test_fine_poll import VirtualTime

FOLLOW_S, POLL_S = 0.001, 0.00005


Sleeping = VirtualTime  # its ``wait`` stands in for ``DoorThread.wait_queued`` (nothing is queued)


@pytest.fixture
def virtual(monkeypatch: pytest.MonkeyPatch) -> Sleeping:
    clock = Sleeping()
    monkeypatch.setattr(door_mod, "time", clock)
    return clock


def _post_tick(door: FakeDoor, clock: Sleeping, *, follow: float = FOLLOW_S, queued: bool = False) -> TickOutcome:
    """A tick posting one WRITE, its follow's waits on ``clock`` (another call queued: at once)."""
    op = PostOp(key="k", peer="b", local_idx=indices([1]), remote_idx=indices([2]), notif=b"n")
    plan = TickPlan(posts=[op], follow=follow, follow_poll=POLL_S,
                    queued=(lambda _s: True) if queued else clock.wait)
    return door_mod.run_tick(door, plan)


def test_a_post_left_in_flight_is_followed_to_its_end(virtual: Sleeping) -> None:
    fabric, a, b, *_pools = pair()
    a.complete_after(3)
    out = _post_tick(a, virtual)
    (key, xid, state), = out.posted
    assert key == "k" and state is XferState.PROC  # as the post returned it ...
    assert out.checked == [(xid, XferState.DONE)]  # ... and its end, in the same outcome
    assert virtual.waits == [POLL_S] * 3 and a.check_counts[xid] == 3
    assert b.notifs() == {"a": [b"n"]} and a.live_ids() == []
    fabric.assert_clean()


def test_a_write_still_in_flight_after_the_follow_is_left_to_the_next_ticks(virtual: Sleeping) -> None:
    fabric, a, _b, *_pools = pair()
    a.hang()
    out = _post_tick(a, virtual)
    (_, xid, state), = out.posted
    assert state is XferState.PROC and out.checked == []
    assert FOLLOW_S <= sum(virtual.waits) < FOLLOW_S + POLL_S + 1e-9  # for FOLLOW_S, and no longer
    assert a.live_ids() == [xid]
    a.finish_hung()
    assert a.check(xid) is XferState.DONE
    fabric.assert_clean()


@pytest.mark.parametrize("how", ["not asked", "another call queued"])
def test_no_follow_without_the_plan_asking_or_with_a_call_waiting(virtual: Sleeping, how: str) -> None:
    fabric, a, _b, *_pools = pair()
    a.complete_after(1)
    out = _post_tick(a, virtual, follow=0.0) if how == "not asked" else _post_tick(a, virtual, queued=True)
    (_, xid, state), = out.posted
    assert state is XferState.PROC and out.checked == [] and virtual.waits == []
    assert a.check_counts[xid] == 0
    assert a.check(xid) is XferState.DONE
    fabric.assert_clean()


def test_an_error_while_following_is_its_handles_end(virtual: Sleeping) -> None:
    fabric, a, _b, *_pools = pair()
    a.complete_after(3)
    err = a.fail_next_check(FailureReason.REMOTE_DISCONNECT, ConnectionResetError("gone"))
    out = _post_tick(a, virtual)
    (_, xid, _), = out.posted
    assert out.checked == [(xid, err)] and a.live_ids() == []
    fabric.assert_clean()


#: every post tick's plan (its follow) and outcome, as the door thread ran them
Ticks = list[tuple[TickPlan, TickOutcome]]


@pytest.fixture
def ticks(monkeypatch: pytest.MonkeyPatch) -> Iterator[Ticks]:
    seen: Ticks = []

    def recording(door: Door, plan: TickPlan) -> TickOutcome:
        out = door_mod.run_tick(door, plan)
        if out.posted:  # its own posts, or those handed over to it while it lingered
            seen.append((plan, out))
        return out

    monkeypatch.setattr(watchdog_mod, "run_tick", recording)
    yield seen


@pytest.fixture
def posted(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The requests the sender said ``Posted`` of."""
    told: list[str] = []
    first_posts = plane_mod.RequestPlane.first_posts

    def spy(self: plane_mod.RequestPlane, peer: str, request_ids: list[str]) -> None:
        told.extend(request_ids)
        first_posts(self, peer, request_ids)

    monkeypatch.setattr(plane_mod.RequestPlane, "first_posts", spy)
    yield told


@pytest.fixture
def patient(monkeypatch: pytest.MonkeyPatch) -> None:
    """A receiver counts as polling for longer than the steps of a test under load take."""
    monkeypatch.setattr(cadence, "WARM_GRACE_S", 60.0)


@pytest.mark.usefixtures("patient")
async def test_a_sender_follows_posts_to_a_receiver_it_knows_polls(ticks: Ticks, posted: list[str]) -> None:
    fabric = FakeFabric()
    with anyio.fail_after(GUARD_S):
        async with two_services(fabric) as (tx, rx):
            txd = door_of(fabric, tx)
            txd.complete_after(2)  # every post returns in flight
            for i, rid in enumerate(("cold", "warming", "warm")):
                await rx.expect(rid, [40 + i], sender=tx.address)
                fill(tx, rid, [1 + i])
                if rid == "warming":  # its post ends the WRITE, as with a receiver polling
                    txd.complete_immediately()
                result = await tx.await_completion(await tx.send(rid, [1 + i], last=True))
                assert result.ok and (await rx.await_arrival(rid)).ok
                if rid == "warming":
                    txd.complete_after(2)
            (cold_plan, cold_out), (warming_plan, _), (warm_plan, warm_out) = ticks
            # nothing had completed to rx within a post yet: not followed, rx told, then polled for
            assert cold_plan.follow == 0.0 and cold_out.checked == []
            # the cold request's end was seen by a later tick, not within one: still not followed
            assert warming_plan.follow == 0.0
            assert warm_plan.follow == cadence.FOLLOW_S  # one completed within its post just now
            (_, xid, state), = warm_out.posted
            assert state is XferState.PROC and warm_out.checked == [(xid, XferState.DONE)]
            assert posted == ["cold", "warming"]  # the followed one's receiver needed no word
            watchdog = inside(tx).plane.watchdog
            assert (watchdog.inflight, watchdog.followed, watchdog.caught) == (0, 1, 1)
    fabric.assert_clean()


@pytest.mark.usefixtures("patient")
async def test_a_followed_write_that_fails_fails_its_request_with_the_error(ticks: Ticks) -> None:
    fabric = FakeFabric()
    with anyio.fail_after(GUARD_S):
        async with two_services(fabric) as (tx, rx):
            txd = door_of(fabric, tx)
            for i, rid in enumerate(("first", "second")):
                await rx.expect(rid, [40 + i], sender=tx.address)
                fill(tx, rid, [1 + i])
            assert (await tx.await_completion(await tx.send("first", [1], last=True))).ok
            txd.complete_after(2)
            err = txd.fail_next_check(FailureReason.REMOTE_DISCONNECT, ConnectionResetError("reset"))
            result = await tx.await_completion(await tx.send("second", [2], last=True))
            assert ticks[-1][0].follow == cadence.FOLLOW_S
            assert not result.ok and result.reason is FailureReason.REMOTE_DISCONNECT
            assert result.error is err.original
            assert inside(tx).plane.watchdog.inflight == 0 and txd.live_ids() == []
            await rx.abort("second")
    fabric.assert_clean()


def test_follow_checks_only_what_its_posts_left_in_flight() -> None:
    """Posts that ended within themselves, or failed, are not checked again."""
    fabric, a, b, *_pools = pair()
    ok = PostOp(key="done", peer="b", local_idx=indices([1]), remote_idx=indices([2]), notif=b"1")
    bad = PostOp(key="bad", peer="nobody", local_idx=indices([1]), remote_idx=indices([3]), notif=b"2")
    plan = TickPlan(posts=[ok, bad], follow=FOLLOW_S, follow_poll=POLL_S, queued=lambda _s: False)
    out = door_mod.run_tick(a, plan)
    assert [s for _, _, s in out.posted] == [XferState.DONE, None]
    assert isinstance(out.posted[1][1], DoorError) and out.checked == []
    assert sum(a.check_counts.values()) == 0
    assert b.notifs() == {"a": [b"1"]}
    fabric.assert_clean()


@pytest.mark.usefixtures("patient")
async def test_no_follow_for_a_tick_queued_behind_one_that_posts(ticks: Ticks) -> None:
    """The WRITEs of the tick ahead, in flight but not digested yet, would wait for its follow:
    here the first chunk of a request, the second queued behind it."""
    fabric = FakeFabric()
    with anyio.fail_after(GUARD_S):
        async with two_services(fabric) as (tx, rx):
            txd = door_of(fabric, tx)
            await rx.expect("warming", [40], sender=tx.address)
            await rx.expect("two", [41, 42], sender=tx.address)
            fill(tx, "warming", [1])
            fill(tx, "two", [2, 3])
            assert (await tx.await_completion(await tx.send("warming", [1], last=True))).ok
            txd.complete_after(2)
            txd.post_delay = 0.05  # the first tick still posts when the loop queues the second
            handle = await tx.send("two", [2], last=False)  # both in one turn of the loop
            await tx.send("two", [3], last=True)
            assert (await tx.await_completion(handle)).ok
            assert [plan.follow for plan, _ in ticks[1:]] == [cadence.FOLLOW_S, 0.0]
            assert (await rx.await_arrival("warming")).ok and (await rx.await_arrival("two")).ok
    fabric.assert_clean()


@pytest.mark.usefixtures("patient")
async def test_no_follow_while_another_send_is_under_way(ticks: Ticks) -> None:
    """Where requests overlap one tick posts one and checks another's already."""
    fabric = FakeFabric()
    with anyio.fail_after(GUARD_S):
        async with two_services(fabric) as (tx, rx):
            txd = door_of(fabric, tx)
            await rx.expect("warming", [40], sender=tx.address)
            await rx.expect("sent", [42], sender=tx.address)
            for i, rid in enumerate(("warming", "waiting", "sent")):
                fill(tx, rid, [1 + i])
            assert (await tx.await_completion(await tx.send("warming", [1], last=True))).ok
            waiting = await tx.send("waiting", [2], last=True)  # its receiver has not asked yet
            txd.complete_after(2)
            assert (await tx.await_completion(await tx.send("sent", [3], last=True))).ok
            assert [plan.follow for plan, _ in ticks[1:]] == [0.0]
            await rx.expect("waiting", [41], sender=tx.address)
            assert (await tx.await_completion(waiting)).ok
            assert [plan.follow for plan, _ in ticks[1:]] == [0.0, cadence.FOLLOW_S]  # alone now
            for rid in ("warming", "waiting", "sent"):
                assert (await rx.await_arrival(rid)).ok
    fabric.assert_clean()


async def test_the_door_threads_wait_for_a_queued_call_ends_when_one_is_queued() -> None:
    thread = DoorThread(name="kvservice-test-door")
    try:
        with anyio.fail_after(GUARD_S):
            assert await thread.submit(thread.wait_queued, 0.01) is False  # nothing queued: the whole wait
            waiting = threading.Event()

            def wait() -> bool:
                waiting.set()
                return thread.wait_queued(GUARD_S * 10)  # far past fail_after, were it not woken

            answer = thread.submit(wait)
            await anyio.to_thread.run_sync(waiting.wait)
            queued = thread.submit(lambda: "queued")
            assert await answer is True
            assert await queued == "queued"
    finally:
        thread.shutdown()
