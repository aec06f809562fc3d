"""``Drains`` forgets a receiver once nothing of it drains, however its last handle ended.

A state machine with its collaborators faked (the watchdog's hooks); the service-level
behaviour is in ``test_drain_proof.py``."""

from __future__ import annotations

from kvservice._transfer.drain import Drains
from kvservice._transfer.proofs import Proofs
from kvservice._transfer.requests import SendRequest


def _drains(pending: list[bool]) -> tuple[Drains, list[object]]:
    released: list[object] = []
    drains = Drains(Proofs(), settle_if_released=lambda req: None, release=released.append,
                    posts_pending=lambda: pending[0], let_go_ended=lambda req: None)
    return drains, released


def _ended_request(rid: str, peer: str) -> SendRequest:
    req = SendRequest(request_id=rid, created=0.0, deadline=1.0)
    req.peer = peer
    return req


def test_a_receiver_whose_let_go_handle_ended_while_posts_were_pending_is_forgotten() -> None:
    """The last let-go handle of a receiver ends while a tick's posts are still pending (they
    may be to it): its deadlines stay until the posts are digested, then go.  (They used to
    stay for good: one entry per such receiver, and a later request's WRITE to that receiver
    was taken for part of a drain long expired and given up unproven.)"""
    pending = [False]
    drains, _ = _drains(pending)
    req = _ended_request("r1", "decode-a")
    drains.let_go(req, [7], now=10.0)
    assert drains.until == {"decode-a": 10.0}
    pending[0] = True
    drains.ended(7, proven=True)
    assert drains.until == {"decode-a": 10.0}  # a pending post may be to it
    pending[0] = False
    drains.check_all()  # the tick's posts digested
    assert drains.until == {} and drains.drained == {} and not drains.handles
    # a later request's WRITE posted after it ended is let go afresh, not drained as before
    later = _ended_request("r2", "decode-a")
    drains.add_posted(8, later, now=500.0)
    assert drains.until == {"decode-a": 500.0}
    drains.expire(now=501.0)
    assert 8 in drains.handles  # still checked: its DRAIN_S runs from now


def test_every_way_a_let_go_handle_ends_leaves_no_receiver_behind() -> None:
    pending = [False]
    drains, released = _drains(pending)
    for k, how in enumerate(("done", "error", "expired", "given_up")):
        peer = f"decode-{how}"
        drains.let_go(_ended_request(f"r{k}", peer), [100 + k], now=0.0)
        if how == "done":
            drains.ended(100 + k, proven=True)
        elif how == "error":
            drains.ended(100 + k, proven=False)
        elif how == "expired":
            drains.expire(now=10_000.0)  # past DRAIN_S: released, unproven
        else:
            drains.give_up(peer)
    assert drains.until == {} and drains.drained == {} and not drains.handles
    assert set(released) >= {102, 103}
