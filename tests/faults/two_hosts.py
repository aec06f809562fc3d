"""Two services on two "hosts": one ``kvservice.testing.peer`` child in each namespace of a
``netns.Wire``, and how a test drives and reads them.

Each child is started inside its namespace (``ip netns exec NS python -m
kvservice.testing.peer``), bound to that namespace's veth address with a shared key
file (``auth_key_file``, as a real deployment binds a non-loopback address), and moves
KV over UCX's TCP transport on that veth only.  The test process drives both through
their stdin/stdout and never touches the network.  With ``logs`` given, each child logs
at info level as JSON lines into a file there, which ``handshakes`` reads back: how many
links a service made, and with whom.
"""

from __future__ import annotations

import contextlib
import itertools
import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import anyio
import anyio.abc

from kvservice import KVLayout
from kvservice.testing import PeerProcess
from tests.faults.netns import Host, Wire
from tests.helpers import READY_S, eventually, peer_config

# 128 KiB pages, 512 of them (64 MiB) per service.
LAYOUT = KVLayout(layers=2, page_tokens=16, kv_heads=8, head_dim=128, dtype="bfloat16", num_pages=512)
PEER_TIMEOUT_S = 2.0
HEARTBEAT_S = 0.5


def service_config(host: Host, key_file: str, **overrides: Any) -> dict[str, Any]:
    settings: dict[str, Any] = {
        "peer_timeout_s": PEER_TIMEOUT_S, "heartbeat_interval_s": HEARTBEAT_S,
        "transfer_timeout_s": 60.0, "arrival_timeout_s": 60.0, "drain_grace_s": 0.5, **overrides}
    return peer_config(LAYOUT, host=host.ip, auth_key_file=key_file, ucx_env=host.ucx_env, **settings)


@contextlib.asynccontextmanager
async def services(w: Wire, key_file: str, logs: Path | None = None,
                   **overrides: Any) -> AsyncIterator[tuple[PeerProcess, PeerProcess]]:
    """A decode service in ``w.a`` and a prefill service in ``w.b`` (``overrides``: settings
    of both).  Both must exit cleanly (status 0) when the block ends normally; they are
    killed if it fails.  ``logs``: a folder for their logs (``log_of``)."""
    async with anyio.create_task_group() as tg, contextlib.AsyncExitStack() as files:
        started: dict[str, PeerProcess] = {}

        async def start(host: Host) -> None:
            env = dict(host.ucx_env)
            stderr = None
            if logs is not None:
                env["KVSERVICE_LOG_LEVEL"] = "info"
                stderr = files.enter_context(log_of(logs, host).open("ab"))
            started[host.netns] = await PeerProcess.start(
                tg, service_config(host, key_file, **overrides), env=env, prefix=host.prefix,
                ready_timeout=READY_S, stderr=stderr)

        try:
            async with anyio.create_task_group() as starting:  # the two start-ups overlap
                for host in (w.a, w.b):
                    starting.start_soon(start, host)
            yield started[w.a.netns], started[w.b.netns]
            codes = [await p.stop(timeout=10) for p in started.values()]
            assert codes == [0, 0], f"exit statuses {codes}"
        finally:
            with anyio.CancelScope(shield=True):
                for p in started.values():
                    await p.stop(timeout=5)
            tg.cancel_scope.cancel()


def log_of(logs: Path, host: Host) -> Path:
    return logs / f"{host.netns}.log"


def handshakes(logs: Path, host: Host, agent: str) -> list[int]:
    """The generations of the links the service on ``host`` made with ``agent`` so far
    (its ``peer.connected`` events), oldest first."""
    made = []
    for line in log_of(logs, host).read_text(errors="replace").splitlines():
        try:
            ev = json.loads(line)
        except ValueError:  # a native library's own line
            continue
        if isinstance(ev, dict) and ev.get("event") == "peer.connected" and ev.get("agent") == agent:
            made.append(int(ev["generation"]))
    return made


_ids = itertools.count(1)


async def status(peer: PeerProcess, timeout: float = 10.0) -> dict[str, Any]:
    """The child's ``svc.status()``; a child that is gone or does not answer fails the test."""
    assert peer.proc.returncode is None, f"peer {peer.pid} exited ({peer.proc.returncode})"
    i = next(_ids)
    await peer.command(op="status", id=i)
    return await peer.wait_for(lambda e: e["event"] == "status" and e.get("id") == i, timeout=timeout)


async def until(peer: PeerProcess, pred: Callable[[dict[str, Any]], bool], timeout: float) -> dict[str, Any]:
    """Poll ``status`` every 50 ms until ``pred`` holds, for at most ``timeout``."""
    last: dict[str, Any] = {}

    async def reached() -> bool:
        nonlocal last
        last = await status(peer)
        return pred(last)

    await eventually(reached, timeout, 0.05, what=lambda: f"peer {peer.pid}: condition (last status {last})")
    return last


async def start_requests(decode: PeerProcess, prefill: PeerProcess, rids: list[str], src: list[list[int]],
                         dst: list[list[int]]) -> None:
    """Fill, expect and send each request (their results come as events)."""
    for rid, s in zip(rids, src, strict=True):
        await prefill.command(op="fill", rid=rid, pages=s)
        await prefill.event("filled", rid)
    for rid, d in zip(rids, dst, strict=True):
        await decode.command(op="expect", rid=rid, pages=d, sender=prefill.address)
        await decode.event("expecting", rid)
    for rid, s in zip(rids, src, strict=True):
        await prefill.command(op="send", rid=rid, pages=s, last=True)


async def move(decode: PeerProcess, prefill: PeerProcess, rids: list[str], src: list[list[int]],
               dst: list[list[int]], timeout: float = 30.0) -> None:
    """Every request succeeds on both sides and arrives byte-exact."""
    await start_requests(decode, prefill, rids, src, dst)
    for rid in rids:
        completed = await prefill.event("completed", rid, timeout=timeout)
        assert completed["status"] == "SUCCESS", completed
        arrived = await decode.event("arrived", rid, timeout=timeout)
        assert arrived["status"] == "SUCCESS" and arrived["verified"] is True, arrived


def counters(st: dict[str, Any]) -> dict[str, Any]:
    return {k: st[k] for k in ("outcomes", "stale_notifs", "refused", "forced_releases", "peers")}
