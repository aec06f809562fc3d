"""Settlement's bookkeeping: holds per (request, sender incarnation), and every waiter
woken whatever the others did."""

from __future__ import annotations

import anyio

from kvservice import FailureReason, TransferStatus
from kvservice._results import TransferResult
from kvservice._transfer.requests import Recent
from kvservice._transfer.settle import Settlement


def book() -> tuple[Settlement, Recent[str, TransferResult]]:
    recvs: Recent[str, TransferResult] = Recent(100)
    return Settlement(recvs, Recent(100)), recvs


def failed(rid: str) -> TransferResult:
    return TransferResult(request_id=rid, status=TransferStatus.FAILED, reason=FailureReason.PEER_LOST, message="lost")


def test_a_hold_is_per_sender_incarnation() -> None:
    """The same id held for an old sender and, after a re-expect, a new one: the old
    one's evidence (its fence, its death) settles only its own hold, and the pages count
    stays exact."""
    s, recvs = book()
    recvs.put("r", failed("r"))
    s.hold("r", "old", 4)
    s.hold("r", "new", 3)
    assert s.unsettled_pages == 7
    assert not s.settle_recv("r", "stranger")  # nobody else's evidence counts
    assert s.settle_recv("r", "old")
    assert s.unsettled_pages == 3
    result = recvs.get("r")
    assert result is not None and not result.settled  # "new" may still write into its pages
    assert s.settle_agent("new") == 1
    assert s.unsettled_pages == 0
    result = recvs.get("r")
    assert result is not None and result.settled


def test_the_same_sender_holding_an_id_twice_adds_up() -> None:
    s, recvs = book()
    recvs.put("r", failed("r"))
    s.hold("r", "a", 4)
    s.hold("r", "a", 2)  # re-expected from the same sender before the first settled
    assert s.unsettled_pages == 6
    assert s.settle_recv("r", "a") and s.unsettled_pages == 0  # its fence covers both


async def test_every_waiter_is_woken_whatever_the_others_did() -> None:
    """Two waiters on one id; the first times out: the second is still woken at the
    settle (before, the first deleted the shared event and the second waited for ever)."""
    s, recvs = book()
    recvs.put("r", failed("r"))
    s.hold("r", "a", 1)
    woken: list[str] = []

    async def wait(name: str, timeout: float | None) -> None:
        await s.wait("recv", "r", timeout)
        woken.append(name)

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(wait, "patient", None)
            tg.start_soon(wait, "hasty", 0.05)
            await anyio.sleep(0.2)
            assert woken == ["hasty"]
            s.settle_recv("r", "a")
    assert woken == ["hasty", "patient"]
    assert not s._waiters  # nothing left behind
