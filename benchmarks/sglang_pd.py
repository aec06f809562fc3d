"""SGLang served end to end: kvservice against SGLang's own transfer backends, as served.

    PYTHONPATH=$PWD "$(bash scripts/engine-env.sh sglang)/bin/python" -m benchmarks.sglang_pd \\
        [--quick] [--rounds N] [--arms kvservice,nixl[,mooncake]] [--faults [--fault-at handoff,before]]
        [--out DIR]

Each arm is the same pair of ``python -m sglang.launch_server`` processes (a prefill and a
decode, as ``tests/integrations/sglang/servers.py`` starts them: the CPU engine, the
``sgl_kernel`` stand-in, a random 2-layer Llama with 8 KV heads made here), differing only in
``--disaggregation-transfer-backend``:

* ``kvservice``: this project;
* ``nixl``: SGLang's own NIXL backend, with ``benchmarks/sglang_nixl_dram`` first on the
  servers' ``PYTHONPATH`` (its pool labelled ``DRAM``, not ``VRAM``: see that file);
* ``mooncake``: SGLang's Mooncake backend over Mooncake's TCP transport
  (``MOONCAKE_PROTOCOL=tcp``, ``MC_FORCE_TCP=1``), with the Mooncake Transfer Engine that the project's own
  environment holds (``kvservice bench``'s Mooncake baseline) on the servers' path.

This process is the router (SGLang's ``mini_lb``: the same body, with the bootstrap fields, to
both servers at once; the client's answer is the decode's, streamed).  A round starts each
arm's pair in turn (the order rotates round by round), sends one warm-up request, runs every
phase and stops the pair.  A phase keeps N requests in flight; per request:

* ``ttft``: the request sent to the decode's first streamed token;
* ``e2e``: the request sent to the decode's last token;
* ``tok/s``: tokens generated over the phase's wall time.

Every arm gets the same prompts; each prompt's greedy tokens must be the same in every arm
(printed as ``tokens: equal`` or the first difference).  Prints p50/p90 per arm and phase and
the ratios kvservice / each other arm; writes ``results.json`` and the servers' logs under
``--out``.

``--faults`` instead runs the seed's faults on each arm, one pair per arm: the decode
SIGKILLed, the decode SIGSTOPped past SGLang's lowered timeouts and then SIGCONTed, the prefill
SIGKILLed; each ``--fault-at handoff`` (1.5 s after the prefill took the request: at these speeds
its KV went over) and/or ``before`` (before any KV moved: the decode's pages
reserved and bootstrapped, the prefill sent the request after the fault).  For each: what
each server answered (HTTP status and reason), how long it took, whether each server is up
and serves the next request (a killed server restarted first).  Writes ``faults.json``.
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvservice.bench.stats import quantile
from tests.integrations.sglang.servers import (
    ROLE_FLAGS,
    SERVE_FLAGS,
    WORDS,
    Answer,
    Pair,
    Server,
    server_env,
    write_model,
)

ROOT = Path(__file__).resolve().parents[1]
DRAM_PATCH = Path(__file__).with_name("sglang_nixl_dram")
ARMS = ("kvservice", "nixl", "mooncake")
#: every arm's prompts: this many tokens, and this many generated
PROMPT_TOKENS = 128
NEW_TOKENS = 16
#: SGLang's bootstrap and waiting timeouts in ``--faults`` (300 s each by default)
FAULT_TIMEOUT_S = 30
#: in ``--faults``, the decode's head start (it takes the request, reserves pages, bootstraps),
#: then the prefill's (it runs the forward and starts the transfer) before the fault: a request
#: takes about a second here idle, 5-15 s at a load average of 18
SETTLE_S = 3.0
PREFILL_HEAD_S = 1.5
#: when a fault lands: after the hand-off (the prefill had its head start) or before the prefill
#: is sent the request (the decode's pages reserved and bootstrapped, none of the KV moved)
FAULT_AT = ("handoff", "before")
#: the slowest a request may be before the router gives up on it
REQUEST_S = 300.0


@dataclass(frozen=True)
class Phase:
    in_flight: int
    requests: int

    @property
    def name(self) -> str:
        return f"{self.in_flight} in flight"


FULL = (Phase(1, 8), Phase(4, 16), Phase(16, 32))
QUICK = (Phase(1, 3),)


def mooncake_path(out: Path) -> Path | None:
    """A directory holding only the project environment's Mooncake Transfer Engine (links)."""
    site = next((ROOT / ".venv" / "lib").glob("python3*/site-packages"), None)
    if site is None or not (site / "mooncake").is_dir():
        return None
    path = out / "mooncake-path"
    path.mkdir(exist_ok=True)
    for entry in site.iterdir():
        if entry.name == "mooncake" or (entry.name.startswith("mooncake_transfer_engine") and entry.suffix == ".libs"):
            link = path / entry.name
            if not link.exists():
                link.symlink_to(entry)
    return path


def arm_env(arm: str, out: Path, timeout_s: int | None) -> dict[str, str]:
    """The servers' environment: ``server_env()``, the arm's path and settings."""
    env = server_env()
    front: list[str] = []
    if arm == "nixl":
        front.append(str(DRAM_PATCH))
    elif arm == "mooncake":
        found = mooncake_path(out)
        if found is None:
            raise SystemExit("mooncake: no Mooncake Transfer Engine in the project's .venv")
        front.append(str(found))
        env["MOONCAKE_PROTOCOL"] = "tcp"
        env["MC_FORCE_TCP"] = "1"  # Mooncake's TCP transport, no RDMA device looked for
    env["PYTHONPATH"] = ":".join([*front, env["PYTHONPATH"]])
    if timeout_s is not None:
        env["SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT"] = env["SGLANG_DISAGGREGATION_WAITING_TIMEOUT"] = str(timeout_s)
    return env


class ArmServer(Server):
    """``servers.Server`` with the arm's transfer backend and environment."""

    def __init__(self, arm: str, env: dict[str, str], name: str, role: str, model: Path, log_dir: Path) -> None:
        self.arm, self.env = arm, env
        super().__init__(f"{arm}-{name}", role, model, log_dir)

    def start(self) -> None:
        assert self.proc is None or self.proc.poll() is not None, f"{self.name} is running"
        self.starts += 1
        flags = list(ROLE_FLAGS[self.role])
        flags[flags.index("--disaggregation-transfer-backend") + 1] = self.arm
        args = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(self.model),
                "--port", str(self.port), *SERVE_FLAGS, *flags]
        if self.bootstrap_port:
            args += ["--disaggregation-bootstrap-port", str(self.bootstrap_port)]
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                         cwd=self.log_dir, start_new_session=True)
        self.ended = False  # as ``Server.start``: this group is ours to signal until reaped


class ArmPair(Pair):
    def __init__(self, arm: str, model: Path, log_dir: Path, timeout_s: int | None = None) -> None:
        env = arm_env(arm, log_dir, timeout_s)
        self.prefill = ArmServer(arm, env, "prefill", "prefill", model, log_dir)
        try:
            self.decode = ArmServer(arm, env, "decode", "decode", model, log_dir)
        except BaseException:
            self.prefill.stop()
            raise

    def stop(self) -> None:
        """As ``Pair.stop``, a stopped (SIGSTOP) server continued first."""
        for server in (self.prefill, self.decode):
            if server.proc is not None and server.proc.poll() is None:
                server.signal(signal.SIGCONT)
        super().stop()


@dataclass
class Timed:
    """One request through the pair: the decode's streamed answer and the prefill's."""

    status: int = 0
    error: str = ""
    tokens: list[int] = field(default_factory=list)
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    prefill_status: int = 0


def stream(server: Server, body: dict[str, Any], started: float) -> Timed:
    """POST ``body`` with ``stream``; the time to the first token and to the end."""
    out = Timed()
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=REQUEST_S)
    try:
        conn.request("POST", "/generate", json.dumps({**body, "stream": True}),
                     {"Content-Type": "application/json"})
        resp = conn.getresponse()
        out.status = resp.status
        if resp.status != 200:
            out.error = resp.read().decode(errors="replace")[:300]
            return out
        for _ in range(100_000):
            line = resp.readline()
            if not line:
                break
            text = line.decode(errors="replace").strip()
            if not text.startswith("data:") or text == "data: [DONE]":
                continue
            chunk = json.loads(text[5:])
            if "error" in chunk:
                out.status, out.error = 500, json.dumps(chunk["error"])[:300]
                break
            ids = list(chunk.get("output_ids") or [])
            if ids and not out.ttft_s:
                out.ttft_s = time.monotonic() - started
            meta = chunk.get("meta_info", {})
            if (meta.get("finish_reason") or {}).get("type") == "abort":  # SGLang's error inside a stream
                out.error = json.dumps(meta["finish_reason"])[:300]
            done = int(meta.get("completion_tokens", 0))
            out.tokens = ids if len(ids) == done else out.tokens + ids  # cumulative or incremental
        out.e2e_s = time.monotonic() - started
    except OSError as exc:
        out.status, out.error = 0, f"{type(exc).__name__}: {exc}"
    finally:
        conn.close()
    return out


def request(pair: ArmPair, prompt: list[int]) -> Timed:
    body = pair.body(prompt)
    body["sampling_params"]["max_new_tokens"] = NEW_TOKENS
    prefilled: dict[str, Answer] = {}
    started = time.monotonic()
    def prefill() -> None:
        try:
            prefilled["a"] = pair.prefill.generate(body)
        except OSError:  # the prefill is gone: the decode's answer says what the client got
            prefilled["a"] = Answer(0, {})

    sent = threading.Thread(target=prefill, daemon=True)
    sent.start()
    timed = stream(pair.decode, body, started)
    sent.join(timeout=REQUEST_S)
    timed.prefill_status = prefilled["a"].status if "a" in prefilled else 0
    return timed


def make_prompts(phases: Sequence[Phase], seed: int = 38) -> dict[str, list[list[int]]]:
    rng = random.Random(seed)
    return {p.name: [[rng.randrange(3, 3 + WORDS) for _ in range(PROMPT_TOKENS)] for _ in range(p.requests)]
            for p in phases}


def run_phase(pair: ArmPair, prompts: list[list[int]], in_flight: int) -> dict[str, Any]:
    started = time.monotonic()
    with ThreadPoolExecutor(in_flight) as pool:
        timed = list(pool.map(lambda prompt: request(pair, prompt), prompts))
    wall = time.monotonic() - started
    ok = [t for t in timed if t.status == 200 and len(t.tokens) == NEW_TOKENS]
    return {"wall_s": wall, "ttft_s": [t.ttft_s for t in ok], "e2e_s": [t.e2e_s for t in ok],
            "tok_per_s": sum(len(t.tokens) for t in ok) / wall, "failed": [asdict(t) for t in timed if t not in ok],
            "tokens": [t.tokens for t in timed]}


def run_arm(arm: str, model: Path, out: Path, phases: Sequence[Phase], prompts: dict[str, list[list[int]]],
            say: Callable[[str], None]) -> dict[str, Any]:
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    pair = ArmPair(arm, model, logs)
    try:
        try:
            pair.wait_ready()
        except (RuntimeError, AssertionError) as exc:  # a server exited, or never said it serves
            say(f"{arm}: broken: {exc}")
            return {"broken": f"start: {str(exc)[-300:]}"}
        say(f"{arm}: pair ready in {time.monotonic() - started:.0f} s")
        warm = request(pair, prompts[phases[0].name][0])
        if warm.status != 200 or len(warm.tokens) != NEW_TOKENS:
            return {"broken": f"warm-up: {warm.status} {warm.error}"}
        result = {}
        for phase in phases:
            result[phase.name] = run_phase(pair, prompts[phase.name], phase.in_flight)
            r = result[phase.name]
            say(f"{arm}: {phase.name}: ttft p50 {quantile(r['ttft_s'], 0.5) * 1e3:.0f} ms, "
                f"{r['tok_per_s']:.1f} tok/s, {len(r['failed'])} failed")
        return result
    finally:
        pair.stop()


def summarize(rounds: list[dict[str, dict[str, Any]]], arms: Sequence[str], phases: Sequence[Phase]) -> str:
    lines = ["| arm | in flight | TTFT p50 | TTFT p90 | e2e p50 | e2e p90 | tok/s | failed |", "|---" * 8 + "|"]
    merged: dict[str, dict[str, dict[str, list[float]]]] = {}
    for arm in arms:
        for phase in phases:
            runs = [r[arm][phase.name] for r in rounds if phase.name in r.get(arm, {})]
            m = merged.setdefault(arm, {}).setdefault(phase.name, {})
            m["ttft"] = [v * 1e3 for run in runs for v in run["ttft_s"]]
            m["e2e"] = [v * 1e3 for run in runs for v in run["e2e_s"]]
            m["tok_s"] = [run["tok_per_s"] for run in runs]
            failed = sum(len(run["failed"]) for run in runs)
            if not runs:
                lines.append(f"| {arm} | {phase.in_flight} | broken: "
                             f"{'; '.join(str(r[arm].get('broken')) for r in rounds if arm in r)} |||||||")
                continue
            lines.append(f"| {arm} | {phase.in_flight} | {quantile(m['ttft'], 0.5):.0f} ms | "
                         f"{quantile(m['ttft'], 0.9):.0f} ms | {quantile(m['e2e'], 0.5):.0f} ms | "
                         f"{quantile(m['e2e'], 0.9):.0f} ms | {quantile(m['tok_s'], 0.5):.1f} | {failed} |")
    if "kvservice" in merged:
        lines += ["", "| kvservice / arm | in flight | TTFT p50 | e2e p50 | tok/s |", "|---" * 5 + "|"]
        ours = merged["kvservice"]
        for arm in arms:
            if arm == "kvservice" or arm not in merged:
                continue
            for phase in phases:
                a, b = ours[phase.name], merged[arm][phase.name]
                if not (a["ttft"] and b["ttft"]):
                    continue
                lines.append(f"| {arm} | {phase.in_flight} | "
                             f"{quantile(a['ttft'], 0.5) / quantile(b['ttft'], 0.5):.2f} | "
                             f"{quantile(a['e2e'], 0.5) / quantile(b['e2e'], 0.5):.2f} | "
                             f"{quantile(a['tok_s'], 0.5) / max(quantile(b['tok_s'], 0.5), 1e-9):.2f} |")
    return "\n".join(lines)


def tokens_agree(rounds: list[dict[str, dict[str, Any]]], arms: Sequence[str], phases: Sequence[Phase]) -> str:
    """``equal`` if every arm produced the same greedy tokens for every prompt, else the first difference."""
    seen: dict[tuple[str, int], tuple[str, list[int]]] = {}
    for r in rounds:
        for arm in arms:
            for phase in phases:
                for i, tokens in enumerate(r.get(arm, {}).get(phase.name, {}).get("tokens", [])):
                    if not tokens:
                        continue
                    first = seen.setdefault((phase.name, i), (arm, tokens))
                    if first[1] != tokens:
                        return f"differ: {phase.name} prompt {i}: {first[0]} {first[1]} vs {arm} {tokens}"
    return f"equal ({len(seen)} prompts)"


# --- faults -------------------------------------------------------------------------------------

def in_background(call: Callable[[], Any]) -> Future[Any]:
    pool = ThreadPoolExecutor(1)
    try:
        return pool.submit(call)
    finally:
        pool.shutdown(wait=False)


def timed_answer(call: Callable[[], Answer]) -> Callable[[], dict[str, Any]]:
    def run() -> dict[str, Any]:
        started = time.monotonic()
        try:
            answer = call()
            text = "" if answer.status == 200 else answer.error
            return {"status": answer.status, "reason": text[:300], "took_s": round(time.monotonic() - started, 1)}
        except OSError as exc:
            return {"status": 0, "reason": f"{type(exc).__name__}: {exc}"[:300],
                    "took_s": round(time.monotonic() - started, 1)}
    return run


def serves(pair: ArmPair, prompt: list[int]) -> bool:
    try:
        return request(pair, prompt).status == 200
    except OSError:
        return False


def fault(pair: ArmPair, kind: str, prompt: list[int], at: str = "handoff") -> dict[str, Any]:
    """``at``: "handoff" lands the fault ``PREFILL_HEAD_S`` after the prefill took the request
    (at these speeds, after its KV went over); "before" once the decode took the request and
    bootstrapped (``SETTLE_S``), before the prefill is sent it: a prefill that then computes and
    writes into a dead or stopped decode, or a decode waiting on a dead prefill (the seed's cases)."""
    body = pair.body(prompt)
    decoding = in_background(timed_answer(lambda: pair.decode.generate(body)))
    time.sleep(SETTLE_S)

    def to_prefill() -> Future[Any]:
        return in_background(timed_answer(lambda: pair.prefill.generate(body)))

    if at == "handoff":
        prefilling = to_prefill()
        time.sleep(PREFILL_HEAD_S)
    if kind == "decode SIGKILL":
        pair.decode.kill()
    elif kind == "prefill SIGKILL":
        pair.prefill.kill()
    else:
        pair.decode.signal(signal.SIGSTOP)
    if at == "before":
        prefilling = to_prefill()  # a killed prefill refuses it at once: the decode's answer is the one
    if kind == "decode SIGSTOP":
        time.sleep(FAULT_TIMEOUT_S + 15)
        pair.decode.signal(signal.SIGCONT)
    result = {"fault": kind, "at": at, "decode": decoding.result(timeout=REQUEST_S),
              "prefill": prefilling.result(timeout=REQUEST_S),
              "prefill_up": pair.prefill.up(), "decode_up": pair.decode.up()}
    for server in (pair.prefill, pair.decode):
        if not server.up():
            server.start()
            server.wait_ready()
    result["serves_next"] = serves(pair, prompt)
    return result


def run_faults(arm: str, model: Path, out: Path, say: Callable[[str], None],
               at: Sequence[str] = ("handoff",)) -> list[dict[str, Any]]:
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    kinds = [(kind, when) for when in at for kind in ("decode SIGKILL", "decode SIGSTOP", "prefill SIGKILL")]
    prompts = make_prompts([Phase(1, len(kinds) + 1)])["1 in flight"]
    pair = ArmPair(arm, model, logs, timeout_s=FAULT_TIMEOUT_S)
    try:
        try:
            pair.wait_ready()
        except (RuntimeError, AssertionError) as exc:
            return [{"fault": "start", "broken": str(exc)[-300:]}]
        if not serves(pair, prompts[0]):
            return [{"fault": "warm-up", "broken": pair.decode.tail(600)}]
        results = []
        for i, (kind, when) in enumerate(kinds):
            results.append(fault(pair, kind, prompts[i + 1], when))
            say(f"{arm}: {json.dumps(results[-1])}")
        return results
    finally:
        pair.stop()


def faults_table(results: dict[str, list[dict[str, Any]]]) -> str:
    lines = ["| arm | fault | at | decode's answer (took) | prefill's answer (took) | up after | serves next |",
             "|---" * 7 + "|"]
    for arm, rows in results.items():
        for row in rows:
            if "broken" in row:
                lines.append(f"| {arm} | {row['fault']} || broken: {row['broken'][-200:]!r} ||||")
                continue

            def said(a: dict[str, Any]) -> str:
                reason = a["reason"].replace("|", "/").replace("\n", " ")[:160]
                return f"{a['status']} {reason} ({a['took_s']} s)"
            up = f"prefill {'up' if row['prefill_up'] else 'down'}, decode {'up' if row['decode_up'] else 'down'}"
            lines.append(f"| {arm} | {row['fault']} | {row.get('at', 'handoff')} | {said(row['decode'])} | "
                         f"{said(row['prefill'])} | {up} | "
                         f"{'yes' if row['serves_next'] else 'no'} |")
    return "\n".join(lines)


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks.sglang_pd", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="one concurrency, three requests")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--arms", default="kvservice,nixl", help=f"comma-separated, of {', '.join(ARMS)}")
    parser.add_argument("--faults", action="store_true", help="the seed's faults per arm instead of timings")
    parser.add_argument("--fault-at", default="handoff",
                        help=f"with --faults: when each fault lands, comma-separated, of {', '.join(FAULT_AT)}")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--report", type=Path, default=None, help="print the tables of a results.json and exit")
    args = parser.parse_args(argv)
    if args.report is not None:
        saved = json.loads(args.report.read_text())
        phases_saved = [Phase(**p) for p in saved["phases"]]
        arms_saved = list(dict.fromkeys(arm for r in saved["rounds"] for arm in r))
        report(saved["rounds"], arms_saved, phases_saved, args.report.parent)
        return 0
    arms = [a for a in args.arms.split(",") if a]
    if unknown := set(arms) - set(ARMS):
        parser.error(f"unknown arms {sorted(unknown)}: choose from {', '.join(ARMS)}")
    at = [a for a in args.fault_at.split(",") if a]
    if not at or set(at) - set(FAULT_AT):
        parser.error(f"--fault-at takes a comma-separated subset of {', '.join(FAULT_AT)}, got {args.fault_at!r}")
    out = (args.out or Path(tempfile.mkdtemp(prefix="sglang-pd-"))).resolve()
    out.mkdir(parents=True, exist_ok=True)

    def say(text: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)

    model = out / "model"
    if not (model / "config.json").exists():
        write_model(model, 8)
    if args.faults:
        results: dict[str, list[dict[str, Any]]] = {}
        for arm in arms:
            results[arm] = run_faults(arm, model, out / arm, say, at)
            (out / "faults.json").write_text(json.dumps(results, indent=1))
        print(faults_table(results))
        return 0
    phases = QUICK if args.quick else FULL
    prompts = make_prompts(phases)
    rounds: list[dict[str, dict[str, Any]]] = []
    for n in range(args.rounds):
        order = arms[n % len(arms):] + arms[:n % len(arms)]
        rounds.append({})
        for arm in order:
            rounds[-1][arm] = run_arm(arm, model, out / f"round{n}" / arm, phases, prompts, say)
            (out / "results.json").write_text(json.dumps({"phases": [asdict(p) for p in phases], "rounds": rounds}))
    report(rounds, arms, phases, out)
    return 0


def report(rounds: list[dict[str, dict[str, Any]]], arms: Sequence[str], phases: Sequence[Phase], out: Path) -> None:
    print(summarize(rounds, arms, phases))
    print(f"tokens: {tokens_agree(rounds, arms, phases)}")
    print(f"out: {out}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
