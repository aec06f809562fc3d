"""A service whose own event loop stalls past its ``peer_timeout_s`` does not blame its peer.

Real NIXL in real processes. The prefill's loop is held (``time.sleep`` on the loop thread:
what a GC pause or an engine holding the GIL does) for longer than its own
``peer_timeout_s``, while the decode keeps pinging it. The decode's pings wait unread in
the prefill's socket, so silence measured across the stall is the prefill's, not the
decode's. A request the decode expects across the stall is then sent and arrives byte-exact
over the same link, and the prefill's loop went on ticking.

The decode's own ``peer_timeout_s`` is longer than the stall, as docs/vllm.md advises where
an engine can starve kvservice's loop: only the stalled side's judgement is under test.
"""

from __future__ import annotations

import anyio
import pytest
import torch

from kvservice import TransferService
from kvservice.testing import pattern
from tests.helpers import SMALL, config, eventually, peer_config, peers, scaled

pytestmark = [pytest.mark.nixl, pytest.mark.slow]

#: the prefill: the stall is longer than its peer_timeout_s, by far
PREFILL = {"heartbeat_interval_s": 0.2, "peer_timeout_s": 1.0}
STALL_S = 2.5
#: the decode: waits out the prefill's stall (and a loaded machine's)
DECODE = {"heartbeat_interval_s": 0.2, "peer_timeout_s": scaled(30.0)}
GUARD_S = scaled(30.0)  # a hang guard, never a timed assertion


async def test_a_stall_of_its_own_loop_loses_no_link_and_no_request() -> None:
    async with peers(peer_config(SMALL, **PREFILL)) as (prefill,), \
            TransferService(config(SMALL, **DECODE)) as decode:
        # linked, and one request through
        await prefill.command(op="fill", rid="before", pages=[0, 1])
        await prefill.event("filled", "before")
        await decode.expect("before", [10, 11], sender=prefill.address)
        await prefill.command(op="send", rid="before", pages=[0, 1])
        with anyio.fail_after(GUARD_S):
            assert (await decode.await_arrival("before")).ok
        await eventually(lambda: decode.status()["peers"] != [], timeout=GUARD_S, what="the decode's link")

        # expected across the stall: the prefill holds the expect while its loop is held
        await prefill.command(op="fill", rid="across", pages=[2, 3])
        await prefill.event("filled", "across")
        await decode.expect("across", [20, 21], sender=prefill.address)
        await prefill.command(op="stall", rid="stall", seconds=STALL_S)
        await prefill.event("stalled", "stall", timeout=GUARD_S)
        # a few heartbeats after the stall: time for a wrongly judged link to be dropped
        await anyio.sleep(5 * PREFILL["heartbeat_interval_s"])

        await prefill.command(op="status", id="st")
        st = await prefill.event("status")
        assert "recv.PEER_LOST" not in st["outcomes"] and "send.PEER_LOST" not in st["outcomes"], st
        assert st["expects_before_send"] == 1, "the prefill dropped the decode's expect"
        # the peer's own stall watch (a 0.1 s tick), not the service's lag monitor: that one may be
        # in an idle second-long sleep when the stall begins, and reads the stall short by up to 1 s
        held = max((seconds for _, seconds in st["stalls"]), default=0.0)
        assert held >= STALL_S * 0.9, ("the stall did not hold the prefill's loop", st["stalls"])

        await prefill.command(op="send", rid="across", pages=[2, 3])
        with anyio.fail_after(GUARD_S):
            got = await decode.await_arrival("across")
        assert got.ok, got
        assert torch.equal(decode.kv.pages([20, 21]), pattern(SMALL, "across", 2))
        sent = await prefill.event("completed", "across", timeout=GUARD_S)
        assert sent["status"] == "SUCCESS", sent
        assert decode.status()["outcomes"].get("recv.PEER_LOST", 0) == 0
