"""What one more linked peer costs a service: resident memory, file descriptors, threads,
TCP connections, NIXL metadata, measured as one service (the hub) links 1 to a few
hundred peers, each link carrying one request (so UCX has its endpoint).

    python -m benchmarks.peer_cost [--peers 1,2,4,8,16,32,64,128,256] [--per-child 32]

The hub runs in this process as a service runs in production: real NIXL over UCX on
loopback, its vetting child vetting every peer's metadata.  The peers are services in
child processes, several per process (``--per-child``), so that a few hundred fit on
one machine; they load the hub's metadata without a vetting child each (a door other
than the service's own, as the simulation does), which changes nothing on the hub.

The hub's pool is written through before the first reading, so that the peers' WRITEs land
in pages already resident.  At each step the hub expects one request from each new peer (it dials, handshakes,
vets and loads the peer's metadata into its NIXL agent), the peer sends it (two pages,
verified on arrival), and the hub is read: /proc (RSS, fds, threads, established TCP)
and its tables (linked peers, NIXL remote agents).  The table prints each step and the
cost per peer since the first, the figure to size a fleet by.  Measures, asserts
nothing.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import subprocess
import sys
from typing import Any

import anyio
import anyio.abc
import anyio.streams.text
import torch

from kvservice import KVLayout, ServiceConfig, TransferService
from kvservice._nixl.agent import NixlDoor
from kvservice._runtime import run
from kvservice.soak._probe import service_tables
from kvservice.soak._usage import established, usage
from kvservice.testing import pattern

UCX = {"UCX_NET_DEVICES": "lo"}
PEER_LAYOUT = KVLayout(layers=2, page_tokens=16, kv_heads=2, head_dim=64, dtype="bfloat16", num_pages=4)
GUARD_S = 300.0  # a hang guard on each step, not a measurement
#: every service's deadlines, long: a machine loaded by hundreds of services must not lose links
#: to late heartbeats or slow dials (a lost link would leave the table short of peers)
PATIENT: dict[str, Any] = {"ucx_env": UCX, "drain_grace_s": 0.5, "connect_timeout_s": 60.0,
                           "peer_timeout_s": 120.0, "bootstrap_timeout_s": 120.0, "arrival_timeout_s": 120.0,
                           "transfer_timeout_s": 120.0}
TRIES = 3  # a link that fails anyway (a dial timed out) is tried again


def _door(agent_name: str, config: ServiceConfig) -> NixlDoor:
    return NixlDoor(agent_name, progress_thread=config.progress_thread, ucx_env=config.ucx_environment)


# -- the peers' side: a child process holding ``n`` services --------------------------------
async def child(n: int, first: int) -> None:
    """Start ``n`` peer services (numbered from ``first``), print their addresses and the
    size of one's NIXL metadata; on each stdin line ``send I A`` peer I sends request
    ``p<I>.<A>`` (pages 0-1, the pattern of ``p<I>``) and prints its result; EOF ends them all."""
    async with contextlib.AsyncExitStack() as stack:
        services: dict[int, TransferService] = {}
        for i in range(first, first + n):
            cfg = ServiceConfig(layout=PEER_LAYOUT, **PATIENT)
            svc = await stack.enter_async_context(TransferService(cfg, door_factory=_door))
            svc.kv.write([0, 1], pattern(PEER_LAYOUT, f"p{i}", 2))
            services[i] = svc
        some = next(iter(services.values()))
        md = len(await some._thread.call(some._door.metadata))  # type: ignore[union-attr]
        print(json.dumps({"addresses": {i: s.address for i, s in services.items()}, "metadata_bytes": md}),
              flush=True)
        async with anyio.create_task_group() as tg:
            async def send(i: int, attempt: int) -> None:
                handle = await services[i].send(f"p{i}.{attempt}", [0, 1], last=True)
                result = await services[i].await_completion(handle, timeout=GUARD_S)
                print(json.dumps({"sent": i, "ok": result.ok, "reason": str(result.reason)}), flush=True)

            stdin = anyio.wrap_file(sys.stdin)
            async for line in stdin:
                words = line.split()
                if words and words[0] == "send":
                    tg.start_soon(send, int(words[1]), int(words[2]))
            tg.cancel_scope.cancel()


# -- the hub's side -----------------------------------------------------------------------------
class Children:
    """The peer processes, started as more peers are needed."""

    def __init__(self, per_child: int) -> None:
        self.per_child = per_child
        self.procs: list[anyio.abc.Process] = []
        self.lines: list[anyio.streams.text.TextReceiveStream] = []
        self.buffers: list[str] = []
        self.addresses: dict[int, tuple[int, str]] = {}  # peer -> (its child, its address)
        self.metadata_bytes = 0

    async def start(self, n: int) -> None:
        first = len(self.addresses)
        proc = await anyio.open_process(
            [sys.executable, "-m", "benchmarks.peer_cost", "--child", f"{n},{first}"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=None, env=dict(os.environ))
        assert proc.stdout is not None
        self.procs.append(proc)
        self.lines.append(anyio.streams.text.TextReceiveStream(proc.stdout))
        self.buffers.append("")
        ready = await self.line(len(self.procs) - 1)
        self.metadata_bytes = int(ready["metadata_bytes"])
        for i, addr in ready["addresses"].items():
            self.addresses[int(i)] = (len(self.procs) - 1, addr)

    async def ensure(self, n: int) -> None:
        while len(self.addresses) < n:
            await self.start(min(self.per_child, n - len(self.addresses)))

    async def line(self, k: int) -> dict[str, Any]:
        with anyio.fail_after(GUARD_S):
            while "\n" not in self.buffers[k]:
                self.buffers[k] += await self.lines[k].receive()
        text, self.buffers[k] = self.buffers[k].split("\n", 1)
        return json.loads(text)  # type: ignore[no-any-return]

    async def send(self, i: int, attempt: int) -> None:
        k, _ = self.addresses[i]
        stdin = self.procs[k].stdin
        assert stdin is not None
        await stdin.send(f"send {i} {attempt}\n".encode())

    async def close(self) -> None:
        for proc in self.procs:
            if proc.stdin is not None:
                await proc.stdin.aclose()
        with anyio.move_on_after(60):
            for proc in self.procs:
                await proc.wait()
        for proc in self.procs:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()


def reading(hub: TransferService) -> dict[str, float]:
    tables = service_tables(hub)
    got: dict[str, float] = dict(usage(os.getpid(), established()))
    got["peers"] = float(tables["peers"]["size"] or 0)
    got["nixl_remote_agents"] = float(tables["nixl_remote_agents"]["size"] or 0)
    return got


async def link(hub: TransferService, peers: Children, lo: int, hi: int) -> None:
    """Peers ``lo``..``hi - 1``: the hub expects each one's request, each sends it, every
    byte is checked; a request that fails is tried again (a new request id), ``TRIES`` in all."""
    todo = list(range(lo, hi))
    for attempt in range(TRIES):
        for i in todo:
            _, addr = peers.addresses[i]
            await hub.expect(f"p{i}.{attempt}", [2 * i, 2 * i + 1], sender=addr, timeout=GUARD_S)
            await peers.send(i, attempt)
        failed = []
        for i in todo:
            got = await hub.await_arrival(f"p{i}.{attempt}", timeout=GUARD_S)
            if not got.ok:
                failed.append(i)
            elif not torch.equal(hub.kv.pages([2 * i, 2 * i + 1]), pattern(hub.kv.layout, f"p{i}", 2)):
                raise SystemExit(f"peer {i}: the bytes differ")
        needed = collections.Counter(peers.addresses[i][0] for i in todo)
        for k, count in sorted(needed.items()):  # each sender's own result, so none is left mid-send
            for _ in range(count):
                await peers.line(k)
        if not failed:
            return
        print(f"{len(failed)} links failed, trying again: {failed}", file=sys.stderr, flush=True)
        todo = failed
    raise SystemExit(f"peers {todo} could not be linked in {TRIES} tries")


async def main(steps: list[int], per_child: int) -> None:
    hub_layout = KVLayout(layers=2, page_tokens=16, kv_heads=2, head_dim=64, dtype="bfloat16",
                          num_pages=2 * steps[-1])
    peers = Children(per_child)
    rows: list[tuple[int, dict[str, float]]] = []
    try:
        async with TransferService(ServiceConfig(layout=hub_layout, **PATIENT)) as hub:
            vetter = getattr(hub, "_vetter", None)
            if vetter is not None:
                await vetter.ready()  # its own process: counted once, before the first peer
            # every page of the pool resident before the first reading: the peers' WRITEs then
            # land in memory already counted, and what grows is what the links cost
            everything = list(range(hub_layout.num_pages))
            hub.kv.write(everything, pattern(hub_layout, "resident", len(everything)))
            rows.append((0, reading(hub)))
            linked = 0
            for n in steps:
                await peers.ensure(n)
                await link(hub, peers, linked, n)
                linked = n
                rows.append((n, reading(hub)))
                print(f"linked {n} peers", file=sys.stderr, flush=True)
    finally:
        await peers.close()
        print(table(rows, peers.metadata_bytes))  # what was measured, even when a step failed


def table(rows: list[tuple[int, dict[str, float]]], metadata_bytes: int) -> str:
    base = next(r for n, r in rows if n == 1) if any(n == 1 for n, _ in rows) else rows[0][1]
    head = ("peers", "RSS MiB", "fds", "threads", "TCP", "NIXL agents", "NIXL md KiB",
            "RSS KiB/peer", "fds/peer", "TCP/peer")
    out = [head]
    for n, r in rows:
        k = max(n - 1, 1)
        out.append((str(n), f"{r['rss_mib']:.0f}", f"{r['fds']:.0f}", f"{r['threads']:.0f}", f"{r['tcp']:.0f}",
                    f"{r['nixl_remote_agents']:.0f}", f"{n * metadata_bytes / 1024:.0f}",
                    "-" if n <= 1 else f"{(r['rss_mib'] - base['rss_mib']) * 1024 / k:.0f}",
                    "-" if n <= 1 else f"{(r['fds'] - base['fds']) / k:.2f}",
                    "-" if n <= 1 else f"{(r['tcp'] - base['tcp']) / k:.2f}"))
    widths = [max(len(row[c]) for row in out) for c in range(len(head))]
    lines = [" | ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)) for row in out]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return (f"one peer's NIXL metadata: {metadata_bytes} bytes; per-peer columns: change since 1 peer, "
            f"divided by the peers added\n" + "\n".join(lines))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", default="1,2,4,8,16,32,64,128,256",
                        help="the peer counts to measure at, ascending (default 1,2,4,8,16,32,64,128,256)")
    parser.add_argument("--per-child", type=int, default=32, help="peer services per child process (default 32)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        n, first = (int(x) for x in args.child.split(","))
        run(child, n, first)
    else:
        counts = sorted({int(x) for x in args.peers.split(",")})
        if not counts or counts[0] < 1 or args.per_child < 1:
            parser.error("--peers: counts >= 1; --per-child >= 1")
        run(main, counts, args.per_child)
