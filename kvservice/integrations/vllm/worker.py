"""The connector's worker side: the kvservice engine over vLLM's own KV tensors, and the
sends and loads the scheduler asked for, reported back as they settle.

Nothing here blocks vLLM's forward loop: every call on ``kvservice.engine`` only queues
(its service runs on a loop thread of its own) and ``poll()`` reads what that loop
published.  A send is posted after the step's forward (``save``, from ``wait_for_save``)
of the step the scheduler names (the one that samples the request's last token, or the one
after it finished), with all its blocks and ``fit="tail"``: when the decode's expect
arrives, the service (on its own loop, not in a vLLM step) binds it and writes the blocks
the decode asked for: all of them, or the last ones when the decode had the prompt's first
blocks in its own prefix cache.  No WRITE can start before the forward has written the
blocks, even where it runs asynchronously (a GPU): the decode can expect only once it holds
the hand-off, which vLLM issues from the step's sampled token.  A decode that never expects
fails the send at the service's ``bootstrap_timeout_s``; one that expected and is gone
fails it at once; one that declines it (its prefix cache held every block) aborts it.

A send is reported to vLLM (``finished_sending``, which frees the blocks) once vLLM said
the request finished (``finished_req_ids``) and the send has ended and *settled*: nothing
reads the blocks any more.  A send the scheduler cancels (its request handed nothing off
after all) is aborted first; one whose request was preempted is aborted and never reported
(vLLM took the blocks back when it preempted it).

A ticket's request (decode-first, ``layerwise``) is sent layer by layer instead: the step's
chunks (``LayerSend``) arrive with the step's metadata, which vLLM binds before the forward
(``start_load_kv`` may run after it: vLLM 0.32 starts asynchronous loads after the forward
is launched), and after each attention layer's forward (``save_layer``, from
``save_kv_layer``) that layer of the chunks' blocks is posted; ``save`` (``wait_for_save``,
after the forward) posts any layer the forward did not pass through ``save_kv_layer``, so
every (block, layer) is sent exactly once and the last chunk's last call says ``last=True``.
Here the decode's expect may be bound already, so a WRITE may start as soon as it is
posted: on CPU the layer's KV is written when the attention op returns; on a GPU the worker
waits for the current stream first.  Reported, freed and cancelled as a whole send is.

A load is reported to vLLM (``finished_recving``) only when it succeeded or,
failed, once it is *settled*: nothing of it can land in the blocks any more, so vLLM may
give them to another request.  A failed load is also reported in ``failed_recving`` and
its blocks in ``get_block_ids_with_load_errors``, so vLLM recomputes the prompt
(``kv_load_failure_policy="recompute"``) or fails the request (``"fail"``).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import torch

from ..._config import ServiceConfig
from ..._log import Throttle, get_logger
from ..._results import FailureReason, failure_text
from ..._tp import TensorParallel
from ...engine import KVPoll, KVReceiver, KVSender, KVTransferEngine
from ...memory import KVMemory
from .layerwise import LayerSend
from .memory import kv_memory
from .params import Handoff
from .scheduler import Cancel, RecvSpec, SendSpec, Work
from .stats import Samples

log = get_logger("kvservice.vllm")

_ENDED = (KVPoll.Success, KVPoll.Failed)
#: a step without a forward in which a transfer ended waits up to this long for the next of
#: those still on their way to end, and goes on while they do (``WorkerSide._idle``) ...
GATHER_GAP_S = 0.02
#: ... up to this long in all
GATHER_MAX_S = 0.1


@dataclass(slots=True)
class _Load:
    spec: RecvSpec
    receivers: list[KVReceiver]
    failed: bool = False
    error: str = ""


@dataclass(slots=True)
class _Send:
    spec: SendSpec
    senders: list[KVSender]
    #: vLLM finished the request: it is reported once the send ended
    finished: bool = False
    cancelled: bool = False
    #: a ticket's request: sent layer by layer (``LayerSend``)
    layerwise: bool = False


class WorkerSide:
    """One worker's (TP rank's) transfers."""

    def __init__(self, config: ServiceConfig, *, tp_size: int = 1, tp_rank: int = 0,
                 engine: Callable[[ServiceConfig, KVMemory], KVTransferEngine] | None = None) -> None:
        self.config = config
        self.tp_size, self.tp_rank = tp_size, tp_rank
        self._make = engine or (lambda cfg, memory: KVTransferEngine(cfg, memory=memory))
        self.engine: KVTransferEngine | None = None
        self._sends: dict[str, _Send] = {}
        self._loads: dict[str, _Load] = {}
        self._load_errors: set[int] = set()
        self._layer_index: dict[str, int] = {}  # vLLM's layer name -> kvservice's layer
        self._cuda = False  # the KV is on a GPU: a layer's KV is written when its stream gets there
        #: this step's layer-wise chunks (those of ``_step``, the metadata's list), and the
        #: layers posted of them so far
        self._step: list[LayerSend] | None = None
        self._chunks: list[LayerSend] = []
        self._posted: set[int] = set()
        #: (chunk, layer) sends posted from ``save_kv_layer``, during a forward (not after it)
        self.layers_in_forward = 0
        self.counts: Counter[str] = Counter()
        self.samples = Samples()  # the successful transfers' times and bytes, for vLLM's stats
        self._throttle = Throttle()

    def register(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        memory = kv_memory(list(kv_caches.values()), tp_size=self.tp_size, tp_rank=self.tp_rank)
        self._layer_index = {name: i for i, name in enumerate(kv_caches)}
        self._cuda = any(t.is_cuda for t in kv_caches.values())
        self.engine = self._make(self.config, memory).start()
        log.info("vllm.registered", address=self.engine.address, layers=memory.layers,
                 blocks=memory.num_pages, block_bytes=memory.page_bytes, tp_rank=self.tp_rank)

    # -- the step's work ------------------------------------------------------------------
    def start(self, work: Work) -> None:
        """Before (or as) the step's forward runs: loads, declines, cancelled sends."""
        for cancel in work.cancels:
            self._cancel(cancel)
        for recv in work.recvs:
            self._start_load(recv)
        for handoff in work.declines:
            self._decline(handoff)

    def _begin(self, chunks: list[LayerSend]) -> None:
        """This step's layer-wise chunks (the metadata's list, the same object all step):
        the first chunk of a request makes its senders."""
        if chunks is self._step:
            return
        self._step, self._chunks, self._posted = chunks, [], set()
        for chunk in chunks:
            if chunk.first:
                self._start_layerwise(chunk)
            entry = self._sends.get(chunk.req_id)
            if entry is not None and entry.layerwise and not entry.cancelled:
                self._chunks.append(chunk)

    def save_layer(self, layer_name: str, chunks: list[LayerSend]) -> None:
        """After a layer's attention forward (``save_kv_layer``): that layer of this step's
        layer-wise chunks."""
        self._begin(chunks)
        layer = self._layer_index.get(layer_name)
        if not self._chunks or layer is None or layer in self._posted:
            return
        if self._cuda:
            torch.cuda.current_stream().synchronize()  # the layer's KV is in its blocks only then
        self.layers_in_forward += self._post_layer(layer)

    def save(self, work: Work) -> None:
        """After the step's forward: the sends (their blocks hold the step's KV), and any
        layer of the layer-wise chunks not posted during the forward."""
        self._begin(work.layers)
        if self._chunks:
            missing = [i for i in range(len(self._layer_index)) if i not in self._posted]
            if missing and self._cuda:
                torch.cuda.current_stream().synchronize()
            for layer in missing:
                self._post_layer(layer)
        self._step, self._chunks = None, []
        for send in work.sends:
            self._start_send(send)

    def _post_layer(self, layer: int) -> int:
        """Post ``layer`` of this step's chunks; how many were posted."""
        posted = 0
        self._posted.add(layer)
        final = len(self._posted) == len(self._layer_index)
        for chunk in self._chunks:
            entry = self._sends.get(chunk.req_id)
            if entry is None or entry.cancelled:
                continue
            try:
                for sender in entry.senders:
                    sender.send(list(chunk.blocks), layers=range(layer, layer + 1), last=chunk.last and final)
                posted += 1
            except (ValueError, RuntimeError) as exc:  # the engine is gone: nothing more is sent
                self._note("send_refused", chunk.req_id, str(exc))
                entry.cancelled = True
                for sender in entry.senders:
                    sender.abort()
        return posted

    def _start_layerwise(self, chunk: LayerSend) -> None:
        """The senders of a ticket's request, under the ticket's id (what its decode expects)."""
        if chunk.req_id in self._sends:
            self._note("send_refused", chunk.req_id, "a send of this request is still on its way")
            return
        entry = self._sends[chunk.req_id] = _Send(SendSpec(chunk.req_id, (), chunk.decode_tp), [], layerwise=True)
        try:
            engine = self._engine()
            tp = TensorParallel(self.tp_size, chunk.decode_tp)
            for d in tp.targets(self.tp_rank):
                entry.senders.append(engine.sender(TensorParallel.request_id(chunk.transfer, self.tp_rank, d)))
        except (ValueError, RuntimeError) as exc:  # a duplicate id, an engine that is gone: nothing sent
            self._note("send_refused", chunk.req_id, str(exc))
            entry.cancelled = True
            for sender in entry.senders:
                sender.abort()

    def _start_send(self, spec: SendSpec) -> None:
        """Send every block now, fitted by the service to what the decode expects when its
        expect arrives (``fit="tail"``): no step of this engine stands between the two."""
        if spec.req_id in self._sends:
            self._note("send_refused", spec.req_id, "a send of this request is still on its way")
            return
        entry = self._sends[spec.req_id] = _Send(spec, [])
        try:
            engine = self._engine()
            tp = TensorParallel(self.tp_size, spec.decode_tp)
            for d in tp.targets(self.tp_rank):
                entry.senders.append(engine.sender(TensorParallel.request_id(spec.req_id, self.tp_rank, d)))
            for sender in entry.senders:
                sender.send(list(spec.blocks), last=True, fit="tail")
        except (ValueError, RuntimeError) as exc:  # a duplicate id, an engine that is gone: nothing sent
            self._note("send_refused", spec.req_id, str(exc))
            entry.cancelled = True  # counted here
            for sender in entry.senders:
                sender.abort()

    def _cancel(self, cancel: Cancel) -> None:
        entry = self._sends.get(cancel.req_id)
        if entry is None:  # never posted here: nothing to wait for
            entry = self._sends[cancel.req_id] = _Send(SendSpec(cancel.req_id, (), 1), [])
        entry.cancelled = True
        self.counts["sends_cancelled"] += 1
        for sender in entry.senders:
            sender.abort()
        if cancel.finished:
            entry.finished = True
        else:  # preempted: vLLM has its blocks back already, and will not hear of this send
            del self._sends[cancel.req_id]
            for sender in entry.senders:
                sender.clear()

    def _decline(self, handoff: Handoff) -> None:
        """Tell each prefill rank this rank loads from that it needs none of the request."""
        try:
            engine = self._engine()
            tp = TensorParallel(len(handoff.senders), self.tp_size)
            for p in tp.sources(self.tp_rank):
                engine.decline(TensorParallel.request_id(handoff.request, p, self.tp_rank), sender=handoff.senders[p],
                               message="the decode's prefix cache holds every block handed off")
                self.counts["declines"] += 1
        except (ValueError, RuntimeError) as exc:  # not told: the prefill frees at its bootstrap_timeout_s
            self._note("decline_failed", handoff.request, str(exc))

    def _start_load(self, spec: RecvSpec) -> None:
        handoff = spec.handoff
        load = self._loads[spec.req_id] = _Load(spec, [])
        try:
            engine = self._engine()
            if len(spec.blocks) != handoff.num_blocks - spec.cached or not spec.blocks:
                raise ValueError(f"{len(spec.blocks)} blocks allocated for {handoff.num_blocks} handed off, "
                                 f"{spec.cached} of them cached here")
            tp = TensorParallel(len(handoff.senders), self.tp_size)
            for p in tp.sources(self.tp_rank):
                # a hand-off a member proved is loaded from that member alone (any other answering
                # at the sender's address is refused, REFUSED naming both)
                receiver = engine.receiver(TensorParallel.request_id(handoff.request, p, self.tp_rank),
                                           sender=handoff.senders[p], member=handoff.member or None)
                load.receivers.append(receiver)
                receiver.init(list(spec.blocks))
        except (ValueError, RuntimeError) as exc:
            self._fail(load, f"refused: {exc}")

    # -- what finished --------------------------------------------------------------------
    def finished(self, finished_req_ids: Iterable[str], *, idle_wait_s: float = 0.0
                 ) -> tuple[set[str], set[str], set[str]]:
        """(finished sending, finished receiving, failed receiving) since the last call;
        ``finished_req_ids``: requests vLLM finished (an abort among them ends its load).
        ``idle_wait_s``: the step ran no forward (its only work is transfers): first wait up
        to that long for one of them to end (``_idle``)."""
        for rid in finished_req_ids:
            load = self._loads.get(rid)
            if load is not None and not load.failed:
                self._fail(load, "the request finished (aborted) while its KV was on the way")
            send = self._sends.get(rid)
            if send is not None:
                send.finished = True
        if idle_wait_s > 0:
            self._idle(idle_wait_s)
        sending = {rid for rid, send in self._sends.items() if send.finished and self._send_ended(send)}
        for rid in sending:
            del self._sends[rid]
        recving, failed = set(), set()
        for rid, load in list(self._loads.items()):
            states = [r.poll() for r in load.receivers]
            if not load.failed and states and all(s is KVPoll.Success for s in states):
                self.counts["loads_ok"] += 1
                self.samples.ended("load", [r.result for r in load.receivers])
            elif not load.failed and KVPoll.Failed in states:
                first = next(r for r in load.receivers if r.poll() is KVPoll.Failed)
                self._fail(load, _why(first))
                continue  # the others end (aborted) and settle: reported on a later step
            elif not (load.failed and all(s in _ENDED for s in states) and all(r.settled for r in load.receivers)):
                continue
            recving.add(rid)
            if load.failed:
                failed.add(rid)
                self._load_errors.update(load.spec.blocks)
            for r in load.receivers:
                r.clear()
            del self._loads[rid]
        return sending, recving, failed

    def load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()

    # -------------------------------------------------------------------------------------
    def _idle(self, timeout: float) -> None:
        """vLLM's engine core steps without pause while a request's blocks are held for a
        decode or a load is on its way, and its steps take the GIL (and, with the engine core
        in the worker's process, the core) from kvservice's loop, which runs the transfers.
        Where the step had nothing else to do, block here instead, until a transfer ends
        (reported by this very step) or ``timeout`` passes (a new request waits that long at
        most).

        Once one has ended, while loads are still on their way, go on waiting for the next for
        up to ``GATHER_GAP_S`` each time, ``GATHER_MAX_S`` in all: the loads of requests
        prefilled together land a few milliseconds apart (one WRITE after another), and a step
        that reported only the first would have vLLM run that request's decode forward
        (hundreds of milliseconds on a CPU) before the next step reports the others, which
        from then on reach the decode a step apart instead of in one batch.  Sends are not
        waited on so: their end only frees blocks, and a prompt arriving at a prefill would
        wait for nothing."""
        engine = self.engine
        if engine is None or not engine.running or not (self._loading() or self._sending()):
            return
        if not engine.wait_for_end(timeout):
            return
        until = time.monotonic() + GATHER_MAX_S
        while self._loading():
            left = until - time.monotonic()
            if left <= 0 or not engine.wait_for_end(min(GATHER_GAP_S, left)):
                return

    def _sending(self) -> bool:
        """A send of this worker has not ended, or has not settled."""
        return any(t.result is None or not t.settled for send in self._sends.values() for t in send.senders)

    def _loading(self) -> bool:
        """A load of this worker has not ended, or has not settled."""
        return any(t.result is None or not t.settled for load in self._loads.values() for t in load.receivers)

    def _send_ended(self, send: _Send) -> bool:
        states = [s.poll() for s in send.senders]
        if not all(state in _ENDED for state in states) or not all(s.settled for s in send.senders):
            return False
        failed = [s for s in send.senders if s.poll() is KVPoll.Failed]
        if failed and send.cancelled:
            pass  # counted when cancelled
        elif failed and all(s.result is not None and s.result.reason is FailureReason.ABORTED for s in failed):
            self.counts["sends_declined"] += 1  # the decode aborted it: declined, or its request aborted
        elif failed:
            self._note("send_failed", send.spec.req_id, _why(failed[0]))
        elif send.senders:
            self.counts["sends_ok"] += 1
            self.samples.ended("send", [s.result for s in send.senders])
            if any(s.result is not None and s.result.pages < len(send.spec.blocks) for s in send.senders):
                self.counts["sends_partial"] += 1  # the decode had the first blocks cached: it took the last ones
        for s in send.senders:
            s.clear()
        return True

    def _fail(self, load: _Load, why: str) -> None:
        load.failed, load.error = True, why
        for r in load.receivers:
            if r.poll() not in _ENDED:
                r.abort()
        self._note("load_failed", load.spec.req_id, why)

    def _engine(self) -> KVTransferEngine:
        if self.engine is None or not self.engine.running:
            raise RuntimeError("the kvservice engine is not running (register_kv_caches not called, or closed)")
        return self.engine

    def _note(self, kind: str, rid: str, why: str) -> None:
        self.counts[kind] += 1
        if (unlogged := self._throttle.allow(kind)) is not None:
            log.warning(f"vllm.{kind}", request=rid, why=why, unlogged=unlogged)


def _why(transfer: KVSender | KVReceiver) -> str:
    """What the log says of a failed transfer: ``failure_exception()``'s message (the
    request, the reason, the peer and the original error)."""
    result = transfer.result
    if result is None or result.reason is None:
        return f"request {transfer.request_id!r} failed"
    return failure_text(result.request_id, result.reason, result.peer, result.message, result.error)
