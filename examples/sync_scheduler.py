"""A synchronous scheduler loop that moves KV with ``kvservice.engine`` and never awaits.

Like SGLang's disaggregated schedulers, each role runs a plain loop: admit requests,
run a (simulated) forward step, then ``poll()`` every transfer and act on what ended.
The transfer service runs on an event loop in a thread of its own, inside
``KVTransferEngine``.

* ``prefill``: "computes" each request's KV chunk by chunk into pages of its pool, one
  chunk per forward step, and hands every chunk to a ``KVSender``.
* ``decode``: reserves pages, announces them with a ``KVReceiver``, "decodes" a few
  steps once the KV is there, and checks every byte of it.  A failed request's pages
  are held until ``settled`` (a WRITE already posted may still land in them).

Each role accounts for every request it took: it ends ``SUCCESS`` or ``FAILED`` with a
reason, none is left pending; the role prints one JSON line per ended request and a
summary, and exits non-zero if anything is unaccounted for.

Self-contained, with a decode SIGKILLed mid-run and restarted on the same address::

    python examples/sync_scheduler.py demo --requests 40 --crash-after 10

Or the roles by hand::

    python examples/sync_scheduler.py prefill --requests 40 --port 7100
    python examples/sync_scheduler.py decode --requests 40 --prefill 127.0.0.1:7100
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import structlog
import torch

from kvservice import KVLayout, ServiceConfig, freeze_startup_objects
from kvservice.engine import KVPoll, KVReceiver, KVSender, KVTransferEngine
from kvservice.testing import pattern  # a deterministic payload per request id

LAYOUT = KVLayout(layers=2, page_tokens=16, kv_heads=2, head_dim=64, dtype="bfloat16", num_pages=64)
ENDED = (KVPoll.Success, KVPoll.Failed)


def request_ids(n: int) -> list[str]:
    return [f"r{i:04d}" for i in range(n)]


def pages_of(rid: str) -> int:
    """Each request's size, the same on both sides: 1..6 pages."""
    return 1 + zlib.crc32(rid.encode()) % 6


def emit(**event: Any) -> None:
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()


class Pages:
    """A free list over the pool."""

    def __init__(self, n: int) -> None:
        self.free = collections.deque(range(n))

    def take(self, n: int) -> list[int] | None:
        if len(self.free) < n:
            return None
        return [self.free.popleft() for _ in range(n)]

    def give(self, pages: list[int]) -> None:
        self.free.extend(pages)


@dataclass
class Job:
    rid: str
    pages: list[int]
    transfer: KVSender | KVReceiver
    data: torch.Tensor | None = None
    chunks_done: int = 0
    steps_left: int = 0  # decode: forward steps still to run once the KV is there


@dataclass
class Ledger:
    """Every request a role took, and how it ended."""

    role: str
    taken: list[str] = field(default_factory=list)
    ended: dict[str, tuple[str, str | None]] = field(default_factory=dict)

    def end(self, rid: str, transfer: KVSender | KVReceiver, **extra: Any) -> None:
        result = transfer.result
        assert result is not None  # poll() said it ended: the result is published
        reason = result.reason.value if result.reason else None
        self.ended[rid] = (result.status.value, reason)
        emit(event="end", role=self.role, rid=rid, status=result.status.value, reason=reason,
             message=result.message, **extra)

    def summary(self, **extra: Any) -> bool:
        pending = [rid for rid in self.taken if rid not in self.ended]
        by = collections.Counter(reason or status for status, reason in self.ended.values())
        emit(event="summary", role=self.role, taken=len(self.taken), ended=len(self.ended),
             pending=len(pending), outcomes=dict(by), **extra)
        print(f"{self.role}: {len(self.taken)} requests, {len(self.ended)} ended "
              f"({', '.join(f'{k}={v}' for k, v in sorted(by.items())) or '-'}), {len(pending)} pending",
              file=sys.stderr)
        return not pending


def engine_config(args: argparse.Namespace) -> ServiceConfig:
    return ServiceConfig(layout=LAYOUT, port=args.port, ucx_env={"UCX_NET_DEVICES": "lo"},
                         bootstrap_timeout_s=args.bootstrap_timeout, arrival_timeout_s=args.arrival_timeout,
                         drain_grace_s=1.0)


def run_prefill(args: argparse.Namespace) -> int:
    ledger = Ledger("prefill")
    todo = collections.deque(request_ids(args.requests))
    with KVTransferEngine(engine_config(args)) as engine:
        freeze_startup_objects()
        emit(event="ready", role="prefill", address=engine.address, pid=os.getpid())
        if args.hold:  # requests reach a prefill once a decode is up: a router's order
            sys.stdin.readline()
        free, running = Pages(LAYOUT.num_pages), dict[str, Job]()
        deadline = time.monotonic() + args.max_seconds
        while (todo or running) and time.monotonic() < deadline:
            while todo and len(running) < args.running:  # admit while there is room
                pages = free.take(pages_of(todo[0]))
                if pages is None:
                    break
                rid = todo.popleft()
                sender = engine.sender(rid)
                sender.init(len(pages))
                running[rid] = Job(rid, pages, sender, data=pattern(LAYOUT, rid, len(pages)))
                ledger.taken.append(rid)
            time.sleep(args.step)  # the forward step; it produced one chunk of each prefilling request
            for job in running.values():
                if job.data is not None and job.chunks_done < len(job.pages):
                    a = job.chunks_done
                    b = min(a + args.chunk_pages, len(job.pages))
                    engine.kv.write(job.pages[a:b], job.data[:, :, a:b])
                    job.transfer.send(job.pages[a:b])  # the last chunk is marked by init()'s count
                    job.chunks_done = b
            for rid, job in list(running.items()):
                if job.transfer.poll() in ENDED:  # settled: a sender's failure ends once its handles are released
                    ledger.end(rid, job.transfer)
                    job.transfer.clear()
                    free.give(job.pages)
                    del running[rid]
        status = engine.status()
        ok = ledger.summary(live_nixl_handles=status.live_nixl_handles, sending=status.sending)
    return 0 if ok and not todo else 1


def run_decode(args: argparse.Namespace) -> int:
    ledger = Ledger("decode")
    todo = collections.deque(request_ids(args.requests)[args.first:])
    with KVTransferEngine(engine_config(args)) as engine:
        freeze_startup_objects()
        emit(event="ready", role="decode", address=engine.address, pid=os.getpid())
        free, running, held = Pages(LAYOUT.num_pages), dict[str, Job](), dict[str, Job]()
        deadline = time.monotonic() + args.max_seconds
        while (todo or running or held) and time.monotonic() < deadline:
            while todo and len(running) < args.running:
                pages = free.take(pages_of(todo[0]))
                if pages is None:
                    break
                rid = todo.popleft()
                # Said before the expect goes out: whoever restarts this role after a
                # crash starts after the last id announced here.
                emit(event="expecting", role="decode", rid=rid)
                receiver = engine.receiver(rid, sender=args.prefill)
                receiver.init(pages)
                running[rid] = Job(rid, pages, receiver, steps_left=args.decode_steps)
                ledger.taken.append(rid)
            time.sleep(args.step)  # the forward step of every request whose KV is here
            for rid, job in list(running.items()):
                state = job.transfer.poll()
                if state is KVPoll.Success:
                    if job.data is None:  # arrived: check every byte, then decode a few steps
                        ok = bool(torch.equal(engine.kv.pages(job.pages), pattern(LAYOUT, rid, len(job.pages))))
                        job.data = torch.empty(0)
                        ledger.end(rid, job.transfer, verified=ok)
                    job.steps_left -= 1
                    if job.steps_left <= 0:
                        job.transfer.clear()
                        free.give(job.pages)
                        del running[rid]
                elif state is KVPoll.Failed:
                    ledger.end(rid, job.transfer)
                    held[rid] = running.pop(rid)  # its pages wait until nothing can land in them
            for rid, job in list(held.items()):
                if job.transfer.settled:
                    job.transfer.clear()
                    free.give(job.pages)
                    del held[rid]
        ok = ledger.summary(unsettled=len(held))
    return 0 if ok and not todo else 1


# -- demo: both roles as processes, the decode SIGKILLed and restarted ---------------------


class Child:
    """A role in a child process; its JSON lines are read by a thread into a queue."""

    def __init__(self, argv: list[str]) -> None:
        self.proc = subprocess.Popen([sys.executable, __file__, *argv], stdout=subprocess.PIPE, text=True,
                                     stdin=subprocess.PIPE if "--hold" in argv else subprocess.DEVNULL)
        self.pid = self.proc.pid
        self.events: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self.seen: list[dict[str, Any]] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        with self.proc.stdout:
            for line in self.proc.stdout:
                if line.startswith("{"):
                    self.events.put(json.loads(line))
        self.events.put(None)

    def wait_for(self, match: Callable[[dict[str, Any]], bool], timeout: float) -> dict[str, Any] | None:
        """The next event that matches (every event is kept in ``seen``); None at exit or timeout."""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                ev = self.events.get(timeout=left)
            except queue.Empty:
                return None
            if ev is None:
                self.events.put(None)  # stays at the end for later calls
                return None
            self.seen.append(ev)
            if match(ev):
                return ev
        return None

    def go(self) -> None:
        """Release a role started with ``--hold``."""
        assert self.proc.stdin is not None
        with self.proc.stdin:
            self.proc.stdin.write("go\n")

    def finish(self, timeout: float) -> int:
        """Read to the end; the exit code (killed if it overruns)."""
        self.wait_for(lambda ev: False, timeout)
        try:
            return self.proc.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def role_argv(role: str, args: argparse.Namespace, **extra: Any) -> list[str]:
    argv = [role, "--requests", str(args.requests), "--step", str(args.step)]
    for key, value in extra.items():
        argv += [f"--{key.replace('_', '-')}", str(value)]
    return argv


def run_demo(args: argparse.Namespace) -> int:
    prefill = Child([*role_argv("prefill", args), "--hold"])
    ready = prefill.wait_for(lambda ev: ev["event"] == "ready", 60)
    assert ready is not None, "the prefill did not start"
    decode = Child(role_argv("decode", args, prefill=ready["address"]))
    d_ready = decode.wait_for(lambda ev: ev["event"] == "ready", 60)
    assert d_ready is not None, "the decode did not start"
    prefill.go()
    successes = 0
    while successes < args.crash_after:
        ev = decode.wait_for(lambda ev: ev["event"] == "end", 60)
        if ev is None:
            break
        successes += ev["status"] == "SUCCESS"
    print(f"-- SIGKILL the decode (pid {decode.pid}) after {successes} successes", file=sys.stderr)
    os.kill(decode.pid, signal.SIGKILL)
    decode.finish(10)
    announced = [ev["rid"] for ev in decode.seen if ev["event"] == "expecting"]
    first = int(max(announced)[1:]) + 1 if announced else 0
    port = d_ready["address"].rsplit(":", 1)[1]
    print(f"-- restart the decode on port {port} from request {first}", file=sys.stderr)
    again = Child(role_argv("decode", args, prefill=ready["address"], first=first, port=port))
    codes = {"prefill": prefill.finish(120), "decode (restarted)": again.finish(120)}
    ends = {role: {ev["rid"]: ev for ev in child.seen if ev["event"] == "end"}
            for role, child in (("prefill", prefill), ("decode1", decode), ("decode2", again))}
    announced1 = {ev["rid"] for ev in decode.seen if ev["event"] == "expecting"}
    print(f"{'request':8} {'prefill':22} {'decode':22}")
    def show(rid: str, ev: dict[str, Any] | None) -> str:
        if ev is None:
            return "(killed while expecting)" if rid in announced1 else "-"
        if ev["status"] == "SUCCESS":
            return "SUCCESS verified" if ev.get("verified") else "SUCCESS"
        return f"FAILED {ev['reason']}"

    for rid in request_ids(args.requests):
        p = ends["prefill"].get(rid)
        d = ends["decode2"].get(rid) or ends["decode1"].get(rid)
        print(f"{rid:8} {show(rid, p):22} {show(rid, d):22}")
    missing = [rid for rid in request_ids(args.requests) if rid not in ends["prefill"]]
    bad = [rid for role in ("decode1", "decode2") for rid, ev in ends[role].items()
           if ev["status"] == "SUCCESS" and not ev.get("verified")]
    ok = not missing and not bad and all(code == 0 for code in codes.values())
    print("every request accounted for" if ok else f"NOT accounted for: missing={missing} "
          f"unverified={bad} exit codes={codes}")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("role", choices=["prefill", "decode", "demo"])
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--running", type=int, default=0,
                        help="requests in flight (default: prefill 3, decode 6: the decode announces ahead)")
    parser.add_argument("--step", type=float, default=0.02, help="seconds per simulated forward step")
    parser.add_argument("--chunk-pages", type=int, default=2)
    parser.add_argument("--decode-steps", type=int, default=3)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--prefill", help="the prefill's address (decode role)")
    parser.add_argument("--first", type=int, default=0, help="first request index (decode role)")
    parser.add_argument("--hold", action="store_true",
                        help="prefill: admit nothing until a line arrives on stdin (once a decode is up)")
    parser.add_argument("--crash-after", type=int, default=10, help="demo: decode successes before SIGKILL")
    parser.add_argument("--bootstrap-timeout", type=float, default=15.0)
    parser.add_argument("--arrival-timeout", type=float, default=15.0)
    parser.add_argument("--max-seconds", type=float, default=120.0, help="bound on a role's loop")
    args = parser.parse_args(argv)
    structlog.configure(  # warnings and above, JSON lines on stderr
        processors=[structlog.processors.add_log_level, structlog.processors.JSONRenderer()],
        wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr))
    args.running = args.running or (6 if args.role == "decode" else 3)
    if args.role == "decode" and not args.prefill:
        parser.error("decode needs --prefill HOST:PORT")
    return {"prefill": run_prefill, "decode": run_decode, "demo": run_demo}[args.role](args)


if __name__ == "__main__":
    sys.exit(main())
