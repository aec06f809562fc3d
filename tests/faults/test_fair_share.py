"""One key holder cannot take what every peer shares: names cost nothing, sources do.

The findings, against real processes: one NIXL agent's metadata linked under four
names filled the early-Expect total and every decode's early Expect was refused;
Joins whose metadata killed the shared vetting child, each under a fresh name,
killed it again and again while a legitimate peer's first link waited behind its
restarts.  Here the attacker holds the key (this user's, on loopback), links from
its own source address (127.0.0.2) with a live donor agent's real metadata renamed
per name, and a legitimate decode process on 127.0.0.1 transfers beside it.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import anyio.abc
import pytest

from kvservice import FailureReason, TransferService
from kvservice._control.protocol import Expect, Join, Message, Reject
from kvservice._control.transport import TcpTransport
from kvservice._trust.strikes import Strikes
from kvservice.testing import PeerProcess
from kvservice.testing.inspect import inside
from tests.faults.test_hostile_peers import legit_transfer
from tests.faults.test_member_identity import WAIT_S, Authority, legit
from tests.faults.test_metadata_fuzz import MEMORY, donor, donor_name, renamed, version_altered
from tests.helpers import config, eventually, peer_config, peers
from tests.hostile import Raw, authenticate, join_for, own_key

pytestmark = pytest.mark.nixl

ATTACKER = "127.0.0.2"
_ports = itertools.count(22000)
#: a Join vetted on a child of its own waits for that child's start, and a first link for a child's
#: restart (seconds of CPU each on a busy machine): bounds, not expectations
JOIN_WAIT_S = 60.0


@asynccontextmanager
async def joined(address: str, agent: str, metadata: bytes) -> AsyncIterator[tuple[Raw, Message | None]]:
    """A key holder at ``ATTACKER`` joins as ``agent``; the answer (a Join when it linked),
    and the connection, open until the block ends."""
    raw = await authenticate(address, key=own_key(), agent=agent, my_address=f"127.0.0.1:{next(_ports)}",
                             source=ATTACKER)
    try:
        await raw.send(join_for(agent, metadata=metadata, memory=MEMORY or None))
        yield raw, await raw.recv(timeout=JOIN_WAIT_S)
    finally:
        await raw.aclose()


async def join_once(address: str, agent: str, metadata: bytes) -> Message | None:
    async with joined(address, agent, metadata) as (_, answer):
        return answer


async def vetting_ready(svc: TransferService) -> None:
    """The service's vetting child serves (a handshake waits for it before its own deadline,
    which a raw client's waits do not allow for)."""
    with anyio.fail_after(60):
        await inside(svc).vetter.ready()


def refused(svc: TransferService, kind: str) -> int:
    return int(svc.status()["refused"].get(kind, 0))


async def test_one_source_under_many_names_holds_only_its_share_of_early_expects_and_peers() -> None:
    """Four names from one source Expect pages without end: the source gets its share
    (8 pages of 32) and the rest is refused, counted as the source's; its fifth name is not
    linked (max_peers_per_source); a decode on another source expects early and receives."""
    cfg = config(peer_timeout_s=60.0, max_unknown_expect_pages=8, max_unknown_expect_pages_total=32,
                 max_unknown_expect_pages_per_source=8, max_peers_per_source=4)
    async with donor() as md, peers(peer_config(connect_timeout_s=JOIN_WAIT_S)) as (decode,), \
            TransferService(cfg) as svc:
        await vetting_ready(svc)
        async with (joined(svc.address, donor_name(1), renamed(md, 1)) as (a, ja),
                    joined(svc.address, donor_name(2), renamed(md, 2)) as (b, jb),
                    joined(svc.address, donor_name(3), renamed(md, 3)) as (c, jc),
                    joined(svc.address, donor_name(4), renamed(md, 4)) as (d, jd)):
            assert all(isinstance(j, Join) for j in (ja, jb, jc, jd)), (ja, jb, jc, jd)
            fifth = await join_once(svc.address, donor_name(5), renamed(md, 5))
            assert isinstance(fifth, Reject) and fifth.kind == "peer_source_limit", fifth
            assert "max_peers_per_source = 4" in fifth.message
            for i, raw in enumerate((a, b, c, d)):  # each name's own bound (8) would take all 32
                for j in range(2):
                    await raw.send(Expect(f"hog-{i}-{j}", [4 * j + k for k in range(4)]))
            await eventually(lambda: refused(svc, "unknown_expect_source_limit") == 6, 20, 0.02,
                             what="six of the source's eight Expects refused")
            assert len(inside(svc).early) == 2 and inside(svc).early.pages == 8
            assert refused(svc, "unknown_expect_limit") == 0
            await legit_transfer(svc, decode)  # its early Expect fits beside the attacker's share
            assert refused(svc, "unknown_expect_source_limit") == 6


async def decode_alive(decode: PeerProcess) -> None:
    """The decode process lives (the vetting child died in its service's stead)."""
    assert decode.proc.returncode is None


@pytest.fixture
def parser_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only the vetting child stands between NIXL and the metadata (in this process's services)."""
    import kvservice._trust.vetting as vetting

    monkeypatch.setattr(vetting, "check_metadata", lambda data: None)


@pytest.mark.usefixtures("parser_off")
async def test_a_source_whose_metadata_killed_vetting_children_twice_is_refused_while_it_backs_off() -> None:
    """The first Join kills the child (SIGABRT in UCX), the second the child its source is
    vetted on from then on: both refused, and the source backs off.  Five more under fresh
    names are refused at once (``vetting_backoff``): no child starts for them, and the
    decode's first link is vetted on the child that replaced the first."""
    async with (donor() as md, peers(peer_config(connect_timeout_s=JOIN_WAIT_S)) as (decode,),
                TransferService(config(connect_timeout_s=JOIN_WAIT_S)) as svc):
        vetter = inside(svc).vetter
        await vetting_ready(svc)
        vetter.strikes = Strikes(base_s=600.0, max_s=600.0)  # no wall clock in the assertions below
        for i in (1, 2):
            answer = await join_once(svc.address, donor_name(i), version_altered(renamed(md, i)))
            assert isinstance(answer, Reject) and answer.kind == "metadata_unsafe" and "SIGABRT" in answer.message
        for i in range(3, 8):
            answer = await join_once(svc.address, donor_name(i), version_altered(renamed(md, i)))
            assert isinstance(answer, Reject) and answer.kind == "vetting_backoff", answer
            assert ATTACKER in answer.message
        await legit_transfer(svc, decode)
        assert vetter.children_started == 3  # the first, the one that replaced it, the source's own
        assert refused(svc, "metadata_unsafe") == 2 and refused(svc, "vetting_backoff") == 5


@pytest.mark.usefixtures("parser_off")
async def test_past_its_backoff_a_source_is_vetted_on_a_child_of_its_own() -> None:
    """With no backoff left, the source's next Joins go to the second lane: they kill that
    child, not the one the decode's first link is vetted on, whose pid stays the same.
    (Each of those Joins waits for its child's start inside its own handshake deadline.)"""
    async with (donor() as md, peers(peer_config(connect_timeout_s=JOIN_WAIT_S)) as (decode,),
                TransferService(config(connect_timeout_s=JOIN_WAIT_S)) as svc):
        vetter = inside(svc).vetter
        await vetting_ready(svc)
        vetter.strikes = Strikes(base_s=0.0, max_s=600.0)  # refused for no time: always vetted apart
        answer = await join_once(svc.address, donor_name(1), version_altered(renamed(md, 1)))
        assert isinstance(answer, Reject) and answer.kind == "metadata_unsafe", answer
        with anyio.fail_after(60):
            await vetter.ready()
        main = vetter.pid
        for i in range(2, 4):
            answer = await join_once(svc.address, donor_name(i), version_altered(renamed(md, i)))
            assert isinstance(answer, Reject) and answer.kind == "metadata_unsafe", answer
            assert "SIGABRT" in answer.message, answer.message
        await legit_transfer(svc, decode)
        assert vetter.pid == main  # the lane other peers are vetted on was not touched again
        assert vetter.children_started == 4  # the first, its replacement, one apart per Join
        assert refused(svc, "metadata_unsafe") == 3
        await decode_alive(decode)


# -- with member identities: shares are charged to the proven member ---------------------------------


class _DialsFrom(TcpTransport):
    """TCP whose connections come from ``source`` (a loopback address every local process has)."""

    def __init__(self, source: str) -> None:
        self.source = source

    async def connect(self, host: str, port: int) -> anyio.abc.ByteStream:
        return await anyio.connect_tcp(host, port, local_host=self.source)


async def _link_or_refusal(svc: TransferService, to: TransferService, rid: str, refusals: int) -> bool:
    """``svc`` dials ``to`` (its expect names ``to`` as the sender): whether it linked, or
    (``False``) ``to`` counted one more ``peer_source_limit`` than ``refusals``."""
    await svc.expect(rid, [1], sender=to.address)
    await eventually(lambda: to.address in svc.status()["peers"] or refused(to, "peer_source_limit") > refusals,
                     WAIT_S, 0.02, what=f"{rid} linked or refused")
    return to.address in svc.status()["peers"]


async def test_one_member_holds_one_share_from_many_addresses_and_agent_names(tmp_path: Path) -> None:
    """Mallory, one member, links to decode-0 from 127.0.0.2, .3, .4 and .5, each time under
    a new agent name: with one peer per source and four in all, it holds one (refused
    ``peer_source_limit``, saying its member, the other three) and prefill-0 on 127.0.0.1
    still links and its request passes byte-exact.  Charged per address, mallory's four
    would fill ``max_peers`` and prefill-0 would be refused."""
    cluster = Authority(tmp_path)
    mallory_files = cluster.member("mallory")
    async with (peers(peer_config(**cluster.member("prefill-0"))) as (prefill,),
                TransferService(config(**cluster.member("decode-0", "decode"), max_peers=4,
                                       max_peers_per_source=1)) as decode,
                contextlib.AsyncExitStack() as stack):
        mallories = [await stack.enter_async_context(TransferService(config(**mallory_files),
                                                                     transport=_DialsFrom(f"127.0.0.{i}")))
                     for i in range(2, 6)]
        assert len({m.agent_name for m in mallories}) == 4
        linked = [await _link_or_refusal(m, decode, f"m-{n}", refused(decode, "peer_source_limit"))
                  for n, m in enumerate(mallories)]
        assert linked == [True, False, False, False], linked
        for n, m in enumerate(mallories[1:], start=1):
            result = await m.await_arrival(f"m-{n}", timeout=WAIT_S)
            assert result.reason is FailureReason.REFUSED, result
            assert "kvservice://c1/prefill/mallory" in result.message and "max_peers_per_source = 1" in result.message
        assert refused(decode, "peer_source_limit") == 3
        await legit(prefill, decode, "honest")
        assert sorted(decode.status()["peers"]) == sorted([prefill.address, mallories[0].address])


async def test_two_members_behind_one_address_each_hold_their_share(tmp_path: Path) -> None:
    """Members a-0 and b-0 link to decode-0 from the same address (127.0.0.2), one peer and
    one early Expect of one page per source: each holds its own share, both link and both
    Expects are held; a second agent of a-0 from there is refused.  Charged per address,
    b-0 would be refused for a-0's link."""
    cluster = Authority(tmp_path)
    behind = _DialsFrom("127.0.0.2")
    async with (TransferService(config(**cluster.member("decode-0", "decode"), max_peers=4,
                                       max_peers_per_source=1, max_unknown_expects_per_source=1,
                                       max_unknown_expect_pages_per_source=1)) as decode,
                TransferService(config(**cluster.member("a-0")), transport=behind) as a,
                TransferService(config(**cluster.member("b-0")), transport=behind) as b,
                TransferService(config(**cluster.member("a-0")), transport=behind) as a_again):
        assert await _link_or_refusal(a, decode, "a", 0)
        assert await _link_or_refusal(b, decode, "b", 0)
        assert not await _link_or_refusal(a_again, decode, "a-again", 0)
        assert sorted(decode.status()["peers"]) == sorted([a.address, b.address])
        assert refused(decode, "peer_source_limit") == 1
        await eventually(lambda: len(inside(decode).early) == 2, WAIT_S, 0.02, what="both early Expects held")
        assert refused(decode, "unknown_expect_source_limit") == 0
