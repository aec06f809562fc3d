"""vLLM prefill/decode through kvservice, side by side with vLLM's own ``NixlConnector``.

    PYTHONPATH=$PWD "$(bash scripts/engine-env.sh vllm)/bin/python" -m benchmarks.vllm_pd \\
        [--quick] [--rounds N] [--out DIR] [--phases TEXT] [--configs NAMES] [--idle-s S]

Configurations of the same two vLLM engines (prefill pinned to CPU 0, decode to CPU
1; ``benchmarks.vllm_pd_engine``: vLLM's ``LLMEngine`` stepped as vLLM's engine core
steps): ``kvservice`` (``KVServiceConnector``), ``nixl`` (``NixlConnector`` as shipped)
and ``nixl-quiet`` (``NixlConnector`` with NIXL's progress thread off); and, only where
``--configs`` names it, ``kvservice-lw``: ``KVServiceConnector`` in its decode-first
layer-wise flow (what kvservice's proxy does with ``--layerwise``).  Each round starts
each configuration's pair in turn (the order rotates round by round), warms it up, runs
every phase, and stops it: drift hits them all alike.

A phase is a prompt length and a number of requests kept in flight.  This process is the
router: it sends each request to the prefill (one token, ``do_remote_decode``), hands the
answer's ``kv_transfer_params`` to the decode, and timestamps what comes back.  For
``kvservice-lw`` it signs a ticket (the proxy's, under the pair's key) and sends the
request with it to the decode, then to the prefill, which writes each layer as its
forward computes it; the prefill's answer carries no hand-off.

* ``handoff``: on the decode, vLLM reserving blocks for the remote KV
  (``update_state_after_alloc``) to the load reported finished (``finished_recving``
  reaching the scheduler), marked by ``benchmarks.vllm_pd_timing``'s subclasses (for
  ``kvservice-lw`` the blocks are reserved before the prefill computes: its hand-off
  holds the prefill's forward);
* ``tail``: the prefill's answer received to the decode's load reported: the part of the
  hand-off after the prefill's forward, comparable across flows (negative: the load was
  reported first);
* ``prefill``: the prefill request sent to its answer received (the router's part of TTFT
  spent on the prefill: queueing, the prompt's forward, the answer);
* ``ttft``: the prefill request sent to the decode's first token received;
* ``e2e``: the prefill request sent to the decode's last token received;
* ``req/s``: requests completed per second with N in flight (per round);
* idle: after its phases, each engine's CPU over ``--idle-s`` seconds with nothing to do
  (every thread, ``/proc/PID/task/*/schedstat``, in % of a core; the baseline engine's too,
  the engine without a connector), and which of its threads spent it.

Every decode's tokens are checked against one engine without a connector; a configuration
whose round has any other tokens (or a failed request) is reported broken for that round,
and nothing of that round is timed.  Prints p50 and p90 of each metric per configuration,
and the ratios kvservice / NixlConnector for each arm; writes ``results.json`` and the
engines' logs under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from statistics import fmean
from typing import Any

from kvservice._trust.handoff import handoff_key
from kvservice._trust.keys import generate_key, load_key
from kvservice.bench.procfs import threads_by_name
from kvservice.bench.stats import quantile
from kvservice.integrations.vllm.params import Handoff
from kvservice.integrations.vllm.settings import settings_from
from kvservice.testing.engine_process import ask_to_quit, reap, send_line

from .vllm_pd_engine import BLOCK_SIZE, KV_BYTES_PER_TOKEN

ROOT = Path(__file__).resolve().parents[1]
TIMING = "benchmarks.vllm_pd_timing"
#: tokens every decode generates
MAX_TOKENS = 16
CONFIGS = ("kvservice", "kvservice-lw", "nixl", "nixl-quiet")
#: run where ``--configs`` names none: the decode-first flow only on request
DEFAULT_CONFIGS = ("kvservice", "nixl", "nixl-quiet")
#: kvservice's flows, each compared with every arm, by the short name of its ratio columns
FLOWS = {"kvservice": "kvs", "kvservice-lw": "lw"}
#: the NixlConnector arms kvservice is compared with
ARMS = ("nixl", "nixl-quiet")
#: seconds a ``kvservice-lw`` ticket is valid from its signing
TICKET_LIFETIME_S = 60.0
METRICS = ("handoff_ms", "tail_ms", "prefill_ms", "ttft_ms", "e2e_ms", "req_per_s", "prefill_cpu_ms", "decode_cpu_ms")
#: per phase and round, each engine's CPU per request by thread name (ms): the cpu metrics' parts
THREAD_METRICS = ("prefill_threads_ms", "decode_threads_ms")
#: per phase and round, each engine's steps per request: that executed the model (a batch's
#: forward), that did not (each followed by the engine core's 1 ms sleep): what the CPU went to
STEP_METRICS = ("prefill_steps", "decode_steps", "prefill_waits", "decode_waits")


@dataclass(frozen=True)
class Phase:
    name: str
    tokens: int
    in_flight: int
    requests: int


FULL = (Phase("64 tok, 1 in flight", 64, 1, 6), Phase("512 tok, 1 in flight", 512, 1, 6),
        Phase("2048 tok, 1 in flight", 2048, 1, 3), Phase("512 tok, 4 in flight", 512, 4, 12),
        Phase("512 tok, 16 in flight", 512, 16, 32))
QUICK = (Phase("64 tok, 1 in flight", 64, 1, 2), Phase("128 tok, 4 in flight", 128, 4, 4))
WARMUP = Phase("warm-up", 64, 1, 2)
#: seconds of idle measured after the phases (``--idle-s``): the full run's, the quick one's
IDLE_S, QUICK_IDLE_S = 20.0, 2.0
#: between the last phase and the idle span: what winds down after work (a watchdog's idle
#: waits back off to their ceiling within about 2 s) is not counted as idle
IDLE_SETTLE_S = 3.0


class Broken(Exception):
    """A round of one configuration that cannot be timed (other tokens, a failed request)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


#: every engine's environment unless ``--engine-env`` says otherwise. vLLM's CPU build runs two
#: OpenMP compute threads per engine, here on one pinned core; with libgomp's default policy the
#: idle one spins after every forward (milliseconds each time), taking the core from the other
#: compute thread (TTFT about 10x, measured) and from whatever else runs there: kvservice's
#: WRITE on the prefill's core (docs/perf/vllm.md, "The prefill's core").
ENGINE_ENV = {"OMP_WAIT_POLICY": "PASSIVE"}


def engine_env(extra: dict[str, str]) -> dict[str, str]:
    env = dict(os.environ)
    env.update({"PYTHONPATH": str(ROOT), "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_LOGGING_LEVEL": "WARNING",
                "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", **extra})
    return env


class Engine:
    """One ``vllm_pd_engine`` process (a session of its own: its engine core goes with it)."""

    def __init__(self, name: str, cfg: dict[str, Any], env: dict[str, str], events: queue.Queue[Any],
                 log: Path) -> None:
        self.name = name
        self._log = open(log, "ab")  # closed by stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.vllm_pd_engine", "serve", json.dumps(cfg)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, env=engine_env(env), cwd=ROOT,
            start_new_session=True)
        self._events = events
        self.ready = threading.Event()
        #: threads the engine's build had moved off its core (pinned back: vllm_pd_engine)
        self.moved = 0
        #: its steps so far, as its last answer said: (executed the model, did not)
        self.steps = (0, 0)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            now = time.monotonic()
            try:
                msg = json.loads(raw)
            except ValueError:
                continue  # a library's print on stdout
            if msg.get("ready"):
                self.moved = int(msg.get("moved", 0))
                self.ready.set()
            else:
                if isinstance(msg.get("steps"), list):  # before the event: a reader of it sees them
                    self.steps = (int(msg["steps"][0]), int(msg["steps"][1]))
                self._events.put((now, self.name, msg))
        self._events.put((time.monotonic(), self.name, None))

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not self.ready.wait(0.5):
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name}: exited while starting (rc={self.proc.returncode}); see its log")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name}: not ready within {timeout:.0f} s")

    def generate(self, rid: str, prompt: list[int], max_tokens: int, params: dict[str, Any] | None = None) -> None:
        send_line(self.proc, {"op": "generate", "id": rid, "prompt": prompt, "max_tokens": max_tokens,
                              "params": params})

    def stop(self) -> None:
        """Quit, then SIGKILL the process's group (its engine core) by the process's id."""
        ask_to_quit(self.proc, 20)
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the group is this process's own session
        except ProcessLookupError:
            pass
        reap(self.proc)
        self._log.close()


@dataclass
class Plan:
    model: Path
    out: Path
    phases: tuple[Phase, ...]
    prompts: dict[str, list[list[int]]]
    expected: dict[str, list[list[int]]] = field(default_factory=dict)
    kv_cache_bytes: int = 512 << 20
    max_model_len: int = 4096
    start_timeout_s: float = 300.0
    #: ``ServiceConfig`` keys for both kvservice engines (``--kvservice``; e.g. ``poll_interval_s``)
    kvservice: dict[str, Any] = field(default_factory=dict)
    #: environment for every engine of every configuration (``ENGINE_ENV``, then ``--engine-env``)
    engine_env: dict[str, str] = field(default_factory=lambda: dict(ENGINE_ENV))
    phase_timeout_s: float = 600.0
    #: the idle span measured after each pair's phases and the baseline's prompts (0: none)
    idle_s: float = IDLE_S


class Harness:
    """Starts engines (every one stopped at the end, whatever happens) and drives phases."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.events: queue.Queue[Any] = queue.Queue()
        self.engines: list[Engine] = []
        #: every engine process started, by PID (all stopped by the end)
        self.pids: list[int] = []
        #: ``idle()`` of the baseline engine (the engine without a connector)
        self.baseline_idle: dict[str, dict[str, Any]] = {}
        #: while a ``kvservice-lw`` pair runs: its prefill's kvservice address and the key
        #: its tickets are signed under
        self.ticket: tuple[str, bytes] | None = None

    def start(self, name: str, cpu: int, transfer: dict[str, Any] | None, env: dict[str, str]) -> Engine:
        cfg = {"model": str(self.plan.model), "cpu": cpu, "transfer": transfer,
               "kv_cache_bytes": self.plan.kv_cache_bytes, "max_model_len": self.plan.max_model_len}
        env = {"VLLM_CPU_OMP_THREADS_BIND": str(cpu), **self.plan.engine_env, **env}
        engine = Engine(name, cfg, env, self.events, self.plan.out / "logs" / f"{name}.log")
        self.engines.append(engine)
        self.pids.append(engine.proc.pid)
        return engine

    def stop(self, engine: Engine) -> None:
        if engine in self.engines:
            self.engines.remove(engine)
        engine.stop()

    def stop_all(self) -> None:
        while self.engines:
            engine = self.engines.pop()
            try:
                engine.stop()
            except Exception as exc:  # noqa: BLE001 -- the others are stopped still
                print(f"stopping {engine.name}: {exc}", file=sys.stderr)

    def drain(self) -> None:
        while True:
            try:
                self.events.get_nowait()
            except queue.Empty:
                return

    def next_event(self, deadline: float) -> tuple[float, str, dict[str, Any]]:
        left = deadline - time.monotonic()
        if left <= 0:
            raise Broken("the phase ran past its time limit")
        try:
            t, who, msg = self.events.get(timeout=left)
        except queue.Empty:
            raise Broken("the phase ran past its time limit") from None
        if msg is None:
            raise Broken(f"{who} exited")
        return t, who, msg

    # -- the baseline ---------------------------------------------------------------------
    def baseline(self) -> None:
        """Every prompt's tokens from one engine without a connector."""
        engine = self.start("baseline", 0, None, {})
        try:
            engine.wait_ready(self.plan.start_timeout_s)
            todo: dict[str, tuple[str, int]] = {}
            for phase in (WARMUP, *self.plan.phases):
                for i, prompt in enumerate(self.plan.prompts[phase.name]):
                    rid = f"b{len(todo)}"
                    todo[rid] = (phase.name, i)
                    engine.generate(rid, prompt, MAX_TOKENS)
            got: dict[str, dict[int, list[int]]] = {}
            deadline = time.monotonic() + self.plan.phase_timeout_s
            while todo:
                _, _, msg = self.next_event(deadline)
                if "error" in msg:
                    raise RuntimeError(f"the baseline failed: {msg['error']}")
                if "tokens" in msg:
                    name, i = todo.pop(msg["id"])
                    got.setdefault(name, {})[i] = msg["tokens"]
            self.plan.expected = {name: [byi[i] for i in range(len(byi))] for name, byi in got.items()}
            self.baseline_idle = self.idle({"engine": engine})
        finally:
            self.stop(engine)

    def idle(self, engines: dict[str, Engine]) -> dict[str, dict[str, Any]]:
        """Each engine's CPU (% of a core) and wake-ups per second over ``plan.idle_s`` with
        nothing sent to any, after ``IDLE_SETTLE_S``; and per thread name, the threads that
        spent any of it.  Empty when ``plan.idle_s`` is 0."""
        if self.plan.idle_s <= 0:
            return {}
        time.sleep(IDLE_SETTLE_S)
        before = {role: threads_by_name(e.proc.pid) for role, e in engines.items()}
        t0 = time.monotonic()
        time.sleep(self.plan.idle_s)
        after = {role: threads_by_name(e.proc.pid) for role, e in engines.items()}
        span = time.monotonic() - t0
        out: dict[str, dict[str, Any]] = {}
        for role, now in after.items():
            threads = {}
            for name, (cpu, runs) in now.items():
                cpu0, runs0 = before[role].get(name, (0.0, 0))
                if cpu > cpu0:  # a thread started meanwhile counts from zero
                    threads[name] = {"cpu_pct": 100 * (cpu - cpu0) / span, "wakes_per_s": (runs - runs0) / span}
            out[role] = {"cpu_pct": sum(t["cpu_pct"] for t in threads.values()),
                         "wakes_per_s": sum(t["wakes_per_s"] for t in threads.values()), "threads": threads}
        return out

    # -- one configuration's round ----------------------------------------------------------
    @contextmanager
    def pair(self, config: str, rnd: int) -> Iterator[tuple[Engine, Engine, Path]]:
        marks = self.plan.out / "marks" / f"{config}-r{rnd}.txt"
        marks.parent.mkdir(parents=True, exist_ok=True)
        common = {"kv_connector_module_path": TIMING, "kv_load_failure_policy": "fail"}
        self.ticket = None
        if config in FLOWS:
            service = dict(self.plan.kvservice)
            port = free_port()
            if config == "kvservice-lw":  # tickets are signed under the cluster's key
                key_file = self.plan.out / "key"
                if not key_file.exists():
                    generate_key(key_file)
                service["auth_key_file"] = str(key_file)
                self.ticket = (f"127.0.0.1:{port}", handoff_key(load_key(key_file)) or b"")
            producer = {**common, "kv_connector": "TimedKVService", "kv_role": "kv_producer",
                        "kv_connector_extra_config": {"kvservice": {**service, "port": port}}}
            consumer = {**common, "kv_connector": "TimedKVService", "kv_role": "kv_consumer",
                        "kv_connector_extra_config": {"kvservice": service}}
            p_env: dict[str, str] = {}
            d_env: dict[str, str] = {}
        else:
            cls = "TimedNixl" if config == "nixl" else "TimedNixlQuiet"
            producer = {**common, "kv_connector": cls, "kv_role": "kv_producer", "kv_buffer_device": "cpu"}
            consumer = {**common, "kv_connector": cls, "kv_role": "kv_consumer", "kv_buffer_device": "cpu"}
            p_env = {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()), "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1"}
            d_env = {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()), "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1"}
        p_env["KVSERVICE_BENCH_MARKS"] = str(marks.with_name(marks.stem + "-prefill.txt"))
        p = self.start(f"{config}-r{rnd}-prefill", 0, producer, p_env)
        d = self.start(f"{config}-r{rnd}-decode", 1, consumer, {**d_env, "KVSERVICE_BENCH_MARKS": str(marks)})
        try:
            p.wait_ready(self.plan.start_timeout_s)
            d.wait_ready(self.plan.start_timeout_s)
            if p.moved or d.moved:
                print(f"round {rnd} {config}: pinned back threads the engines' build moved off their core"
                      f" (prefill {p.moved}, decode {d.moved})", flush=True)
            yield p, d, marks
        finally:
            self.stop(p)
            self.stop(d)

    def phase(self, p: Engine, d: Engine, marks: Path, phase: Phase, tag: str) -> dict[str, Any]:
        """Run one phase through the pair; its numbers, or ``Broken``."""
        prompts, expected = self.plan.prompts[phase.name], self.plan.expected[phase.name]
        self.drain()
        sent: dict[int, float] = {}
        answered: dict[int, float] = {}  # when the prefill's answer came (monotonic s)
        ttft: dict[int, float] = {}
        e2e: dict[int, float] = {}
        nxt = 0
        ticket = self.ticket

        def launch() -> None:
            nonlocal nxt
            sent[nxt] = time.monotonic()
            if ticket is None:
                p.generate(f"p{tag}x{nxt}", prompts[nxt], 1, {"do_remote_decode": True})
            else:  # decode-first: the decode reserves and expects, then the prefill computes
                signed = Handoff.issue(f"{tag}x{nxt}-kv", (ticket[0],), prompts[nxt], len(prompts[nxt]), BLOCK_SIZE,
                                       key=ticket[1], lifetime_s=TICKET_LIFETIME_S, now=time.time(), ticket=True)
                d.generate(f"d{tag}x{nxt}", prompts[nxt], MAX_TOKENS, signed.to_params())
                p.generate(f"p{tag}x{nxt}", prompts[nxt], 1, signed.to_prefill_params())
            nxt += 1

        cpu_before = {e.name: engine_threads_s(e.proc.pid) for e in (p, d)}
        steps_before = {e.name: e.steps for e in (p, d)}
        start = time.monotonic()
        deadline = start + self.plan.phase_timeout_s
        while nxt < min(phase.in_flight, len(prompts)):
            launch()
        while len(e2e) < len(prompts):
            t, who, msg = self.next_event(deadline)
            rid = str(msg.get("id", ""))
            if not rid.startswith(("p" + tag + "x", "d" + tag + "x")):
                continue  # not this phase's
            i = int(rid.rsplit("x", 1)[1])
            if "error" in msg or msg.get("finish") not in (None, "length", "stop"):
                raise Broken(f"{who}: request {rid} failed: {msg.get('error') or msg.get('finish')}")
            if who == p.name and "tokens" in msg:
                params = msg.get("params")
                answered[i] = t
                if ticket is not None:
                    if params:  # it refused the ticket: nothing comes under it
                        raise Broken(f"{who}: request {rid} refused its ticket (answered with {params})")
                    continue
                if not params:
                    raise Broken(f"{who}: request {rid} answered without kv_transfer_params")
                d.generate(f"d{tag}x{i}", prompts[i], MAX_TOKENS, params)
            elif who == d.name and msg.get("first"):
                ttft[i] = t - sent[i]
            elif who == d.name and "tokens" in msg:
                if msg["tokens"] != expected[i]:
                    raise Broken(f"{who}: request {rid}: tokens {msg['tokens']} differ from one engine's "
                                 f"{expected[i]}")
                e2e[i] = t - sent[i]
                if nxt < len(prompts):
                    launch()
        elapsed = time.monotonic() - start
        threads_ms = {}
        for e in (p, d):
            after, before = engine_threads_s(e.proc.pid), cpu_before[e.name]
            threads_ms[e.name] = {t: (s - before.get(t, 0.0)) * 1e3 / len(prompts) for t, s in after.items()}
        cpu_ms = {name: sum(by.values()) for name, by in threads_ms.items()}
        steps = {}  # the last answer of each came after its last step of the phase
        for side, e in (("prefill", p), ("decode", d)):
            (m1, w1), (m0, w0) = e.steps, steps_before[e.name]
            steps[f"{side}_steps"], steps[f"{side}_waits"] = [(m1 - m0) / len(prompts)], [(w1 - w0) / len(prompts)]
        alloc, loaded = load_marks(marks, f"d{tag}x")
        handoff = {i: loaded[i] - alloc[i] for i in loaded if i in alloc}
        if len(handoff) != len(prompts):
            raise Broken(f"{len(handoff)} hand-offs marked for {len(prompts)} requests")
        return {"handoff_ms": [handoff[i] * 1e3 for i in sorted(handoff)],
                "tail_ms": [(loaded[i] - answered[i]) * 1e3 for i in sorted(handoff)],
                "prefill_ms": [(answered[i] - sent[i]) * 1e3 for i in sorted(answered)],
                "ttft_ms": [ttft[i] * 1e3 for i in sorted(ttft)], "e2e_ms": [e2e[i] * 1e3 for i in sorted(e2e)],
                "req_per_s": [len(prompts) / elapsed],
                "prefill_cpu_ms": [cpu_ms[p.name]], "decode_cpu_ms": [cpu_ms[d.name]],
                "prefill_threads_ms": [threads_ms[p.name]], "decode_threads_ms": [threads_ms[d.name]], **steps}


def engine_threads_s(pid: int) -> dict[str, float]:
    """CPU seconds each thread of engine ``pid`` has spent, by name (``main``: the engine's
    own thread, its steps and the connector's calls in them; ``python``: the threads it
    started unnamed, OpenMP's compute threads among them; ``kvservice-*``: the service's)."""
    return {name: cpu for name, (cpu, _) in threads_by_name(pid, main="main").items()}


Results = dict[str, dict[str, dict[str, list[Any]]]]


def arms_table(results: Results, phases: Sequence[Phase], title: str, columns: str,
               cells: Callable[[dict[str, list[Any]]], str | None]) -> str:
    """A line per phase and configuration that has one: ``cells`` of its metrics."""
    lines = [f"\n## {title}", f"{'phase':<24}{'configuration':<14}{columns}"]
    for ph in phases:
        for c in CONFIGS:
            line = cells(results.get(c, {}).get(ph.name, {}))
            if line is not None:
                lines.append(f"{ph.name:<24}{c:<14}{line}")
    return "\n".join(lines)


def threads_table(results: Results, phases: Sequence[Phase]) -> str:
    """Each engine's CPU per request, by thread (ms, mean over rounds; the busiest four)."""
    def busiest(got: dict[str, list[Any]]) -> str | None:
        if not got.get("prefill_threads_ms"):
            return None
        sides = []
        for side in ("prefill", "decode"):
            rounds = got.get(f"{side}_threads_ms", [])
            mean: dict[str, float] = {}
            for by in rounds:
                for t, ms in by.items():
                    mean[t] = mean.get(t, 0.0) + ms / len(rounds)
            top = sorted(mean.items(), key=lambda kv: -kv[1])[:4]
            sides.append(", ".join(f"{t} {ms:.1f}" for t, ms in top) or "-")
        return " | ".join(sides)

    return arms_table(results, phases, "Each engine's CPU per request by thread (ms, mean over rounds)",
                      "prefill | decode", busiest)


def steps_table(results: Results, phases: Sequence[Phase]) -> str:
    """Each engine's steps per request (mean over rounds): the model's, and the waits."""
    def steps(got: dict[str, list[Any]]) -> str | None:
        if not got.get("decode_steps"):
            return None
        cells = [f"{fmean(got[side + '_steps']):.1f} / {fmean(got[side + '_waits']):.1f}"
                 for side in ("prefill", "decode")]
        return "".join(f"{cell:>14}" for cell in cells)

    return arms_table(results, phases, "Each engine's steps per request (mean over rounds): executing the "
                      "model / not (1 ms sleep after)", f"{'prefill':>14}{'decode':>14}", steps)


def load_marks(marks: Path, prefix: str) -> tuple[dict[int, float], dict[int, float]]:
    """For the decode requests named ``prefix<i>``: request index -> when vLLM reserved
    blocks for its remote KV (the first time), and -> when its load was reported finished
    after that (monotonic s)."""
    alloc: dict[int, float] = {}
    loaded: dict[int, float] = {}
    if not marks.exists():
        return alloc, loaded
    for line in marks.read_text().splitlines():
        if not line.startswith(("alloc ", "loaded ")):
            continue
        event, rid, t = line.split()
        rid = rid.rsplit("-", 1)[0]  # vLLM appends "-<random>" to the id it was given
        if not rid.startswith(prefix):
            continue
        i = int(rid[len(prefix):])
        if event == "alloc":
            alloc.setdefault(i, float(t))
        elif event == "loaded" and i in alloc:
            loaded[i] = float(t)
    return alloc, loaded


#: the segments of a kvservice hand-off, from the marks of ``TimedKVService`` (decode, prefill)
SEGMENTS = ("alloc->recv created", "recv created->expect sent", "expect sent->landed", "landed->polled",
            "polled->scheduler", "send created-alloc", "send 1st write-expect sent", "send's posts")


def kvservice_path(marks_dir: Path, phases: Sequence[Phase]) -> str:
    """Where kvservice's hand-off time goes: the median of each segment per phase (ms)."""
    seg: dict[str, dict[str, list[float]]] = {}
    for decode_marks in sorted(marks_dir.glob("kvservice-r*[0-9].txt")):
        sends: dict[str, tuple[float, float]] = {}
        #: the NIXL post calls' time of each send (the calls since the last mark, shared out)
        post_s: dict[str, float] = {}
        prefill_marks = decode_marks.with_name(decode_marks.stem + "-prefill.txt")
        if prefill_marks.exists():
            ended, posted = [], 0.0
            for line in prefill_marks.read_text().splitlines():
                f = line.split()
                if f[0] == "send":
                    sends[f[1]] = (float(f[3]), float(f[4]))
                    ended.append(f[1])
                elif f[0] == "posts":
                    total = float(f[3])
                    for rid in ended:
                        post_s[rid] = (total - posted) / len(ended)
                    ended, posted = [], total
        alloc: dict[str, float] = {}
        loaded: dict[str, float] = {}
        recvs: dict[str, list[str]] = {}
        for line in decode_marks.read_text().splitlines():
            f = line.split()
            if f[0] == "alloc":
                alloc.setdefault(f[1], float(f[2]))
            elif f[0] == "loaded":
                loaded[f[1]] = float(f[2])
            elif f[0] == "recv":
                recvs[f[1]] = f[2:]
        for rid, (source, created, started, landed, polled, _) in recvs.items():
            k = rid.split("k", 1)[-1].split("x", 1)[0] if "k" in rid else ""
            if not k.isdigit() or rid not in alloc or rid not in loaded:
                continue  # the warm-up's
            name = phases[int(k)].name
            c, st, la, po = float(created), float(started), float(landed), float(polled)
            values = [c - alloc[rid], st - c, la - st, po - la, loaded[rid] - po]
            if source in sends:
                values += [sends[source][0] - alloc[rid], sends[source][1] - st]
                if source in post_s:
                    values.append(post_s[source])
            for key, v in zip(SEGMENTS, values, strict=False):
                seg.setdefault(name, {}).setdefault(key, []).append(v * 1e3)
    if not seg:
        return ""
    lines = ["\n## kvservice's hand-off, segment by segment (p50 ms; from kvservice's own results)",
             f"{'phase':<24}" + "".join(f"{k:>{max(len(k), 8) + 2}}" for k in SEGMENTS)]
    for ph in phases:
        by = seg.get(ph.name, {})
        lines.append(f"{ph.name:<24}" + "".join(
            f"{quantile(by[k], 0.5) if by.get(k) else float('nan'):>{max(len(k), 8) + 2}.1f}" for k in SEGMENTS))
    return "\n".join(lines)


def make_prompts(phases: Sequence[Phase], seed: int = 7) -> dict[str, list[list[int]]]:
    """Distinct prompts for every request of every phase (token ids of the random model)."""
    rng = random.Random(seed)
    return {ph.name: [[rng.randrange(1, 1000) for _ in range(ph.tokens)] for _ in range(ph.requests)]
            for ph in (WARMUP, *phases)}


def summarize(results: dict[str, dict[str, dict[str, list[float]]]], phases: Sequence[Phase]) -> str:
    """The table: p50 / p90 per metric, phase and configuration run; then each of kvservice's
    flows / each arm (p50; none for ``tail_ms``, which may be negative)."""
    shown = [c for c in CONFIGS if c in results]
    pairs = [(f, a) for f in FLOWS if f in shown for a in ARMS if a in shown]
    lines = []
    for ph in phases:
        lines.append(f"\n## {ph.name} ({ph.tokens * KV_BYTES_PER_TOKEN / 2**20:.1f} MiB of KV per request)")
        lines.append(f"{'metric':<15}" + "".join(f"{c + ' p50/p90':>24}" for c in shown)
                     + "".join(f"{FLOWS[f] + '/' + a:>16}" for f, a in pairs))
        for metric in METRICS:
            row = f"{metric:<15}"
            p50 = {}
            for c in shown:
                values = results.get(c, {}).get(ph.name, {}).get(metric, [])
                if values:
                    p50[c] = quantile(values, 0.5)
                    row += f"{p50[c]:>13.1f} /{quantile(values, 0.9):>8.1f}"
                else:
                    row += f"{'none timed':>24}"
            for f, a in pairs:
                ratio = f in p50 and p50.get(a) and metric != "tail_ms"
                row += f"{p50[f] / p50[a]:>15.2f}x" if ratio else f"{'-':>16}"
            lines.append(row)
    return "\n".join(lines)


def idle_table(idle: dict[str, list[dict[str, dict[str, Any]]]], baseline: dict[str, dict[str, Any]],
               seconds: float) -> str:
    """Each configuration's engines idle: % of a core and wakes/s (the median over rounds),
    what that is more than the engine without a connector, and the threads that spent most."""
    if not idle:
        return ""
    base = baseline.get("engine", {}).get("cpu_pct")
    lines = [f"\n## Idle: {seconds:.0f} s with nothing sent, after each pair's phases (% of a core; median over "
             "rounds)",
             f"{'engine':<26}{'% of a core':>12}{'wakes/s':>10}{'more than without a connector':>31}   busiest threads"]
    rows = [("baseline (no connector)", [baseline])] if baseline else []
    rows += [(f"{config} {role}", [{"engine": r[role]} for r in rounds if role in r])
             for config, rounds in idle.items() for role in ("prefill", "decode")]
    for name, readings in rows:
        got = [r["engine"] for r in readings if "engine" in r]
        if not got:
            continue
        cpu = quantile([g["cpu_pct"] for g in got], 0.5)
        wakes = quantile([g["wakes_per_s"] for g in got], 0.5)
        more = f"{cpu - base:+.2f}" if base is not None and not name.startswith("baseline") else "-"
        threads: dict[str, float] = {}
        for g in got:
            for t, v in g["threads"].items():
                threads[t] = threads.get(t, 0.0) + v["cpu_pct"] / len(got)
        busiest = ", ".join(f"{t} {v:.2f}" for t, v in sorted(threads.items(), key=lambda kv: -kv[1])[:4])
        lines.append(f"{name:<26}{cpu:>12.2f}{wakes:>10.0f}{more:>31}   {busiest}")
    return "\n".join(lines)


def _setting(text: str) -> tuple[str, Any]:
    """``KEY=VALUE`` with a JSON value (a bare word is a string); ``ValueError`` otherwise."""
    key, sep, value = text.partition("=")
    if not sep or not key.isidentifier():
        raise ValueError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def _variable(text: str) -> tuple[str, str]:
    """``NAME=VALUE`` for an environment variable; ``ValueError`` otherwise."""
    name, sep, value = text.partition("=")
    if not sep or not name.isidentifier():
        raise ValueError(f"expected NAME=VALUE, got {text!r}")
    return name, value


def main(argv: Sequence[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.vllm_pd", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="one round of two small phases (the smoke test's)")
    ap.add_argument("--rounds", type=int, help="rounds (default 3; 1 with --quick)")
    ap.add_argument("--out", type=Path, help="where results.json and the logs go (default: a new temp dir)")
    ap.add_argument("--budget-s", type=float, default=3600.0,
                    help="start no round past this many seconds (default 3600)")
    ap.add_argument("--phases", help="only the phases whose name contains this (e.g. '1 in flight')")
    ap.add_argument("--configs", help=f"these configurations, comma-separated (of {', '.join(CONFIGS)}; "
                                       f"default {','.join(DEFAULT_CONFIGS)})")
    ap.add_argument("--idle-s", type=float,
                    help=f"seconds of idle measured after each pair's phases (default {IDLE_S:.0f}; "
                         f"{QUICK_IDLE_S:.0f} with --quick; 0: none)")
    ap.add_argument("--kvservice", metavar="KEY=VALUE", action="append", default=[],
                    help="a ServiceConfig setting for both kvservice engines, its value as JSON "
                         "(repeatable; e.g. poll_interval_s=0.0001)")
    ap.add_argument("--engine-env", metavar="NAME=VALUE", action="append", default=[],
                    help="an environment variable for every engine of every configuration, the baseline's "
                         f"too (repeatable; on top of {' '.join(f'{k}={v}' for k, v in ENGINE_ENV.items())}: "
                         "OMP_WAIT_POLICY=ACTIVE for libgomp's spinning)")
    args = ap.parse_args(list(argv))
    try:
        settings = dict(_setting(kv) for kv in args.kvservice)
        settings_from({"kvservice": settings})  # refused here as the engines would, before any starts
    except ValueError as exc:
        ap.error(f"--kvservice: {exc}")
    try:
        engine_vars = {**ENGINE_ENV, **dict(_variable(kv) for kv in args.engine_env)}
    except ValueError as exc:
        ap.error(f"--engine-env: {exc}")
    phases = tuple(ph for ph in (QUICK if args.quick else FULL) if args.phases is None or args.phases in ph.name)
    named = DEFAULT_CONFIGS if args.configs is None else tuple(args.configs.split(","))
    if unknown := [c for c in named if c not in CONFIGS]:
        ap.error(f"--configs: no configuration {', '.join(unknown)} (of {', '.join(CONFIGS)})")
    configs = tuple(c for c in CONFIGS if c in named)
    if not phases or not configs:
        ap.error("--phases / --configs select nothing")
    rounds = args.rounds or (1 if args.quick else 3)
    out = args.out or Path(tempfile.mkdtemp(prefix="vllm-pd-"))
    (out / "logs").mkdir(parents=True, exist_ok=True)
    began = time.monotonic()
    load_before = os.getloadavg()
    plan = Plan(model=out / "model", out=out, phases=phases, prompts=make_prompts(phases), kvservice=settings,
                engine_env=engine_vars)
    if args.quick:
        plan.kv_cache_bytes, plan.max_model_len = 128 << 20, 1024
    plan.idle_s = args.idle_s if args.idle_s is not None else QUICK_IDLE_S if args.quick else IDLE_S
    if plan.idle_s < 0:
        ap.error("--idle-s: must be 0 or more")
    harness = Harness(plan)
    results: dict[str, dict[str, dict[str, list[float]]]] = {}
    #: per configuration, one ``Harness.idle`` per round
    idle: dict[str, list[dict[str, dict[str, Any]]]] = {}
    broken: list[dict[str, Any]] = []

    def on_term(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_term)
    interrupted = False
    try:
        if not (plan.model / "config.json").exists():
            subprocess.run([sys.executable, "-m", "benchmarks.vllm_pd_engine", "model", str(plan.model)],
                           env=engine_env({}), cwd=ROOT, check=True, capture_output=True, timeout=300)
        harness.baseline()
        print(f"baseline: {sum(map(len, plan.expected.values()))} prompts, tokens recorded", flush=True)
        for rnd in range(rounds):
            if time.monotonic() - began > args.budget_s:
                print(f"budget of {args.budget_s:.0f} s spent: {rnd} rounds", flush=True)
                break
            order = configs[rnd % len(configs):] + configs[:rnd % len(configs)]
            for config in order:
                results.setdefault(config, {})
                t0 = time.monotonic()
                got: dict[str, dict[str, list[float]]] = {}
                try:
                    with harness.pair(config, rnd) as (p, d, marks):
                        harness.phase(p, d, marks, WARMUP, f"r{rnd}w")
                        for k, ph in enumerate(phases):
                            try:
                                got[ph.name] = harness.phase(p, d, marks, ph, f"r{rnd}k{k}")
                            except (Broken, OSError) as exc:  # this phase is not timed; the next may be
                                broken.append({"config": config, "round": rnd, "phase": ph.name, "why": str(exc)})
                                print(f"round {rnd} {config} {ph.name}: BROKEN ({exc})", flush=True)
                        if plan.idle_s > 0:
                            idle.setdefault(config, []).append(harness.idle({"prefill": p, "decode": d}))
                except (Broken, OSError, RuntimeError, TimeoutError) as exc:
                    broken.append({"config": config, "round": rnd, "phase": None, "why": str(exc)})
                    print(f"round {rnd} {config}: BROKEN ({exc})", flush=True)
                    continue
                for name, metrics in got.items():
                    for metric, values in metrics.items():
                        results[config].setdefault(name, {}).setdefault(metric, []).extend(values)
                print(f"round {rnd} {config}: ok ({time.monotonic() - t0:.0f} s)", flush=True)
    except KeyboardInterrupt:  # SIGINT or SIGTERM: what was measured is still reported
        interrupted = True
        print("interrupted: the configurations' rounds that completed are reported", flush=True)
    finally:
        harness.stop_all()
    load_after = os.getloadavg()
    table = (summarize(results, phases) + threads_table(results, phases) + steps_table(results, phases)
             + kvservice_path(out / "marks", phases)
             + idle_table(idle, harness.baseline_idle, plan.idle_s))
    verified = {c: sum(len(m.get("e2e_ms", [])) for m in results.get(c, {}).values()) for c in configs}
    header = (f"vLLM P/D, kvservice vs NixlConnector: {rounds} round(s), {MAX_TOKENS} tokens decoded per request, "
              f"model {KV_BYTES_PER_TOKEN // 1024} KiB KV/token; load avg before {load_before[0]:.2f}, "
              f"after {load_after[0]:.2f}; {time.monotonic() - began:.0f} s\n"
              f"tokens verified against one engine: {verified}; broken phases: {len(broken)}\n"
              "ratios are kvservice p50 / NixlConnector p50 (kvs: the whole-request push, lw: decode-first "
              "layer-wise; times: below 1 is kvservice faster; req_per_s: above 1 is kvservice faster)")
    print(header + table, flush=True)
    for b in broken:
        print(f"broken: round {b['round']} {b['config']} {b['phase'] or 'start/warm-up'}: {b['why']}")
    (out / "results.json").write_text(json.dumps(
        {"rounds": rounds, "phases": [ph.__dict__ for ph in phases], "max_tokens": MAX_TOKENS,
         "kv_bytes_per_token": KV_BYTES_PER_TOKEN, "kvservice": settings, "engine_env": engine_vars,
         "load_before": load_before, "load_after": load_after,
         "verified": verified, "broken": broken, "interrupted": interrupted, "engine_pids": harness.pids,
         "results": results, "idle_s": plan.idle_s, "idle": idle, "baseline_idle": harness.baseline_idle},
        indent=1))
    print(f"results: {out / 'results.json'}")
    return 0 if all(verified.values()) and not broken and not interrupted else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
