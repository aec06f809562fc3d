"""A fleet moves from the cluster's shared key to member identities while requests flow,
against the previous release (docs/security.md "Mixed fleets", docs/operations.md "Upgrades").

The previous release (``previous.PREVIOUS``) knows no identities.  A prefill and a decode of
that release, sharing the cluster key, are replaced one by one, in place (same address) and
under traffic, by this release with a member certificate and ``allow_peers_without_identity``,
then restarted again with that setting off: the documented way to move.  Each way round
(the prefill first, so this release with an identity sends to the previous one; the decode
first, so the previous release sends to it), at every step:

- a request in flight when a member is replaced ends ``SUCCESS`` (verified) or fails with the
  loss of its peer, never with a refusal;
- the survivor refused nothing (no ``identity*`` or any other refusal is counted);
- the next requests pass, every byte verified by the receiver;
- once both hold identities, the decode's expects name the prefill's member (``member=``), which
  only a link that proved that member can answer, and the link speaks this release's version.

At the end the previous release can no longer link: a prefill of that release is refused by
the decode, with the setting named in the reason and counted ``identity_missing``.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import pytest

from kvservice import FailureReason
from kvservice._control.protocol import PROTOCOL_VERSION
from kvservice.testing import PeerProcess
from tests.compat.previous import PREVIOUS_PROTOCOL, previous_env
from tests.faults.test_member_identity import Authority
from tests.helpers import READY_S, free_port, peer_config, scaled

pytestmark = [pytest.mark.nixl, pytest.mark.slow]

GUARD_S = scaled(30.0)  # a hang guard for one step, never a speed assertion
#: what a request in flight across its peer's replacement may end as, besides SUCCESS
LOST = {FailureReason.PEER_LOST.value, FailureReason.REMOTE_DISCONNECT.value}


@dataclass
class Member:
    """One member's place in the fleet: its role, name and port (the same across restarts)."""

    role: str
    name: str
    port: int = field(default_factory=free_port)


@dataclass
class Fleet:
    """The prefill and the decode, each a child process of the previous release or of this one."""

    tg: anyio.abc.TaskGroup
    cluster: Authority
    old_env: dict[str, str]
    prefill: Member
    decode: Member
    procs: dict[str, PeerProcess] = field(default_factory=dict)
    settings: dict[str, dict[str, Any]] = field(default_factory=dict)

    async def start(self, m: Member, stage: str) -> None:
        """``m`` as ``stage``: "previous" (the previous release, shared key), "allow" (this
        release, identity, peers without one allowed) or "strict" (identity required)."""
        cfg: dict[str, Any] = {"auth_key_file": self.cluster.key, "port": m.port,
                               "connect_timeout_s": GUARD_S}
        if stage != "previous":
            cfg |= self.cluster.member(m.name, m.role)
            cfg["allow_peers_without_identity"] = stage == "allow"
        self.settings[m.role] = cfg
        env = self.old_env if stage == "previous" else None
        self.procs[m.role] = await PeerProcess.start(self.tg, peer_config(**cfg), env=env, ready_timeout=READY_S)

    def identity(self, m: Member) -> bool:
        return "identity_cert_file" in self.settings[m.role]

    async def request(self, pages: int = 2) -> str:
        """One request from the prefill to the decode, started (not awaited): its id."""
        prefill, decode = self.procs["prefill"], self.procs["decode"]
        rid = f"r-{next(_counter)}"
        k = next(_counter) % 24
        src, dst = list(range(k, k + pages)), list(range(30 + k, 30 + k + pages))
        await prefill.command(op="fill", rid=rid, pages=src)
        await prefill.event("filled", timeout=GUARD_S)
        expect: dict[str, Any] = {"rid": rid, "pages": dst, "sender": prefill.address, "timeout": GUARD_S}
        if self.identity(self.prefill) and self.identity(self.decode):
            expect["member"] = self.prefill.name  # answered only by a link that proved it
        await decode.command(op="expect", **expect)
        await decode.event("expecting", rid, timeout=GUARD_S)
        await prefill.command(op="send", rid=rid, pages=src, last=True)
        return rid

    async def verified(self, rid: str) -> None:
        arrived = await self.procs["decode"].event("arrived", rid, timeout=GUARD_S)
        assert arrived["status"] == "SUCCESS" and arrived["verified"] is True, arrived
        completed = await self.procs["prefill"].event("completed", rid, timeout=GUARD_S)
        assert completed["status"] == "SUCCESS", completed

    async def status(self, role: str) -> dict[str, Any]:
        await self.procs[role].command(op="status")
        return await self.procs[role].event("status", timeout=GUARD_S)

    async def replace(self, m: Member, stage: str) -> None:
        """Replace ``m`` in place with a request in flight to or from it; the survivor sees
        that request end as a success or as its peer's loss, and refuses nothing."""
        survivor = "decode" if m.role == "prefill" else "prefill"
        rid = await self.request()
        await self.procs[m.role].stop(timeout=GUARD_S)  # a rolling restart: asked to exit
        if survivor == "decode":
            ended = await self.procs["decode"].event("arrived", rid, timeout=GUARD_S)
        else:
            ended = await self.procs["prefill"].event("completed", rid, timeout=GUARD_S)
        assert ended["status"] == "SUCCESS" or ended["reason"] in LOST, ended
        await self.start(m, stage)
        for _ in range(3):
            await self.verified(await self.request())
        status = await self.status(survivor)
        assert status.get("refused", {}) == {}, status.get("refused")


_counter = itertools.count()


@pytest.mark.parametrize("first", ["prefill", "decode"])
async def test_a_fleet_moves_to_member_identities_under_traffic(tmp_path: Path, first: str) -> None:
    cluster = Authority(tmp_path)
    async with anyio.create_task_group() as tg:
        fleet = Fleet(tg, cluster, previous_env(), Member("prefill", "prefill-0"), Member("decode", "decode-0"))
        try:
            await fleet.start(fleet.prefill, "previous")
            await fleet.start(fleet.decode, "previous")
            for _ in range(2):
                await fleet.verified(await fleet.request())
            one, other = (fleet.prefill, fleet.decode) if first == "prefill" else (fleet.decode, fleet.prefill)
            await fleet.replace(one, "allow")  # this release, with an identity, beside the previous one
            assert (await fleet.status(one.role))["peer_versions"] == {str(PREVIOUS_PROTOCOL): 1}
            await fleet.replace(other, "allow")  # both proven now: expects name the prefill's member
            assert (await fleet.status("decode"))["peer_versions"] == {str(PROTOCOL_VERSION): 1}
            await fleet.replace(one, "strict")
            await fleet.replace(other, "strict")

            # the previous release cannot link any more: refused by name of the setting, counted
            old = await PeerProcess.start(tg, peer_config(auth_key_file=cluster.key), env=fleet.old_env,
                                          ready_timeout=READY_S)
            try:
                decode = fleet.procs["decode"]
                await decode.command(op="expect", rid="stale", pages=[60], sender=old.address, timeout=GUARD_S)
                await decode.event("expecting", "stale", timeout=GUARD_S)
                refused = await decode.event("arrived", "stale", timeout=GUARD_S)
                assert refused["status"] == "FAILED" and refused["reason"] == FailureReason.REFUSED.value, refused
                assert "allow_peers_without_identity" in refused["message"], refused
                assert (await fleet.status("decode"))["refused"].get("identity_missing", 0) >= 1
            finally:
                await old.stop(timeout=10)
            await fleet.verified(await fleet.request())  # and the fleet's own traffic goes on
        finally:
            with anyio.CancelScope(shield=True):
                for proc in fleet.procs.values():
                    await proc.stop(timeout=10)
            tg.cancel_scope.cancel()
