"""A receiver polling for one hand-off polls at ``cadence.LIGHT_POLL_S``; one holding more, or a
larger one than ``LIGHT_MAX_BYTES``, or a side with a WRITE of its own in flight, at its
``poll_interval_s`` (``Watchdog._linger_poll``).

On this transport a WRITE into a receiver ends at the receiver's next poll, so one hand-off at
a time ends as soon as the receiver polls (docs/perf/library.md, "A receiver polling for one
hand-off"); where many requests are held each poll serves many, and the finer cadence's CPU
would slow the copies sharing the cores.
"""

from __future__ import annotations

from collections.abc import Iterator

import anyio
import pytest

from kvservice import KVPoll
from kvservice._nixl import door as door_mod
from kvservice._nixl.door import Door, TickOutcome, TickPlan
from kvservice._transfer import cadence
from kvservice._transfer import plane as plane_mod
from kvservice._transfer import watchdog as watchdog_mod
from kvservice.testing import FakeFabric
from kvservice.testing.inspect import inside
from tests.helpers import eventually

from .harness import GUARD_S, door_of, fill, two_services, unit_config

#: (agent, the poll of its plan) of every tick that lingered, as it began; on the door thread
Polls = list[tuple[str, float]]
POLL_S = 0.0005


@pytest.fixture
def polls(monkeypatch: pytest.MonkeyPatch) -> Iterator[Polls]:
    seen: Polls = []

    def recording(door: Door, plan: TickPlan) -> TickOutcome:
        if plan.linger > 0:
            seen.append((door.agent_name, plan.poll))
        return door_mod.run_tick(door, plan)

    monkeypatch.setattr(watchdog_mod, "run_tick", recording)
    yield seen


async def lingering(polls: Polls, agent: str, since: int) -> list[float]:
    """The polls of ``agent``'s ticks that lingered from index ``since`` on, once there is one."""
    await eventually(lambda: any(a == agent for a, _ in polls[since:]), GUARD_S,
                     what=f"ticks of {agent} lingering")
    return [p for a, p in polls[since:] if a == agent]


async def test_a_receiver_polls_one_hand_off_finely_and_more_at_its_cadence(polls: Polls) -> None:
    fabric = FakeFabric()
    cfg = unit_config(poll_interval_s=POLL_S)
    with anyio.fail_after(GUARD_S):
        async with two_services(fabric, cfg, cfg) as (tx, rx):
            plane = inside(rx).plane
            await rx.expect("one", [40], sender=tx.address)  # cold: polled for EXPECT_GRACE_S
            assert plane.light()
            assert set(await lingering(polls, rx.agent_name, 0)) == {cadence.LIGHT_POLL_S}

            await rx.expect("two", [41], sender=tx.address)
            assert not plane.light()
            since = len(polls)
            assert set(await lingering(polls, rx.agent_name, since)) == {POLL_S}

            for rid, src in (("one", [1]), ("two", [2])):  # both arrive: nothing is held after them
                fill(tx, rid, src)
                assert (await tx.await_completion(await tx.send(rid, src, last=True))).ok
                assert (await rx.await_arrival(rid)).ok
            assert not plane.light()  # nothing received any more: no receiving side to poll for
    fabric.assert_clean()


async def test_a_side_with_its_own_write_in_flight_polls_at_its_cadence(polls: Polls) -> None:
    """A sender that also receives one hand-off keeps its cadence (and its fine window after
    a post left in flight) for its own WRITE: the light cadence is the receiving side's."""
    fabric = FakeFabric()
    cfg = unit_config(poll_interval_s=POLL_S)
    with anyio.fail_after(GUARD_S):
        async with two_services(fabric, cfg, cfg) as (tx, rx):
            await tx.expect("back", [50], sender=rx.address)  # tx receives one hand-off...
            assert inside(tx).plane.light()
            txd = door_of(fabric, tx)
            txd.hang()  # ... and its WRITE of another stays in flight
            fill(tx, "out", [3])
            await rx.expect("out", [42], sender=tx.address)
            handle = await tx.send("out", [3], last=True)
            await eventually(lambda: handle.poll() is KVPoll.Transferring and bool(txd.live_ids()), GUARD_S)
            await anyio.sleep(cadence.FINE_WINDOW_S * 5)  # past the fine window of its post
            since = len(polls)
            assert set(await lingering(polls, tx.agent_name, since)) == {POLL_S}
            txd.finish_hung()
            assert (await tx.await_completion(handle)).ok
            assert (await rx.await_arrival("out")).ok
            await tx.abort("back")
    fabric.assert_clean()


async def test_a_receiver_configured_finer_keeps_its_cadence(polls: Polls) -> None:
    fine = cadence.LIGHT_POLL_S / 2
    fabric = FakeFabric()
    with anyio.fail_after(GUARD_S):
        async with two_services(fabric, unit_config(), unit_config(poll_interval_s=fine)) as (tx, rx):
            await rx.expect("one", [40], sender=tx.address)
            assert set(await lingering(polls, rx.agent_name, 0)) == {fine}
            fill(tx, "one", [1])
            assert (await tx.await_completion(await tx.send("one", [1], last=True))).ok
            assert (await rx.await_arrival("one")).ok
    fabric.assert_clean()


async def test_a_receiver_of_one_large_request_polls_at_its_cadence(polls: Polls,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """``LIGHT_MAX_BYTES`` (set here to two pages): a request of three polls at the cadence."""
    fabric = FakeFabric()
    cfg = unit_config(poll_interval_s=POLL_S)
    with anyio.fail_after(GUARD_S):
        async with two_services(fabric, cfg, cfg) as (tx, rx):
            monkeypatch.setattr(plane_mod, "LIGHT_MAX_BYTES", 2 * rx.kv.layout.page_bytes)
            plane = inside(rx).plane
            await rx.expect("large", [40, 41, 42], sender=tx.address)
            assert not plane.light()
            assert set(await lingering(polls, rx.agent_name, 0)) == {POLL_S}
            await rx.abort("large")
            await rx.expect("small", [43, 44], sender=tx.address)
            assert plane.light()
            since = len(polls)
            assert set(await lingering(polls, rx.agent_name, since)) == {cadence.LIGHT_POLL_S}
            fill(tx, "small", [1, 2])
            assert (await tx.await_completion(await tx.send("small", [1, 2], last=True))).ok
            assert (await rx.await_arrival("small")).ok
    fabric.assert_clean()
