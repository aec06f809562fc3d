"""A side that holds nothing a notification could be for idles at its ceiling at once.

After work the watchdog's idle waits back off from ``cadence.IDLE_FIRST_S``: a notification
soon after the last request (a settle fence, a cold Expect's WRITE) is taken promptly.  Where
nothing is held (no request under way or expected, no pages unsettled:
``RequestPlane.quiet``) nothing can come that matters, and each of those early idle ticks
was a round trip to the NIXL thread per hand-off for nothing.
"""

from __future__ import annotations

import anyio
import pytest
import torch

from kvservice import TransferService
from kvservice._transfer import cadence
from kvservice.testing import FakeFabric
from kvservice.testing.inspect import inside
from tests.helpers import eventually, scaled

from .harness import GUARD_S, door_of, fill, two_services, unit_config

#: the first idle wait after work here: many would fit in ``WATCH_S``
FIRST_S = 0.02
#: how long the idle ticks are counted
WATCH_S = 0.4


async def settled_ticks(svc: TransferService) -> int:
    """``svc``'s watchdog ticks once it has stopped polling and nothing is on the door thread."""
    watchdog = inside(svc).plane.watchdog
    await eventually(lambda: not (watchdog.working or watchdog.lingering), GUARD_S,
                     what="the watchdog going idle")
    return watchdog.ticks


async def test_a_side_holding_nothing_idles_at_its_ceiling_and_one_holding_an_expect_backs_off(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cadence, "IDLE_FIRST_S", FIRST_S)
    fabric = FakeFabric()
    idle = unit_config(idle_poll_interval_s=600.0)
    with anyio.fail_after(GUARD_S * 2):
        async with two_services(fabric, sender=idle, receiver=idle) as (tx, rx):
            fill(tx, "first", [1])
            await rx.expect("first", [30], sender=tx.address)
            assert (await tx.await_completion(await tx.send("first", [1], last=True))).ok
            assert (await rx.await_arrival("first")).ok
            assert inside(tx).plane.quiet() and inside(rx).plane.quiet()
            before = {svc: await settled_ticks(svc) for svc in (tx, rx)}
            await anyio.sleep(WATCH_S)  # waits from 20 ms would tick 4 times in it
            assert {svc: inside(svc).plane.watchdog.ticks for svc in (tx, rx)} == before

            data = fill(tx, "second", [2])
            await rx.expect("second", [31], sender=tx.address)  # held: the receiver is not quiet
            assert not inside(rx).plane.quiet()
            ticks = await settled_ticks(rx)
            await anyio.sleep(scaled(WATCH_S))
            assert inside(rx).plane.watchdog.ticks - ticks >= 2  # backing off from 20 ms
            assert (await tx.await_completion(await tx.send("second", [2], last=True))).ok
            assert (await rx.await_arrival("second")).ok
            assert torch.equal(rx.kv.pages([31]), data)
    assert door_of(fabric, rx).live_xfers() == 0
    fabric.assert_clean()
