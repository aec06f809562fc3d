"""The sidecar's ownership table (``kvservice.sidecar.owners``) step by step, against a
stand-in for what the service remembers."""

from __future__ import annotations

import pytest

from kvservice.sidecar.owners import RECV, SEND, NotOwnerError, Owners


class Service:
    """What ``TransferService.remembers`` answers: ids put here until forgotten."""

    def __init__(self) -> None:
        self.ids: set[str] = set()

    def remembers(self, rid: str) -> bool:
        return rid in self.ids


def owners_of(svc: Service, *conns: int) -> Owners:
    owners = Owners(svc.remembers)
    for conn in conns:
        owners.connected(conn)
    return owners


def test_the_first_user_of_either_side_owns_both() -> None:
    svc = Service()
    owners = owners_of(svc, 1, 2)
    assert owners.claim(1, (RECV, "r"))
    for side in (SEND, RECV):
        with pytest.raises(NotOwnerError, match=r"^request 'r' belongs to another worker of this sidecar$"):
            owners.claim(2, (side, "r"))
    with pytest.raises(NotOwnerError):
        owners.check(2, "r")
    assert owners.claim(1, (SEND, "r"))  # the owner may use the other side
    assert not owners.claim(1, (SEND, "r"))  # a second chunk: not a new start
    owners.check(1, "r")


def test_an_ended_id_is_owned_exactly_while_the_service_remembers_it() -> None:
    svc = Service()
    owners = owners_of(svc, 1, 2)
    owners.claim(1, (RECV, "r"))
    svc.ids.add("r")
    owners.ended((RECV, "r"))
    for i in range(100):  # others' requests end: they do not push "r" out
        owners.claim(2, (SEND, f"x{i}"))
        svc.ids.add(f"x{i}")
        owners.ended((SEND, f"x{i}"))
    with pytest.raises(NotOwnerError):
        owners.check(2, "r")
    svc.ids.discard("r")  # the service forgot its result
    owners.check(2, "r")
    assert owners.claim(2, (SEND, "r"))


def test_ended_ids_the_service_forgot_are_pruned() -> None:
    svc = Service()
    owners = owners_of(svc, 1)
    for i in range(1000):
        rid = f"r{i}"
        owners.claim(1, (SEND, rid))
        svc.ids.add(rid)
        owners.ended((SEND, rid))
        if i >= 10:
            svc.ids.discard(f"r{i - 10}")  # the service keeps the 10 most recent
    assert len(owners) <= 2 * 10 + 2


def test_unclaim_undoes_only_what_the_claim_did() -> None:
    svc = Service()
    owners = owners_of(svc, 1, 2)
    assert owners.claim(1, (SEND, "r"))
    assert owners.claim(1, (RECV, "r"))
    owners.unclaim((RECV, "r"))  # its expect registered nothing: the send side keeps the id
    with pytest.raises(NotOwnerError):
        owners.check(2, "r")
    owners.unclaim((SEND, "r"))
    owners.check(2, "r")
    assert len(owners) == 0


def test_a_departed_workers_live_ids_are_returned_and_stay_its_own() -> None:
    svc = Service()
    owners = owners_of(svc, 1, 2)
    owners.claim(1, (SEND, "r"))
    owners.claim(1, (RECV, "r"))
    owners.claim(1, (SEND, "done"))
    svc.ids |= {"r", "done"}
    owners.ended((SEND, "done"))
    assert owners.disconnected(1) == [(RECV, "r"), (SEND, "r")]
    with pytest.raises(NotOwnerError, match="which disconnected"):
        owners.check(2, "r")
