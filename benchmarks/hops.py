"""Where a lone request's time goes: a diagnostic, not part of ``kvservice bench``.

    .venv/bin/python -m benchmarks.hops --case w2/c1 --requests 1000

Runs the benchmark's sender in this process (one ``TransferService``, requests
sent one at a time, as in ``w2/c1``) against a ``kvservice.bench.kv_side`` receiver,
with timestamps patched onto the hops of each request: ``send()`` called, the
post starting and ending on the NIXL thread, its outcome reaching the loop, the
watchdog's digest, ``await_completion`` returning.  Prints the median of each
segment over the requests whose post returned ``DONE`` (nearly all), and the
CPU each thread spent per request (from ``/proc``).  The patches cost a few
microseconds per hop; compare segments with each other, not with the bench.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import anyio

from benchmarks.loop_cpu import beside_a_receiver
from kvservice._control import protocol
from kvservice._nixl import agent as _agent
from kvservice._nixl import door as _door
from kvservice._transfer import watchdog as _watchdog
from kvservice._trust.handshake import NOTIF_MAC_BYTES
from kvservice.bench.workloads import FULL, all_cases

#: hop name -> request id -> time.monotonic()
marks: dict[str, dict[str, float]] = {}
_posting: list[str] = []  # the request whose tick the loop is waiting for (one at a time here)
#: how many posts returned each state (``DONE``: the WRITE ended within the post call)
states: dict[str, int] = {}


def _request_of(notif: bytes) -> Any:
    """The notification's body, its MAC not checked (we built it)."""
    body = notif[len(protocol.NOTIF_MAGIC):-NOTIF_MAC_BYTES]
    return protocol._notif_decoder.decode(body)


def mark(hop: str, rid: str) -> None:
    marks.setdefault(hop, {})[rid] = time.monotonic()


def instrument() -> None:
    """Wrap the hops of kvservice's hot path with timestamps (this process only)."""
    post: Callable[..., Any] = _agent.NixlDoor.post
    settle: Callable[..., Any] = _door._settle
    digest: Callable[..., Any] = _watchdog.Watchdog._digest

    def timed_post(self: Any, peer: str, local: Any, remote: Any, notif: bytes) -> Any:
        n = _request_of(notif)
        rid = n.request_id if n else "?"
        mark("post starts", rid)
        out = post(self, peer, local, remote, notif)
        states[out[1].name] = states.get(out[1].name, 0) + 1
        if out[1] is _door.XferState.DONE:
            mark("post returns DONE", rid)
            _posting.append(rid)
        return out

    def timed_settle(future: Any, result: Any, error: Any) -> None:
        if _posting:
            mark("outcome on the loop", _posting[-1])
        settle(future, result, error)

    def timed_digest(self: Any, outcome: Any, tick: Any) -> None:
        rid = _posting.pop() if _posting else None
        if rid:
            mark("digest starts", rid)
        digest(self, outcome, tick)
        if rid:
            mark("digest ends", rid)

    _agent.NixlDoor.post = timed_post  # type: ignore[method-assign, assignment]
    _door._settle = timed_settle
    _watchdog.Watchdog._digest = timed_digest  # type: ignore[method-assign]


def thread_cpu(tids: dict[str, int]) -> dict[str, tuple[float, float]]:
    """CPU seconds (user, system) of each named native thread of this process."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for name, tid in tids.items():
        with open(f"/proc/self/task/{tid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        out[name] = (int(fields[11]) / tick, int(fields[12]) / tick)
    return out


async def run(case_key: str, nreq: int) -> None:
    case = {c.key: c for c in all_cases(FULL, 1)}[case_key]
    reqs = case.with_prefix("hops")[:nreq]
    async with beside_a_receiver() as (svc, expect):
        await expect(reqs)
        await anyio.sleep(0.5)  # the Expects reach the sender
        door = svc._thread
        assert door is not None
        tids = {"event loop": int(os.getpid()), "NIXL thread": int(door._thread.native_id or 0)}
        cpu0, t0 = thread_cpu(tids), time.monotonic()
        for r in reqs:
            mark("send() called", r["rid"])
            handle = await svc.send(r["rid"], r["src"], last=True)
            await svc.await_completion(handle)
            mark("await_completion returns", r["rid"])
        cpu1, t1 = thread_cpu(tids), time.monotonic()
    report(reqs, len(reqs), t1 - t0, {k: (cpu1[k][0] - cpu0[k][0], cpu1[k][1] - cpu0[k][1]) for k in tids})


def report(reqs: Sequence[dict[str, Any]], n: int, wall: float, cpu: dict[str, tuple[float, float]]) -> None:
    """``n``: the requests sent (the case may have fewer than ``--requests``)."""
    hops = ["send() called", "post starts", "post returns DONE", "outcome on the loop", "digest starts",
            "digest ends", "await_completion returns"]
    rids = [r["rid"] for r in reqs[len(reqs) // 10:]  # skip the first tenth: warm-up
            if all(r["rid"] in marks.get(h, {}) for h in hops)]
    print(f"{n} requests, {len(rids)} measured (post returned DONE); wall {wall / n * 1e6:.0f} us per request;"
          f" posts returned {', '.join(f'{k} {v}' for k, v in sorted(states.items()))}")
    for a, b in itertools.pairwise(hops):
        spans = [marks[b][rid] - marks[a][rid] for rid in rids]
        print(f"  {a:>24} -> {b:<26} p50 {statistics.median(spans) * 1e6:7.0f} us")
    for name, (user, system) in cpu.items():
        print(f"  CPU of the {name:<12} {(user + system) / n * 1e6:7.0f} us per request"
              f" ({user / n * 1e6:.0f} user, {system / n * 1e6:.0f} system)")


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.hops", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--case", default="w2/c1", help="a case of the full plan run one request at a time")
    p.add_argument("--requests", type=int, default=1000)
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    instrument()
    anyio.run(run, args.case, args.requests, backend="asyncio", backend_options={"use_uvloop": True})


if __name__ == "__main__":
    main()
