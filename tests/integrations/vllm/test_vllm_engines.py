"""vLLM loads kvservice: two real vLLM engines (vLLM's own CPU build, its scheduler, model
runner and attention), prefill and decode in processes of their own, the KV moved by
``kvservice.integrations.vllm``.  Judged by the decode's greedy tokens against one engine
without any connector, on a seeded random model whose tokens depend on every bit of the KV
(the control run proves it: the same KV corrupted on the way changes the tokens)."""

from __future__ import annotations

import signal
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: scripts/engine-env.sh vllm builds its environment")

from kvservice._trust.authority import CA_CERT, create_authority, issue
from kvservice._trust.handoff import handoff_key
from kvservice._trust.identity import load_identity
from kvservice._trust.keys import generate_key, load_key
from kvservice.integrations.vllm.params import MEMBER_KEY, Handoff

from .engine_proc import MODEL
from .engines import MAX_TOKENS, Engine, free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

#: bytes of KV per block of the test model (32 tokens; K and V, float32, every layer)
BLOCK_BYTES = 32 * MODEL["num_hidden_layers"] * 2 * MODEL["num_key_value_heads"] * MODEL["head_dim"] * 4
#: what vLLM's log line shows of the transfer times (stats.summary), beside the counts
TIMES = {f"{side}{key}" for side in ("load", "send") for key in ("s_timed", "_avg_ms", "_p90_ms", "_mib")}


@pytest.fixture
def spawn(model: Path, logs: Path) -> Iterator[Any]:
    started: list[Engine] = []

    def start(name: str, role: str, cpu: int, *, connector: tuple[str, str] | None = None,
              prefix_caching: bool = False, stepping: str = "busy", **service: Any) -> Engine:
        engine = Engine(name, model, role=role, extra={"kvservice": service}, cpu=cpu, log_dir=logs,
                        connector=connector, prefix_caching=prefix_caching, stepping=stepping)
        started.append(engine)
        return engine

    yield start
    for engine in started:
        engine.signal(signal.SIGCONT)
        engine.stop()


def prefill(p: Engine, prompts: list[list[int]], tag: str) -> list[dict[str, Any]]:
    """Prefill every prompt (one token, hand-off asked); the hand-offs as a router passes them."""
    for i, prompt in enumerate(prompts):
        p.generate(f"{tag}{i}", prompt, 1, {"do_remote_decode": True})
    handoffs = []
    for i in range(len(prompts)):
        params = p.result(f"{tag}{i}")["params"]
        assert params["kvservice"]["num_tokens"] == len(prompts[i]), params
        # vLLM adds the prefill's own cache hits so the decode reports those; drop it to see
        # what the decode itself loaded
        params.pop("remote_prefill_cached_tokens", None)
        handoffs.append(params)
    return handoffs


def decode(d: Engine, prompts: list[list[int]], handoffs: list[dict[str, Any] | None],
           tag: str) -> list[dict[str, Any]]:
    for i, (prompt, params) in enumerate(zip(prompts, handoffs, strict=True)):
        d.generate(f"{tag}{i}", prompt, MAX_TOKENS, params)
    return [d.result(f"{tag}{i}", timeout=180) for i in range(len(prompts))]


def vllm_saw(state: dict[str, Any]) -> dict[str, int]:
    """The connector's counts as vLLM's own stat loggers got them through
    ``get_kv_connector_stats``: its log line's summary and its Prometheus counter, both
    checked equal to the counts on the connector's objects."""
    logged = {k: v for k, v in state["logged"].items() if k not in TIMES}
    prom = {k.removeprefix("vllm:kvservice_events_total{event=").removesuffix("}"): int(v)
            for k, v in state["prom"].items() if k.startswith("vllm:kvservice_events_total{")}
    own = dict(Counter(state.get("scheduler", {})) + Counter(state.get("worker", {})))
    assert logged == prom == own, (logged, prom, own)
    return logged


def settled(engine: Engine) -> dict[str, Any]:
    """The engine's state once it holds no block beyond vLLM's reserved one (within 60 s)."""
    return engine.wait_state(lambda s: not s.get("held") and s["free_blocks"] == s["total_blocks"] - 1)


def test_decode_tokens_equal_a_single_engines_and_corrupted_kv_changes_them(
        spawn: Any, prompts: list[list[int]], baseline: list[list[int]]) -> None:
    p = spawn("prefill", "kv_producer", 0, port=free_port())
    d = spawn("decode", "kv_consumer", 1)
    got = decode(d, prompts, prefill(p, prompts, "p"), "d")
    assert [g["tokens"] for g in got] == baseline
    # the decode loaded the whole prompt: vLLM counts it as cached (external) tokens
    assert [g["cached"] for g in got] == [len(prompt) for prompt in prompts]
    ps, ds = settled(p), settled(d)
    assert ps["scheduler"] == {"handoffs": 4, "handoffs_freed": 4} and ps["worker"] == {"sends_ok": 4}
    assert ds["scheduler"] == {"loads": 4} and ds["worker"] == {"loads_ok": 4}
    assert ps["held"] == {} and ps["free_blocks"] == ps["total_blocks"] - 1
    assert ds["free_blocks"] == ds["total_blocks"] - 1
    # vLLM's own stats got the same counts, and each transfer's time and bytes (every block of
    # every prompt, sent and loaded)
    assert vllm_saw(ps) == {"handoffs": 4, "handoffs_freed": 4, "sends_ok": 4}
    assert vllm_saw(ds) == {"loads": 4, "loads_ok": 4}
    assert ps["logged"]["sends_timed"] == ds["logged"]["loads_timed"] == len(prompts)
    assert ps["prom"]["vllm:kvservice_send_time_seconds_count{}"] == len(prompts)
    assert ds["prom"]["vllm:kvservice_load_time_seconds_count{}"] == len(prompts)
    kv_bytes = sum(-(-len(prompt) // 32) for prompt in prompts) * BLOCK_BYTES
    assert ps["prom"]["vllm:kvservice_send_bytes_sum{}"] == ds["prom"]["vllm:kvservice_load_bytes_sum{}"] == kv_bytes
    assert ds["logged"]["load_mib"] == round(kv_bytes / 2**20, 3) and ds["logged"]["load_avg_ms"] > 0

    # control: the same hand-off into a decode that overwrites the KV once it landed
    bad = spawn("decode-corrupt", "kv_consumer", 1,
                connector=("CorruptingConnector", "tests.integrations.vllm.corrupt"))
    corrupted = decode(bad, prompts, prefill(p, prompts, "q"), "c")
    assert all(c["tokens"] != b for c, b in zip(corrupted, baseline, strict=True)), corrupted
    assert settled(bad)["worker"] == {"loads_ok": 4}


def test_prefill_killed_mid_transfer_the_decode_recomputes_once_nothing_can_land(
        spawn: Any, prompts: list[list[int]], baseline: list[list[int]]) -> None:
    p = spawn("prefill", "kv_producer", 0, port=free_port())
    d = spawn("decode", "kv_consumer", 1)
    assert [g["tokens"] for g in decode(d, prompts[:1], prefill(p, prompts[:1], "w"), "w")] == baseline[:1]

    handoffs = prefill(p, prompts, "p")
    p.signal(signal.SIGSTOP)  # hung: its sends wait, its link goes silent
    for i, (prompt, params) in enumerate(zip(prompts, handoffs, strict=True)):
        d.generate(f"d{i}", prompt, MAX_TOKENS, params)
    # the decode gives the loads up once the prefill is silent past peer_timeout_s ...
    state = d.wait_state(lambda s: s["worker"].get("load_failed", 0) == len(prompts))
    assert state["worker"].get("load_failed") == len(prompts), state
    # ... but reports none of them while the hung prefill could still write into their blocks
    time.sleep(1.0)
    assert not any(d.done(f"d{i}") for i in range(len(prompts)))
    p.kill()  # now nothing can land: the loads settle, vLLM recomputes
    got = [d.result(f"d{i}", timeout=120) for i in range(len(prompts))]
    assert [g["tokens"] for g in got] == baseline
    ds = settled(d)
    assert ds["free_blocks"] == ds["total_blocks"] - 1
    assert ds["worker"] == {"loads_ok": 1, "load_failed": len(prompts)}, ds
    assert vllm_saw(ds)["load_failed"] == len(prompts) and ds["logged"]["loads_timed"] == 1


def test_decode_killed_mid_transfer_the_prefill_frees_every_block_and_serves_the_next(
        spawn: Any, prompts: list[list[int]], baseline: list[list[int]]) -> None:
    p = spawn("prefill", "kv_producer", 0, port=free_port(), bootstrap_timeout_s=8.0)
    d = spawn("decode", "kv_consumer", 1)
    assert [g["tokens"] for g in decode(d, prompts[:1], prefill(p, prompts[:1], "w"), "w")] == baseline[:1]

    handoffs = prefill(p, prompts, "p")
    assert len(p.state()["held"]) == len(prompts)
    p.signal(signal.SIGSTOP)  # the sends wait for the decode's expects, which now queue unread
    for i, (prompt, params) in enumerate(zip(prompts, handoffs, strict=True)):
        d.generate(f"d{i}", prompt, MAX_TOKENS, params)
    d.wait_state(lambda s: s["scheduler"].get("loads", 0) == 1 + len(prompts))
    time.sleep(0.5)  # the worker posted its expects
    d.kill()
    p.signal(signal.SIGCONT)
    ps = settled(p)
    assert ps["held"] == {} and ps["free_blocks"] == ps["total_blocks"] - 1, ps
    # each send failed at once (PEER_LOST): the decode's expects had reached the prefill and went
    # with the decode, and the prefill's worker did not wait for them to come back
    assert ps["worker"] == {"sends_ok": 1, "send_failed": len(prompts)}, ps

    # the prefill stays up and serves the next request, to a decode started afresh
    d2 = spawn("decode-2", "kv_consumer", 1)
    got = decode(d2, prompts, prefill(p, prompts, "q"), "e")
    assert [g["tokens"] for g in got] == baseline

    # a consumer that never comes: the prefill frees the blocks after bootstrap_timeout_s
    prefill(p, prompts[:2], "r")
    assert len(p.state()["held"]) == 2
    ps = p.wait_state(lambda s: not s["held"], timeout=60)
    assert ps["held"] == {} and ps["free_blocks"] == ps["total_blocks"] - 1, ps
    assert ps["worker"]["send_failed"] == len(prompts) + 2, ps
    assert vllm_saw(ps)["send_failed"] == len(prompts) + 2


def test_hostile_handoffs_are_refused_and_the_decode_prefills_locally(
        spawn: Any, prompts: list[list[int]], baseline: list[list[int]], tmp_path: Path) -> None:
    key_file = tmp_path / "key"
    generate_key(key_file)
    p = spawn("prefill", "kv_producer", 0, port=free_port(), auth_key_file=str(key_file))
    d = spawn("decode", "kv_consumer", 1, arrival_timeout_s=5.0, auth_key_file=str(key_file))
    (good,) = prefill(p, prompts[:1], "g")
    assert decode(d, prompts[:1], [good], "g")[0]["tokens"] == baseline[0]
    kv = good["kvservice"]
    assert len(kv["mac"]) == 64 and kv["expires"] > time.time()
    closed = f"127.0.0.1:{free_port()}"
    other_key = tmp_path / "other-key"
    generate_key(other_key)

    def signed(rid: str, senders: list[str], num_tokens: int = len(prompts[0]), block_size: int = 32, *,
               key: Path = key_file, age_s: float = 0.0) -> dict[str, Any]:
        """A hand-off for prompts[0] signed under ``key``, issued ``age_s`` ago (30 s to live)."""
        return Handoff.issue(rid, tuple(senders), prompts[0], num_tokens, block_size,
                             key=handoff_key(load_key(key)), lifetime_s=30, now=time.time() - age_s).to_params()

    unsigned = {k: v for k, v in kv.items() if k != "mac"}
    hostile: list[tuple[str, Any]] = [
        ("handoff_invalid", {"do_remote_prefill": True, "kvservice": "junk"}),
        ("handoff_invalid", {"do_remote_prefill": True, "kvservice": {**kv, "request": 5}}),
        ("handoff_invalid", {"do_remote_prefill": True, "kvservice": {**kv, "senders": ["nohost"]}}),
        ("handoff_invalid", {"do_remote_prefill": True, "kvservice": {**kv, "senders": [kv["senders"][0]] * 999}}),
        ("handoff_invalid", {"do_remote_prefill": True, "kvservice": {**kv, "extra": "x" * 10_000}}),
        # the format before hand-offs were signed: no expiry, no prompt, no MAC
        ("handoff_invalid", {"do_remote_prefill": True, "kvservice": {
            k: kv[k] for k in ("request", "senders", "num_tokens", "block_size")}}),
        # not proved: what a client can write itself
        ("handoff_unsigned", {"do_remote_prefill": True, "kvservice": {**unsigned, "senders": [closed]}}),
        ("handoff_forged", {"do_remote_prefill": True, "kvservice": {**kv, "senders": [closed]}}),
        ("handoff_forged", {"do_remote_prefill": True, "kvservice": {**kv, "request": "nobody"}}),
        ("handoff_forged", {"do_remote_prefill": True, "kvservice": {**kv, "num_tokens": 32}}),
        ("handoff_forged", signed("forged", [closed], key=other_key)),
        ("handoff_expired", signed("expired", [closed], age_s=120)),
        ("handoff_replayed", good),  # presented again, by another request
        # proved, but not for this decode
        ("handoff_unusable", signed("long", kv["senders"], num_tokens=10_000)),
        ("handoff_unusable", signed("blocks", kv["senders"], block_size=16)),
        # proved, naming an address nobody listens on (only a key holder can): the dial fails at once
        ("load_failed", signed("nobody", [closed])),
    ]
    for i, (_, params) in enumerate(hostile):
        d.generate(f"h{i}", prompts[0], MAX_TOKENS, params)
    got = [d.result(f"h{i}", timeout=180) for i in range(len(hostile))]
    assert all(g["tokens"] == baseline[0] for g in got)
    ds = settled(d)
    kinds = {kind for kind, _ in hostile if kind != "load_failed"}
    assert {k: v for k, v in ds["scheduler"].items() if k.startswith("handoff_")} == \
        {kind: sum(k == kind for k, _ in hostile) for kind in kinds}, ds
    assert ds["scheduler"]["loads"] == 2 and ds["worker"] == {"loads_ok": 1, "load_failed": 1}, ds
    # the decode and the prefill are up: a legitimate hand-off still moves
    got = decode(d, prompts, prefill(p, prompts, "n"), "n")
    assert [g["tokens"] for g in got] == baseline


def test_with_member_identities_a_handoff_loads_only_from_the_prefill_member_that_signed_it(
        spawn: Any, prompts: list[list[int]], baseline: list[list[int]], tmp_path: Path) -> None:
    """The prefill signs its hand-offs with its member key, through vLLM's own output path;
    mallory, a member with the cluster's key, signs a hand-off of the prefill's pending
    request naming its sender: the decode loads it only from mallory, so the prefill's
    service (proving prefill-a) is refused on the link and the decode recomputes; one
    without a member proof is refused before anything is reserved."""
    ca = tmp_path / "ca"
    ca.mkdir()
    create_authority(str(ca), "c1")
    key = ca / "cluster.key"
    generate_key(key)

    def member(name: str, role: str) -> dict[str, str]:
        cert, own = issue(str(ca), role, name, str(ca), force=True)
        return {"auth_key_file": str(key), "identity_cert_file": cert, "identity_key_file": own,
                "identity_ca_file": str(ca / CA_CERT)}

    p = spawn("prefill", "kv_producer", 0, port=free_port(), **member("prefill-a", "prefill"))
    d = spawn("decode", "kv_consumer", 1, arrival_timeout_s=5.0, **member("decode-0", "decode"))
    (good,) = prefill(p, prompts[:1], "g")
    assert set(good[MEMBER_KEY]) == {"cert", "signature"}, good
    assert decode(d, prompts[:1], [good], "g")[0]["tokens"] == baseline[0]
    (pending,) = prefill(p, prompts[:1], "v")  # its send waits in prefill-a's service
    m = member("mallory", "prefill")
    mallory = load_identity(m["identity_cert_file"], m["identity_key_file"], m["identity_ca_file"])
    kv = pending["kvservice"]
    forged = Handoff.issue(kv["request"], tuple(kv["senders"]), prompts[0], kv["num_tokens"], kv["block_size"],
                           key=handoff_key(load_key(key)), lifetime_s=30, now=time.time(),
                           identity=mallory).to_params()
    bare = Handoff.issue("bare", tuple(kv["senders"]), prompts[0], kv["num_tokens"], kv["block_size"],
                         key=handoff_key(load_key(key)), lifetime_s=30, now=time.time()).to_params()
    got = decode(d, [prompts[0]] * 2, [forged, bare], "h")
    assert all(g["tokens"] == baseline[0] for g in got)
    ds = settled(d)
    assert ds["scheduler"].get("handoff_identity_missing") == 1 and ds["scheduler"]["loads"] == 2, ds
    assert ds["worker"] == {"loads_ok": 1, "load_failed": 1}, ds
    # the decode and the prefill are up: a legitimate hand-off still moves
    got = decode(d, prompts, prefill(p, prompts, "n"), "n")
    assert [g["tokens"] for g in got] == baseline


def test_a_decode_with_the_prompts_first_blocks_in_its_prefix_cache_loads_only_the_rest(
        spawn: Any, prompts: list[list[int]], baseline: list[list[int]]) -> None:
    p = spawn("prefill", "kv_producer", 0, port=free_port())
    d = spawn("decode", "kv_consumer", 1, prefix_caching=True)  # vLLM's default
    prompt = prompts[2]  # 100 tokens: three whole blocks and four tokens
    first = decode(d, [prompt], prefill(p, [prompt], "a"), "a")[0]
    assert first["tokens"] == baseline[2] and first["cached"] == len(prompt)
    # the same prompt again: the decode's own cache holds its three whole blocks now, so it
    # asks for the last block only, and the prefill sends just that one
    again = decode(d, [prompt], prefill(p, [prompt], "b"), "b")[0]
    assert again["tokens"] == baseline[2] and again["cached"] == len(prompt)
    ps, ds = settled(p), settled(d)
    assert ps["worker"] == {"sends_ok": 2, "sends_partial": 1} and ps["held"] == {}, ps
    assert ds["worker"] == {"loads_ok": 2} and ds["scheduler"] == {"loads": 2}, ds


def test_engine_cores_stepped_only_inside_requests_hand_off_without_another_prefill_step(
        spawn: Any, prompts: list[list[int]], baseline: list[list[int]]) -> None:
    """As ``LLM.generate()`` with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``: once a prefill's output
    is out, nothing steps that engine until its next request.  Its sends were posted in the
    step that computed the prompts, so they wait in kvservice for the decode's expects."""
    p = spawn("prefill", "kv_producer", 0, stepping="request")  # no port: the producer's default
    assert p.ready["address"] == "127.0.0.1:7100"
    d = spawn("decode", "kv_consumer", 1, stepping="request", arrival_timeout_s=20.0)
    got = decode(d, prompts, prefill(p, prompts, "p"), "d")
    assert [g["tokens"] for g in got] == baseline
    assert [g["cached"] for g in got] == [len(prompt) for prompt in prompts]  # loaded, not recomputed
    ds = d.state()
    assert ds["worker"] == {"loads_ok": 4} and ds["free_blocks"] == ds["total_blocks"] - 1, ds
    # the prefill has not stepped since its outputs: the sends ended in its kvservice, and its
    # blocks stay held until a step reports them
    ps = p.wait_state(lambda s: s["sends_pending"] == 0)
    assert len(ps["held"]) == len(prompts) and "sends_ok" not in ps["worker"], ps
    p.generate("next", prompts[0], 1)  # no hand-off asked
    assert p.result("next")["params"] is None
    ps = p.state()  # its next request's step reported them
    assert ps["held"] == {} and ps["free_blocks"] == ps["total_blocks"] - 1, ps
    assert ps["worker"] == {"sends_ok": 4}, ps

    # the decode killed with the sends outstanding: they fail in kvservice (no prefill step),
    # the blocks are freed at the next one, and the prefill serves a new decode
    handoffs = prefill(p, prompts[:2], "k")
    p.signal(signal.SIGSTOP)  # the decode's expects queue unread
    for i, (prompt, params) in enumerate(zip(prompts[:2], handoffs, strict=True)):
        d.generate(f"k{i}", prompt, MAX_TOKENS, params)
    d.wait_state(lambda s: s["scheduler"].get("loads", 0) == len(prompts) + 2)
    time.sleep(0.5)  # the worker posted its expects
    d.kill()
    p.signal(signal.SIGCONT)
    p.wait_state(lambda s: s["sends_pending"] == 0)
    p.generate("next-2", prompts[0], 1)
    p.result("next-2")
    ps = p.state()
    assert ps["held"] == {} and ps["free_blocks"] == ps["total_blocks"] - 1, ps
    assert ps["worker"] == {"sends_ok": 4, "send_failed": 2}, ps
    d2 = spawn("decode-2", "kv_consumer", 1, stepping="request", arrival_timeout_s=20.0)
    got = decode(d2, prompts, prefill(p, prompts, "q"), "e")
    assert [g["tokens"] for g in got] == baseline and [g["cached"] for g in got] == [len(x) for x in prompts]

    # the prefill killed after its answers: every load fails, settles (its process is gone)
    # and is recomputed
    handoffs = prefill(p, prompts, "z")
    p.kill()
    got = decode(d2, prompts, handoffs, "z")
    assert [g["tokens"] for g in got] == baseline
    ds = d2.state()
    assert ds["worker"] == {"loads_ok": 4, "load_failed": 4} and ds["free_blocks"] == ds["total_blocks"] - 1, ds


def test_kv_both_engines_each_prefill_for_the_other(
        spawn: Any, prompts: list[list[int]], baseline: list[list[int]]) -> None:
    a = spawn("both-a", "kv_both", 0, port=free_port())
    b = spawn("both-b", "kv_both", 1, port=free_port())
    got = decode(b, prompts[:2], prefill(a, prompts[:2], "a"), "b")
    got += decode(a, prompts[2:], prefill(b, prompts[2:], "c"), "d")
    assert [g["tokens"] for g in got] == baseline
    assert [g["cached"] for g in got] == [len(prompt) for prompt in prompts]
    for engine in (a, b):
        state = settled(engine)
        assert state["worker"] == {"sends_ok": 2, "loads_ok": 2}, state
        assert state["scheduler"] == {"handoffs": 2, "handoffs_freed": 2, "loads": 2}, state


def test_a_decode_whose_prefix_cache_holds_every_block_handed_off_declines_and_the_prefill_frees_them(
        spawn: Any, prompts: list[list[int]]) -> None:
    # the bootstrap deadline is far past the test's waits: only the decline can free the blocks
    p = spawn("prefill", "kv_producer", 0, port=free_port(), bootstrap_timeout_s=600.0)
    d = spawn("decode", "kv_consumer", 1, prefix_caching=True)
    prompt = prompts[3]  # 64 tokens: two whole blocks
    longer = prompt + prompts[0][:40]  # the decode's request goes on from the prefill's prompt
    (local,) = decode(d, [longer], [None], "w")  # computed here: its three whole blocks are cached
    (handoff,) = prefill(p, [prompt], "x")
    assert len(p.state()["held"]) == 1
    (got,) = decode(d, [longer], [handoff], "y")
    assert got["tokens"] == local["tokens"]
    ds = settled(d)
    assert ds["scheduler"] == {"loads_cached": 1} and ds["worker"] == {"declines": 1}, ds
    ps = p.wait_state(lambda s: not s["held"])
    assert ps["free_blocks"] == ps["total_blocks"] - 1 and ps["worker"] == {"sends_declined": 1}, ps
