"""Loop stalls past ``peer_timeout_s`` with a WRITE in flight: no side says more than it knows.

Real NIXL in real processes, the soak's liveness settings (heartbeat 0.2 s,
``peer_timeout_s`` 1.5 s).  One side is a child whose event loop is held (``stall``: what
a loaded machine's scheduler, a GC pause or an engine holding the GIL does) while a
request's only WRITE is on its way.  The long soak failed on three requests whose
receiver verified every byte while the sender said ``PEER_LOST``, with no fault injected
and the prefill's loop lagging up to 3.6 s; these are the two stalls that can lie behind it.

- The **sender** stalls (3 s) just after posting: its door thread goes on; when its loop
  runs again it forgives its own stall (``_control/links.py``) and, as measured here, sees
  the WRITE ``DONE`` before it reads that the receiver dropped the link: it says
  ``SUCCESS``, and the bytes are there.  The receiver says ``SUCCESS`` or, when it read the
  link's end before the notification, ``PEER_LOST``: the two sides differ the other way.
- The **receiver** stalls (1.6-3 s): the sender hears nothing for ``peer_timeout_s`` and
  loses the link ("peer silent for ...") before its WRITE is seen ``DONE``, so it says
  ``PEER_LOST``.  Here the receiver then read the link's end before the notification and
  failed too; when it takes the notification first (a narrower window: the long run saw
  138 with a SIGSTOP of the decode, 3 with none), it says ``SUCCESS`` beside the sender's
  ``PEER_LOST``: the soak's case, which it now counts as a ``loop stall``.

What must hold every time, and is checked: a receiver's ``SUCCESS`` has every byte, a
sender's ``SUCCESS`` means its bytes are in the receiver's pages, and a sender's failure
beside a receiver's ``SUCCESS`` after a stall is named a loop stall by the soak.
"""

from __future__ import annotations

from typing import Any

import anyio
import pytest
import torch

from kvservice import TransferService
from kvservice.soak._summary import disagreement_cause
from kvservice.testing import pattern
from tests.helpers import SMALL, config, eventually, peer_config, peers, scaled

pytestmark = [pytest.mark.nixl, pytest.mark.slow]

#: the soak's liveness settings, both sides
LIVENESS = {"heartbeat_interval_s": 0.2, "peer_timeout_s": 1.5}
STALL_S = 3.0  # twice peer_timeout_s
GUARD_S = scaled(30.0)  # a hang guard, never a timed assertion
TRIES = 4
#: the receiver's stalls: around peer_timeout_s, so that it resumes about when the sender
#: gives up (longer, and it reads the link's end before the WRITE's notification)
RECV_STALLS_S = (1.6, 1.8, 2.0, 3.0)


async def test_a_receiver_stalled_with_a_write_in_flight_never_makes_a_false_success() -> None:
    outcomes: list[tuple[str, str]] = []
    async with TransferService(config(SMALL, transfer_timeout_s=scaled(10.0), **LIVENESS)) as prefill, \
            peers(peer_config(SMALL, **LIVENESS)) as (decode,):
        for i, stall in enumerate(RECV_STALLS_S):
            rid = f"stalled-recv-{i}"
            prefill.kv.write([0, 1], pattern(SMALL, rid, 2))
            await decode.command(op="expect", rid=rid, pages=[10, 11], sender=prefill.address)
            await decode.event("expecting", rid, timeout=GUARD_S)
            await eventually(lambda: prefill.status()["expects_before_send"] == 1, timeout=GUARD_S,
                             what="the prefill holding the expect")
            await decode.command(op="stall", rid=f"stall-{i}", seconds=stall)
            await anyio.sleep(0.2)  # let it reach the stall (if not, this try just succeeds)
            handle = await prefill.send(rid, [0, 1])
            with anyio.fail_after(GUARD_S):
                sent = await prefill.await_completion(handle)
            await decode.event("stalled", f"stall-{i}", timeout=GUARD_S)
            arrived = await decode.event("arrived", rid, timeout=GUARD_S)
            if arrived["status"] == "SUCCESS":
                assert arrived["verified"], arrived
            if sent.ok:  # a sender's SUCCESS: its WRITE landed
                await decode.command(op="verify", rid=rid, pages=[10, 11])
                assert (await decode.event("verified", rid, timeout=GUARD_S))["ok"], (sent, arrived)
            elif arrived["status"] == "SUCCESS":  # the long soak's case: the soak calls it a loop stall
                event = {"status": sent.status.value, "reason": sent.reason.value if sent.reason else None,
                         "message": sent.message}
                assert disagreement_cause("none", False, event, True) == "loop stall", event
            outcomes.append((arrived["status"], sent.reason.value if sent.reason else "SUCCESS"))
    # the stalls did cut the link: the sender heard nothing for peer_timeout_s at least once
    assert any(send == "PEER_LOST" for _, send in outcomes), outcomes


async def test_a_sender_stalled_after_posting_its_write_reports_what_it_saw() -> None:
    outcomes: list[tuple[str, str]] = []
    async with peers(peer_config(SMALL, **LIVENESS)) as (prefill,), \
            TransferService(config(SMALL, **LIVENESS)) as decode:
        for i in range(TRIES):
            rid = f"stalled-send-{i}"
            await prefill.command(op="fill", rid=rid, pages=[0, 1])
            await prefill.event("filled", rid, timeout=GUARD_S)
            await decode.expect(rid, [10, 11], sender=prefill.address)

            async def expect_held(i: int = i) -> bool:  # so the send binds, and posts, at once
                await prefill.command(op="status", id=f"st-{i}")
                st: dict[str, Any] = await prefill.event("status", timeout=GUARD_S)
                return bool(st["expects_before_send"] == 1)

            await eventually(expect_held, timeout=GUARD_S, interval=0.05, what="the prefill holding the expect")
            # back to back: the loop posts the WRITE (the door thread runs it), then is held
            await prefill.command(op="send", rid=rid, pages=[0, 1])
            await prefill.command(op="stall", rid=f"stall-{i}", seconds=STALL_S)
            with anyio.fail_after(GUARD_S):
                got = await decode.await_arrival(rid)
            # the stall cuts the link: the receiver hears nothing for peer_timeout_s
            await eventually(lambda: decode.status()["peers"] == [], timeout=GUARD_S, what="the link's end")
            await prefill.event("stalled", f"stall-{i}", timeout=GUARD_S)
            sent = await prefill.event("completed", rid, timeout=GUARD_S)
            if got.ok or sent["status"] == "SUCCESS":  # a sender's SUCCESS: its WRITE landed
                assert torch.equal(decode.kv.pages([10, 11]), pattern(SMALL, rid, 2)), (sent, got)
            outcomes.append((got.status.value if got.ok else str(got.reason.value if got.reason else None),
                             sent["reason"] or "SUCCESS"))
