"""A lost agent gone for good (here: it said ``Bye``) leaves no entry behind in the
tables kept per agent after a link ends: the inbound notification keys (control plane),
the proofs ledger and the heal's records (request plane).  A live agent keeps its own.
(Real TCP between services; NIXL faked.)"""

from __future__ import annotations

import anyio

from kvservice import TransferService
from kvservice.testing import FakeFabric
from tests.helpers import eventually

from .harness import GUARD_S, fill, unit_config


def entries(svc: TransferService) -> dict[str, set[str]]:
    """The agents each per-agent table of ``svc`` holds an entry for."""
    p = svc._plane
    assert p is not None
    heal = p.inbound._heal
    return {
        "notif_in": set(p.control._notif_in),
        "proofs": set(p.watchdog.proofs._unproven),
        "heal_lost": set(heal._lost_at),
        "heal_answered": set(heal._answered),
    }


async def linked_pair(tx: TransferService, rx: TransferService, rid: str) -> None:
    fill(tx, rid, [0])
    await rx.expect(rid, [1], sender=tx.address)
    assert (await tx.await_completion(await tx.send(rid, [0], last=True), timeout=GUARD_S)).ok
    assert (await rx.await_arrival(rid, timeout=GUARD_S)).ok


async def test_a_receiver_that_said_bye_is_forgotten_by_its_sender() -> None:
    fabric = FakeFabric()
    async with TransferService(unit_config(), door_factory=fabric.factory) as tx, \
            TransferService(unit_config(), door_factory=fabric.factory) as live:
        await linked_pair(tx, live, "live")
        async with TransferService(unit_config(), door_factory=fabric.factory) as rx:
            await linked_pair(tx, rx, "r1")
            gone = rx.agent_name
            assert tx._plane is not None
            # what a lost link leaves behind for it: an unproven WRITE, a loss, an answered Ask
            tx._plane.watchdog.proofs.unproven(gone, "r0", "test")
            tx._plane.watchdog.proofs.unproven(live.agent_name, "r0", "test")
            heal = tx._plane.inbound._heal
            heal.lost(gone, frozenset({rx.address}))
            heal._answered.put(gone, 0.0)
            held = entries(tx)
            assert all(gone in agents for agents in held.values()), held
        with anyio.fail_after(GUARD_S):  # its Bye: unloaded, then forgotten
            await eventually(lambda: all(gone not in agents for agents in entries(tx).values()),
                             timeout=GUARD_S, what=lambda: f"tables {entries(tx)}")
        now = entries(tx)
        assert live.agent_name in now["notif_in"] and live.agent_name in now["proofs"], now
        assert tx._plane.watchdog.proofs.may_prove(gone, "r0")  # nobody can ask under its name again
