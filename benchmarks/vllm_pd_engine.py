"""One vLLM engine of ``benchmarks.vllm_pd``, in a process of its own (vLLM's environment).

    python -m benchmarks.vllm_pd_engine model DIR           # write the benchmark's model
    python -m benchmarks.vllm_pd_engine serve CONFIG_JSON   # run an engine

The engine is vLLM's ``LLMEngine`` with its engine core in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``: one process per engine, which two cores can afford),
stepped the way vLLM's engine core steps in ``vllm serve``: every request that arrived is
added, then the engine steps while its scheduler ``has_requests()`` (which counts a
connector's pending push work); a step that executed no model (requests waiting for remote
KV, blocks held for a push) is followed, once its outputs are out, by a 1 ms sleep while the
scheduler still has requests, as ``EngineCoreProc._process_engine_step`` does ("yield the GIL
briefly to allow background transfer threads to make progress").  Both connectors meet
exactly that loop.  ``serve`` pins every thread of its process to ``CONFIG["cpu"]``, before
the engine is built and again after (NixlConnector's worker, on a CPU platform, moves the
thread that builds it to the last core of each NUMA node, "reserved for KV transfer": on two
cores, the other engine's core), prints ``{"ready": ..., "moved": N}`` (N: the threads found
off their core after the build), then reads JSON lines on stdin: ``{"op": "generate", "id",
"prompt", "max_tokens", "params"}`` is answered with ``{"id", "first": true, "steps"}`` in the
step that produced the request's first token and ``{"id", "tokens", "params", "finish",
"steps"}`` in the step that finished it (``steps``: the engine's steps so far, ``[that executed
the model, that did not]``); ``{"op": "quit"}`` shuts the engine down.
"""

from __future__ import annotations

import json
import os
import queue
import sys
import time
from typing import Any

from kvservice.testing.engine_process import IDLE_STEP_SLEEP_S, read_commands, record_model_executed, say

#: 8 layers, 4 KV heads of 128 floats: 32 KiB of KV per token (float32), random but far from
#: uniform (``initializer_range``) so that the tokens depend on every bit of the KV; seeded, so
#: every process builds the same one
LAYERS, KV_HEADS, HEAD_DIM = 8, 4, 128
MODEL = {"hidden_size": 512, "intermediate_size": 1024, "num_hidden_layers": LAYERS, "num_attention_heads": 8,
         "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM, "vocab_size": 1024, "max_position_embeddings": 4096,
         "initializer_range": 0.2, "torch_dtype": "float32"}
#: KV bytes per token of ``MODEL`` (K and V, every layer, float32)
KV_BYTES_PER_TOKEN = 2 * LAYERS * KV_HEADS * HEAD_DIM * 4
#: tokens per KV block of every engine (a ticket names it)
BLOCK_SIZE = 32


def make_model(path: str) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**MODEL)).save_pretrained(path)


def pin_threads(cpu: int) -> int:
    """Pin every thread of this process to ``cpu`` (a thread's affinity is its own: one set
    later reaches only the threads created after it).  Returns how many were elsewhere."""
    moved = 0
    for tid in map(int, os.listdir("/proc/self/task")):
        try:
            if os.sched_getaffinity(tid) != {cpu}:
                moved += 1
                os.sched_setaffinity(tid, {cpu})
        except OSError:  # the thread ended meanwhile
            continue
    return moved


def serve(cfg: dict[str, Any]) -> None:
    from vllm import EngineArgs, LLMEngine, SamplingParams
    from vllm.config import KVTransferConfig

    kvt = KVTransferConfig(**cfg["transfer"]) if cfg.get("transfer") else None
    args = EngineArgs(model=cfg["model"], dtype="float32", block_size=BLOCK_SIZE, enable_prefix_caching=False,
                      kv_cache_memory_bytes=cfg["kv_cache_bytes"], enforce_eager=True,
                      distributed_executor_backend="uni", skip_tokenizer_init=True, kv_transfer_config=kvt,
                      seed=0, max_model_len=cfg["max_model_len"], disable_log_stats=True)
    engine = LLMEngine.from_engine_args(args)
    moved = pin_threads(int(cfg["cpu"]))
    core = engine.engine_core.engine_core  # in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0)
    scheduler = core.scheduler
    executed = record_model_executed(core)
    commands = read_commands()
    started: set[str] = set()
    steps = [0, 0]  # steps that executed the model, steps that did not (each followed by the sleep)
    say({"ready": True, "pid": os.getpid(), "moved": moved})
    while True:
        # vLLM's engine core: take what arrived (without waiting while there is work), then
        # step while the scheduler has work (its has_requests() counts a connector's pending
        # push work too)
        try:
            cmd = commands.get(timeout=0 if scheduler.has_requests() else 0.05)
        except queue.Empty:
            cmd = {"op": "idle"}
        if cmd is None or cmd["op"] == "quit":
            break
        if cmd["op"] == "generate":
            extra = {"kv_transfer_params": cmd["params"]} if cmd.get("params") else None
            params = SamplingParams(max_tokens=cmd["max_tokens"], temperature=0.0, detokenize=False,
                                    extra_args=extra)
            engine.add_request(cmd["id"], {"prompt_token_ids": cmd["prompt"]}, params)
            continue  # take every request already there before stepping, as the engine core does
        if not scheduler.has_requests():
            continue
        outputs = engine.step()
        steps[0 if executed[0] else 1] += 1
        for out in outputs:
            tokens = list(out.outputs[0].token_ids)
            if tokens and out.request_id not in started:
                started.add(out.request_id)
                say({"id": out.request_id, "first": True, "steps": steps})
            if out.finished:
                started.discard(out.request_id)
                say({"id": out.request_id, "tokens": tokens, "params": out.kv_transfer_params,
                      "finish": out.outputs[0].finish_reason, "steps": steps})
        if not executed[0] and scheduler.has_requests():
            time.sleep(IDLE_STEP_SLEEP_S)  # vLLM's engine core process, after such a step's outputs
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    if has_kv_transfer_group():
        get_kv_transfer_group().shutdown()


def main(argv: list[str]) -> None:
    if argv[0] == "model":
        make_model(argv[1])
        return
    cfg = json.loads(argv[1])
    # the threads started from here on (UCX's progress thread among them) inherit this
    pin_threads(int(cfg["cpu"]))
    serve(cfg)


if __name__ == "__main__":
    main(sys.argv[1:])
