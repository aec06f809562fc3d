"""Decode-first, layer-wise push between two real vLLM engines: the router (here, the test)
signs a ticket under the cluster's key and gives it to the decode first (it reserves the
prompt's blocks and expects them) and to the prefill, which writes each layer's blocks as
its forward computes them.  Judged, as the whole-request tests are, by the decode's greedy
tokens against one engine without any connector."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: scripts/engine-env.sh vllm builds its environment")

from kvservice._trust.handoff import handoff_key
from kvservice._trust.keys import generate_key, load_key
from kvservice.integrations.vllm.params import Handoff

from .engine_proc import MODEL
from .engines import MAX_TOKENS, Engine, free_port
from .test_vllm_engines import settled, vllm_saw

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]



@pytest.fixture
def spawn(model: Path, logs: Path, key_file: Path) -> Iterator[Any]:
    """Engines with the cluster's key in ``key_file``."""
    started: list[Engine] = []

    def start(name: str, role: str, cpu: int, *, max_batched: int | None = None, prefix_caching: bool = False,
              **service: Any) -> Engine:
        engine = Engine(name, model, role=role, extra={"kvservice": {"auth_key_file": str(key_file), **service}},
                        cpu=cpu, log_dir=logs, max_batched=max_batched, prefix_caching=prefix_caching)
        started.append(engine)
        return engine

    yield start
    for engine in started:
        engine.signal(signal.SIGCONT)
        engine.stop()


def ticket(rid: str, prefill: Engine, prompt: list[int], key: Path, *, age_s: float = 0.0,
           num_tokens: int | None = None) -> Handoff:
    """The router's ticket: ``prefill``'s kvservice writes ``prompt``'s KV to request ``rid``."""
    return Handoff.issue(rid, (prefill.ready["address"],), prompt, len(prompt) if num_tokens is None else num_tokens,
                         32, key=handoff_key(load_key(key)), lifetime_s=30, now=time.time() - age_s, ticket=True)


def decode_first(p: Engine, d: Engine, prompts: list[list[int]], key: Path, tag: str) -> list[dict[str, Any]]:
    """Each prompt to the decode with its ticket, then to the prefill (one token); the
    decode's results, and the prefill answered with no hand-off."""
    tickets = [ticket(f"{tag}{i}-kv", p, prompt, key) for i, prompt in enumerate(prompts)]
    for i, (prompt, t) in enumerate(zip(prompts, tickets, strict=True)):
        d.generate(f"{tag}{i}", prompt, MAX_TOKENS, t.to_params())
    for i, (prompt, t) in enumerate(zip(prompts, tickets, strict=True)):
        p.generate(f"{tag}{i}", prompt, 1, t.to_prefill_params())
    for i in range(len(prompts)):
        assert not p.result(f"{tag}{i}")["params"], "a ticket's prefill hands nothing off"
    return [d.result(f"{tag}{i}", timeout=180) for i in range(len(prompts))]


def test_layerwise_tokens_equal_a_single_engines_whole_and_chunked(
        spawn: Any, key_file: Path, prompts: list[list[int]], baseline: list[list[int]]) -> None:
    p = spawn("prefill", "kv_producer", 0, port=free_port())
    d = spawn("decode", "kv_consumer", 1)
    got = decode_first(p, d, prompts, key_file, "a")
    assert [g["tokens"] for g in got] == baseline
    assert [g["cached"] for g in got] == [len(prompt) for prompt in prompts]  # the whole prompt loaded
    ps, ds = settled(p), settled(d)
    assert ps["scheduler"] == {"layerwise": 4, "handoffs_freed": 4} and ps["worker"] == {"sends_ok": 4}, ps
    assert ds["scheduler"] == {"loads": 4} and ds["worker"] == {"loads_ok": 4}, ds
    assert vllm_saw(ps) == {"layerwise": 4, "handoffs_freed": 4, "sends_ok": 4}
    # posted from save_kv_layer, during the forward: each layer of each prompt's one chunk
    assert ps["layers_in_forward"] == 4 * MODEL["num_hidden_layers"], ps

    # a prefill that computes each prompt in chunks of 32 tokens (vLLM's chunked prefill): each
    # step writes the blocks it completed, layer by layer; the last one the partial block
    c = spawn("prefill-chunked", "kv_producer", 0, port=free_port(), max_batched=32)
    got = decode_first(c, d, prompts, key_file, "c")
    assert [g["tokens"] for g in got] == baseline
    assert [g["cached"] for g in got] == [len(prompt) for prompt in prompts]
    cs = settled(c)
    assert cs["scheduler"] == {"layerwise": 4, "handoffs_freed": 4} and cs["worker"] == {"sends_ok": 4}, cs
    # more than one chunk per prompt (each step's completed blocks), each layer posted in the forward
    assert cs["layers_in_forward"] > len(prompts) * MODEL["num_hidden_layers"], cs

    # with the option off (no ticket), today's whole-request hand-off, unchanged
    for i, prompt in enumerate(prompts):
        p.generate(f"w{i}", prompt, 1, {"do_remote_decode": True})
    handoffs = [p.result(f"w{i}")["params"] for i in range(len(prompts))]
    assert all("ticket" not in h["kvservice"] for h in handoffs)
    for i, (prompt, h) in enumerate(zip(prompts, handoffs, strict=True)):
        h.pop("remote_prefill_cached_tokens", None)
        d.generate(f"w{i}", prompt, MAX_TOKENS, h)
    assert [d.result(f"w{i}", timeout=180)["tokens"] for i in range(len(prompts))] == baseline
    assert settled(p)["scheduler"] == {"layerwise": 4, "handoffs": 4, "handoffs_freed": 8}


def test_prefill_killed_the_decode_recomputes_and_decode_killed_the_prefill_frees_its_blocks(
        spawn: Any, key_file: Path, prompts: list[list[int]], baseline: list[list[int]]) -> None:
    p = spawn("prefill", "kv_producer", 0, port=free_port(), bootstrap_timeout_s=8.0)
    d = spawn("decode", "kv_consumer", 1)
    assert [g["tokens"] for g in decode_first(p, d, prompts[:1], key_file, "w")] == baseline[:1]

    # the prefill killed while the decode waits for its layers: every load fails, recomputed
    p.signal(signal.SIGSTOP)
    tickets = [ticket(f"k{i}-kv", p, prompt, key_file) for i, prompt in enumerate(prompts)]
    for i, (prompt, t) in enumerate(zip(prompts, tickets, strict=True)):
        d.generate(f"k{i}", prompt, MAX_TOKENS, t.to_params())
        p.generate(f"k{i}", prompt, 1, t.to_prefill_params())
    d.wait_state(lambda s: s["scheduler"].get("loads", 0) == 1 + len(prompts))
    time.sleep(0.5)
    assert not any(d.done(f"k{i}") for i in range(len(prompts)))
    p.kill()
    assert [d.result(f"k{i}", timeout=120)["tokens"] for i in range(len(prompts))] == baseline
    ds = settled(d)
    assert ds["worker"] == {"loads_ok": 1, "load_failed": len(prompts)}, ds

    # the decode killed once its expects are out: the prefill's layer sends fail, it frees
    # every block and serves a new decode
    p2 = spawn("prefill-2", "kv_producer", 0, port=free_port(), bootstrap_timeout_s=8.0)
    tickets = [ticket(f"x{i}-kv", p2, prompt, key_file) for i, prompt in enumerate(prompts)]
    for i, (prompt, t) in enumerate(zip(prompts, tickets, strict=True)):
        d.generate(f"x{i}", prompt, MAX_TOKENS, t.to_params())
    d.wait_state(lambda s: s["scheduler"].get("loads", 0) == 1 + 2 * len(prompts))
    p2.wait_state(lambda s: s["early_expects"] == len(prompts))  # the expects are there, before the prompts
    d.kill()
    for i, (prompt, t) in enumerate(zip(prompts, tickets, strict=True)):
        p2.generate(f"x{i}", prompt, 1, t.to_prefill_params())
    for i in range(len(prompts)):
        p2.result(f"x{i}")
    ps = settled(p2)
    assert ps["held"] == {} and ps["worker"] == {"send_failed": len(prompts)}, ps
    d2 = spawn("decode-2", "kv_consumer", 1)
    assert [g["tokens"] for g in decode_first(p2, d2, prompts, key_file, "y")] == baseline

    # a ticket whose decode never expects: the prefill frees its blocks after bootstrap_timeout_s
    orphan = ticket("o0-kv", p2, prompts[0], key_file)
    p2.generate("o0", prompts[0], 1, orphan.to_prefill_params())
    p2.result("o0")
    assert len(p2.state()["held"]) == 1
    started = time.monotonic()
    ps = p2.wait_state(lambda s: not s["held"], timeout=60)
    assert time.monotonic() - started < 30 and ps["free_blocks"] == ps["total_blocks"] - 1, ps
    assert ps["worker"]["send_failed"] == len(prompts) + 1, ps


def test_tickets_not_proved_are_refused_and_counted_on_both_sides(
        spawn: Any, key_file: Path, tmp_path: Path, prompts: list[list[int]], baseline: list[list[int]]) -> None:
    p = spawn("prefill", "kv_producer", 0, port=free_port())
    d = spawn("decode", "kv_consumer", 1, arrival_timeout_s=5.0)
    other = tmp_path / "other-key"
    generate_key(other)
    good = ticket("g0-kv", p, prompts[0], key_file)
    body = good.body()
    unsigned = {k: v for k, v in body.items() if k != "mac"}
    hostile: list[tuple[str, dict[str, Any]]] = [
        ("handoff_unsigned", unsigned),
        ("handoff_forged", {**body, "request": "nobody-kv"}),
        ("handoff_forged", {**body, "ticket": True, "num_tokens": 32}),
        ("handoff_forged", {k: v for k, v in body.items() if k != "ticket"}),  # a ticket is no hand-off
        ("handoff_forged", ticket("f0-kv", p, prompts[0], other).body()),
        ("handoff_expired", ticket("e0-kv", p, prompts[0], key_file, age_s=120).body()),
    ]
    # the decode refuses each before it reserves or dials anything, and prefills locally
    for i, (_, raw) in enumerate(hostile):
        d.generate(f"h{i}", prompts[0], MAX_TOKENS, {"do_remote_prefill": True, "do_remote_decode": False,
                                                      "kvservice": raw})
    assert all(d.result(f"h{i}", timeout=180)["tokens"] == baseline[0] for i in range(len(hostile)))
    ds = settled(d)
    kinds = {kind for kind, _ in hostile}
    assert {k: v for k, v in ds["scheduler"].items() if k.startswith("handoff_")} == \
        {kind: sum(k == kind for k, _ in hostile) for kind in kinds}, ds
    assert "loads" not in ds["scheduler"], ds

    # the prefill refuses each too (the prefill's own answer: today's whole hand-off)
    for i, (_, raw) in enumerate(hostile):
        p.generate(f"h{i}", prompts[0], 1, {"do_remote_decode": True, "kvservice": raw})
    answers = [p.result(f"h{i}")["params"] for i in range(len(hostile))]
    assert all(a["do_remote_prefill"] and "ticket" not in a["kvservice"] for a in answers), answers
    ps = p.state()
    assert {k: v for k, v in ps["scheduler"].items() if k.startswith("handoff_")} == \
        {kind: sum(k == kind for k, _ in hostile) for kind in kinds}, ps

    # a ticket presented by a second decode request: replayed
    got = decode_first(p, d, prompts[:1], key_file, "r")
    assert got[0]["tokens"] == baseline[0]
    replay = ticket("rr-kv", p, prompts[0], key_file)  # issued afresh: another MAC, not a replay
    d.generate("r1", prompts[0], MAX_TOKENS, replay.to_params())
    d.generate("r2", prompts[0], MAX_TOKENS, replay.to_params())
    p.generate("r1", prompts[0], 1, replay.to_prefill_params())
    assert d.result("r1", timeout=180)["tokens"] == d.result("r2", timeout=180)["tokens"] == baseline[0]
    assert settled(d)["scheduler"]["handoff_replayed"] == 1


def test_a_decode_holding_the_first_blocks_declines_and_the_prefill_frees_at_once(
        spawn: Any, key_file: Path, prompts: list[list[int]], baseline: list[list[int]]) -> None:
    p = spawn("prefill", "kv_producer", 0, port=free_port(), bootstrap_timeout_s=60.0)
    d = spawn("decode-cached", "kv_consumer", 1, prefix_caching=True)
    prompt = prompts[2]  # 100 tokens: 3 whole blocks and a partial one
    assert decode_first(p, d, [prompt], key_file, "a")[0]["tokens"] == baseline[2]
    settled(p)
    # the same prompt again: the decode's prefix cache holds its first 3 blocks
    started = time.monotonic()
    got = decode_first(p, d, [prompt], key_file, "b")[0]
    assert got["tokens"] == baseline[2] and got["cached"] == 96  # its own cache, the rest computed here
    ps = settled(p)
    assert time.monotonic() - started < 30, "freed long before bootstrap_timeout_s (60 s)"
    assert ps["worker"] == {"sends_ok": 1, "sends_declined": 1}, ps
    ds = settled(d)
    assert ds["scheduler"] == {"loads": 1, "tickets_declined": 1} and ds["worker"] == {"loads_ok": 1, "declines": 1}, ds
