"""Both sides agree on how a request ended when a sender's give-up (abort, deadline)
races its last chunk: the receiver answers the sender's ``Failed`` with its
``Outcome``, and the sender's settled result follows it."""

from __future__ import annotations

import anyio
import pytest

from kvservice import FailureReason, TransferStatus
from kvservice._control.protocol import ChunkNotif
from kvservice.testing import FakeFabric
from kvservice.testing.inspect import inside
from tests.helpers import eventually

from .harness import GUARD_S, door_of, fill, notif_from, two_services


@pytest.mark.parametrize("landed", [True, False], ids=["last-chunk-landed", "not-landed"])
async def test_a_sender_abort_racing_the_last_chunk_ends_alike_on_both_sides(landed: bool) -> None:
    """The receiver's Outcome comes back while the aborted request's WRITE is still in flight
    (let go, not released: a release would not stop it): the request ends at once all the
    same (a soak once found it hanging when it waited for a release: the upgraded SUCCESS was
    never settled), and the WRITE's handle is released once it ends."""
    fabric = FakeFabric()
    with anyio.fail_after(GUARD_S):
        async with two_services(fabric) as (tx, rx):
            txd, rxd = door_of(fabric, tx), door_of(fabric, rx)
            txd.hang()  # the WRITE stays in flight on the sender
            fill(tx, "race", [1])
            await rx.expect("race", [9], sender=tx.address)
            handle = await tx.send("race", [1], last=True)
            await eventually(lambda: txd.live_xfers() == 1, GUARD_S)
            if landed:  # the receiver already saw the last chunk's notification
                rxd.inject_notif(tx.agent_name, notif_from(tx, rx, ChunkNotif("race", 0, 1)))
                assert (await rx.await_arrival("race", timeout=GUARD_S)).ok
            (xid,) = txd.live_ids()
            aborted = await tx.abort("race")
            assert aborted is not None and aborted.reason is FailureReason.ABORTED  # as it stands now
            # The sender's result: once the Outcome is in, its (hung) WRITE still in flight.
            # Only then let the fake finish what still hangs (the WRITE, the settle fence):
            # finishing the WRITE before the result would be another race (it lands, the
            # receiver succeeds, and both agree on SUCCESS).
            sent = await tx.await_completion(handle)
            assert txd.release_counts[xid] == 0 and xid in txd.live_ids()
            txd.complete_immediately()
            await eventually(lambda: txd.finish_hung() >= 1 or txd.live_xfers() == 0, GUARD_S)
            got = await rx.await_settled("race", timeout=GUARD_S)
            assert sent.settled and got.settled, (sent, got)
            if landed:
                assert sent.status is TransferStatus.SUCCESS and "receiver had every page" in sent.message, sent
                assert got.ok
                assert (await tx.await_settled("race")).ok
            else:
                assert sent.reason is FailureReason.ABORTED and got.reason is FailureReason.ABORTED, (sent, got)
            await eventually(lambda: txd.release_counts[xid] == 1, GUARD_S)
    fabric.assert_clean()


async def test_without_an_outcome_the_failure_stands_after_the_peer_timeout() -> None:
    """A receiver that never answers (its link silent) does not hold the sender's
    result for ever: it stands once the link is lost."""
    fabric = FakeFabric()
    with anyio.fail_after(GUARD_S):
        async with two_services(fabric) as (tx, rx):
            txd = door_of(fabric, tx)
            txd.hang()
            fill(tx, "mute", [1])
            await rx.expect("mute", [9], sender=tx.address)
            handle = await tx.send("mute", [1], last=True)
            await eventually(lambda: txd.live_xfers() == 1, GUARD_S)
            inside(rx).drop_link(tx.agent_name, ConnectionResetError("test: the receiver goes away"))
            await tx.abort("mute")
            sent = await tx.await_completion(handle)
            assert sent.status is TransferStatus.FAILED and sent.settled, sent
    fabric.assert_clean()
