"""The connector's scheduler side under vLLM's real ``Scheduler`` (no model, no workers):
the request state transitions a disaggregated request goes through, driven step by step
with the model runner's outputs written by hand (what the workers would report)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: scripts/engine-env.sh vllm builds its environment")

import time

import torch
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus

from kvservice._trust.handoff import handoff_key
from kvservice._trust.keys import generate_key, load_key
from kvservice.integrations.vllm.params import Handoff
from kvservice.integrations.vllm.scheduler import Cancel

BLOCK = 32
BLOCKS = 64
PROMPT = 70  # three blocks



@pytest.fixture
def make_scheduler(model: Path, key_file: Path) -> Iterator[Any]:
    def make(role: str, prefix_caching: bool = False, **extra: Any) -> Scheduler:
        table = extra.setdefault("kvservice", {})
        if isinstance(table, dict):
            table.setdefault("auth_key_file", str(key_file))
        kvt = KVTransferConfig(kv_connector="KVServiceConnector",
                               kv_connector_module_path="kvservice.integrations.vllm", kv_role=role,
                               kv_load_failure_policy="recompute", kv_connector_extra_config=extra)
        config = VllmConfig(
            model_config=ModelConfig(model=str(model), skip_tokenizer_init=True, dtype="float32", max_model_len=1024,
                                     seed=0),
            cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=prefix_caching),
            scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=1024, max_model_len=1024,
                                             is_encoder_decoder=False),
            kv_transfer_config=kvt, device_config=DeviceConfig("cpu"))
        config.cache_config.num_gpu_blocks = BLOCKS
        spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=32, dtype=torch.float32)
        kv_cache = KVCacheConfig(num_blocks=BLOCKS, kv_cache_tensors=[],
                                 kv_cache_groups=[KVCacheGroupSpec(["model.layers.0.self_attn.attn"], spec)])
        from vllm.v1.structured_output import StructuredOutputManager

        return Scheduler(config, kv_cache, StructuredOutputManager(config), block_size=BLOCK)

    yield make


TOKENS = list(range(1, PROMPT + 1))


def request(rid: str, params: Any, max_tokens: int = 4, tokens: list[int] = TOKENS) -> Request:
    extra = {"kv_transfer_params": params} if params is not None else None
    return Request(rid, tokens, SamplingParams(max_tokens=max_tokens, extra_args=extra), None,
                   block_hasher=_hasher())


def _hasher() -> Any:
    """The block hasher vLLM's engine core gives each request (its prefix cache needs it)."""
    from vllm.utils.hashing import sha256_cbor
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    init_none_hash(sha256_cbor)
    return get_request_block_hasher(BLOCK, sha256_cbor)


def handoff(key_file: Path, rid: str = "p0-1", **change: Any) -> dict[str, Any]:
    """A hand-off for ``TOKENS`` as a prefill of this cluster issues it now."""
    issued = Handoff.issue(rid, ("127.0.0.1:7100",), TOKENS, PROMPT, BLOCK, key=handoff_key(load_key(key_file)),
                           lifetime_s=30, now=change.pop("now", time.time()))
    return issued.to_params()


def step(s: Scheduler, *, sending: set[str] | None = None, recving: set[str] | None = None,
         failed: set[str] | None = None, token: int = 7, aborted: list[str] | None = None) -> tuple[Any, Any]:
    """One engine step: schedule, then the model runner's output (a token for every
    request that computed its last prompt token or decodes; the workers' reports).
    ``aborted``: requests aborted while the step ran (before its output is processed)."""
    out = s.schedule()
    if aborted:
        s.finish_requests(aborted, RequestStatus.FINISHED_ABORTED)
    ids = [rid for rid, n in out.num_scheduled_tokens.items()
           if s.requests[rid].num_computed_tokens + n >= s.requests[rid].num_prompt_tokens]
    runner = ModelRunnerOutput(
        req_ids=ids, req_id_to_index={rid: i for i, rid in enumerate(ids)}, sampled_token_ids=[[token] for _ in ids],
        kv_connector_output=KVConnectorOutput(finished_sending=sending, finished_recving=recving,
                                              failed_recving=failed or set()))
    engine_out = s.update_from_output(out, runner)
    return out, engine_out


def free(s: Scheduler) -> int:
    return int(s.kv_cache_manager.block_pool.get_num_free_blocks())


def outputs(engine_out: Any) -> list[Any]:
    return [o for eco in engine_out.values() for o in eco.outputs]


def test_decode_waits_for_remote_kv_then_runs_from_the_loaded_prompt(make_scheduler: Any, key_file: Path) -> None:
    s = make_scheduler("kv_consumer")
    r = request("d0", handoff(key_file))
    s.add_request(r)
    out, _ = step(s)
    assert r.status is RequestStatus.WAITING_FOR_REMOTE_KVS
    (recv,) = out.kv_connector_metadata.recvs
    assert recv.req_id == "d0" and recv.handoff.request == "p0-1" and len(recv.blocks) == 3
    assert free(s) == BLOCKS - 1 - 3
    for _ in range(3):  # the load is on its way: nothing is scheduled, nothing else is asked
        out, _ = step(s)
        assert out.num_scheduled_tokens == {} and out.kv_connector_metadata.recvs == []
    step(s, recving={"d0"})  # the worker reports it landed
    out, _ = step(s)
    # the whole prompt came from the prefill: only its last token is recomputed (for the logits)
    assert r.status is RequestStatus.RUNNING and out.num_scheduled_tokens == {"d0": 1}
    assert r.num_computed_tokens == PROMPT
    for _ in range(5):
        if r.is_finished():
            break
        step(s)
    assert r.status is RequestStatus.FINISHED_LENGTH_CAPPED and free(s) == BLOCKS - 1


def test_a_failed_load_is_recomputed_once_and_never_loaded_again(make_scheduler: Any, key_file: Path) -> None:
    s = make_scheduler("kv_consumer")
    r = request("d0", handoff(key_file))
    s.add_request(r)
    step(s)
    step(s, recving={"d0"}, failed={"d0"})  # failed, and settled: the worker reports both
    out, _ = step(s)
    assert r.status is RequestStatus.RUNNING and out.num_scheduled_tokens == {"d0": PROMPT}
    assert out.kv_connector_metadata.recvs == []
    side = s.connector.scheduler_side
    assert side.counts["loads"] == 1


def test_a_decode_aborted_while_its_kv_is_on_the_way_keeps_its_blocks_until_the_load_settles(
        make_scheduler: Any, key_file: Path) -> None:
    s = make_scheduler("kv_consumer")
    r = request("d0", handoff(key_file))
    s.add_request(r)
    step(s)
    s.finish_requests(["d0"], RequestStatus.FINISHED_ABORTED)
    for _ in range(3):  # a WRITE may still land: vLLM must not reuse the blocks yet
        step(s)
        assert free(s) == BLOCKS - 1 - 3
    step(s, recving={"d0"}, failed={"d0"})
    step(s)
    assert free(s) == BLOCKS - 1 and s.connector.scheduler_side.counts["loads_abandoned"] == 1
    assert not s.has_requests()


def test_the_prefill_holds_a_finished_requests_blocks_until_its_send_is_reported(
        make_scheduler: Any, key_file: Path) -> None:
    s = make_scheduler("kv_producer", kvservice={"port": 7100, "advertise_host": "10.0.0.5"})
    r = request("p0", {"do_remote_decode": True}, max_tokens=1)
    s.add_request(r)
    out, engine_out = step(s)
    # posted in the step that computes the prompt (its one token ends it): nothing waits for
    # another step of this engine, which an engine core stepped only inside generate() never runs
    (send,) = out.kv_connector_metadata.sends
    assert send.req_id == "p0" and len(send.blocks) == 3 and send.decode_tp == 1
    assert r.status is RequestStatus.FINISHED_LENGTH_CAPPED
    (o,) = outputs(engine_out)
    params = o.kv_transfer_params
    assert params["do_remote_prefill"] is True
    kv = params["kvservice"]
    assert {k: kv[k] for k in ("request", "senders", "num_tokens", "block_size")} == \
        {"request": "p0", "senders": ["10.0.0.5:7100"], "num_tokens": PROMPT, "block_size": BLOCK}
    # signed under the cluster's key, valid for the prefill's bootstrap_timeout_s (30 s)
    issued = Handoff(kv["request"], tuple(kv["senders"]), PROMPT, BLOCK, kv["expires"], kv["prompt"], kv["mac"])
    issued.check(handoff_key(load_key(key_file)), now=time.time(), skew_s=0, tokens=TOKENS)
    assert time.time() < kv["expires"] <= time.time() + 31
    assert free(s) == BLOCKS - 1 - 3 and s.has_requests()  # held; vLLM keeps stepping
    out, _ = step(s)
    assert out.kv_connector_metadata.sends == []  # not twice
    for _ in range(3):
        step(s)
        assert free(s) == BLOCKS - 1 - 3
    step(s, sending={"p0"})
    assert free(s) == BLOCKS - 1 and not s.has_requests()
    assert s.connector.scheduler_side.counts == {"handoffs": 1, "handoffs_freed": 1}


def test_an_aborted_prefill_hands_nothing_off_and_frees_at_once(make_scheduler: Any) -> None:
    s = make_scheduler("kv_producer", kvservice={"port": 7100})
    # two tokens: its first step does not end it, so nothing is sent from that step
    r = request("p0", {"do_remote_decode": True}, max_tokens=2)
    s.add_request(r)
    out = s.schedule()  # allocated, not computed
    assert out.kv_connector_metadata.sends == []
    s.finish_requests(["p0"], RequestStatus.FINISHED_ABORTED)
    assert free(s) == BLOCKS - 1
    step(s)  # the step that tells the workers it finished
    assert not s.has_requests()
    assert s.connector.scheduler_side.counts == {"handoffs_skipped": 1}


HOSTILE: list[tuple[str, Any]] = [
    ("handoff_invalid", {"do_remote_prefill": True, "kvservice": {"request": "x", "senders": "127.0.0.1:1",
                                                                  "num_tokens": PROMPT, "block_size": BLOCK}}),
    ("handoff_invalid", {"do_remote_prefill": True, "kvservice": []}),
    ("handoff_invalid", "kv_transfer_params from vllm_xargs"),
    ("handoff_invalid", "old format"),
    ("handoff_unsigned", "unsigned"),
    ("handoff_forged", "senders"),
    ("handoff_forged", "num_tokens"),
    ("handoff_forged", "another key"),
    ("handoff_expired", "expired"),
    ("handoff_unusable", "another prompt"),
]


def hostile(kind: str, what: Any, key_file: Path, tmp_path: Path) -> Any:
    if not isinstance(what, str) or what == "kv_transfer_params from vllm_xargs":
        return what
    good = handoff(key_file)
    kv = good["kvservice"]
    if what == "old format":
        return {"do_remote_prefill": True, "kvservice": {k: kv[k] for k in ("request", "senders", "num_tokens",
                                                                           "block_size")}}
    if what == "unsigned":
        del kv["mac"]
    elif what == "senders":
        kv["senders"] = ["10.6.6.6:7100"]
    elif what == "num_tokens":
        kv["num_tokens"] = PROMPT - BLOCK
    elif what == "another key":
        other = tmp_path / "other-key"
        generate_key(other)
        return handoff(other)
    elif what == "expired":
        return handoff(key_file, now=time.time() - 120)
    elif what == "another prompt":
        good = Handoff.issue("p0-1", ("127.0.0.1:7100",), TOKENS[::-1], PROMPT, BLOCK,
                             key=handoff_key(load_key(key_file)), lifetime_s=30, now=time.time()).to_params()
    return good


@pytest.mark.parametrize(("kind", "what"), HOSTILE)
def test_a_hostile_handoff_is_prefilled_locally_at_once(
        make_scheduler: Any, key_file: Path, tmp_path: Path, kind: str, what: Any) -> None:
    s = make_scheduler("kv_consumer")
    r = request("d0", hostile(kind, what, key_file, tmp_path))
    s.add_request(r)
    out, _ = step(s)
    assert r.status is RequestStatus.RUNNING and out.num_scheduled_tokens == {"d0": PROMPT}
    assert out.kv_connector_metadata.recvs == [] and s.connector.scheduler_side.counts == {kind: 1}


def test_a_handoff_presented_by_a_second_request_is_refused(make_scheduler: Any, key_file: Path) -> None:
    s = make_scheduler("kv_consumer")
    params = handoff(key_file)
    first, second = request("d0", params), request("d1", {**params, "kvservice": dict(params["kvservice"])})
    s.add_request(first)
    s.add_request(second)
    out, _ = step(s)
    assert [r.req_id for r in out.kv_connector_metadata.recvs] == ["d0"]
    assert second.status is RequestStatus.RUNNING and out.num_scheduled_tokens == {"d1": PROMPT}
    assert s.connector.scheduler_side.counts == {"loads": 1, "handoff_replayed": 1}


def test_a_prefill_aborted_in_its_last_step_keeps_its_blocks_until_its_send_is_cancelled(
        make_scheduler: Any) -> None:
    s = make_scheduler("kv_producer", kvservice={"port": 7100})
    r = request("p0", {"do_remote_decode": True}, max_tokens=1)
    s.add_request(r)
    out, engine_out = step(s, aborted=["p0"])  # the send was posted by the step's worker
    assert len(out.kv_connector_metadata.sends) == 1 and outputs(engine_out) == []
    assert r.status is RequestStatus.FINISHED_ABORTED and free(s) == BLOCKS - 1 - 3
    out, _ = step(s)
    assert out.kv_connector_metadata.cancels == [Cancel("p0", finished=True)]
    step(s)
    assert free(s) == BLOCKS - 1 - 3  # the worker has not reported the aborted send yet
    step(s, sending={"p0"})
    assert free(s) == BLOCKS - 1 and not s.has_requests()
    assert s.connector.scheduler_side.counts == {"handoffs_skipped": 1, "handoffs_freed": 1}


def test_kv_both_hands_off_and_loads_in_one_engine(make_scheduler: Any, key_file: Path) -> None:
    s = make_scheduler("kv_both")  # a producer: the default port
    p, d = request("p0", {"do_remote_decode": True}, max_tokens=1), request("d0", handoff(key_file))
    s.add_request(p)
    s.add_request(d)
    out, engine_out = step(s)
    meta = out.kv_connector_metadata
    assert [x.req_id for x in meta.sends] == ["p0"] and [x.req_id for x in meta.recvs] == ["d0"]
    assert d.status is RequestStatus.WAITING_FOR_REMOTE_KVS and p.status is RequestStatus.FINISHED_LENGTH_CAPPED
    (o,) = outputs(engine_out)
    assert o.kv_transfer_params["kvservice"]["senders"] == ["127.0.0.1:7100"]
    step(s, sending={"p0"}, recving={"d0"})
    out, _ = step(s)
    assert out.num_scheduled_tokens == {"d0": 1} and free(s) == BLOCKS - 1 - 3
    assert s.connector.scheduler_side.counts == {"handoffs": 1, "handoffs_freed": 1, "loads": 1}


def test_a_decode_whose_prefix_cache_holds_every_block_handed_off_declines_it(
        make_scheduler: Any, key_file: Path) -> None:
    s = make_scheduler("kv_consumer", prefix_caching=True)
    longer = TOKENS + list(range(500, 540))  # the prefill's prompt, then the decode's own 40 tokens
    warm = request("w0", None, max_tokens=1, tokens=longer)
    s.add_request(warm)
    step(s)
    step(s)
    assert warm.is_finished() and free(s) == BLOCKS - 1  # freed, its full blocks cached
    params = Handoff.issue("p0", ("127.0.0.1:7100",), longer, PROMPT, BLOCK, key=handoff_key(load_key(key_file)),
                           lifetime_s=30, now=time.time()).to_params()
    r = request("d0", params, tokens=longer)
    s.add_request(r)
    out, _ = step(s)
    # three whole blocks (96 tokens) cached: every block of the 70-token hand-off; nothing loads
    (declined,) = out.kv_connector_metadata.declines
    assert declined.request == "p0" and out.kv_connector_metadata.recvs == []
    assert r.status is RequestStatus.RUNNING and out.num_scheduled_tokens == {"d0": len(longer) - 96}
    assert s.connector.scheduler_side.counts == {"loads_cached": 1}


def test_a_producer_without_a_port_takes_the_default_and_bad_settings_are_refused(
        make_scheduler: Any, key_file: Path) -> None:
    s = make_scheduler("kv_producer")
    assert s.connector.scheduler_side.senders == ("127.0.0.1:7100",)
    with pytest.raises(ValueError, match=r"kv_connector_extra_config\.bogus: unknown key"):
        make_scheduler("kv_consumer", kvservice={"port": 7100}, bogus=1)
    with pytest.raises(ValueError, match=r"extra_config\.kvservice\.prot: unknown key; did you mean port\?"):
        make_scheduler("kv_consumer", kvservice={"prot": 7100})
    with pytest.raises(ValueError, match=r"service\.port"):
        make_scheduler("kv_consumer", kvservice={"port": "x"})
    with pytest.raises(ValueError, match="handoff_skew_s"):
        make_scheduler("kv_consumer", handoff_skew_s=-1)
