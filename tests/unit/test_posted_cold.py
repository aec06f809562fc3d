"""Cold Expects and ``Posted`` (``RequestPlane.busy``, ``warm``, ``Inbound._on_posted``), over a
fake fabric: what keeps the receiver's watchdog polling, and what each frame is counted as."""

from __future__ import annotations

import time

import anyio
import torch

from kvservice import FailureReason, TransferService
from kvservice._control.protocol import Posted
from kvservice._transfer.cadence import EXPECT_GRACE_S, WARM_GRACE_S
from kvservice.testing import FakeFabric
from kvservice.testing.inspect import inside
from tests.helpers import eventually, heard_by
from tests.unit.harness import GUARD_S, fill, two_services, unit_config


async def test_an_expect_is_cold_until_its_send_then_counted_off() -> None:
    fabric = FakeFabric()
    with anyio.fail_after(GUARD_S):
        async with two_services(fabric) as (tx, rx):
            plane = inside(rx).plane
            fill(tx, "r1", [1, 2])
            await rx.expect("r1", [3, 4], sender=tx.address)
            assert plane.recvs["r1"].cold and plane.cold == 1
            await rx.expect("r2", [5], sender=tx.address)
            assert plane.cold == 2
            await eventually(lambda: not plane.busy(), GUARD_S, what="the Expects' own polling to end")
            assert (await tx.await_completion(await tx.send("r1", [1, 2], last=True))).ok
            assert (await rx.await_arrival("r1")).ok
            assert plane.cold == 1  # r2 is still cold: polled only for a while after r1 (WARM_GRACE_S)
            await eventually(lambda: not plane.busy(), GUARD_S, what="polling to end")
            await rx.abort("r2")  # a cold request that ends is counted off too
            assert plane.cold == 0 and not plane.recvs
            assert "posted_unknown" not in rx.status()["refused"]


async def test_an_expect_is_polled_for_a_while_in_case_its_sender_is_ready() -> None:
    """A cold Expect keeps the watchdog polling for ``EXPECT_GRACE_S`` after it goes out (a
    sender whose ``send()`` came first posts as it reads it), then only its idle cadence;
    each new Expect starts that polling again."""
    fabric = FakeFabric()
    with anyio.fail_after(GUARD_S):
        async with two_services(fabric) as (tx, rx):
            plane, watchdog = inside(rx).plane, inside(rx).plane.watchdog

            async def expect_cold(rid: str, page: int) -> None:
                await eventually(lambda: not plane.busy(), GUARD_S, what="no polling")
                lingered = watchdog.lingered
                started = time.monotonic()
                await rx.expect(rid, [page], sender=tx.address)
                assert plane.recvs[rid].cold and plane.busy()
                await eventually(lambda: watchdog.lingered > lingered, GUARD_S, what="a tick polling NIXL")
                await eventually(lambda: not plane.busy(), GUARD_S, what="the polling to end")
                assert time.monotonic() - started >= EXPECT_GRACE_S
                assert plane.recvs[rid].cold

            await expect_cold("r0", 3)
            await expect_cold("r1", 4)  # each Expect starts it again


async def test_a_posted_warms_only_its_own_senders_request() -> None:
    """From its own sender a ``Posted`` warms the request (the watchdog polls: ``busy``);
    from another peer it is ``foreign_request``, for an id never heard of ``posted_unknown``;
    one that comes after its request ended here, from its own sender, is the race of a
    notification overtaking it: ignored, not counted."""
    fabric = FakeFabric()
    with anyio.fail_after(GUARD_S):
        async with two_services(fabric) as (tx, rx), \
                TransferService(unit_config(), door_factory=fabric.factory) as other:
            plane = inside(rx).plane
            await rx.expect("r1", [3], sender=tx.address)
            await inside(other).control.link_to(rx.address)
            inside(other).control.send_to(rx.agent_name, Posted(["r1"]))
            inside(other).control.send_to(rx.agent_name, Posted(["nobody"]))
            await eventually(lambda: rx.status()["refused"].get("posted_unknown") == 1, GUARD_S)
            assert rx.status()["refused"].get("foreign_request") == 1
            await eventually(lambda: not plane.busy(), GUARD_S, what="r1's own polling to end")
            assert plane.recvs["r1"].cold
            inside(tx).control.send_to(rx.agent_name, Posted(["r1"]))
            await eventually(lambda: not plane.recvs["r1"].cold, GUARD_S, what="r1 warm")
            assert plane.busy() and plane.cold == 0
            await rx.abort("r1")
            inside(tx).control.send_to(rx.agent_name, Posted(["r1"]))  # after its end: the race
            inside(tx).control.send_to(rx.agent_name, Posted(["nobody-2"]))  # marks the frames' order
            await eventually(lambda: rx.status()["refused"].get("posted_unknown") == 2, GUARD_S)
            assert rx.status()["refused"].get("foreign_request") == 1
            result = await rx.await_arrival("r1")
            assert result.reason is FailureReason.ABORTED


async def test_hand_offs_one_after_another_need_no_frame_each() -> None:
    """Requests sent one after another, each completed within its post (the fake's default,
    as a copy on this host's transport): the receiver polls on after each (``WARM_GRACE_S``)
    and takes the next one's notification without a ``Posted``; the sender says it again for
    the first request after a pause longer than half of that.  Every request arrives."""
    fabric = FakeFabric()
    n = 12
    with anyio.fail_after(GUARD_S):
        async with two_services(fabric) as (tx, rx):
            heard = heard_by(rx)
            data = {i: fill(tx, f"r{i}", [i]) for i in range(n + 1)}
            for i in range(n + 1):
                await rx.expect(f"r{i}", [30 + i], sender=tx.address)
            for i in range(n):
                assert (await tx.await_completion(await tx.send(f"r{i}", [i], last=True))).ok
                assert (await rx.await_arrival(f"r{i}")).ok
            told = [rid for m in heard if isinstance(m, Posted) for rid in m.request_ids]
            assert "r0" in told and len(told) < n // 2, told
            await anyio.sleep(WARM_GRACE_S)  # past half the receiver's polling after r{n-1}
            assert (await tx.await_completion(await tx.send(f"r{n}", [n], last=True))).ok
            assert (await rx.await_arrival(f"r{n}")).ok
            await eventually(lambda: any(isinstance(m, Posted) and f"r{n}" in m.request_ids for m in heard),
                             GUARD_S, what=f"a Posted for r{n}")
    for i in range(n + 1):
        assert torch.equal(rx.kv.pages([30 + i]), data[i])


async def test_a_lone_expect_goes_out_within_the_call() -> None:
    """On a live link with nothing queued, ``expect()`` writes its Expect itself (the
    connection's write, not the link's writer task a loop turn later); the sender binds it."""
    fabric = FakeFabric()
    with anyio.fail_after(GUARD_S):
        async with two_services(fabric) as (tx, rx):
            await rx.expect("r0", [3], sender=tx.address)  # dials: the link's first frames
            link = await inside(rx).control.link_to(tx.address)
            await anyio.sleep(0.05)  # the writer waits on an empty outbox
            now, queued = link.written_now, link.written_queued
            fill(tx, "r1", [1])
            await rx.expect("r1", [4], sender=tx.address)
            assert (link.written_now, link.written_queued) == (now + 1, queued)
            assert (await tx.await_completion(await tx.send("r1", [1], last=True))).ok
            assert (await rx.await_arrival("r1")).ok
