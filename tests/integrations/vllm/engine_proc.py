"""A vLLM engine in a process of its own, driven by JSON lines on stdin (tests only).

    python -m tests.integrations.vllm.engine_proc model DIR          # write the test model
    python -m tests.integrations.vllm.engine_proc serve CONFIG_JSON  # run an engine

``serve`` prints ``{"ready": ...}`` once the engine is up, then answers commands:
``{"op": "generate", "id", "prompt", "max_tokens", "params"}`` (answered when the
request finishes: tokens, kv_transfer_params, num_cached_tokens), ``{"op": "abort", "id"}``,
``{"op": "state"}`` (free blocks, the connector's counts, and what vLLM's stat loggers made
of the connector's stats: ``logged``, the summary vLLM's ``KV Transfer metrics`` line would
show since the start, and ``prom``, vLLM's Prometheus samples of the ``vllm:kvservice_*``
families) and ``{"op": "quit"}``.

How it steps (``"stepping"`` in the config):

* ``"busy"`` (the default): between commands it steps the engine while vLLM's scheduler has
  work (requests, or blocks held for a decode), as vLLM's engine-core process does in
  ``vllm serve`` and in the offline ``LLM`` with its default multiprocessing: a step that ran
  no model (a decode waiting for its KV, a prefill holding blocks for a pull) is followed by
  ``IDLE_STEP_SLEEP_S`` (1 ms) of sleep, as there;
* ``"request"``: it steps only while a request it was given is unfinished, as
  ``LLM.generate()`` does with the engine core in-process
  (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): once a prefill's output is out, nothing steps
  that engine until its next request.
"""

from __future__ import annotations

import json
import os
import queue
import sys
import time
from typing import Any

from kvservice.testing.engine_process import IDLE_STEP_SLEEP_S, read_commands, record_model_executed, say

#: the model: small, float32, random but far from uniform (initializer_range) so that the
#: tokens depend on every bit of the KV; seeded, so every process builds the same one
MODEL = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 1024, "max_position_embeddings": 1024,
         "initializer_range": 0.2, "torch_dtype": "float32"}


def make_model(path: str) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**MODEL)).save_pretrained(path)


#: the connector's stats as vLLM's stat loggers accumulated them (``connector_stats``)
LOGGED: list[Any] = []


def connector_stats() -> Any:
    """A stat logger class (vLLM's ``StatLoggerBase``) that accumulates the connector's stats
    with vLLM's own ``KVConnectorLogging``, as vLLM's log line does, and never resets them."""
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging
    from vllm.v1.metrics.loggers import StatLoggerBase

    class ConnectorStats(StatLoggerBase):  # type: ignore[misc]
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            self.logging = KVConnectorLogging(vllm_config.kv_transfer_config)
            LOGGED.append(self.logging)

        def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
                   engine_idx: int = 0) -> None:
            if scheduler_stats is not None and scheduler_stats.kv_connector_stats:
                self.logging.observe(scheduler_stats.kv_connector_stats)

        def log_engine_initialized(self) -> None:
            pass

    return ConnectorStats


def logged() -> dict[str, Any]:
    """What vLLM's ``KV Transfer metrics`` line would show of everything since the start."""
    acc = LOGGED[-1].transfer_stats_accumulator if LOGGED else None
    return dict(acc.reduce()) if acc is not None and not acc.is_empty() else {}


def prom_samples(prefix: str = "vllm:kvservice") -> dict[str, float]:
    """vLLM's Prometheus samples named ``prefix...``: ``name{label=value,...}`` -> value
    (the ``model_name`` and ``engine`` labels left out)."""
    from prometheus_client import REGISTRY

    out = {}
    for family in REGISTRY.collect():
        for sample in family.samples:
            if sample.name.startswith(prefix) and not sample.name.endswith("_created"):
                labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items())
                                  if k not in ("model_name", "engine"))
                out[f"{sample.name}{{{labels}}}"] = sample.value
    return out


def serve(cfg: dict[str, Any]) -> None:
    import logging

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(message)s"))
    logging.getLogger("kvservice").addHandler(handler)
    logging.getLogger("kvservice").setLevel(logging.INFO)
    from vllm import EngineArgs, LLMEngine, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    kvt = None
    if cfg.get("role"):
        name, module = cfg.get("connector") or ("KVServiceConnector", "kvservice.integrations.vllm")
        kvt = KVTransferConfig(kv_connector=name, kv_connector_module_path=module, kv_role=cfg["role"],
                               kv_connector_extra_config=cfg.get("extra", {}), kv_load_failure_policy="recompute")
    args = EngineArgs(model=cfg["model"], dtype="float32", block_size=32,
                      enable_prefix_caching=bool(cfg.get("prefix_caching")), kv_cache_memory_bytes=64 << 20,
                      enforce_eager=True, distributed_executor_backend="uni", skip_tokenizer_init=True,
                      kv_transfer_config=kvt, seed=0, max_model_len=1024,
                      **({"max_num_batched_tokens": cfg["max_batched"]} if cfg.get("max_batched") else {}))
    engine = LLMEngine.from_engine_args(args, stat_loggers=[connector_stats()] if kvt is not None else None)
    core = engine.engine_core.engine_core  # in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0)
    scheduler = core.scheduler
    worker = get_kv_transfer_group() if has_kv_transfer_group() else None

    def state() -> dict[str, Any]:
        out: dict[str, Any] = {"free_blocks": scheduler.kv_cache_manager.block_pool.get_num_free_blocks(),
                               "total_blocks": scheduler.kv_cache_manager.block_pool.num_gpu_blocks}
        if scheduler.connector is not None:
            side = scheduler.connector.scheduler_side
            out["scheduler"] = dict(side.counts)
            out["held"] = side.held
        if worker is not None:
            out["worker"] = dict(worker.worker_side.counts)
            out["address"] = worker.worker_side.engine.address
            # kvservice's own view, moved on by its loop and not by engine steps: sends not ended
            out["sends_pending"] = sum(type(t).__name__ == "KVSender" for t in worker.worker_side.engine.pending())
            # expects from decodes held for a send not posted yet (decode-first: before the prefill computes)
            out["early_expects"] = worker.worker_side.engine.status()["expects_before_send"]
            out["layers_in_forward"] = worker.worker_side.layers_in_forward
        if LOGGED:
            out["logged"] = logged()
            out["prom"] = prom_samples()
        return out

    executed = record_model_executed(core)
    commands = read_commands()
    say({"ready": True, "pid": os.getpid(), **state()})

    in_process = cfg.get("stepping", "busy") == "request"

    def busy() -> bool:
        if in_process:
            return bool(engine.has_unfinished_requests())
        return bool(scheduler.has_requests())

    while True:
        try:
            cmd = commands.get(timeout=0 if busy() else 0.05)
        except queue.Empty:
            cmd = {"op": "idle"}
        if cmd is None or cmd["op"] == "quit":
            break
        if cmd["op"] == "generate":
            params = SamplingParams(max_tokens=cmd["max_tokens"], temperature=0.0, detokenize=False,
                                    extra_args={"kv_transfer_params": cmd["params"]} if cmd.get("params") else None)
            engine.add_request(cmd["id"], {"prompt_token_ids": cmd["prompt"]}, params)
        elif cmd["op"] == "abort":
            engine.abort_request([cmd["id"]])
        elif cmd["op"] == "state":
            say({"state": state()})
        if busy():
            for out in engine.step():
                if out.finished:
                    say({"id": out.request_id, "tokens": list(out.outputs[0].token_ids),
                          "params": out.kv_transfer_params, "cached": out.num_cached_tokens,
                          "finish": out.outputs[0].finish_reason, "t": time.monotonic()})
            if not in_process and not executed[0] and busy():
                time.sleep(IDLE_STEP_SLEEP_S)  # vLLM's engine-core process, after such a step's outputs
    if worker is not None:
        worker.shutdown()


if __name__ == "__main__":
    if sys.argv[1] == "model":
        make_model(sys.argv[2])
    else:
        serve(json.loads(sys.argv[2]))
