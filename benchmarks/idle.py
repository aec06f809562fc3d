"""What an idle, linked pair costs: a diagnostic, not part of ``kvservice bench``.

    .venv/bin/python -m benchmarks.idle --seconds 30

Starts, side by side in one run, a pair of processes per method: bare NIXL agents
(``kvservice.bench.raw_nixl``: an agent each, the other's metadata loaded, nothing
running), kvservice in process (``kvservice.bench.kv_side``, its loop-lag ticker off),
the sidecar (a ``kvservice serve`` daemon per side and a ``SidecarClient`` worker on
each), the engine facade (``KVTransferEngine`` on its loop thread, in this module's
``engine`` child), ``expecting``: kvservice in process again, its receiver holding one
Expect whose ``send()`` never comes (a decode that reserved pages for a prefill still
computing), and ``sending``: its sender holding one ``send()`` whose Expect never comes (a
prefill finished before its decode reserved pages).  Neither polls NIXL for what it holds:
nothing can land before the Expect, and nothing is posted before it comes.
Each pair moves one request (so links, agents and connections are up), then every
process of every method sits idle for the same ``--seconds``, and ``/proc`` says what
each spent meanwhile (``kvservice.bench.procfs``: every thread's
run time, and how many times its threads were put on a CPU: ``wakes``).

Printed: per process, % of a core and wakes per second; per method and side, the sum
over that side's processes less the bare agent's process of that side: what kvservice
adds to an idle engine, in % of a core.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from typing import Any

from kvservice.bench._lines import Child, ChildError, emit, take_stdout
from kvservice.bench.methods import SETUP_TIMEOUT_S, KvService, Method, RawNixl, Sidecar, processes
from kvservice.bench.procfs import threads_cpu_and_runs
from kvservice.bench.workloads import LLAMA3_8B, Case, Request

POOL_PAGES = 16
LINK_TIMEOUT_S = 60.0
#: the one request each pair moves before the idle span
LINK = Case("w2", "link", 1, [Request("link", [0, 1], [2, 3])])


class Engine:
    """The engine facade: a ``KVTransferEngine`` per side, in this module's ``engine`` child."""

    name = "engine"

    def __init__(self, layout: dict[str, Any], num_pages: int) -> None:
        self.cfg: dict[str, Any] = {"layout": layout, "num_pages": num_pages}
        self.send: Child | None = None
        self.recv: Child | None = None

    def start(self) -> None:
        self.send = Child("benchmarks.idle", "engine", self.cfg)
        self.recv = Child("benchmarks.idle", "engine", self.cfg)
        address = self.send.wait("ready", SETUP_TIMEOUT_S)["address"]
        self.recv.wait("ready", SETUP_TIMEOUT_S)
        self.recv.send("receive", sender=address, rid="link", pages=LINK.requests[0].dst)
        self.send.call("send", "ended", LINK_TIMEOUT_S, rid="link", pages=LINK.requests[0].src)
        self.recv.wait("ended", LINK_TIMEOUT_S)

    def measure(self, case: Case, prefix: str) -> dict[str, Any]:
        raise NotImplementedError("the engine pair only links (start) and idles")

    def close(self) -> None:
        for child in (self.send, self.recv):
            if child is not None:
                child.close()


def engine_child(cfg: dict[str, Any]) -> None:
    """``python -m benchmarks.idle engine CONFIG``: one engine facade, driven by JSON lines;
    between commands its main thread blocks on stdin, as an idle engine's scheduler sleeps."""
    take_stdout()
    import os

    import torch

    from kvservice.bench.kv_side import make_config, quiet_logs
    from kvservice.engine import KVPoll, KVTransferEngine

    quiet_logs()
    torch.set_num_threads(1)
    with KVTransferEngine(make_config(cfg)) as engine:
        emit({"event": "ready", "address": engine.address, "pid": os.getpid()})
        for line in sys.stdin:
            cmd = json.loads(line)
            if cmd["op"] == "exit":
                break
            if cmd["op"] == "receive":
                transfer: Any = engine.receiver(cmd["rid"], sender=cmd["sender"])
                transfer.init(cmd["pages"])
            else:
                transfer = engine.sender(cmd["rid"])
                transfer.init(num_pages=len(cmd["pages"]))
                transfer.send(cmd["pages"])
            deadline = time.monotonic() + LINK_TIMEOUT_S
            while transfer.poll() not in (KVPoll.Success, KVPoll.Failed) and time.monotonic() < deadline:
                engine.wait_for_end(0.1)
            emit({"event": "ended", "poll": transfer.poll().name})
            transfer.clear()


def idle_span(methods: Sequence[Method], seconds: float) -> dict[str, dict[str, tuple[float, float]]]:
    """Per method and process role: (% of a core, wakes per second) over ``seconds`` of idling."""
    pids = {m.name: processes(m) for m in methods}
    t0 = time.monotonic()
    before = {(name, role): threads_cpu_and_runs(pid) for name, roles in pids.items() for role, pid in roles.items()}
    time.sleep(seconds)
    after = {key: threads_cpu_and_runs(pids[key[0]][key[1]]) for key in before}
    span = time.monotonic() - t0
    out: dict[str, dict[str, tuple[float, float]]] = {name: {} for name in pids}
    for (name, role), (cpu0, runs0) in before.items():
        cpu1, runs1 = after[(name, role)]
        out[name][role] = (100 * (cpu1 - cpu0) / span, (runs1 - runs0) / span)
    return out


SIDE_OF = {"send": "send", "recv": "recv", "prefill-daemon": "send", "decode-daemon": "recv"}


def report(spans: list[dict[str, dict[str, tuple[float, float]]]]) -> None:
    """Per process: the median over the spans; per method and side: what it adds to the bare agent."""
    names = list(spans[0])
    median: dict[str, dict[str, tuple[float, float]]] = {}
    for name in names:
        median[name] = {}
        for role in spans[0][name]:
            cpus = sorted(s[name][role][0] for s in spans)
            runs = sorted(s[name][role][1] for s in spans)
            median[name][role] = (cpus[len(cpus) // 2], runs[len(runs) // 2])
    print(f"{'method':10} {'process':15} {'% of a core':>12} {'wakes/s':>9}")
    for name in names:
        for role, (cpu, wakes) in median[name].items():
            print(f"{name:10} {role:15} {cpu:12.3f} {wakes:9.1f}")
    bare = median["raw_nixl"]
    print(f"\n{'method':10} {'side':5} {'% of a core':>12} {'bare agent':>11} {'added':>8}")
    for name in names:
        for side in ("send", "recv"):
            cpu = sum(c for role, (c, _) in median[name].items() if SIDE_OF[role] == side)
            print(f"{name:10} {side:5} {cpu:12.3f} {bare[side][0]:11.3f} {cpu - bare[side][0]:8.3f}")


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.idle", description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=30.0, help="each idle span (default 30)")
    ap.add_argument("--repeats", type=int, default=1, help="idle spans, one after another (median printed)")
    ap.add_argument("--methods", default="raw_nixl,kvservice,sidecar,engine,expecting,sending",
                    help="comma-separated: raw_nixl (always), kvservice, sidecar, engine, expecting, sending")
    args = ap.parse_args(argv)
    layout = dict(LLAMA3_8B)
    wanted = set(args.methods.split(",")) | {"raw_nixl"}
    methods: list[Method] = [RawNixl(layout, POOL_PAGES)]
    if "kvservice" in wanted:
        kv = KvService(layout, POOL_PAGES)
        kv.cfg["ticker"] = False
        methods.append(kv)
    if "sidecar" in wanted:
        sidecar = Sidecar(layout, POOL_PAGES)
        sidecar.cfg["ticker"] = False
        methods.append(sidecar)
    if "engine" in wanted:
        methods.append(Engine(layout, POOL_PAGES))
    if "expecting" in wanted:
        held = KvService(layout, POOL_PAGES, name="expecting")
        held.cfg["ticker"] = False
        methods.append(held)
    if "sending" in wanted:
        # the held send outlives the spans: its bootstrap deadline is past any of them
        holding = KvService(layout, POOL_PAGES, name="sending", service={"bootstrap_timeout_s": 3600.0})
        holding.cfg["ticker"] = False
        methods.append(holding)
    started: list[Method] = []
    try:
        for m in methods:
            started.append(m)
            m.start()
            if not isinstance(m, Engine):
                m.measure(LINK, "link")
            if m.name == "expecting":  # one Expect held, never sent (it outlives the spans)
                assert isinstance(m, KvService) and m.recv is not None
                m.recv.call("expect", "expecting", requests=[{"rid": "held", "dst": [POOL_PAGES - 1]}],
                            sender=m.address, wait=False)
            if m.name == "sending":  # one send held, never expected
                assert isinstance(m, KvService) and m.send is not None
                m.send.call("hold", "holding", requests=[{"rid": "held", "src": [POOL_PAGES - 1]}])
        print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: {len(methods)} pairs linked and idle; "
              f"{args.repeats} x {args.seconds:.0f} s", flush=True)
        report([idle_span(methods, args.seconds) for _ in range(args.repeats)])
    except ChildError as exc:
        raise SystemExit(f"idle: {exc}") from exc
    finally:
        for m in reversed(started):
            m.close()


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "engine":
        engine_child(json.loads(sys.argv[2]))
    else:
        main()
