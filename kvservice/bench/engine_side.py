"""One rank of an engine for the engine-memory cases: kvservice and raw NIXL over the same tensors.

``python -m kvservice.bench.engine_side send|recv CONFIG`` allocates the KV
tensors of one engine layout and tensor-parallel rank (``SyntheticKV`` of the
``EngineSpec`` in CONFIG), touches them once, and puts two NIXL agents on them:

* kvservice: a ``TransferService(config, memory=...)`` over those tensors;
* raw NIXL: an agent of its own that registers the same tensors and, per peer,
  prepares exactly the descriptor lists the service prepares (``pair(src, dst)``:
  the plain ``regions_table`` where whole pages move, else the pair's source and
  destination tables), and posts the index arrays the service's ``Indexer``
  gives, computed before the clock starts.

The raw loops (``make_prepped_xfer`` + ``transfer``, ``check_xfer_state`` to
``DONE``; the receiver drains ``get_new_notifs`` every 0.5 ms) are those of
``raw_nixl``; they run on a worker thread so that the service in the same
process keeps answering heartbeats, and nothing else runs meanwhile.  The
kvservice runs carry no loop-lag probe (``kv_side.Ticker`` records their GC pauses
only): its ticks would cost the sender's loop CPU that raw NIXL's runs do not pay.
Replies are JSON lines on stdout, as ``kv_side``'s.
"""

from __future__ import annotations

import base64
import collections
import json
import logging
import os
import sys
import time
from typing import Any

import anyio
import anyio.lowlevel
import anyio.to_thread
import numpy as np

from kvservice import ServiceConfig, TransferService
from kvservice.bench._lines import emit, take_stdout
from kvservice.bench.kv_side import RUN_TIMEOUT_S, Ticker, drive, freeze_startup_heap, quiet_logs
from kvservice.bench.raw_nixl import POLL_TIMEOUT_S, RECV_SLEEP_S, Post, closed_loop
from kvservice.memory import KVMemory, Region
from kvservice.memory._pairing import Indexer, Pair, pair
from kvservice.memory._regions import regions_table
from kvservice.memory.synthetic import EngineSpec, SyntheticKV


def memory_json(memory: KVMemory) -> dict[str, Any]:
    """What a peer's raw agent needs of this memory (as the service's handshake carries it)."""
    return {"num_pages": memory.num_pages, "tp_size": memory.tp_size, "tp_rank": memory.tp_rank,
            "regions": [[r.addr, r.page_stride, r.layer, r.kind, r.dtype, r.tokens, r.heads, r.head_dim,
                         r.order, r.device_id] for r in memory.regions]}


def memory_from_json(d: dict[str, Any]) -> KVMemory:
    regions = tuple(Region(*r) for r in d["regions"])
    return KVMemory(regions, int(d["num_pages"]), (), "DRAM", int(d["tp_size"]), int(d["tp_rank"]))


class RawAgent:
    """The raw-NIXL side of a rank: its own agent on the rank's tensors."""

    def __init__(self, role: str, memory: KVMemory) -> None:
        from nixl._api import nixl_agent, nixl_agent_config

        logging.getLogger("nixl").setLevel(logging.WARNING)
        self.memory = memory
        conf = nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False, backends=["UCX"])
        self.agent = nixl_agent(f"raw-eng-{role}-{os.getpid()}", conf)
        self.reg = self.agent.register_memory([(a, n, d, "") for a, n, d in memory.segments], "DRAM")
        self.plain = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", regions_table(memory.regions,
                                                                                 memory.num_pages), "DRAM")
        #: per peer (by the driver's index): (agent name, local dlist, remote dlist, indexer)
        self.peers: dict[int, tuple[str, Any, Any, Indexer]] = {}
        self.descriptors: dict[int, int] = {}

    def metadata(self) -> str:
        return base64.b64encode(bytes(self.agent.get_agent_metadata())).decode()

    def connect(self, peer: int, metadata: str, remote: dict[str, Any]) -> None:
        name = self.agent.add_remote_agent(base64.b64decode(metadata))
        name = name.decode() if isinstance(name, bytes) else str(name)
        p = pair(self.memory, memory_from_json(remote))
        if not isinstance(p, Pair):
            raise ValueError(f"raw: no pair with peer {peer}: {p}")
        local = self.plain if p.whole else self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", p.src_table(), "DRAM")
        dst = self.agent.prep_xfer_dlist(name, p.dst_table(), "DRAM")
        self.agent.make_connection(name)
        self.peers[peer] = (name, local, dst, Indexer(p))

    def run(self, requests: list[dict[str, Any]], concurrency: int) -> dict[str, Any]:
        """``raw_nixl.closed_loop`` over this rank's pairs: each request names its peer."""
        todo: collections.deque[Post] = collections.deque()
        ndesc = 0
        for r in requests:
            _, local, remote, indexer = self.peers[int(r["peer"])]
            lo, hi = r.get("layers") or (0, self.memory.layers)
            src, dst = indexer.indices(np.asarray(r["src"], dtype=np.int32), np.asarray(r["dst"], dtype=np.int32),
                                       lo, hi)
            ndesc += len(src)
            todo.append((local, src, remote, dst, r["rid"].encode()))
        start, end, lat = closed_loop(self.agent, todo, concurrency)
        return {"event": "done", "start": start, "end": end, "latencies": lat, "ok": len(lat),
                "descriptors": ndesc}

    def arrivals(self, rids: list[str]) -> dict[str, Any]:
        """Drain notifications until every one of ``rids`` has arrived (bounded in time)."""
        want = {r.encode() for r in rids}
        at: dict[str, float] = {}
        deadline = time.monotonic() + POLL_TIMEOUT_S
        while want and time.monotonic() < deadline:
            got = self.agent.get_new_notifs()
            if not got:
                time.sleep(RECV_SLEEP_S)
                continue
            now = time.monotonic()
            for msgs in got.values():
                for m in msgs:
                    if m in want:
                        want.discard(m)
                        at[m.decode()] = now
        return {"event": "arrived", "last": max(at.values(), default=0.0), "at": at,
                "missing": len(want), "nfailed": 0}


async def forward_and_send(svc: TransferService, requests: list[dict[str, Any]], mode: str,
                           per_layer_s: float, layers: int) -> dict[str, Any]:
    """A simulated prefill per request, one after another: the forward pass computes layer
    after layer (``per_layer_s`` each, by the clock); ``mode`` "layer" sends each layer as it
    is computed, "whole" sends the request once the last layer is.  ``computed``: when the
    last layer of each request was."""
    computed: dict[str, float] = {}
    failed: list[str] = []
    for r in requests:
        t0 = time.monotonic()
        handle = None
        for layer in range(layers):
            end = t0 + (layer + 1) * per_layer_s
            left = end - time.monotonic()  # the forward pass of this layer (late wake-ups do not add up)
            if left > 0:
                await anyio.sleep(left)
            if layer == layers - 1:
                computed[r["rid"]] = time.monotonic()
            if mode == "layer":
                handle = await svc.send(r["rid"], r["src"], layers=range(layer, layer + 1), last=layer == layers - 1)
        if mode == "whole":
            handle = await svc.send(r["rid"], r["src"], last=True)
        assert handle is not None
        result = await svc.await_completion(handle, timeout=RUN_TIMEOUT_S)
        if not result.ok:
            failed.append(f"{r['rid']}: {result.reason} {result.message}")
    return {"event": "done", "computed": computed, "nfailed": len(failed), "failed": failed[:5]}


async def rank(role: str, cfg: dict[str, Any], stdin: Any) -> None:
    spec = EngineSpec(**cfg["spec"])
    kv = SyntheticKV(spec)
    for t in kv.tensors:
        t.fill_(1.0 if role == "send" else 0.5)  # touch every page once
    raw = RawAgent(role, kv.memory)
    config = ServiceConfig(**{"ucx_env": {"UCX_NET_DEVICES": "lo"}, "drain_grace_s": 1.0, **cfg.get("service", {})})
    ticker = Ticker()
    async with TransferService(config, memory=kv.memory) as svc, anyio.create_task_group() as tg:
        tg.start_soon(ticker.run)
        freeze_startup_heap("freeze")
        emit({"event": "ready", "address": svc.address, "metadata": raw.metadata(),
              "memory": memory_json(kv.memory), "pid": os.getpid()})

        async def kv_arrivals(rids: list[str]) -> None:
            at: dict[str, float] = {}
            failed: list[str] = []
            with anyio.move_on_after(RUN_TIMEOUT_S):
                for rid in rids:
                    result = await svc.await_arrival(rid)
                    at[rid] = result.finished_at
                    if not result.ok:
                        failed.append(f"{rid}: {result.reason} {result.message}")
            emit({"event": "arrived", "last": max(at.values(), default=0.0), "at": at,
                  "missing": len(rids) - len(at), "nfailed": len(failed), "failed": failed[:5]})

        async for line in stdin:
            cmd = json.loads(line)
            op = cmd["op"]
            if op == "connect_raw":
                for peer in cmd["peers"]:
                    await anyio.to_thread.run_sync(raw.connect, int(peer["index"]), peer["metadata"], peer["memory"])
                emit({"event": "connected"})
            elif op == "raw":
                emit(await anyio.to_thread.run_sync(raw.run, cmd["requests"], int(cmd["concurrency"])))
            elif op == "raw_expect":
                emit({"event": "expecting"})
                emit(await anyio.to_thread.run_sync(raw.arrivals, cmd["rids"]))
            elif op == "kv":  # no lag probe (engines.Group.measure checks)
                emit(await drive(svc, ticker, cmd["requests"], int(cmd["concurrency"]), lag=False))
            elif op == "kv_expect":
                for r in cmd["requests"]:
                    await svc.expect(r["rid"], r["dst"], sender=r["sender"])
                emit({"event": "expecting"})
                tg.start_soon(kv_arrivals, [r["rid"] for r in cmd["requests"]])
            elif op == "forward":
                emit(await forward_and_send(svc, cmd["requests"], cmd["mode"], float(cmd["per_layer_s"]),
                                            spec.layers))
            elif op == "exit":
                break
            else:
                emit({"event": "error", "message": f"unknown op {op!r}"})
            await anyio.lowlevel.checkpoint()
        tg.cancel_scope.cancel()


def main() -> None:
    take_stdout()
    import torch

    quiet_logs()
    torch.set_num_threads(1)
    role, cfg = sys.argv[1], json.loads(sys.argv[2])
    anyio.run(rank, role, cfg, anyio.wrap_file(sys.stdin), backend="asyncio",
              backend_options={"use_uvloop": cfg.get("loop", "uvloop") == "uvloop"})


if __name__ == "__main__":
    main()
