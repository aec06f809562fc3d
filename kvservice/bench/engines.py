"""The engine-memory cases of ``kvservice bench``: engines' own tensors, tensor parallelism,
layer-wise sends and fan-out, each measured against a baseline of the same run.

Every case runs a *group* of rank processes (``engine_side``), prefill ranks
sending and decode ranks receiving, each holding one engine layout's tensors
(``SyntheticKV``) with a ``TransferService`` and a raw-NIXL agent on them.  The
group is started for the case, used for every repeat, and stopped.

* ``engine``: the 256 MiB request (128 pages of Llama-3-8B KV) between two engine
  memories of 32 layers x K/V regions, kvservice against raw NIXL posting the same
  descriptors (``kv/raw``, target >= 0.9).
* ``tp``: ``(tp_p, tp_d)`` pairs, token-major (``NHD``, SGLang's MHA pool: a sliced
  pair moves ``tokens`` runs per page per region) and head-major (``HND``, vLLM's
  head-major blocks: one descriptor per page) pages; GB/s of both methods, and
  what slicing costs: ``NHD`` against ``HND`` at the same pair.
* ``layerwise``: a simulated prefill (a fixed time per layer) sending each layer
  as it is computed against sending the whole request after the forward pass;
  the tail from "last layer computed" to the decode's ``SUCCESS``.
* ``fanout``: one prefill serving many decodes at once (and many prefills one
  decode): aggregate GB/s of both methods, per-peer GB/s and Jain's fairness index.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

from kvservice import TensorParallel
from kvservice.bench._lines import Child, ChildError
from kvservice.bench.methods import RUN_TIMEOUT_S, SETUP_TIMEOUT_S
from kvservice.bench.stats import median, quantile
from kvservice.memory.synthetic import EngineSpec

PARTS = ("engine", "tp", "layerwise", "fanout")
METHODS = ("raw_nixl", "kvservice")
#: Llama-3-8B KV, as the other workloads (32 layers, 8 KV heads, head dim 128, bf16, 16-token pages)
MODEL = {"layers": 32, "page_tokens": 16, "heads": 8, "head_dim": 128, "dtype": "bfloat16"}
#: the layouts of the TP cases: token-major and head-major pages
ORDERS = {"nhd": "sglang_mha", "hnd": "vllm_hnd"}
TARGETS = {"engine_ratio": 0.9, "nhd_over_hnd": 0.5}


@dataclass(frozen=True)
class EnginePlan:
    repeats: int
    engine_pages: int  # pages of the engine request (128: 256 MiB)
    engines: tuple[str, ...]
    tp_pages: int
    tp_pairs: tuple[tuple[int, int], ...]
    tp_orders: tuple[str, ...]
    layerwise_pages: int
    layerwise_requests: int  # per mode and repeat
    per_layer_ms: float
    fanout_peers: int
    fanin_peers: int
    fanout_requests: int  # per peer
    fanout_pages: int  # per request


FULL = EnginePlan(repeats=5, engine_pages=128, engines=("sglang_mha", "vllm"), tp_pages=64,
                  tp_pairs=((1, 1), (2, 1), (1, 2), (4, 2)), tp_orders=("nhd", "hnd"),
                  layerwise_pages=32, layerwise_requests=8, per_layer_ms=2.0,
                  fanout_peers=8, fanin_peers=4, fanout_requests=4, fanout_pages=4)
QUICK = EnginePlan(repeats=1, engine_pages=8, engines=("sglang_mha",), tp_pages=4, tp_pairs=((1, 2),),
                   tp_orders=("nhd", "hnd"), layerwise_pages=4, layerwise_requests=3, per_layer_ms=1.0,
                   fanout_peers=2, fanin_peers=0, fanout_requests=2, fanout_pages=2)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def spec(engine: str, pages: int, tp_size: int = 1, tp_rank: int = 0) -> EngineSpec:
    return EngineSpec(engine=engine, pages=pages, tp_size=tp_size, tp_rank=tp_rank, **MODEL)  # type: ignore[arg-type]


def model_page_bytes() -> int:
    return 2 * MODEL["layers"] * MODEL["page_tokens"] * MODEL["heads"] * MODEL["head_dim"] * 2  # type: ignore[operator]


@dataclass
class Sub:
    """One request (or TP sub-request) from sender ``i`` to receiver ``j``."""

    i: int
    j: int
    rid: str
    src: list[int]
    dst: list[int]
    nbytes: int


class Group:
    """Prefill and decode rank processes for one case; ``close`` stops each by its pid."""

    def __init__(self, senders: list[EngineSpec], receivers: list[EngineSpec], routes: list[tuple[int, int]],
                 loop: str, env: dict[str, str | None] | None) -> None:
        self.senders: list[Child] = []
        self.receivers: list[Child] = []
        try:
            for role, specs, out in (("send", senders, self.senders), ("recv", receivers, self.receivers)):
                for s in specs:
                    out.append(Child("kvservice.bench.engine_side", role, {"spec": s.to_dict(), "loop": loop},
                                     env=env))
            hs = [c.wait("ready", SETUP_TIMEOUT_S) for c in self.senders]
            hr = [c.wait("ready", SETUP_TIMEOUT_S) for c in self.receivers]
            self.addresses = [h["address"] for h in hs]
            for i, c in enumerate(self.senders):
                peers = [{"index": j, "metadata": hr[j]["metadata"], "memory": hr[j]["memory"]}
                         for a, j in routes if a == i]
                c.call("connect_raw", "connected", SETUP_TIMEOUT_S, peers=peers)
        except BaseException:
            self.close()
            raise

    def measure(self, method: str, subs: list[Sub], prefix: str, concurrency: int) -> dict[str, Any]:
        """Move ``subs`` once by ``method``; per sender, ``concurrency`` requests at a time."""
        reqs = [{**s.__dict__, "rid": f"{prefix}-{s.rid}", "peer": s.j, "sender": self.addresses[s.i]}
                for s in subs]
        busy_r = sorted({s.j for s in subs})
        busy_s = sorted({s.i for s in subs})
        for j in busy_r:
            mine = [r for r in reqs if r["j"] == j]
            if method == "raw_nixl":
                self.receivers[j].call("raw_expect", "expecting", rids=[r["rid"] for r in mine])
            else:
                self.receivers[j].call("kv_expect", "expecting", RUN_TIMEOUT_S, requests=mine)
        for i in busy_s:
            self.senders[i].send("raw" if method == "raw_nixl" else "kv",
                                 requests=[r for r in reqs if r["i"] == i], concurrency=concurrency)
        sent = {i: self.senders[i].wait("done", RUN_TIMEOUT_S) for i in busy_s}
        got = {j: self.receivers[j].wait("arrived", RUN_TIMEOUT_S) for j in busy_r}
        if any(d.get("lags") is not None for d in sent.values()):  # engine_side's kv runs carry none
            raise ChildError(f"{method}: a sender ran the loop-lag probe, whose CPU the GB/s would carry")
        for who, d in [*sent.items(), *got.items()]:
            if d.get("nfailed") or d.get("missing") or ("ok" in d and d["ok"] != sum(1 for r in reqs if r["i"] == who)):
                raise ChildError(f"{method}: requests failed: {d.get('failed') or d}")
        start = min(d["start"] for d in sent.values())
        end = max([d["end"] for d in sent.values()] + [d["last"] for d in got.values()])
        total = sum(s.nbytes for s in subs)
        per_recv = {j: sum(s.nbytes for s in subs if s.j == j) / (got[j]["last"] - start) / 1e9 for j in busy_r}
        per_send = {i: sum(s.nbytes for s in subs if s.i == i) / (max(
            [sent[i]["end"]] + [got[s.j]["at"][f"{prefix}-{s.rid}"] for s in subs if s.i == i]) - start) / 1e9
            for i in busy_s}
        out: dict[str, Any] = {"elapsed_s": end - start, "gbps": total / (end - start) / 1e9,
                               "per_receiver_gbps": list(per_recv.values()), "per_sender_gbps": list(per_send.values())}
        if "descriptors" in next(iter(sent.values())):
            out["descriptors"] = sum(d["descriptors"] for d in sent.values())
        return out

    def close(self) -> None:
        for c in [*self.senders, *self.receivers]:
            c.close()


def jain(xs: list[float]) -> float:
    """Jain's fairness index: 1 when every peer got the same, 1/n when one got everything."""
    return sum(xs) ** 2 / (len(xs) * sum(x * x for x in xs)) if xs and any(xs) else 0.0


def tp_subs(tp: TensorParallel, pages: int) -> list[Sub]:
    """The 256 MiB-style request of ``pages`` pages (0.. on both sides), split into TP sub-requests."""
    per_head = pages * model_page_bytes() // MODEL["heads"]  # type: ignore[operator]
    heads_p, heads_d = MODEL["heads"] // tp.prefill, MODEL["heads"] // tp.decode  # type: ignore[operator]
    out = []
    for j in range(tp.decode):
        for i in tp.sources(j):
            shared = min((i + 1) * heads_p, (j + 1) * heads_d) - max(i * heads_p, j * heads_d)
            out.append(Sub(i, j, TensorParallel.request_id("r", i, j), list(range(pages)), list(range(pages)),
                           shared * per_head))
    return out


def _interleaved(group: Group, subs: list[Sub], repeats: int, concurrency: int, label: str) -> dict[str, Any]:
    group.measure("raw_nixl", subs, "warm-raw", concurrency)
    group.measure("kvservice", subs, "warm-kv", concurrency)
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in METHODS}
    for rep in range(repeats):
        order = METHODS if rep % 2 == 0 else METHODS[::-1]
        for m in order:
            runs[m].append(group.measure(m, subs, f"{rep}-{m}", concurrency))
        log(f"  [{rep + 1}/{repeats}] {label:<16} " + ", ".join(
            f"{m} {runs[m][-1]['gbps']:.2f} GB/s" for m in METHODS))
    ratio = [k["gbps"] / r["gbps"] for k, r in zip(runs["kvservice"], runs["raw_nixl"], strict=True)]
    methods = {m: {key: median([r[key] for r in runs[m]]) for key in ("gbps", "elapsed_s")} for m in METHODS}
    return {"methods": methods, "kv_over_raw": {"metric": "gbps", "median": median(ratio), "per_repeat": ratio},
            "runs": runs, "bytes": sum(s.nbytes for s in subs), "requests": len(subs),
            # index entries posted per run (both methods post the same arrays; NIXL merges adjacent ones)
            "descriptors": runs["raw_nixl"][0].get("descriptors")}


# -- the cases ----------------------------------------------------------------------------------------


def engine_cases(plan: EnginePlan, loop: str, env: dict[str, str | None] | None) -> list[dict[str, Any]]:
    out = []
    for engine in plan.engines:
        n = plan.engine_pages
        group = Group([spec(engine, n)], [spec(engine, n)], [(0, 0)], loop, env)
        try:
            subs = [Sub(0, 0, "r", list(range(n)), list(range(n)), n * model_page_bytes())]
            entry = _interleaved(group, subs, plan.repeats, 1, f"engine/{engine}")
        finally:
            group.close()
        out.append({"key": f"engine/{engine}", "part": "engine", "engine": engine, "pages": n, **entry})
    return out


def tp_cases(plan: EnginePlan, loop: str, env: dict[str, str | None] | None) -> list[dict[str, Any]]:
    out = []
    for order in plan.tp_orders:
        for tp_p, tp_d in plan.tp_pairs:
            tp = TensorParallel(tp_p, tp_d)
            n, engine = plan.tp_pages, ORDERS[order]
            routes = [(i, j) for j in range(tp_d) for i in tp.sources(j)]
            group = Group([spec(engine, n, tp_p, i) for i in range(tp_p)],
                          [spec(engine, n, tp_d, j) for j in range(tp_d)], routes, loop, env)
            key = f"tp/{order}-{tp_p}x{tp_d}"
            try:
                # every prefill rank sends its sub-requests at once, as an engine's ranks do
                entry = _interleaved(group, tp_subs(tp, n), plan.repeats, tp_d, key)
            finally:
                group.close()
            out.append({"key": key, "part": "tp", "order": order, "engine": engine, "tp": [tp_p, tp_d],
                        "pages": n, "sliced": tp_p != tp_d, **entry})
    by = {(c["order"], tuple(c["tp"])): c for c in out}
    for c in out:  # what slicing costs: token-major pages against head-major ones, same pair
        other = by.get(("hnd", tuple(c["tp"])))
        if c["order"] == "nhd" and other is not None:
            c["nhd_over_hnd"] = {m: c["methods"][m]["gbps"] / other["methods"][m]["gbps"] for m in METHODS
                                 if other["methods"][m]["gbps"]}
    return out


def layerwise_case(plan: EnginePlan, loop: str, env: dict[str, str | None] | None) -> dict[str, Any]:
    n, count = plan.layerwise_pages, plan.layerwise_requests
    group = Group([spec("sglang_mha", n)], [spec("sglang_mha", n)], [(0, 0)], loop, env)
    tails: dict[str, list[float]] = {"layer": [], "whole": []}
    try:
        for rep in range(-1, plan.repeats):  # -1: the warm-up
            for mode in ("layer", "whole") if rep % 2 == 0 else ("whole", "layer"):
                reqs = [{"rid": f"lw{rep}-{mode}-{k}", "src": list(range(n)), "dst": list(range(n)),
                         "sender": group.addresses[0]} for k in range(count)]
                group.receivers[0].call("kv_expect", "expecting", RUN_TIMEOUT_S, requests=reqs)
                done = group.senders[0].call("forward", "done", RUN_TIMEOUT_S, requests=reqs, mode=mode,
                                             per_layer_s=plan.per_layer_ms / 1e3)
                got = group.receivers[0].wait("arrived", RUN_TIMEOUT_S)
                if done["nfailed"] or got["nfailed"] or got["missing"]:
                    raise ChildError(f"layerwise {mode}: {done['failed'] or got}")
                if rep >= 0:
                    tails[mode] += [(got["at"][r["rid"]] - done["computed"][r["rid"]]) * 1e3 for r in reqs]
            if rep >= 0:
                log(f"  [{rep + 1}/{plan.repeats}] layerwise        tail p50 layer-wise "
                    f"{median(tails['layer'][-count:]):.2f} ms, whole {median(tails['whole'][-count:]):.2f} ms")
    finally:
        group.close()
    modes = {m: {"tail_p50_ms": quantile(t, 0.5), "tail_p99_ms": quantile(t, 0.99), "tail_max_ms": max(t),
                 "samples": len(t)} for m, t in tails.items()}
    return {"key": "layerwise", "part": "layerwise", "pages": n, "bytes": n * model_page_bytes(),
            "layers": MODEL["layers"], "per_layer_ms": plan.per_layer_ms, "requests": len(tails["layer"]),
            "modes": modes, "tails_ms": tails,
            "layer_over_whole": {q: modes["layer"][f"tail_{q}_ms"] / modes["whole"][f"tail_{q}_ms"]
                                 for q in ("p50", "p99") if modes["whole"][f"tail_{q}_ms"]}}


def fanout_cases(plan: EnginePlan, loop: str, env: dict[str, str | None] | None) -> list[dict[str, Any]]:
    out = []
    k, w = plan.fanout_requests, plan.fanout_pages
    for name, peers in (("1to", plan.fanout_peers), ("to1", plan.fanin_peers)):
        if peers < 2:
            continue
        fan_out = name == "1to"
        key = f"fanout/1to{peers}" if fan_out else f"fanout/{peers}to1"
        many = peers * k * w  # pages on the side with one process
        one = k * w
        s_pages, r_pages = (many, one) if fan_out else (one, many)
        senders = [spec("vllm", s_pages)] * (1 if fan_out else peers)
        receivers = [spec("vllm", r_pages)] * (peers if fan_out else 1)
        routes = [(0, j) for j in range(peers)] if fan_out else [(i, 0) for i in range(peers)]
        subs = []
        for r in range(k):  # round-robin over the peers, so the order favours none
            for p in range(peers):
                pages_one = list(range(r * w, (r + 1) * w))
                pages_many = list(range((p * k + r) * w, (p * k + r + 1) * w))
                i, j = (0, p) if fan_out else (p, 0)
                src, dst = (pages_many, pages_one) if fan_out else (pages_one, pages_many)
                subs.append(Sub(i, j, f"f{p}-{r}", src, dst, w * model_page_bytes()))
        group = Group(senders, receivers, routes, loop, env)
        try:
            entry = _interleaved(group, subs, plan.repeats, peers if fan_out else 1, key)
        finally:
            group.close()
        side = "per_receiver_gbps" if fan_out else "per_sender_gbps"
        for m in METHODS:
            fair = [jain(r[side]) for r in entry["runs"][m]]
            lows = [min(r[side]) / max(r[side]) for r in entry["runs"][m]]
            entry["methods"][m].update(jain=median(fair), min_over_max=median(lows),
                                       peer_gbps_min=median([min(r[side]) for r in entry["runs"][m]]),
                                       peer_gbps_max=median([max(r[side]) for r in entry["runs"][m]]))
        out.append({"key": key, "part": "fanout", "peers": peers, "direction": "out" if fan_out else "in",
                    "pages": k * w * peers, **entry})
    return out


def run(only: set[str], quick: bool, repeats: int | None, loop: str,
        env: dict[str, str | None] | None) -> dict[str, Any]:
    plan = QUICK if quick else FULL
    if repeats is not None:
        plan = EnginePlan(**{**plan.__dict__, "repeats": repeats})
    results: dict[str, Any] = {"plan": {**plan.__dict__}, "model": MODEL, "cases": []}
    if "engine" in only:
        results["cases"] += engine_cases(plan, loop, env)
    if "tp" in only:
        results["cases"] += tp_cases(plan, loop, env)
    if "layerwise" in only:
        results["cases"].append(layerwise_case(plan, loop, env))
    if "fanout" in only:
        results["cases"] += fanout_cases(plan, loop, env)
    return results


def evaluate(results: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for c in results.get("cases", []):
        if c["part"] == "engine":
            got = c["kv_over_raw"]["median"]
            rows.append({"target": f"{c['key']} kv/raw GB/s", "measured": got,
                         "goal": f">= {TARGETS['engine_ratio']:g}", "met": got >= TARGETS["engine_ratio"], "note": ""})
        elif c["part"] == "tp" and c.get("sliced") and "kvservice" in c.get("nhd_over_hnd", {}):
            got = c["nhd_over_hnd"]["kvservice"]  # token-major slices (through staging) against head-major pages
            rows.append({"target": f"{c['key']} kv nhd/hnd GB/s, same TP pair", "measured": got,
                         "goal": f">= {TARGETS['nhd_over_hnd']:g}", "met": got >= TARGETS["nhd_over_hnd"], "note": ""})
    return rows
