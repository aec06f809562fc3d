"""Raw NIXL: a prefill's WRITE against a decode's READ of the same blocks, two pinned processes.

The question it answers (issue #24): in the vLLM benchmark kvservice's WRITE of a request
ran at 1.7-2.7 GB/s, while vLLM's NixlConnector READs the same blocks in less time than
that. Is the WRITE itself slower than the READ, with no service and no engine on the path?

Two processes, each pinned to its own core (``--cores``), each with one NIXL agent (UCX,
progress thread off) and a pool with the vLLM benchmark's model's KV (8 layers, 4 KiB per
token per layer) in vLLM's CPU default blocks (128 tokens: one 512 KiB descriptor per block
and layer; the benchmark's engines use 32-token blocks, which NIXL merges where adjacent),
touched once. Each request moves ``tokens`` worth of blocks into blocks the
decode has not used for a while (vLLM's free list hands out the least recently freed).

* ``write``: the prefill posts a WRITE with a notification and polls its handle; the
  decode polls ``get_new_notifs`` every ``--poll-ms`` (kvservice's receiver cadence).
  Latency: post to the decode seeing the notification.
* ``read``: the decode posts a READ and polls its handle; the prefill polls notifications
  at the same cadence (what a service's loop does). Latency: post to DONE.

Both arms run interleaved, in turns, and share one monotonic clock (one host).

``--busy prefill`` adds a process that spins on the prefill's core for the whole run: a
prefill engine that steps without pause while it holds a request's blocks. A WRITE's copy
runs on the prefill's core (the post performs it), a READ's on the decode's.

    python -m benchmarks.nixl_read_write --repeats 20
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time
from multiprocessing.connection import Connection
from typing import Any

from kvservice.bench.raw_nixl import descriptor_indices, descriptor_table

LAYERS = 8
BLOCK_TOKENS = 128
TOKEN_LAYER_BYTES = 4096  # 32 KiB per token over 8 layers
BLOCK_BYTES = BLOCK_TOKENS * TOKEN_LAYER_BYTES
POOL_BLOCKS = 128
DEADLINE_S = 30.0


def _side(role: str, core: int, poll_s: float, conn: Connection) -> None:
    """One process: set up, then serve the driver's commands until ``None``."""
    os.sched_setaffinity(0, {core})
    import torch
    from nixl._api import nixl_agent, nixl_agent_config

    pool = torch.empty(LAYERS * POOL_BLOCKS * BLOCK_BYTES, dtype=torch.uint8)
    pool.fill_(7 if role == "prefill" else 0)  # touch every page once
    agent = nixl_agent(f"rw-{role}-{os.getpid()}",
                       nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False, backends=["UCX"]))
    agent.register_memory(pool)
    table = descriptor_table(pool.data_ptr(), LAYERS, POOL_BLOCKS, BLOCK_BYTES)  # layer-major: the raw baseline's
    local = agent.prep_xfer_dlist("NIXL_INIT_AGENT", table, "DRAM")
    conn.send((agent.get_agent_metadata(), pool.data_ptr()))
    peer_md, peer_base = conn.recv()
    peer = agent.add_remote_agent(peer_md)
    if isinstance(peer, bytes):
        peer = peer.decode()
    remote = agent.prep_xfer_dlist(peer, descriptor_table(peer_base, LAYERS, POOL_BLOCKS, BLOCK_BYTES), "DRAM")
    conn.send("ready")
    while (cmd := conn.recv()) is not None:
        arm, src, dst, tag = cmd
        if (arm == "write") == (role == "prefill"):  # the initiator
            op, mine, theirs = ("WRITE", src, dst) if arm == "write" else ("READ", dst, src)
            t0 = time.monotonic()
            handle = agent.make_prepped_xfer(op, local, descriptor_indices(mine, LAYERS, POOL_BLOCKS), remote,
                                             descriptor_indices(theirs, LAYERS, POOL_BLOCKS), tag)
            state = agent.transfer(handle)
            post_s = time.monotonic() - t0
            while state == "PROC" and time.monotonic() - t0 < DEADLINE_S:
                state = agent.check_xfer_state(handle)
            t1 = time.monotonic()
            agent.release_xfer_handle(handle)
            if state != "DONE":
                raise RuntimeError(f"{op} ended {state}")
            conn.send((t0, t1, post_s))
        else:  # the other side: polls notifications at the receiver's cadence
            conn.send("polling")
            t_seen = 0.0
            deadline = time.monotonic() + DEADLINE_S
            while time.monotonic() < deadline:
                notifs = agent.get_new_notifs()
                if not t_seen and any(tag in msgs for msgs in notifs.values()):
                    t_seen = time.monotonic()
                if arm == "write" and t_seen:
                    break
                if arm == "read" and conn.poll():  # the READ ended (its notification may come too)
                    conn.recv()
                    break
                time.sleep(poll_s)
            conn.send(t_seen)


def _spin(core: int) -> None:
    os.sched_setaffinity(0, {core})
    while True:
        pass


def run(args: argparse.Namespace) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    ends, procs = {}, []
    if args.busy != "none":
        spinner = ctx.Process(target=_spin, args=(args.cores[args.busy == "decode"],), daemon=True, name="spinner")
        spinner.start()
        procs.append(spinner)
    for role, core in zip(("prefill", "decode"), args.cores, strict=True):
        mine, theirs = ctx.Pipe()
        proc = ctx.Process(target=_side, args=(role, core, args.poll_ms / 1000, theirs), daemon=True)
        proc.start()
        ends[role], procs = mine, [*procs, proc]
    p, d = ends["prefill"], ends["decode"]
    md_p, md_d = p.recv(), d.recv()
    p.send(md_d)
    d.send(md_p)
    assert p.recv() == "ready" and d.recv() == "ready"
    out: dict[str, dict[str, list[float]]] = {}
    cursor = 0
    try:
        for tokens in args.tokens:
            nblocks = -(-tokens // BLOCK_TOKENS)
            for rep in range(args.repeats + 1):  # the first round warms the connection up
                for arm in (("write", "read") if rep % 2 else ("read", "write")):
                    src = [(cursor + i) % POOL_BLOCKS for i in range(nblocks)]
                    dst = [(cursor + 61 + i) % POOL_BLOCKS for i in range(nblocks)]
                    cursor = (cursor + nblocks) % POOL_BLOCKS
                    tag = f"{arm}-{tokens}-{rep}".encode()
                    initiator, other = (p, d) if arm == "write" else (d, p)
                    other.send((arm, src, dst, tag))
                    assert other.recv() == "polling"
                    initiator.send((arm, src, dst, tag))
                    t0, t1, post_s = initiator.recv()
                    if arm == "read":
                        other.send("stop")
                    t_seen = other.recv()
                    if rep == 0:
                        continue
                    end = t_seen if arm == "write" else t1
                    if arm == "write" and not t_seen:
                        raise RuntimeError("the decode never saw the WRITE's notification")
                    row = out.setdefault(f"{arm} {tokens}", {"ms": [], "post_ms": []})
                    row["ms"].append((end - t0) * 1000)
                    row["post_ms"].append(post_s * 1000)
    finally:
        for end_ in (p, d):
            end_.send(None)
        for proc in procs:
            proc.join(0 if proc.name == "spinner" else 10)
            if proc.is_alive():
                proc.kill()
    return {key: {k: statistics.median(v) for k, v in row.items()} for key, row in out.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[64, 512, 2048])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--poll-ms", type=float, default=0.5)
    parser.add_argument("--busy", choices=["none", "prefill", "decode"], default="none",
                        help="a process spinning on that side's core all along")
    parser.add_argument("--cores", type=int, nargs=2, default=[0, 1], metavar=("PREFILL", "DECODE"))
    args = parser.parse_args(argv)
    result = run(args)
    print(f"{'tokens':>7} {'MiB':>5} {'WRITE ms':>9} {'READ ms':>8} {'W/R':>5} {'W post ms':>10} {'R post ms':>10}")
    for tokens in args.tokens:
        w, r = result[f"write {tokens}"], result[f"read {tokens}"]
        mib = -(-tokens // BLOCK_TOKENS) * BLOCK_BYTES * LAYERS / 2**20
        print(f"{tokens:>7} {mib:>5.0f} {w['ms']:>9.2f} {r['ms']:>8.2f} {w['ms'] / r['ms']:>5.2f} "
              f"{w['post_ms']:>10.2f} {r['post_ms']:>10.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
