"""Days of uptime: a decode that ends (SIGKILLed, or shut down) and comes back as a new
agent, again and again, leaves no entry of its old agents in the prefill's per-agent
tables (the proofs ledger, the heal's records, the inbound notification keys) nor in
its NIXL agent: each is forgotten once that agent is known gone for good.

Real NIXL (UCX over TCP on loopback) in real processes; the prefill is this process,
read through the soak's table probe."""

from __future__ import annotations

import signal
from collections.abc import Awaitable, Callable

import anyio
import anyio.abc
import pytest
import structlog

from kvservice import TransferService
from kvservice._control import departures
from kvservice._control.protocol import Join
from kvservice._nixl import agent as nixl_door
from kvservice.soak._probe import service_tables
from kvservice.testing import pattern
from kvservice.testing.inspect import inside
from tests.faults.test_heal import LOST, PREFILL, SETTLE_GUARD_S, new_request_arrives_at
from tests.faults.test_hostile_peers import hostile_config, nixl_agent
from tests.faults.test_settle import LAYOUT, PAGES, TCP
from tests.helpers import config, eventually, peer_config, peers
from tests.hostile import authenticate, own_key

pytestmark = [pytest.mark.nixl, pytest.mark.slow]

FAST = {"heartbeat_interval_s": 0.2, "peer_timeout_s": 1.0}
#: per-agent tables that used to keep a dead agent until capacity evicted it
PER_AGENT = ("proofs_unproven", "heal_lost", "heal_answered", "notif_in")
#: decodes started, one after the other: SIGKILLed but the last, which shuts down
ROUNDS = 3


def agents_held(prefill: TransferService) -> set[str]:
    """Every agent some per-agent table of ``prefill``, or its NIXL agent, holds."""
    return inside(prefill).agents_remembered()


async def test_a_decode_restarted_again_and_again_leaves_nothing_of_its_old_agents() -> None:
    async with TransferService(config(LAYOUT, ucx_env=TCP, **PREFILL)) as prefill:
        ended: list[str] = []
        for i in range(ROUNDS):
            kill = i < ROUNDS - 1
            async with peers(peer_config(LAYOUT, ucx_env=TCP, **FAST), env=TCP) as (decode,):
                await new_request_arrives_at(prefill, decode, f"warm-{i}", [0], [1])
                assert decode.agent in agents_held(prefill)
                rid = f"cut-{i}"
                prefill.kv.write(PAGES, pattern(LAYOUT, rid, len(PAGES)))
                await decode.command(op="expect", rid=rid, pages=PAGES, sender=prefill.address)
                await decode.event("expecting", rid)
                handle = await prefill.send(rid, PAGES, last=True)
                if kill:  # mid-copy: its WRITEs in flight are drained, then it is unloaded
                    decode.signal(signal.SIGKILL)
                with anyio.fail_after(SETTLE_GUARD_S):
                    sent = await prefill.await_completion(handle)
                assert sent.ok or sent.reason in LOST, sent
                ended.append(decode.agent)
            # (the last one leaves with a Bye)
            with anyio.fail_after(3 * SETTLE_GUARD_S):
                await eventually(lambda: not agents_held(prefill) & set(ended), timeout=2 * SETTLE_GUARD_S,
                                 what=lambda: f"held {agents_held(prefill) & set(ended)} of ended {ended}")
        tables = service_tables(prefill)
        assert all(tables[name]["size"] == 0 for name in PER_AGENT), tables
        assert tables["nixl_remote_agents"]["size"] == 0 and tables["nixl_live_handles"]["size"] == 0, tables
        assert prefill.status()["peers"] == []


async def test_a_decode_lost_alive_then_killed_before_it_links_again_is_forgotten(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The prefill loses its link to a decode that lives on (stopped past ``peer_timeout_s``):
    it keeps the decode's agent loaded, probes, and finds it alive.  The decode is then
    SIGKILLed before any request links it again, so no link is lost to say so: the prefill's
    slower probes, while it keeps that agent, find its address refusing and forget it.  (It
    used to stop probing at the first answer: the dead agent and its connection's file stayed
    until evicted by the bound, one more for each such decode in the long soak.)"""
    monkeypatch.setattr(departures, "GONE_PROBES", 2)
    monkeypatch.setattr(departures, "GONE_WATCH_S", 0.5)
    cfg = config(LAYOUT, ucx_env=TCP, **{**PREFILL, "peer_timeout_s": 1.0})
    async with TransferService(cfg) as prefill:
        async with peers(peer_config(LAYOUT, ucx_env=TCP, **FAST), env=TCP) as (decode,):
            await new_request_arrives_at(prefill, decode, "warm", [0], [1])
            with structlog.testing.capture_logs() as logs:
                decode.signal(signal.SIGSTOP)
                try:
                    await eventually(lambda: prefill.status()["peers"] == [], timeout=SETTLE_GUARD_S,
                                     what="the prefill losing the stopped decode")
                finally:
                    decode.signal(signal.SIGCONT)
                await eventually(lambda: any(e["event"] == "peer.gone_probe_alive" for e in logs),
                                 timeout=SETTLE_GUARD_S, what="a probe finding the decode alive")
            assert decode.agent in agents_held(prefill)  # alive: kept
            decode.signal(signal.SIGKILL)
            with anyio.fail_after(SETTLE_GUARD_S):
                await eventually(lambda: decode.agent not in agents_held(prefill), timeout=SETTLE_GUARD_S,
                                 what=lambda: f"held {agents_held(prefill)}")
        tables = service_tables(prefill)
        assert tables["nixl_kept_agents"]["size"] == 0 and tables["nixl_remote_agents"]["size"] == 0, tables


async def test_a_decode_lost_and_not_kept_is_still_watched_until_it_is_gone(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """As above, but the prefill's door keeps no agent after a lost link (its bound reached,
    or NIXL reported the endpoint disconnected, as a network cut makes it): the decode, stopped,
    answers no early probe, and is SIGKILLed only after them.  The slow probes go on while the
    prefill remembers the agent anywhere, find its address refusing, and forget it.  (They
    used to stop with the door's keeping: a decode cut off, then killed while cut off, stayed
    in the per-agent tables until evicted, the long soak's slow creep of them.)"""
    monkeypatch.setattr(departures, "GONE_PROBES", 2)
    monkeypatch.setattr(departures, "GONE_WATCH_S", 0.5)
    monkeypatch.setattr(nixl_door, "KEPT_MAX", 0)
    cfg = config(LAYOUT, ucx_env=TCP, **{**PREFILL, "peer_timeout_s": 1.0, "connect_timeout_s": 1.0})
    async with TransferService(cfg) as prefill:
        async with peers(peer_config(LAYOUT, ucx_env=TCP, **FAST), env=TCP) as (decode,):
            await new_request_arrives_at(prefill, decode, "warm", [0], [1])
            with structlog.testing.capture_logs() as logs:
                decode.signal(signal.SIGSTOP)
                await eventually(lambda: prefill.status()["peers"] == [], timeout=SETTLE_GUARD_S,
                                 what="the prefill losing the stopped decode")
                await eventually(
                    lambda: sum(e["event"] == "peer.gone_probe_failed" for e in logs) >= departures.GONE_PROBES,
                    timeout=3 * SETTLE_GUARD_S, what="the early probes, unanswered")
            held, tables = agents_held(prefill), service_tables(prefill)
            assert decode.agent in held and tables["nixl_kept_agents"]["size"] == 0, (held, tables)
            decode.signal(signal.SIGKILL)
            with anyio.fail_after(SETTLE_GUARD_S):
                await eventually(lambda: decode.agent not in agents_held(prefill), timeout=SETTLE_GUARD_S,
                                 what=lambda: f"held {agents_held(prefill)}")
        tables = service_tables(prefill)
        assert all(tables[name]["size"] == 0 for name in PER_AGENT), tables


async def claim_listener(handler: Callable[[anyio.abc.SocketStream], Awaitable[None]], *,
                         task_status: anyio.abc.TaskStatus[tuple[str, anyio.CancelScope]]) -> None:
    """What listens at the address a peer claims, serving each connection (a probe) with
    ``handler``; starts with that address and the scope that closes the listener."""
    async with await anyio.create_tcp_listener(local_host="127.0.0.1") as listener:
        with anyio.CancelScope() as scope:
            task_status.started((f"127.0.0.1:{listener.extra(anyio.abc.SocketAttribute.local_port)}", scope))
            await listener.serve(handler)


async def test_a_peer_lost_before_its_address_was_proven_is_probed_where_it_claimed_to_be(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A peer that dialled the service is proven at the address it claims by a probe there;
    its link is lost while that probe still runs (the soak's decodes killed, or cut off, just
    after linking).  Proven nowhere, it used to be probed nowhere and never forgotten (the
    long soak's notification keys crept up by such agents): it is probed where it claimed to
    be, found refusing once its listener is gone, and forgotten."""
    monkeypatch.setattr(departures, "GONE_PROBES", 2)
    monkeypatch.setattr(departures, "GONE_WATCH_S", 0.5)
    accepted = 0
    release = anyio.Event()

    async def hold(stream: anyio.abc.SocketStream) -> None:  # answers no probe while open
        nonlocal accepted
        accepted += 1
        async with stream:
            await release.wait()

    agent = "kv-claims"
    async with anyio.create_task_group() as tg:
        claimed, listening = await tg.start(claim_listener, hold)
        async with nixl_agent(agent) as join, TransferService(hostile_config(connect_timeout_s=5.0)) as svc:
            raw = await authenticate(svc.address, key=own_key(), agent=agent, my_address=claimed)
            await raw.send(join)
            assert isinstance(await raw.recv(), Join)
            await eventually(lambda: accepted >= 1, what="the service's proof of the claimed address")
            await raw.stream.aclose()  # lost while that proof runs
            await eventually(lambda: svc.status()["peers"] == [], what="the link lost")
            assert agent in agents_held(svc)
            listening.cancel()  # its listener goes: the address refuses
            release.set()
            await eventually(lambda: agent not in agents_held(svc), timeout=SETTLE_GUARD_S,
                             what=lambda: f"held {agents_held(svc)}")


async def test_a_peer_whose_address_proof_failed_is_still_probed_where_it_claimed_to_be(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """As above, but the proof ends before the link does, unanswered: what listens at the
    claimed address hangs up at once (as a decode stopped or cut off while the probe ran lets
    it time out).  Nobody else answered there, so the claim is still the one place to look:
    it used to count as disproven, the lost peer was probed nowhere and never forgotten (the
    long soak's notification keys still crept up, about one agent in 80 restarts)."""
    monkeypatch.setattr(departures, "GONE_PROBES", 2)
    monkeypatch.setattr(departures, "GONE_WATCH_S", 0.5)
    accepted = 0

    async def hang_up(stream: anyio.abc.SocketStream) -> None:
        nonlocal accepted
        accepted += 1
        await stream.aclose()

    agent = "kv-claims-unanswered"
    async with anyio.create_task_group() as tg:
        claimed, listening = await tg.start(claim_listener, hang_up)
        async with nixl_agent(agent) as join, TransferService(hostile_config(connect_timeout_s=5.0)) as svc:
            with structlog.testing.capture_logs() as logs:
                raw = await authenticate(svc.address, key=own_key(), agent=agent, my_address=claimed)
                await raw.send(join)
                assert isinstance(await raw.recv(), Join)
                await eventually(lambda: any(e["event"] == "peer.address_unproven" for e in logs),
                                 timeout=SETTLE_GUARD_S, what="the proof of the claimed address, failed")
            assert accepted >= 1
            await raw.stream.aclose()  # lost after that proof ended
            await eventually(lambda: svc.status()["peers"] == [], what="the link lost")
            assert agent in agents_held(svc)
            listening.cancel()  # its listener goes: the address refuses
            await eventually(lambda: agent not in agents_held(svc), timeout=SETTLE_GUARD_S,
                             what=lambda: f"held {agents_held(svc)}")
