"""Strangers holding handshake slots against a real prefill service (real NIXL, real
decode processes): the pre-authentication pool is shared fairly (``kvservice._control.preauth``),
many loopback addresses buy one share, and a connection it refuses is told why (a
``Reject``), so a dialer ends ``REFUSED``."""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable, Sequence

import anyio
import pytest

from kvservice import FailureReason, ServiceConfig, TransferService
from kvservice._control.protocol import Hello, Reject
from tests.faults.test_hostile_peers import WAIT_S, hostile_config, legit_transfer, refused
from tests.helpers import eventually, peer_config, peers, scaled
from tests.hostile import Raw, dial, is_reject

pytestmark = pytest.mark.nixl

_rids = itertools.count()
POOL_KINDS = ("handshake_limit", "handshake_source_limit", "handshake_evicted")


async def hold(address: str, source: str, seen: Counter[str]) -> None:
    """Keep one idle connection from ``source`` open, reopening it whenever the service
    closes it (a short pause between, so the flood does not starve the machine), until
    cancelled.  ``seen`` counts what each connection read before its close."""
    while True:
        try:
            raw = await Raw.connect(address, source=source)
        except (OSError, TimeoutError):
            await anyio.sleep(0.1)
            continue
        try:
            msg = await raw.recv(timeout=60)
            seen[msg.kind if isinstance(msg, Reject) else "closed"] += 1
        finally:
            await raw.aclose()
        await anyio.sleep(0.1)


async def decodes_link_while_strangers_hold(
        cfg: ServiceConfig, decodes_n: int, sources: Sequence[str], seen: Counter[str],
        full: Callable[[TransferService], bool], what: str) -> TransferService:
    """A real prefill service on ``cfg``; one idle stranger per entry of ``sources`` (an
    address) held open (``hold``) until ``full(svc)``; then ``decodes_n`` real decode
    processes on 127.0.0.1 link and receive byte-exact, and no stranger is linked.  The
    service, closed, for what it counted."""
    configs = [peer_config() for _ in range(decodes_n)]
    async with peers(*configs) as decodes, TransferService(cfg) as svc:
        async with anyio.create_task_group() as tg:
            for source in sources:
                tg.start_soon(hold, svc.address, source, seen)
            await eventually(lambda: full(svc), WAIT_S, 0.05, what=what)
            try:
                for decode in decodes:
                    await legit_transfer(svc, decode)  # each decode dials the service: a new link
            finally:
                tg.cancel_scope.cancel()
        assert sorted(svc.status()["peers"]) == sorted(d.address for d in decodes)
    return svc


async def test_strangers_on_many_loopback_addresses_hold_one_share() -> None:
    """Six addresses 127.0.0.2-7 each keep 24 idle connections open, reopening every one
    closed (144 wanted; 64 slots, 16 per source): every local process has all of
    127.0.0.0/8, so they are one source before the handshake, held to 16 slots together.
    The pool never fills (nobody is refused for room, nobody evicted), every refusal is
    counted and was told why, three real decode processes on 127.0.0.1 link and receive
    byte-exact, and no stranger is linked."""
    cfg = hostile_config(connect_timeout_s=scaled(2.0))  # the pool's defaults: 64 slots, 16 per source
    seen: Counter[str] = Counter()
    svc = await decodes_link_while_strangers_hold(
        cfg, 3, [f"127.0.0.{s}" for s in range(2, 8) for _ in range(24)], seen,
        lambda svc: sum(refused(svc, kind) for kind in POOL_KINDS) >= 128, "the strangers refused")
    counts = {kind: refused(svc, kind) for kind in (*POOL_KINDS, "handshake_timeout")}
    assert counts["handshake_limit"] == 0 and counts["handshake_evicted"] == 0, counts
    # what the strangers were told matches what the service counted (some may have been
    # closed by the end of the test before they read their Reject)
    assert seen["handshake_source_limit"] >= 1 and seen["handshake_source_limit"] <= counts["handshake_source_limit"]
    assert seen["handshake_limit"] == 0 and seen["handshake_evicted"] == 0, seen


async def test_strangers_filling_a_small_pool_from_loopback_do_not_lock_out_peers_on_127_0_0_1() -> None:
    """The same strangers against a pool no larger than one share (16 slots): they fill
    it, and the decodes on 127.0.0.1, a source of its own holding fewer, take the
    strangers' oldest slots (evicted), link and receive byte-exact."""
    cfg = hostile_config(connect_timeout_s=scaled(2.0), max_handshakes=16)
    seen: Counter[str] = Counter()
    svc = await decodes_link_while_strangers_hold(
        cfg, 2, [f"127.0.0.{s}" for s in range(2, 6) for _ in range(8)], seen,
        lambda svc: refused(svc, "handshake_source_limit") >= 16, "the pool full of strangers")
    assert refused(svc, "handshake_evicted") >= 1, svc.status()["refused"]


async def test_one_source_reopening_its_connections_is_held_to_its_share() -> None:
    """The finding as reported: one source (127.0.0.2) holds 64 idle connections and
    reopens each one closed; new peers (127.0.0.1) link and transfer byte-exact."""
    seen: Counter[str] = Counter()
    await decodes_link_while_strangers_hold(
        hostile_config(), 2, ["127.0.0.2"] * 64, seen,
        lambda svc: refused(svc, "handshake_source_limit") >= 48, "one source held to its share")
    assert seen["handshake_source_limit"] >= 1, seen


async def stall(address: str) -> Raw:
    """A connection from 127.0.0.1 holding a handshake slot: its Hello answered, then silence."""
    raw, answer, _ = await dial(address)
    assert isinstance(answer, Hello), answer
    return raw


@pytest.mark.parametrize(("limits", "kind", "reason"), [
    ({"max_handshakes": 1}, "handshake_limit", "max_handshakes = 1"),
    ({"max_handshakes": 4, "max_handshakes_per_source": 1}, "handshake_source_limit",
     "max_handshakes_per_source = 1"),
])
async def test_a_dialer_refused_by_the_pool_ends_refused_with_the_reason(
        limits: dict[str, int], kind: str, reason: str) -> None:
    """A real decode dials a service whose pool has no slot for it: its expect ends
    ``REFUSED`` with the limit in the message (not ``PEER_LOST``), at once; the refusal is
    counted; once the slot is free the same decode links and receives byte-exact."""
    cfg = hostile_config(connect_timeout_s=30.0, **limits)
    async with peers(peer_config()) as (decode,), TransferService(cfg) as svc:
        holder = await stall(svc.address)
        try:
            rid = f"pool-{next(_rids)}"
            await decode.command(op="expect", rid=rid, pages=[1, 2], sender=svc.address)
            arrived = await decode.event("arrived", rid)
            assert arrived["status"] == "FAILED" and arrived["reason"] == FailureReason.REFUSED.value, arrived
            assert reason in arrived["message"], arrived
            assert refused(svc, kind) == 1
        finally:
            await holder.aclose()
        await eventually(lambda: refused(svc, "handshake_incomplete") >= 1, WAIT_S, 0.02,
                         what="the holder's slot freed")
        await legit_transfer(svc, decode)


async def test_pool_refusals_say_why_before_closing() -> None:
    """A raw connection past its source's share reads a ``Reject`` of kind
    ``handshake_source_limit``, then the close."""
    async with TransferService(hostile_config(max_handshakes_per_source=2, connect_timeout_s=30.0)) as svc:
        held = [await stall(svc.address) for _ in range(2)]
        extra = await Raw.connect(svc.address)
        msg = await extra.recv()
        assert is_reject(msg, "handshake_source_limit"), msg
        assert await extra.closed_by_peer()
        for raw in [*held, extra]:
            await raw.aclose()
        assert refused(svc, "handshake_source_limit") == 1

