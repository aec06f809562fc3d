"""A prefill or decode scheduler rank of SGLang, minus the model, for the kvservice backend's tests.

Run with the SGLang environment's python (scripts/engine-env.sh sglang), kvservice on PYTHONPATH::

    python tests/integrations/sglang/roles.py prefill --bootstrap-port 8998 [--serve-bootstrap]
    python tests/integrations/sglang/roles.py decode --bootstrap-port 8998

Everything SGLang-side is SGLang's own: ``load_plugins()`` (which loads the kvservice
plugin through its entry point), ``prepare_server_args`` (the real CLI parsing, with
``--disaggregation-transfer-backend kvservice``), ``TransferBackend`` and ``get_kv_class``
to pick the classes, ``KVArgs``, ``MetadataBuffers`` for the aux rows, ``DisaggregationMode``,
and the schedulers' own poll functions (``poll_and_all_reduce_attn_cp_tp_group`` on the
prefill, ``poll_and_all_reduce`` with the metadata gate on the decode, over a one-rank
gloo group).  The loops call the sender and receiver in the order
``disaggregation/prefill.py`` and ``disaggregation/decode.py`` do, and treat poll states
as they do (an unexpected one raises, as SGLang's loop does).  The KV pool is CPU
tensors, SGLang's MHA layout: per layer a K and a V tensor ``(tokens, heads, head_dim)``.

Commands arrive as JSON lines on stdin (``{"room": R, "pages": N, ...}``, ``{"quit": true}``);
events leave as JSON lines on stdout.  The process exits 0 only if its loop never raised.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import sys
import threading
import time
from types import SimpleNamespace
from typing import Any

import torch

LAYERS, HEADS, HEAD_DIM, PAGE, NUM_PAGES = 2, 2, 8, 4, 64
LATENT = 24  # an MLA pool's kv_lora_rank + rope dim
AUX_ROWS = 16
TICK_S = 0.01
#: how long a failed request's pages may take to become safe to reuse (``release_safe``)
RELEASE_WAIT_S = 30.0
RETRY_S, TRIES = 0.5, 10  # the decode's lookups of a prefill: bounded, spaced retries


def emit(**event: Any) -> None:
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()


def pattern(room: int, pages: int, mla: bool) -> torch.Tensor:
    """A request's KV, the same on both sides: per buffer (K and V of each layer, or each
    layer's MLA latent) ``pages`` pages of ``PAGE`` tokens."""
    g = torch.Generator().manual_seed(room)
    shape = (LAYERS, pages, PAGE, 1, LATENT) if mla else (2 * LAYERS, pages, PAGE, HEADS, HEAD_DIM)
    return torch.rand(shape, generator=g)


class Inbox:
    """The test's commands, one JSON object a line on stdin, read by a thread of their own;
    ``{"quit": true}`` or the end of stdin asks the role to finish what it holds and exit."""

    def __init__(self) -> None:
        self._q: queue.Queue[dict[str, Any]] = queue.Queue()
        self.quitting = False
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in sys.stdin:
            if line.strip():
                self._q.put(json.loads(line))
        self._q.put({"quit": True})

    def new(self) -> list[dict[str, Any]]:
        """The commands that came since the last call, without blocking."""
        got: list[dict[str, Any]] = []
        while True:
            try:
                cmd = self._q.get_nowait()
            except queue.Empty:
                return got
            if cmd.get("quit"):
                self.quitting = True
            else:
                got.append(cmd)


class Rank:
    """What both roles set up: SGLang's plugin, server args, classes, pool, aux rows, manager."""

    def __init__(self, mode: str, bootstrap_port: int, extra: list[str], mla: bool) -> None:
        from sglang.srt.plugins import load_plugins

        load_plugins()  # SGLang's own loader: the kvservice entry point registers its hooks
        import torch.distributed as dist
        from sglang.srt.disaggregation.utils import (
            DisaggregationMode,
            KVClassType,
            MetadataBuffers,
            TransferBackend,
            get_kv_class,
        )
        from sglang.srt.server_args import prepare_server_args

        self.server_args = prepare_server_args([
            "--model-path", "unused", "--device", "cpu", "--disaggregation-mode", mode,
            "--disaggregation-transfer-backend", "kvservice",
            "--disaggregation-bootstrap-port", str(bootstrap_port), *extra])
        backend = TransferBackend(self.server_args.disaggregation_transfer_backend)
        self.classes = {t: get_kv_class(backend, t) for t in KVClassType}
        self.mla = mla
        if mla:  # MLATokenToKVPool: one latent buffer per layer
            self.bufs = [torch.zeros(NUM_PAGES * PAGE, 1, LATENT) for _ in range(LAYERS)]
        else:  # MHATokenToKVPool: k_buffer + v_buffer
            self.bufs = [torch.zeros(NUM_PAGES * PAGE, HEADS, HEAD_DIM) for _ in range(2 * LAYERS)]
        self.meta = MetadataBuffers(AUX_ROWS, hidden_size=8, hidden_states_dtype=torch.float32,
                                    max_sampling_mask_tokens=4)
        kv_args = self.classes[KVClassType.KVARGS]()
        bufs = self.bufs
        kv_args.engine_rank = 0
        kv_args.pp_rank = 0
        kv_args.system_dp_rank = 0
        kv_args.kv_cache_dtype_str = "auto"
        kv_args.kv_data_ptrs = [t.data_ptr() for t in bufs]
        kv_args.kv_data_lens = [t.nbytes for t in bufs]
        kv_args.kv_item_lens = [t[0].nbytes * PAGE for t in bufs]
        kv_args.aux_data_ptrs, kv_args.aux_data_lens, kv_args.aux_item_lens = self.meta.get_buf_infos()
        kv_args.state_types = []
        kv_args.page_size = PAGE
        if mode == "prefill" and not mla:  # as SGLang's schedulers do: its decode sets neither
            kv_args.kv_head_num = HEADS
            kv_args.total_kv_head_num = HEADS
        if mode == "prefill":
            kv_args.gpu_id = 0
        self.mode = DisaggregationMode.PREFILL if mode == "prefill" else DisaggregationMode.DECODE
        self.kv_args = kv_args
        self.free = list(range(NUM_PAGES)) if mode == "decode" else list(reversed(range(NUM_PAGES)))
        self.aux_free = list(range(AUX_ROWS))
        if not dist.is_initialized():
            dist.init_process_group("gloo", init_method=f"file://{os.environ['KVSERVICE_TEST_GLOO_FILE']}",
                                    rank=0, world_size=1)
        self.group = dist.group.WORLD

    def manager(self) -> Any:
        from sglang.srt.disaggregation.utils import KVClassType

        return self.classes[KVClassType.MANAGER](self.kv_args, self.mode, self.server_args, self.mla)

    def _order(self) -> list[torch.Tensor]:
        """The buffers in the pattern's order: per layer its K then its V (or its latent)."""
        if self.mla:
            return self.bufs
        return [self.bufs[layer + j * LAYERS] for layer in range(LAYERS) for j in (0, 1)]

    def write_pages(self, pages: list[int], data: torch.Tensor) -> None:
        for i, buf in enumerate(self._order()):
            for j, page in enumerate(pages):
                buf[page * PAGE:(page + 1) * PAGE] = data[i, j]

    def read_pages(self, pages: list[int]) -> torch.Tensor:
        return torch.stack([torch.stack([buf[p * PAGE:(p + 1) * PAGE] for p in pages]) for buf in self._order()])


def failure(t: Any) -> dict[str, Any]:
    """What SGLang's failure handlers do (``failure_exception()`` in a try, logging ``str()``
    of it), what that string says, and whether the original error is reachable: the
    error kvservice kept, as the raised exception's ``__cause__``."""
    try:
        t.failure_exception()
    except Exception as exc:  # noqa: BLE001 - what the scheduler does
        facade = getattr(t, "_t", None)
        result = facade.result if facade is not None else None
        own = getattr(t, "_failure", None)
        kept = own.__cause__ if own is not None else (result.error if result is not None else None)
        reason = getattr(exc, "reason", None)
        cause = exc.__cause__
        return {"error_type": type(exc).__name__, "error": str(exc)[:400],
                "reason": reason.value if reason is not None else None, "peer": getattr(exc, "peer", None),
                "cause_type": type(cause).__name__ if cause is not None else None,
                "original": cause is not None and cause is kept}
    return {"error_type": None, "error": "failure_exception() returned"}


def release_safe(receiver: Any) -> tuple[bool, float]:
    """Whether a failed receiver's pages became safe to reuse, and after how long: SGLang's
    decode holds them and asks ``is_abort_release_safe()`` again every step until they are
    (``DecodeTransferQueue.resolve_deferred_releases``).  A sender SIGKILLed mid-transfer is
    known gone at once when NIXL has seen its endpoint drop, else once a probe of its
    address finds nobody (``Inbound.on_peer_lost``)."""
    start = time.monotonic()
    while not receiver.is_abort_release_safe():
        if time.monotonic() - start > RELEASE_WAIT_S:
            return False, time.monotonic() - start
        time.sleep(TICK_S)
    return True, time.monotonic() - start


def track(states: dict[int, list[int]], room: int, poll: int) -> None:
    seen = states.setdefault(room, [])
    if not seen or seen[-1] != poll:
        seen.append(int(poll))


def run_prefill(rank: Rank, args: argparse.Namespace) -> None:
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.utils import KVClassType, poll_and_all_reduce_attn_cp_tp_group

    def serve() -> Any:  # what start_disagg_service does in the prefill's main process
        return rank.classes[KVClassType.BOOTSTRAP_SERVER](host="127.0.0.1", port=args.bootstrap_port)

    server = serve() if args.serve_bootstrap and not args.bootstrap_delay else None
    mgr = rank.manager()
    if args.serve_bootstrap and args.bootstrap_delay:  # the registry starts after this rank
        time.sleep(args.bootstrap_delay)
        server = serve()
    emit(event="ready", address=mgr.engine.address, bootstrap=server.port if server else None)
    sender_cls = rank.classes[KVClassType.SENDER]
    inbox = Inbox()
    bootstrap_q: list[SimpleNamespace] = []
    running: list[SimpleNamespace] = []  # computing chunk by chunk
    inflight: list[SimpleNamespace] = []
    states: dict[int, list[int]] = {}
    awaited: list[tuple[str, int]] = []  # ("expected" | "expect_dropped", room)
    while not (inbox.quitting and not bootstrap_q and not running and not inflight):
        for what, room in [a for a in awaited if getattr(mgr.engine, a[0])(str(a[1]))]:
            awaited.remove((what, room))
            emit(event=what, room=room)
        for cmd in inbox.new():
            if "await" in cmd:  # tell the test once the engine says so of the room
                awaited.append((cmd["await"], cmd["room"]))
                continue
            room = cmd["room"]
            req = SimpleNamespace(room=room, n=cmd["pages"], chunk=cmd.get("chunk", 2), step_s=cmd.get("step_s", 0.0),
                                  sent=0, last_step=0.0, pages=None, aux=None)
            req.sender = sender_cls(mgr=mgr, bootstrap_addr=f"127.0.0.1:{args.bootstrap_port}", bootstrap_room=room)
            bootstrap_q.append(req)
        # pop_bootstrapped
        polls = poll_and_all_reduce_attn_cp_tp_group([r.sender for r in bootstrap_q], rank.group, rank.group)
        keep = []
        for req, poll in zip(bootstrap_q, polls, strict=True):
            track(states, req.room, poll)
            if poll == KVPoll.Failed:
                emit(event="end", room=req.room, poll="Failed", phase="bootstrap", states=states[req.room],
                     **failure(req.sender))
            elif poll == KVPoll.Bootstrapping:
                keep.append(req)
            elif poll == KVPoll.WaitingForInput:
                req.pages, req.aux = [rank.free.pop() for _ in range(req.n)], rank.aux_free.pop()
                rank.write_pages(req.pages, pattern(req.room, req.n, rank.mla))
                rank.meta.output_ids[req.aux].fill_(req.room % 1000)
                rank.meta.bootstrap_room[req.aux, 0] = req.room
                req.sender.init(req.n, req.aux)
                running.append(req)
            else:
                raise RuntimeError(f"Unexpected poll state {poll} for room {req.room} in pop_bootstrapped")
        bootstrap_q = keep
        # forward steps: one chunk per step (send_kv_chunk)
        now = time.monotonic()
        for req in list(running):
            if now - req.last_step < req.step_s:
                continue
            req.last_step = now
            chunk = req.pages[req.sent:req.sent + req.chunk]
            req.sender.send(torch.tensor(chunk, dtype=torch.int32).numpy())
            req.sent += len(chunk)
            emit(event="chunk", room=req.room, sent=req.sent, of=req.n)
            if req.sent >= req.n:
                running.remove(req)
                inflight.append(req)
        # process_disagg_prefill_inflight_queue
        polls = poll_and_all_reduce_attn_cp_tp_group([r.sender for r in inflight], rank.group, rank.group)
        undone = []
        for req, poll in zip(inflight, polls, strict=True):
            track(states, req.room, poll)
            if poll in (KVPoll.WaitingForInput, KVPoll.Transferring):
                undone.append(req)
            elif poll == KVPoll.Success:
                req.sender.clear()
                metric = req.sender.get_transfer_metric()
                emit(event="end", room=req.room, poll="Success", states=states[req.room],
                     bytes=metric.transfer_total_bytes)
            elif poll == KVPoll.Failed:
                emit(event="end", room=req.room, poll="Failed", phase="inflight", states=states[req.room],
                     **failure(req.sender))
            else:
                raise RuntimeError(f"Unexpected poll state {poll} for room {req.room} in inflight queue")
        inflight = undone
        time.sleep(TICK_S)
    mgr.close()
    emit(event="exit")


def run_decode(rank: Rank, args: argparse.Namespace) -> None:
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.utils import KVClassType, poll_and_all_reduce

    mgr = rank.manager()
    emit(event="ready", address=mgr.engine.address)
    receiver_cls = rank.classes[KVClassType.RECEIVER]
    inbox = Inbox()
    prealloc: list[SimpleNamespace] = []
    transfer: list[SimpleNamespace] = []
    states: dict[int, list[int]] = {}
    while not (inbox.quitting and not prealloc and not transfer):
        for cmd in inbox.new():
            addr = cmd.get("bootstrap", f"127.0.0.1:{args.bootstrap_port}")
            req = SimpleNamespace(room=cmd["room"], n=cmd["pages"], hold_s=cmd.get("hold_s", 0.0),
                                  bootstrap_host=addr.rpartition(":")[0], ready_at=None, tries=0, addr=addr,
                                  next_try=0.0, abort=cmd.get("abort", False),
                                  init_direct=cmd.get("init_direct", False))
            req.receiver = receiver_cls(mgr=mgr, bootstrap_addr=addr, bootstrap_room=cmd["room"])
            req.req, req.metadata_buffer_index = req, -1
            prealloc.append(req)
        # resolve the prefill (try_ensure_parallel_info, bounded like SGLang's retries), then init
        for req in prealloc:
            if req.receiver.bootstrap_infos is not None or req.receiver.conclude_state is not None:
                continue
            if time.monotonic() < req.next_try:
                continue
            if req.init_direct or mgr.try_ensure_parallel_info(req.addr):
                req.receiver.init(0)
            else:
                req.tries += 1
                req.next_try = time.monotonic() + RETRY_S
                if req.tries >= TRIES:  # SGLang: "Could not fetch prefill parallel info ... after N attempts"
                    req.receiver.abort()
        polls = poll_and_all_reduce([r.receiver for r in prealloc], rank.group)
        keep = []
        for req, poll in zip(prealloc, polls, strict=True):
            track(states, req.room, poll)
            if poll == KVPoll.Bootstrapping:
                keep.append(req)
            elif poll == KVPoll.WaitingForInput and req.abort:  # the scheduler gives it up before its metadata
                req.receiver.abort()
                req.abort = False
                keep.append(req)
            elif poll == KVPoll.WaitingForInput:
                req.ready_at = req.ready_at or time.monotonic()
                if time.monotonic() - req.ready_at < req.hold_s:
                    keep.append(req)
                    continue
                req.pages, req.metadata_buffer_index = [rank.free.pop(0) for _ in range(req.n)], rank.aux_free.pop(0)
                rank.meta.bootstrap_room[req.metadata_buffer_index].zero_()
                pages = torch.tensor(req.pages, dtype=torch.int32).numpy()
                req.receiver.send_metadata(pages, req.metadata_buffer_index)
                emit(event="metadata", room=req.room)
                transfer.append(req)
            elif poll == KVPoll.Failed:
                emit(event="end", room=req.room, poll="Failed", phase="prealloc", states=states[req.room],
                     **failure(req.receiver))
            else:
                raise RuntimeError(f"Unexpected poll state {poll} for room {req.room} in the prealloc queue")
        prealloc = keep
        polls = poll_and_all_reduce([r.receiver for r in transfer], rank.group, transfer, rank.meta)
        undone = []
        for req, poll in zip(transfer, polls, strict=True):
            track(states, req.room, poll)
            if poll in (KVPoll.WaitingForInput, KVPoll.Transferring, KVPoll.Bootstrapping):
                undone.append(req)
            elif poll == KVPoll.Success:
                got = rank.read_pages(req.pages)
                aux = req.metadata_buffer_index
                verified = bool(torch.equal(got, pattern(req.room, req.n, rank.mla)))
                aux_ok = int(rank.meta.bootstrap_room[aux, 0]) == req.room and \
                    int(rank.meta.output_ids[aux, 0]) == req.room % 1000
                req.receiver.clear()
                emit(event="end", room=req.room, poll="Success", verified=verified, aux=aux_ok, states=states[req.room])
            elif poll == KVPoll.Failed:
                safe, waited = release_safe(req.receiver)
                emit(event="end", room=req.room, poll="Failed", phase="transfer", states=states[req.room],
                     release_safe=safe, release_waited_s=waited, **failure(req.receiver))
            else:
                raise RuntimeError(f"Unexpected poll state {poll} for room {req.room} in the transfer queue")
        transfer = undone
        time.sleep(TICK_S)
    mgr.close()
    emit(event="exit")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("role", choices=["prefill", "decode"])
    parser.add_argument("--bootstrap-port", type=int, required=True)
    parser.add_argument("--serve-bootstrap", action="store_true")
    parser.add_argument("--mla", action="store_true")
    parser.add_argument("--bootstrap-delay", type=float, default=0.0)
    args = parser.parse_args()
    rank = Rank(args.role, args.bootstrap_port, [], args.mla)
    (run_prefill if args.role == "prefill" else run_decode)(rank, args)


if __name__ == "__main__":
    main()
