"""A broken transport between two live services heals without a restart.

Two services in two network namespaces joined by a veth (``two_hosts``), KV over UCX's
TCP transport.  The faults land on the data path while both processes stay alive:

* **an endpoint killed under UCX** (at either end): every TCP connection UCX holds between the two
  hosts is destroyed in the kernel (``ss -K``: the socket is aborted and the peer gets a
  RST), the control link's connection spared.  NIXL then fails the WRITEs in flight
  with ``nixlRemoteDisconnectError``, the error one vLLM deployment saw on every decode
  at once with its prefill healthy.  The sender fails them ``REMOTE_DISCONNECT`` with
  NIXL's error kept, drops the link, and the next request makes a new one (a second
  handshake, the peer's metadata loaded afresh, a new UCX endpoint).
* **a short cut** (the veth down for less than ``peer_timeout_s``), **a flapping link**
  (down 150 ms of every 500 ms for 3 s: loss in bursts) and **packet loss** (``netem loss
  30%`` for 3 s, where the kernel has ``sch_netem``): no link need be lost; each request
  ends either byte-exact or failed with a reason; traffic flows afterwards.

A cut longer than ``peer_timeout_s`` is ``test_network_cut``'s.  Every wait is bounded;
every namespace is removed (the ``link`` fixture checks it).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import anyio
import pytest

from kvservice.testing import PeerProcess
from tests.faults import netns
from tests.faults.netns import NetnsError, Wire
from tests.faults.two_hosts import (
    LAYOUT,
    counters,
    handshakes,
    move,
    services,
    start_requests,
    status,
    until,
)

#: the requests a fault lands on: 4 x 48 pages (24 MiB) through a 64 Mbit/s egress, ~3 s uncut
REQUESTS = 4
PAGES = 48
SHAPED_RATE = "64mbit"
#: hang guard for a request hit by a fault; slack for a loaded 2-core machine, not a speed claim
GUARD_S = 30.0
#: requests moved after each fault, byte-exact
AFTER = 4


def _port(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


def _requests(tag: str, base: int = 0) -> tuple[list[str], list[list[int]], list[list[int]]]:
    rids = [f"{tag}{i}" for i in range(REQUESTS)]
    src = [list(range(PAGES * i, PAGES * (i + 1))) for i in range(REQUESTS)]
    dst = [list(range(LAYOUT.num_pages - base - PAGES * (i + 1), LAYOUT.num_pages - base - PAGES * i))
           for i in range(REQUESTS)]
    return rids, src, dst


async def _in_flight(w: Wire, decode: PeerProcess, prefill: PeerProcess, tag: str) -> list[str]:
    """Link the two, then start ``REQUESTS`` large requests copying slowly; returns their ids
    once every one is posted (none can finish in under ~3 s)."""
    await move(decode, prefill, [f"warm-{tag}"], [[0]], [[1]])
    w.shape(w.b, SHAPED_RATE)
    rids, src, dst = _requests(tag)
    await start_requests(decode, prefill, rids, src, dst)
    await until(prefill, lambda s: s["inflight_handles"] == REQUESTS, timeout=10)
    return rids


async def _ends(decode: PeerProcess, prefill: PeerProcess, rids: list[str]) -> dict[str, dict[str, Any]]:
    ended: dict[str, dict[str, Any]] = {}
    with anyio.fail_after(GUARD_S):  # hang guard
        for rid in rids:
            ended[f"send {rid}"] = await prefill.event("completed", rid, timeout=GUARD_S)
            ended[f"recv {rid}"] = await decode.event("arrived", rid, timeout=GUARD_S)
    return ended


async def _after(decode: PeerProcess, prefill: PeerProcess, tag: str) -> None:
    """``AFTER`` new requests between the same two processes, byte-exact, into pages no
    request hit by the fault used (a late WRITE of those could land there)."""
    rids = [f"{tag}{i}" for i in range(AFTER)]
    src = [list(range(8 * i, 8 * i + 8)) for i in range(AFTER)]
    dst = [list(range(64 + 8 * i, 64 + 8 * i + 8)) for i in range(AFTER)]
    with anyio.fail_after(60):
        await move(decode, prefill, rids, src, dst)


async def _clean(p: PeerProcess) -> dict[str, Any]:
    """No handle, request or early expect is left once the requests ended."""
    st = await until(p, lambda s: s["live_nixl_handles"] == 0 and s["inflight_handles"] == 0
                     and s["sending"] == 0 and s["receiving"] == 0, timeout=15)
    assert st["expects_before_send"] == 0, st
    return st


def _kill_ucx_endpoints(w: Wire, decode: PeerProcess, prefill: PeerProcess, at: str = "prefill") -> list[str]:
    """Abort every TCP connection between the hosts, in the namespace of the service ``at``,
    but the control link's (one end of it is a service's listening port); the other end gets
    a RST.  Returns the connections killed."""
    here, there = (w.b, w.a) if at == "prefill" else (w.a, w.b)
    mine, theirs = (prefill, decode) if at == "prefill" else (decode, prefill)
    spare = f"dport != :{_port(theirs.address)} and sport != :{_port(mine.address)}"
    out = netns._run("ip", "netns", "exec", here.netns, "ss", "-K", "-tnH", "dst", there.ip, "and", *spare.split())
    return [line for line in out.splitlines() if line.strip()]


# -- an endpoint killed under UCX -----------------------------------------------------------


@pytest.mark.nixl
@pytest.mark.slow
@pytest.mark.parametrize("at", ["prefill", "decode"])
async def test_killed_ucx_endpoint_fails_in_flight_then_relinks(
        link: Wire, key_file: str, tmp_path: Path, at: str) -> None:
    async with services(link, key_file, logs=tmp_path) as (decode, prefill):
        rids = await _in_flight(link, decode, prefill, "ep")
        assert handshakes(tmp_path, link.b, decode.agent) == handshakes(tmp_path, link.a, prefill.agent) == [1]
        killed = _kill_ucx_endpoints(link, decode, prefill, at)
        assert killed, "no UCX connection between the hosts to kill"
        print(f"\nkilled {len(killed)} UCX connection(s): {killed}")
        killed_at = time.monotonic()

        ended = await _ends(decode, prefill, rids)
        print({side: (ev["reason"], ev["error_type"], round(ev["_t"] - killed_at, 2)) for side, ev in ended.items()})
        for side, ev in ended.items():
            assert ev["status"] == "FAILED" and ev["message"], (side, ev)
        sends = [ev for side, ev in ended.items() if side.startswith("send")]
        # The sender's own NIXL reported it: its reason and its error, kept.
        assert any(ev["reason"] == "REMOTE_DISCONNECT" and ev["error_type"] == "nixlRemoteDisconnectError"
                   for ev in sends), sends
        for ev in sends:  # the first NIXL reported; the rest failed with it (PEER_LOST), telling why
            assert ev["reason"] in ("REMOTE_DISCONNECT", "PEER_LOST") and ev["error_type"], ev
        sends_reason = {side.removeprefix("send "): ev["reason"] for side, ev in ended.items()
                        if side.startswith("send")}
        for side, ev in ended.items():
            if side.startswith("recv"):  # the sender told it why before it dropped the link
                assert ev["reason"] == sends_reason[side.removeprefix("recv ")], (side, ev)
                assert "nixlRemoteDisconnectError" in ev["message"], (side, ev)

        link.unshape(link.b)
        await _after(decode, prefill, "ep-after")
        # Neither process restarted; each made a second link to the same other agent.
        assert len(handshakes(tmp_path, link.b, decode.agent)) == 2
        assert len(handshakes(tmp_path, link.a, prefill.agent)) == 2
        for p, other, side in ((decode, prefill, "recv"), (prefill, decode, "send")):
            st = await _clean(p)
            assert st["peers"] == [other.address], st
            assert st["outcomes"].get(f"{side}.SUCCESS") == 1 + AFTER, st
            assert sum(st["outcomes"].values()) == 1 + AFTER + REQUESTS, st  # each request ended once
            assert st["refused"] == {}, st
            print(f"{side} side after the heal: {counters(st)}")


@pytest.mark.nixl
@pytest.mark.slow
async def test_endpoint_killed_while_idle_costs_at_most_one_request(
        link: Wire, key_file: str, tmp_path: Path) -> None:
    """Nothing in flight when UCX's connections die: the next request meets the broken
    endpoint (NIXL keeps it) and fails saying so, or UCX reconnects under it; either way
    the requests after it pass byte-exact over a link made again if one was lost."""
    async with services(link, key_file, logs=tmp_path) as (decode, prefill):
        await move(decode, prefill, ["idle-warm"], [[0]], [[1]])
        assert _kill_ucx_endpoints(link, decode, prefill), "no UCX connection between the hosts to kill"
        for p in (decode, prefill):  # both loops tick on, neither process noticed anything
            await status(p, timeout=5)
        ended = []
        with anyio.fail_after(GUARD_S):
            for i in range(3):
                rid = f"idle{i}"
                await start_requests(decode, prefill, [rid], [[8 + i]], [[100 + i]])
                ended.append((await prefill.event("completed", rid), await decode.event("arrived", rid)))
        print(f"\nafter an idle kill: {[(s['reason'] or 'SUCCESS', r['reason'] or 'SUCCESS') for s, r in ended]}")
        failed = [pair for pair in ended if pair[0]["status"] != "SUCCESS" or pair[1]["status"] != "SUCCESS"]
        assert len(failed) <= 1, failed
        for sent, arrived in failed:
            assert sent["reason"] == "REMOTE_DISCONNECT" and sent["error_type"] == "nixlRemoteDisconnectError", sent
            assert arrived["reason"] == "REMOTE_DISCONNECT" and arrived["message"], arrived
        assert ended[-1][1]["verified"] is True
        await _after(decode, prefill, "idle-after")
        made = len(handshakes(tmp_path, link.b, decode.agent))
        assert made == 1 + len(failed), made  # a new link for the one that failed, if any
        for p in (decode, prefill):
            await _clean(p)


@pytest.mark.nixl
@pytest.mark.slow
async def test_killed_control_connection_with_ucx_intact_relinks(link: Wire, key_file: str, tmp_path: Path) -> None:
    """The converse: the control link's TCP connection aborted (``ss -K``), UCX's left alone.
    The link is the authority on its requests: those in flight fail ``PEER_LOST`` on both
    sides with the connection's error, though their WRITEs may still complete (the sender
    drains them before the peer is loaded again); the next requests link again and pass."""
    async with services(link, key_file, logs=tmp_path) as (decode, prefill):
        rids = await _in_flight(link, decode, prefill, "ctl")
        control = f"( dport = :{_port(decode.address)} or sport = :{_port(prefill.address)} )"
        out = netns._run("ip", "netns", "exec", link.b.netns, "ss", "-K", "-tnH", "dst", link.a.ip, "and",
                         *control.split())
        killed = [line for line in out.splitlines() if line.strip()]
        assert len(killed) == 1, killed
        ended = await _ends(decode, prefill, rids)
        for side, ev in ended.items():
            assert ev["status"] == "FAILED" and ev["reason"] == "PEER_LOST", (side, ev)
            assert ev["message"] and ev["error_type"], (side, ev)
        link.unshape(link.b)
        await _after(decode, prefill, "ctl-after")
        assert len(handshakes(tmp_path, link.b, decode.agent)) == 2
        assert len(handshakes(tmp_path, link.a, prefill.agent)) == 2
        for p, side in ((decode, "recv"), (prefill, "send")):
            st = await _clean(p)
            assert st["outcomes"] == {f"{side}.SUCCESS": 1 + AFTER, f"{side}.PEER_LOST": REQUESTS}, st
            assert st["refused"] == {}, st


# -- a short cut, packet loss ----------------------------------------------------------------


def _short_cut(w: Wire, seconds: float) -> None:
    w.link_down(w.b)
    time.sleep(seconds)
    w.link_up(w.b)
    for h in (w.a, w.b):  # neighbour entries the cut left FAILED
        h.ip_cmd("neigh", "flush", "dev", h.dev)


def _flapping(w: Wire, seconds: float, down: float, period: float) -> None:
    """Bursts of loss where the kernel has no ``sch_netem``: the veth down ``down`` s of
    every ``period`` s, for ``seconds``."""
    for _ in range(round(seconds / period)):
        _short_cut(w, down)
        time.sleep(period - down)


def _lossy(w: Wire, seconds: float, loss: str) -> None:
    w.b.tc("qdisc", "replace", "dev", w.b.dev, "root", "netem", "loss", loss)
    time.sleep(seconds)
    w.unshape(w.b)


def _require_netem(w: Wire) -> None:
    """Skip, saying why, where the kernel has no ``sch_netem`` (the flapping case runs there)."""
    try:
        w.b.tc("qdisc", "replace", "dev", w.b.dev, "root", "netem", "loss", "0%")
    except NetnsError as exc:
        pytest.skip(f"sch_netem is missing: {exc}")
    w.unshape(w.b)


#: a peer_timeout_s well above the faults below: no link may be lost to them
PATIENT_TIMEOUT_S = 8.0


@pytest.mark.nixl
@pytest.mark.slow
@pytest.mark.parametrize("fault", ["short_cut", "flapping", "loss_30"])
async def test_brief_fault_ends_every_request_then_traffic_flows(
        link: Wire, key_file: str, tmp_path: Path, fault: str) -> None:
    if fault == "loss_30":
        _require_netem(link)
    async with services(link, key_file, logs=tmp_path, peer_timeout_s=PATIENT_TIMEOUT_S) as (decode, prefill):
        rids = await _in_flight(link, decode, prefill, "brief")
        link.unshape(link.b)  # the fault alone slows them now
        if fault == "short_cut":
            await anyio.to_thread.run_sync(_short_cut, link, 1.0)
        elif fault == "flapping":
            await anyio.to_thread.run_sync(_flapping, link, 3.0, 0.15, 0.5)
        else:
            await anyio.to_thread.run_sync(_lossy, link, 3.0, "30%")
        # The loops kept ticking through it: both answer at once.
        for p in (decode, prefill):
            await status(p, timeout=5)
        ended = await _ends(decode, prefill, rids)
        for side, ev in ended.items():
            if ev["status"] == "SUCCESS":
                assert side.startswith("send") or ev["verified"] is True, (side, ev)
            else:
                assert ev["reason"] and ev["message"], (side, ev)
        outcome = {side: ev["reason"] or "SUCCESS" for side, ev in ended.items()}
        print(f"\n{fault}: {outcome}")
        await _after(decode, prefill, "brief-after")
        # Shorter than peer_timeout_s: the link held through it, nothing was made again.
        assert handshakes(tmp_path, link.b, decode.agent) == handshakes(tmp_path, link.a, prefill.agent) == [1]
        for p, side in ((decode, "recv"), (prefill, "send")):
            st = await _clean(p)
            assert st["outcomes"].get(f"{side}.SUCCESS", 0) >= 1 + AFTER, st
            print(f"{side} side: {counters(st)}")
