"""TTFT at long prompts: decode-first layer-wise push against today's whole-request push.

    PYTHONPATH=$PWD "$(bash scripts/engine-env.sh vllm)/bin/python" -m benchmarks.vllm_layerwise \\
        [--rounds N] [--lengths 2048,4000] [--out DIR]

One pair of vLLM engines with ``KVServiceConnector`` (``benchmarks.vllm_pd``'s engines,
model and pinning: prefill on CPU 0, decode on CPU 1; both with one key file), and the
flows interleaved request by request on that same pair (the order alternates round by
round), one request in flight:

* ``whole``: the router sends the prompt to the prefill (one token, ``do_remote_decode``),
  then the prefill's hand-off to the decode; the prefill posts one send of every block
  after the prompt's forward;
* ``layerwise``: the router signs a ticket and sends it to the decode (which reserves the
  blocks and expects them), then to the prefill, which writes each layer as its forward
  computes it.

Metrics, from the router's first send: ``ttft_ms`` (the decode's first token) and
``e2e_ms`` (its last); ``wait_ms``: on the decode, vLLM reserving blocks for the remote KV
to the load reported finished (for ``layerwise`` this includes the prefill's forward);
``tail_ms``: from the prefill's answer reaching the router (its forward done) to the decode's
load reported, the part of the hand-off left after the forward (``CLOCK_MONOTONIC`` is one
clock for every process of the host; negative when the load was reported first).
Every decode's tokens are checked against one engine without a connector; a request with
other tokens or a failed one stops the run.  Prints p50 / p90 and the ratio layerwise /
whole, with the load average before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from kvservice._trust.handoff import handoff_key
from kvservice._trust.keys import generate_key, load_key
from kvservice.bench.stats import quantile
from kvservice.integrations.vllm.params import Handoff

from .vllm_pd import (
    MAX_TOKENS,
    ROOT,
    TIMING,
    WARMUP,
    Broken,
    Engine,
    Harness,
    Phase,
    Plan,
    engine_env,
    free_port,
    load_marks,
    make_prompts,
)
from .vllm_pd_engine import BLOCK_SIZE, KV_BYTES_PER_TOKEN

FLOWS = ("whole", "layerwise")
METRICS = ("ttft_ms", "e2e_ms", "wait_ms", "tail_ms")


class Bench:
    def __init__(self, harness: Harness, p: Engine, d: Engine, sender: str, key: bytes, marks: Path) -> None:
        self.harness, self.p, self.d = harness, p, d
        self.sender, self.key, self.marks = sender, key, marks
        self.n = 0

    def one(self, flow: str, prompt: list[int], expected: list[int]) -> dict[str, float]:
        """One request through ``flow``; its times (s), or ``Broken``."""
        self.n += 1
        rid = f"{flow[0]}x{self.n}"
        self.harness.drain()
        start = time.monotonic()
        if flow == "layerwise":
            ticket = Handoff.issue(f"{rid}-kv", (self.sender,), prompt, len(prompt), BLOCK_SIZE, key=self.key,
                                   lifetime_s=30, now=time.time(), ticket=True)
            self.d.generate(f"d{rid}", prompt, MAX_TOKENS, ticket.to_params())
            self.p.generate(f"p{rid}", prompt, 1, ticket.to_prefill_params())
        else:
            self.p.generate(f"p{rid}", prompt, 1, {"do_remote_decode": True})
        deadline = start + self.harness.plan.phase_timeout_s
        first = answered = 0.0
        while True:
            t, who, msg = self.harness.next_event(deadline)
            if msg.get("id") not in (f"p{rid}", f"d{rid}"):
                continue
            if "error" in msg or msg.get("finish") not in (None, "length", "stop"):
                raise Broken(f"{who}: {msg.get('id')} failed: {msg.get('error') or msg.get('finish')}")
            if who == self.p.name and "tokens" in msg:
                answered = t
            if who == self.p.name and "tokens" in msg and flow == "whole":
                if not msg.get("params"):
                    raise Broken(f"{who}: {rid} answered without kv_transfer_params")
                self.d.generate(f"d{rid}", prompt, MAX_TOKENS, msg["params"])
            elif who == self.d.name and msg.get("first"):
                first = t
            elif who == self.d.name and "tokens" in msg:
                if msg["tokens"] != expected:
                    raise Broken(f"{rid}: tokens {msg['tokens']} differ from one engine's {expected}")
                alloc, done = load_marks(self.marks, f"d{rid[0]}x")
                loaded = done.get(self.n)
                wait = None if loaded is None else loaded - alloc[self.n]
                return {"ttft_ms": (first - start) * 1e3, "e2e_ms": (t - start) * 1e3,
                        "wait_ms": float("nan") if wait is None else wait * 1e3,
                        "tail_ms": float("nan") if loaded is None or not answered else (loaded - answered) * 1e3}


def summarize(results: dict[str, dict[str, dict[str, list[float]]]], phases: Sequence[Phase]) -> str:
    lines = []
    for ph in phases:
        lines.append(f"\n## {ph.name} ({ph.tokens * KV_BYTES_PER_TOKEN / 2**20:.1f} MiB of KV per request)")
        lines.append(f"{'metric':<9}" + "".join(f"{f + ' p50/p90 (n)':>30}" for f in FLOWS) + f"{'lw/whole':>10}")
        for metric in METRICS:
            row, p50 = f"{metric:<9}", {}
            for f in FLOWS:
                values = [v for v in results.get(f, {}).get(ph.name, {}).get(metric, []) if v == v]
                if values:
                    p50[f] = quantile(values, 0.5)
                    row += f"{p50[f]:>16.1f} /{quantile(values, 0.9):>8.1f} ({len(values)})"
                else:
                    row += f"{'none':>30}"
            row += f"{p50['layerwise'] / p50['whole']:>9.3f}x" if len(p50) == 2 and p50["whole"] else f"{'-':>10}"
            lines.append(row)
    return "\n".join(lines)


def main(argv: Sequence[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.vllm_layerwise", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=4, help="requests per flow and length (default 4)")
    ap.add_argument("--lengths", default="2048,4000", help="prompt lengths, comma-separated (default 2048,4000)")
    ap.add_argument("--out", type=Path, help="where results.json and the logs go (default: a new temp dir)")
    args = ap.parse_args(list(argv))
    lengths = [int(x) for x in args.lengths.split(",")]
    phases = tuple(Phase(f"{n} tok, 1 in flight", n, 1, args.rounds * len(FLOWS)) for n in lengths)
    out = args.out or Path(tempfile.mkdtemp(prefix="vllm-lw-"))
    (out / "logs").mkdir(parents=True, exist_ok=True)
    began, load_before = time.monotonic(), os.getloadavg()
    plan = Plan(model=out / "model", out=out, phases=phases, prompts=make_prompts(phases),
                max_model_len=max(4096, max(lengths) + MAX_TOKENS))
    harness = Harness(plan)
    key_file = out / "key"
    if not key_file.exists():
        generate_key(key_file)
    results: dict[str, dict[str, dict[str, list[float]]]] = {f: {} for f in FLOWS}
    broken = ""
    try:
        if not (plan.model / "config.json").exists():
            subprocess.run([sys.executable, "-m", "benchmarks.vllm_pd_engine", "model", str(plan.model)],
                           env=engine_env({}), cwd=ROOT, check=True, capture_output=True, timeout=300)
        harness.baseline()
        marks = out / "marks.txt"
        port = free_port()
        common = {"kv_connector_module_path": TIMING, "kv_load_failure_policy": "fail",
                  "kv_connector": "TimedKVService"}
        service = {"auth_key_file": str(key_file)}
        p = harness.start("prefill", 0, {**common, "kv_role": "kv_producer",
                                         "kv_connector_extra_config": {"kvservice": {**service, "port": port}}}, {})
        d = harness.start("decode", 1, {**common, "kv_role": "kv_consumer",
                                        "kv_connector_extra_config": {"kvservice": service}},
                          {"KVSERVICE_BENCH_MARKS": str(marks)})
        p.wait_ready(plan.start_timeout_s)
        d.wait_ready(plan.start_timeout_s)
        bench = Bench(harness, p, d, f"127.0.0.1:{port}", handoff_key(load_key(key_file)) or b"", marks)
        for flow in FLOWS:  # warm-up: the first connection, each flow once
            for i, prompt in enumerate(plan.prompts[WARMUP.name]):
                bench.one(flow, prompt, plan.expected[WARMUP.name][i])
        for ph in phases:
            prompts, expected = plan.prompts[ph.name], plan.expected[ph.name]
            for r in range(args.rounds):
                order = FLOWS if r % 2 == 0 else FLOWS[::-1]
                for j, flow in enumerate(order):
                    i = r * len(FLOWS) + j  # distinct prompts: no cache can serve one
                    for metric, v in bench.one(flow, prompts[i], expected[i]).items():
                        results[flow].setdefault(ph.name, {}).setdefault(metric, []).append(v)
                print(f"{ph.name}: round {r} done", flush=True)
    except (Broken, OSError, RuntimeError, TimeoutError) as exc:
        broken = str(exc)
        print(f"BROKEN: {exc}", flush=True)
    finally:
        harness.stop_all()
    load_after = os.getloadavg()
    header = (f"vLLM P/D through kvservice, layer-wise vs whole-request push: {args.rounds} request(s) per flow and "
              f"length, interleaved, {MAX_TOKENS} tokens decoded, model {KV_BYTES_PER_TOKEN // 1024} KiB KV/token; "
              f"load avg (1/5/15 min) before {'/'.join(f'{x:.2f}' for x in load_before)}, after "
              f"{'/'.join(f'{x:.2f}' for x in load_after)}; {time.monotonic() - began:.0f} s\n"
              "every decode's tokens equal one engine's" + (f"; BROKEN: {broken}" if broken else ""))
    print(header + summarize(results, phases), flush=True)
    (out / "results.json").write_text(json.dumps(
        {"rounds": args.rounds, "lengths": lengths, "load_before": load_before, "load_after": load_after,
         "broken": broken, "engine_pids": harness.pids, "results": results}, indent=1))
    print(f"results: {out / 'results.json'}")
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
