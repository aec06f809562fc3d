"""One hand-off at a time, the sender ready first: kvservice's push against a pull.

    .venv/bin/python -m benchmarks.handoff [--pages 2,16,64] [--requests 30] [--rounds 3] \\
        [--gap-s 0.1] [--against <other checkout>/kvservice ...]

The flow of a prefill-first router (vLLM's proxy, SGLang's router): the prefill has
finished and its ``send()`` is issued; the decode then reserves pages and asks for the
KV.  Two processes, each pinned to a core of its own (as ``benchmarks.vllm_pd`` pins its
engines), KV of ``benchmarks.vllm_pd``'s model (32 KiB per token, pages of 32 tokens:
1 MiB a page), one request at a time with ``--gap-s`` between them (longer than the
receiver's polling after a request, ``WARM_GRACE_S``, as in an engine where the next
prompt's forward comes between two hand-offs).  What each method times, per request:

- ``kvservice`` (and ``kvservice@PKG`` per ``--against``): the decode's ``expect()``
  called -> its ``await_arrival()`` returning the result (the prefill's ``send()`` came
  before the expect, and waits for it).
- ``pull``: raw NIXL as a decode pulls (vLLM's ``NixlConnector``): the decode, whose
  agent holds the prefill's metadata and both descriptor lists prepped, makes the READ
  (``make_prepped_xfer``), posts it and polls ``check_xfer_state`` to ``DONE`` without
  sleeping: the least a pull can take here, NIXL's progress threads off on both sides.

Methods take turns within each round (the order rotating), fresh processes each
time, so drift falls on all alike.  Prints p50 and p90 per method and page count,
each method's p50 over the pull's, and for kvservice each side's event-loop thread's CPU per
request (``time.thread_time()`` over the timed requests, their gaps included: what a hand-off
costs the loop, the waits around it among it), its whole process's (``time.process_time()``:
the NIXL thread's polling too) and how many of the sender's NIXL posts
returned ``DONE`` (the WRITE complete within the post) rather than ``PROC`` (complete only
after the receiver's progress and more checks).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from benchmarks.compare import add_against, shadow
from kvservice.bench._lines import child_environ

ROOT = Path(__file__).resolve().parent.parent
#: ``benchmarks.vllm_pd``'s model, in pages of vLLM's ``block_size=32``
LAYOUT: dict[str, Any] = {"layers": 8, "page_tokens": 32, "kv_heads": 4, "head_dim": 128, "dtype": "float32"}
#: untimed requests first (links, NIXL connections)
WARMUP = 3
CHILD_TIMEOUT_S = 300.0
#: longest one READ may take before the run is called broken
READ_TIMEOUT_S = 30.0


def pin(cpu: int) -> None:
    """Pin this process to ``cpu`` when the machine has it (a one-core box shares it)."""
    if cpu < (os.cpu_count() or 1):
        os.sched_setaffinity(0, {cpu})


# -- kvservice ------------------------------------------------------------------------------
def _kv_config(num_pages: int) -> Any:
    from kvservice import KVLayout, ServiceConfig

    return ServiceConfig(layout=KVLayout(num_pages=num_pages, **LAYOUT), ucx_env={"UCX_NET_DEVICES": "lo"})


def _count_post_states(states: list[str]) -> None:
    """Record the state each NIXL post returns in (``DONE``: the WRITE completed within the
    post; ``PROC``: it needs checks after, and the receiver's progress) into ``states``."""
    from kvservice._nixl.agent import NixlDoor

    post = NixlDoor.post

    def counted(self: NixlDoor, *args: Any, **kwargs: Any) -> Any:
        out = post(self, *args, **kwargs)
        states.append(out[1].name)
        return out

    NixlDoor.post = counted  # type: ignore[method-assign]


def _kv_sender(conn: mpc.Connection, num_pages: int) -> None:
    """The prefill: ``send()`` each request it is told of, before the decode expects it."""
    pin(0)
    from kvservice import TransferService

    states: list[str] = []
    _count_post_states(states)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        async with TransferService(_kv_config(num_pages)) as svc:
            svc.kv.tensor.fill_(1.0)
            conn.send(svc.address)
            pending: list[asyncio.Future[Any]] = []
            cpu0 = proc0 = 0.0
            while (cmd := await loop.run_in_executor(None, conn.recv)) is not None:
                if len(pending) == WARMUP:
                    cpu0, proc0 = time.thread_time(), time.process_time()
                rid, pages = cmd
                pending.append(asyncio.ensure_future(svc.await_completion(await svc.send(rid, pages, last=True))))
                conn.send("sent")
            ok = sum(r.ok for r in await asyncio.gather(*pending))
            timed = max(1, len(pending) - WARMUP)
            cpu, proc = (time.thread_time() - cpu0) / timed, (time.process_time() - proc0) / timed
            conn.send((ok, states[WARMUP:], cpu, proc))

    asyncio.run(main())


async def _kv_receiver(conn: mpc.Connection, n: int, pages: int, gap: float,
                       num_pages: int) -> tuple[list[float], list[str], dict[str, float]]:
    from kvservice import TransferService

    loop = asyncio.get_running_loop()
    async with TransferService(_kv_config(num_pages)) as svc:
        svc.kv.tensor.zero_()
        sender = await loop.run_in_executor(None, conn.recv)
        times = []
        cpu0 = proc0 = 0.0
        for i in range(WARMUP + n):
            if i == WARMUP:
                cpu0, proc0 = time.thread_time(), time.process_time()
            conn.send((f"r{i}", list(range(pages))))
            await loop.run_in_executor(None, conn.recv)
            await asyncio.sleep(gap)
            t0 = time.monotonic()
            await svc.expect(f"r{i}", list(range(pages, 2 * pages)), sender=sender)
            result = await svc.await_arrival(f"r{i}")
            t1 = time.monotonic()
            if not result.ok:
                raise RuntimeError(f"r{i}: {result.reason} {result.message}")
            if i >= WARMUP:
                times.append(t1 - t0)
        await asyncio.sleep(gap)  # the last request's idle time, as every other's
        cpu, proc = (time.thread_time() - cpu0) / n, (time.process_time() - proc0) / n
        conn.send(None)
        ok, states, send_cpu, send_proc = await loop.run_in_executor(None, conn.recv)
    if ok != WARMUP + n:
        raise RuntimeError(f"the sender completed {ok} of {WARMUP + n}")
    return times, states, {"send": send_cpu, "recv": cpu, "send_proc": send_proc, "recv_proc": proc}


@contextmanager
def prefill(target: Callable[[mpc.Connection, int], None], num_pages: int) -> Iterator[mpc.Connection]:
    """The prefill: ``target`` in a process of its own (on core 0), this one, the decode,
    pinned to core 1; yields the pipe to it, and waits for it to end (then kills it)."""
    ctx = mp.get_context("spawn")
    mine, theirs = ctx.Pipe()
    child = ctx.Process(target=target, args=(theirs, num_pages), daemon=True)
    child.start()
    pin(1)
    try:
        yield mine
    finally:
        child.join(10)
        if child.is_alive():
            child.kill()


def kvservice_times(n: int, pages: int, gap: float) -> tuple[list[float], list[str], dict[str, float]]:
    """Each request's time, the state each of the sender's posts returned in, and each side's
    event-loop thread's CPU per request (s; its gap included: what a request costs the loop,
    the waits around it among it), and its whole process's (``*_proc``: the NIXL thread's
    polls too, and the harness's pipe reads, alike for every build)."""
    with prefill(_kv_sender, 2 * pages) as conn:
        return asyncio.run(_kv_receiver(conn, n, pages, gap, 2 * pages))


# -- raw NIXL, pulled -------------------------------------------------------------------------
def _raw_cfg(num_pages: int) -> dict[str, Any]:
    return {"layout": LAYOUT, "num_pages": num_pages}


def _raw_source(conn: mpc.Connection, num_pages: int) -> None:
    """The prefill: an agent holding the pages, read by the decode.  With NIXL's progress
    thread off a READ of it completes only while it calls into NIXL: it polls as a prefill
    engine holding a request's blocks does (``NixlConnector`` drains its notifications
    every step), every ``RECV_SLEEP_S``."""
    pin(0)
    from kvservice.bench.raw_nixl import RECV_SLEEP_S, Side

    side = Side("send", _raw_cfg(num_pages))
    conn.send(side.hello())
    while not conn.poll(RECV_SLEEP_S):  # until the end
        side.agent.get_new_notifs()


def pull_times(n: int, pages: int, gap: float) -> list[float]:
    from kvservice.bench.raw_nixl import Side, descriptor_indices

    num_pages = 2 * pages
    with prefill(_raw_source, num_pages) as conn:
        try:
            side = Side("recv", _raw_cfg(num_pages))
            side.connect({**conn.recv(), "prep": True})
            agent, planes = side.agent, side.planes
            local_idx = descriptor_indices(list(range(pages, 2 * pages)), planes, num_pages)
            remote_idx = descriptor_indices(list(range(pages)), planes, num_pages)
            times = []
            for i in range(WARMUP + n):
                time.sleep(gap)
                t0 = time.monotonic()
                xfer = agent.make_prepped_xfer("READ", side.local, local_idx, side.remote, remote_idx, b"")
                state = agent.transfer(xfer)
                deadline = t0 + READ_TIMEOUT_S
                while state != "DONE":
                    if state == "ERR" or time.monotonic() > deadline:
                        raise RuntimeError(f"READ {i}: {state}")
                    state = agent.check_xfer_state(xfer)
                t1 = time.monotonic()
                agent.release_xfer_handle(xfer)
                if i >= WARMUP:
                    times.append(t1 - t0)
            if not bool((side.pool[:, :, pages:] == 1.0).all()):
                raise RuntimeError("the pulled pages do not hold the source's bytes")
            return times
        finally:
            conn.send(None)  # the source's end


# -- the runs ----------------------------------------------------------------------------------
def child_main(method: str, n: int, pages: int, gap: float) -> None:
    import kvservice

    times, states, cpu = (pull_times(n, pages, gap), [], {}) if method == "pull" else kvservice_times(n, pages, gap)
    print(json.dumps({"times": times, "posts": states, "cpu": cpu,
                      "package": str(Path(kvservice.__file__).resolve().parent)}), flush=True)


def run_child(method: str, package: Path, n: int, pages: int, gap: float,
              cwd: Path) -> tuple[list[float], list[str], dict[str, float]]:
    """One run in a fresh process whose ``kvservice`` is ``package`` (a directory holding
    it first on the path; run from ``cwd``, which holds none: ``-m`` puts it first): each
    request's time, the states the sender's posts returned in and each side's loop CPU per
    request (kvservice's)."""
    env = child_environ()  # the bench's children's: loopback, quiet logs, this host's UCX modules
    env["PYTHONPATH"] = os.pathsep.join((str(package.parent), str(ROOT)))
    cmd = [sys.executable, "-m", "benchmarks.handoff", "--child", method, "--requests", str(n),
           "--pages", str(pages), "--gap-s", str(gap)]
    out = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
    if out.returncode != 0:
        raise RuntimeError(f"{method} ({pages} pages) exited {out.returncode}: {out.stderr[-2000:]}")
    result = json.loads([ln for ln in out.stdout.splitlines() if ln.startswith("{")][-1])
    if Path(result["package"]) != package.resolve():
        raise RuntimeError(f"{method} ran {result['package']}, not {package}")
    return [float(t) for t in result["times"]], list(result["posts"]), dict(result["cpu"])


def quantile(xs: Sequence[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.handoff", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pages", default="2,16,64", help="pages of 1 MiB per request, comma-separated")
    p.add_argument("--requests", type=int, default=30, help="timed requests per run")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--gap-s", type=float, default=0.1, help="pause before each request")
    p.add_argument("--child", choices=("pull", "kvservice"), help=argparse.SUPPRESS)
    add_against(p)
    args = p.parse_args(argv)
    if args.child:
        child_main(args.child, args.requests, int(args.pages), args.gap_s)
        return 0
    sizes = [int(x) for x in args.pages.split(",")]
    with tempfile.TemporaryDirectory(prefix="kvservice-handoff-") as tmp:
        mine = ROOT / "kvservice"
        methods: list[tuple[str, str, Path]] = [("pull", "pull", mine), ("kvservice", "kvservice", mine)]
        for i, pkg in enumerate(args.against):
            methods.append((f"kvservice@{pkg}", "kvservice", shadow(pkg, Path(tmp) / str(i)) / "kvservice"))
        times: dict[tuple[str, int], list[float]] = {}
        posts: dict[tuple[str, int], list[str]] = {}
        cpus: dict[tuple[str, int], list[dict[str, float]]] = {}
        for r in range(args.rounds):
            order = methods[r % len(methods):] + methods[: r % len(methods)]
            for pages in sizes:
                for name, method, package in order:
                    t, states, cpu = run_child(method, package, args.requests, pages, args.gap_s, Path(tmp))
                    times.setdefault((name, pages), []).extend(t)
                    posts.setdefault((name, pages), []).extend(states)
                    cpus.setdefault((name, pages), []).append(cpu)
                    print(f"round {r} {pages} pages {name}: done", file=sys.stderr, flush=True)
    print(f"\n## one hand-off at a time, the sender ready first ({args.rounds} rounds x {args.requests} "
          f"requests, {args.gap_s * 1e3:.0f} ms apart; ms)")
    width = max(len(n) for n, _, _ in methods) + 2
    print(f"{'pages (MiB)':<12}{'method':<{width}}{'p50':>9}{'p90':>9}{'/ pull (p50)':>14}"
          f"{'loop CPU/request, send / recv (us)':>36}{'process CPU/request (us)':>26}  posts DONE at once")
    for pages in sizes:
        base = statistics.median(times[("pull", pages)])
        for name, _, _ in methods:
            t, states = times[(name, pages)], posts[(name, pages)]
            done = f"  {states.count('DONE')} of {len(states)}" if states else ""
            runs = [c for c in cpus[(name, pages)] if c]
            loop_cpu, proc_cpu = (f"{statistics.median(c[f'send{k}'] for c in runs) * 1e6:.0f} / "
                                  f"{statistics.median(c[f'recv{k}'] for c in runs) * 1e6:.0f}" if runs else "-"
                                  for k in ("", "_proc"))
            print(f"{pages:<12}{name:<{width}}{quantile(t, 0.5) * 1e3:>9.2f}{quantile(t, 0.9) * 1e3:>9.2f}"
                  f"{statistics.median(t) / base:>13.2f}x{loop_cpu:>36}{proc_cpu:>26}{done}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
