"""Timing subclasses of the connectors ``benchmarks.vllm_pd`` compares (vLLM's environment).

Loaded by ``kv_connector_module_path="benchmarks.vllm_pd_timing"``; each class is the
connector as it ships plus two timestamps on the scheduler side, the same for all:

* ``alloc``: vLLM reserved blocks for a request's remote KV (``update_state_after_alloc``
  with external tokens, on the decode);
* ``loaded``: the request's load reached the scheduler as finished (``finished_recving`` in
  ``update_connector_output``, before vLLM acts on it).

The hand-off is ``loaded - alloc``.  Each mark is a line ``EVENT REQUEST_ID MONOTONIC_S``
appended to the file named by ``$KVSERVICE_BENCH_MARKS`` (nothing is written without it).

``TimedNixlQuiet`` is vLLM's ``NixlConnector`` with NIXL's progress thread off
(``nixl_agent_config(..., enable_prog_thread=False)``): on a host with a core per engine
UCX's progress thread busy-polls the engine's core, so the pairing for transfer cost is
with it off; the engine's own ``check_xfer_state`` calls drive the transfers then.
"""

from __future__ import annotations

import os
import time
from typing import IO, Any

from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlConnector

from kvservice.integrations.vllm.connector import KVServiceConnector

__all__ = ["TimedKVService", "TimedNixl", "TimedNixlQuiet"]

#: the environment variable naming the file marks go to
MARKS_ENV = "KVSERVICE_BENCH_MARKS"

_out: IO[str] | None = None


def mark(event: str, request_id: str) -> None:
    """Append ``EVENT REQUEST_ID NOW`` (``request_id`` may carry more fields before NOW)."""
    global _out
    path = os.environ.get(MARKS_ENV)
    if not path:
        return
    if _out is None:
        _out = open(path, "a", buffering=1)
    _out.write(f"{event} {request_id} {time.monotonic():.6f}\n")


class _Timed:
    """The two marks, around the connector's own methods (next in the MRO)."""

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if num_external_tokens > 0:
            mark("alloc", request.request_id)
        super().update_state_after_alloc(request, blocks, num_external_tokens)  # type: ignore[misc]

    def update_connector_output(self, connector_output: Any) -> None:
        for rid in connector_output.finished_recving or ():
            mark("loaded", rid)
        super().update_connector_output(connector_output)  # type: ignore[misc]


class TimedKVService(_Timed, KVServiceConnector):
    """kvservice's connector, timed; its worker side also marks the path of each transfer
    from kvservice's own results (``created_at``, ``started_at``, ``finished_at``, all
    ``time.monotonic()``, which every process on the host shares) and when vLLM's step
    polled it finished:

    * ``recv DECODE_ID PREFILL_ID CREATED EXPECT_SENT LANDED POLLED`` on the decode;
    * ``send PREFILL_ID - CREATED FIRST_WRITE FINISHED POLLED`` on the prefill, then a line
      ``posts - COUNT SECONDS`` with the service's NIXL post calls so far (how many, and how
      long they took in all: on the default transport a WRITE's post performs the copy).
    """

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        worker = self.worker_side
        loads = {rid: (load.spec.handoff.request, list(load.receivers))
                 for rid, load in worker._loads.items()} if worker is not None else {}
        sends = {rid: list(send.senders) for rid, send in worker._sends.items()} if worker is not None else {}
        out = super().get_transfer_results(finished_req_ids)
        polled = time.monotonic()
        for rid in out.finished_recving or ():
            source, receivers = loads.get(rid, ("-", []))
            for r in receivers:
                _path("recv", rid, source, r.result, polled)
        for rid in out.finished_sending or ():
            for sender in sends.get(rid, []):
                _path("send", rid, "-", sender.result, polled)
        if out.finished_sending and worker is not None and worker.engine is not None:
            svc = worker.engine._svc  # read without a hop to its loop: counters, for a mark
            if svc is not None:
                posts = [series["post_time"] for series in svc.stats.peers.snapshot().values()]
                mark("posts", f"- {sum(p['count'] for p in posts)} {sum(p['sum_s'] for p in posts):.6f}")
        return out


def _path(kind: str, rid: str, other: str, result: Any, polled: float) -> None:
    if result is None:
        return
    started = result.started_at if result.started_at is not None else float("nan")
    mark(kind, f"{rid} {other} {result.created_at:.6f} {started:.6f} {result.finished_at:.6f} {polled:.6f}")


class TimedNixl(_Timed, NixlConnector):
    """vLLM's ``NixlConnector`` as shipped, timed."""


class TimedNixlQuiet(TimedNixl):
    """vLLM's ``NixlConnector`` with NIXL's progress thread off, timed."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        _progress_thread_off()
        super().__init__(vllm_config, role, kv_cache_config)


def _progress_thread_off() -> None:
    """Make vLLM's NIXL worker build its agent with ``enable_prog_thread=False``."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker

    config = base_worker.nixl_agent_config
    if config is None or getattr(config, "progress_thread_off", False):
        return

    def quiet(*args: Any, **kwargs: Any) -> Any:
        kwargs["enable_prog_thread"] = False
        return config(*args, **kwargs)

    quiet.progress_thread_off = True  # type: ignore[attr-defined]
    base_worker.nixl_agent_config = quiet
