"""The deadline heap on its own, then the three deadlines it serves in a service."""

from __future__ import annotations

import random
from dataclasses import dataclass

import anyio
import pytest

from kvservice import FailureReason, KVPoll, TransferStatus
from kvservice._transfer import cadence
from kvservice._transfer.deadlines import Deadlines
from kvservice.testing import FakeFabric

from .harness import GUARD_S, door_of, two_services, unit_config

#: idle waits of the services under test, far past every bound here
IDLE_S = 600.0
#: how late past its deadline a request may fail: generous for a loaded machine, far below
#: ``IDLE_S`` (the idle wait a deadline must end)
LATE_S = 10.0


@dataclass(eq=False)
class Req:
    at: float
    finished: bool = False

    def due_at(self) -> float:
        return self.at


def test_only_what_is_due_pops_earliest_first() -> None:
    heap: Deadlines[Req] = Deadlines()
    reqs = [Req(at) for at in (5.0, 1.0, 3.0, 9.0)]
    for r in reqs:
        heap.push(r)
    assert heap.pop_due(0.5) == []
    assert heap.pop_due(4.0) == [reqs[1], reqs[2]]
    assert heap.pop_due(4.0) == []  # popped once only
    assert heap.pop_due(100.0) == [reqs[0], reqs[3]]
    assert len(heap) == 0


def test_moved_and_ended_deadlines() -> None:
    heap: Deadlines[Req] = Deadlines()
    later, earlier, ended = Req(1.0), Req(10.0), Req(2.0)
    for r in (later, earlier, ended):
        heap.push(r)
    later.at = 20.0  # moved later: its old entry is filed again, not reported
    earlier.at = 0.5  # moved earlier: a new entry, the old one stays behind
    heap.push(earlier)
    ended.finished = True
    assert heap.pop_due(5.0) == [earlier]
    earlier.finished = True  # the service fails what is due
    assert heap.pop_due(15.0) == []  # so its stale entry at 10.0 is dropped
    assert heap.pop_due(25.0) == [later]


def test_next_due_is_the_earliest_live_deadline() -> None:
    heap: Deadlines[Req] = Deadlines()
    assert heap.next_due() is None
    first, second = Req(3.0), Req(7.0)
    heap.push(second)
    heap.push(first)
    assert heap.next_due() == 3.0
    heap.discard(first)  # ended: its pair names nobody, and is dropped on the way
    assert heap.next_due() == 7.0 and len(heap) == 1
    second.at = 9.0  # moved later: the old time until a scan files it again
    assert heap.next_due() == 7.0
    assert heap.pop_due(8.0) == [] and heap.next_due() == 9.0
    heap.discard(second)
    assert heap.next_due() is None and len(heap) == 0


def test_a_request_filed_twice_pops_once() -> None:
    heap: Deadlines[Req] = Deadlines()
    r = Req(1.0)
    heap.push(r)
    heap.push(r)
    assert heap.pop_due(2.0) == [r]
    assert len(heap) == 0


def test_ended_requests_leave_nothing_behind_past_the_bound() -> None:
    heap: Deadlines[Req] = Deadlines()
    live = [Req(100.0 + i) for i in range(10)]
    for r in live:
        heap.push(r)
    for i in range(5000):
        r = Req(50.0 + i)
        heap.push(r)
        r.finished = True
        heap.discard(r)
        assert len(heap) <= Deadlines.SLACK * len(live) + Deadlines.FLOOR
    assert heap.pop_due(1000.0) == live
    assert len(heap) <= Deadlines.FLOOR  # only pairs naming nobody are left, within the bound


def test_the_bound_holds_after_every_call() -> None:
    """What the soak's probe checks at any moment: at most SLACK x live + FLOOR pairs,
    through pushes, moved deadlines, discards and pops in any mix (no other call tidies)."""
    rng = random.Random(7)
    heap: Deadlines[Req] = Deadlines()
    live: list[Req] = []
    now = 0.0
    biggest = 0
    for step in range(40_000):
        op = rng.random()
        if op < 0.38 or not live:  # a new request
            r = Req(now + rng.uniform(0.0, 60.0))
            live.append(r)
            heap.push(r)
        elif op < 0.6:  # a deadline moved (later or earlier) and filed again
            r = rng.choice(live)
            r.at = now + rng.uniform(0.0, 60.0)
            heap.push(r)
        elif op < 0.97:  # a request ended
            r = live.pop(rng.randrange(len(live)))
            r.finished = True
            heap.discard(r)
        else:  # the watchdog's scan: what is due ends
            now += rng.uniform(0.0, 0.5)
            for r in heap.pop_due(now):
                r.finished = True
                live.remove(r)
        biggest = max(biggest, len(heap))
        assert len(heap) <= Deadlines.SLACK * len(live) + Deadlines.FLOOR, (step, len(heap), len(live))
    assert biggest > Deadlines.FLOOR  # the bound was reached, so rebuilds happened
    # nothing was lost on the way: every live request still pops, each once
    assert sorted(heap.pop_due(now + 100.0), key=id) == sorted(live, key=id)


async def test_arrival_deadline_fails_the_receiver() -> None:
    async with two_services(FakeFabric(), receiver=unit_config(arrival_timeout_s=0.2)) as (tx, rx):
        with anyio.fail_after(GUARD_S):
            await rx.expect("never", [3], sender=tx.address)
            result = await rx.await_arrival("never")
        assert result.status is TransferStatus.FAILED and result.reason is FailureReason.TIMEOUT
        assert "arrival deadline" in result.message
        assert rx.poll_arrival("never") is KVPoll.Failed
        assert await rx.await_arrival("never") is result  # kept as a result after the end


async def test_deadlines_end_long_idle_waits(monkeypatch: pytest.MonkeyPatch) -> None:
    """A send waiting for its expect and a cold expect keep no tick polling: the watchdog
    sleeps its idle wait (here far past the test's bound), which their deadlines end, so
    they fail on time."""
    monkeypatch.setattr(cadence, "IDLE_FIRST_S", IDLE_S)
    fabric = FakeFabric()
    async with two_services(fabric, sender=unit_config(bootstrap_timeout_s=0.3, idle_poll_interval_s=IDLE_S),
                            receiver=unit_config(arrival_timeout_s=0.4, idle_poll_interval_s=IDLE_S)) as (tx, rx):
        with anyio.fail_after(GUARD_S):
            handle = await tx.send("unmet", [1], last=True)
            await rx.expect("unsent", [2], sender=tx.address)
            sent, arrived = await tx.await_completion(handle), await rx.await_arrival("unsent")
    assert sent.reason is FailureReason.TIMEOUT and sent.message.startswith("no expect"), sent
    assert arrived.reason is FailureReason.TIMEOUT and "arrival deadline" in arrived.message, arrived
    for result, limit in ((sent, 0.3), (arrived, 0.4)):
        assert limit <= result.finished_at - result.created_at < limit + LATE_S, result


async def test_binding_replaces_the_bootstrap_deadline() -> None:
    """Sent before the expect: due at the bootstrap deadline until bound, then at the
    transfer deadline; the bootstrap entry left in the heap must not fail it."""
    fabric = FakeFabric()
    sender = unit_config(bootstrap_timeout_s=0.3, transfer_timeout_s=0.8)
    async with two_services(fabric, sender=sender) as (tx, rx):
        door_of(fabric, tx).hang()
        with anyio.fail_after(GUARD_S):
            handle = await tx.send("bound", [1], last=True)
            await rx.expect("bound", [2], sender=tx.address)
            result = await tx.await_completion(handle)
        assert result.reason is FailureReason.TIMEOUT
        assert result.message == "transfer deadline passed"  # not "no expect ..."
        assert result.started_at is not None and result.finished_at - result.created_at > 0.3


async def test_a_shorter_send_timeout_moves_the_deadline_earlier() -> None:
    fabric = FakeFabric()
    async with two_services(fabric, sender=unit_config(transfer_timeout_s=60.0)) as (tx, rx):
        door_of(fabric, tx).hang()
        with anyio.fail_after(GUARD_S):
            await rx.expect("short", [2], sender=tx.address)
            handle = await tx.send("short", [1], last=True, timeout=0.2)
            result = await tx.await_completion(handle)
        assert result.reason is FailureReason.TIMEOUT and "deadline" in result.message


