"""SGLang's transfer-backend interface over kvservice: manager, sender, receiver, bootstrap server.

Like SGLang's own backends (``disaggregation/<backend>/conn.py``), one module holds the
four classes ``get_kv_class`` hands out; they implement ``disaggregation/base/conn.py``.
Each scheduler rank's ``KVManager`` runs one ``kvservice.engine.KVTransferEngine`` (the
service on a loop thread of its own) over the rank's KV buffers as they are
(``memory.kv_memory``); a request's sender and receiver are the facade's
``KVSender`` / ``KVReceiver`` under the request id ``str(bootstrap_room)``.

How the schedulers' calls map (the prefill's in ``disaggregation/prefill.py``, the
decode's in ``disaggregation/decode.py``):

* prefill ``KVSender(mgr, bootstrap_addr, room)``; ``poll()`` is ``Bootstrapping`` until
  the decode's expect for the room has reached this rank (``KVTransferEngine.expected``),
  then ``WaitingForInput``: the scheduler calls ``init(num_pages, aux_index)`` and
  ``send(page_indices)`` per chunk; the chunk that reaches ``num_pages`` is the last and
  carries the aux row as its payload.  After ``init`` the facade's ``Bootstrapping`` reads
  ``WaitingForInput``: the prefill's inflight queue takes only ``WaitingForInput``,
  ``Transferring``, ``Success`` and ``Failed`` (anything else raises in its loop).
* decode ``KVReceiver(mgr, bootstrap_addr, room)``: ``Bootstrapping``; ``init(dp_rank)``
  looks the prefill ranks up in the bootstrap registry (cached per prefill) and picks
  the rank with this rank's heads (with a member identity, the lookup's signed
  registrations name the rank's member, which alone is taken at its address:
  ``registration.lookup_ranks``, ``expect(member=)``): ``WaitingForInput``; ``send_metadata(kv_indices,
  aux_index)`` sends the expect; ``Success`` once every chunk's notification is in and
  the payload is in this rank's aux row.
* A decode rank believes a prefill's ranks for ``PREFILL_CACHE_S`` (shorter than any
  restart), so it never dials a restarted prefill's old address; a receiver that fails or
  is aborted before its expect reached the prefill rank declines the room there, so the
  prefill's sender fails at once instead of at its bootstrap timeout.
* Failure is sticky and never raises into a scheduler loop: ``poll()`` says ``Failed``
  for good and ``failure_exception()`` raises ``TransferFailed``, whose message names the
  request, the reason and the peer, with the original error (NIXL's exception, the lost
  connection's, the registry's ``BootstrapError``, the service's ``ValueError``...) as its
  ``__cause__``.  SGLang's schedulers call it in a ``try`` and log only ``str()`` of
  what it raised (``Prefill transfer failed ... with exception {e}``): that string must
  say why by itself.

Scope: equal attention-TP on both sides (MHA or MLA), DP attention, page-wise KV.
Refused with a clear error: pipeline parallelism, Mamba/SWA state (``state_types``),
draft-model KV, host (CPU) KV destinations on the decode.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from sglang.srt.disaggregation.base.conn import (
    BaseKVBootstrapServer,
    BaseKVManager,
    BaseKVReceiver,
    BaseKVSender,
    KVArgs,
    KVTransferDestination,
    KVTransferMetric,
)
from sglang.srt.disaggregation.common.conn import PrefillServerInfo
from sglang.srt.disaggregation.utils import DisaggregationMode

from ..._log import get_logger
from ..._results import FailureReason, KVPoll, TransferFailed
from ...engine import KVReceiver as FacadeReceiver
from ...engine import KVSender as FacadeSender
from ...engine import KVTransferEngine
from . import bootstrap, checks, registration
from .memory import AuxRows, kv_memory
from .registration import MAX_RANKS
from .settings import service_config

log = get_logger("kvservice.sglang")

#: how long a prefill rank keeps trying to register while its bootstrap server starts
REGISTER_TIMEOUT_S = 60.0


def _attn_tp_size(server_args: Any) -> int:
    tp = int(getattr(server_args, "tp_size", 1) or 1)
    dp = int(getattr(server_args, "dp_size", 1) or 1)
    return tp // dp if getattr(server_args, "enable_dp_attention", False) and dp > 1 else tp


def _bootstrap_host(server_args: Any) -> str:
    dist = getattr(server_args, "dist_init_addr", None)
    if dist:
        return str(dist).rpartition(":")[0].strip("[]") or "127.0.0.1"
    host = getattr(server_args, "host", None) or "127.0.0.1"
    return "127.0.0.1" if host in ("0.0.0.0", "::") else str(host)


def _device() -> int:
    """The GPU this scheduler rank runs on: both of SGLang's schedulers set it as the process's
    device before they build a manager (only the prefill also sets ``KVArgs.gpu_id``)."""
    import torch

    return int(torch.cuda.current_device())


class KVManager(BaseKVManager):
    """One scheduler rank's transfer engine, over the rank's own KV buffers."""

    supports_host_destination = False

    def __init__(self, args: KVArgs, disaggregation_mode: DisaggregationMode, server_args: Any,
                 is_mla_backend: bool | None = False) -> None:
        self.kv_args = args
        self.disaggregation_mode = disaggregation_mode
        self.server_args = server_args
        self.is_mla_backend = bool(is_mla_backend)
        if int(getattr(server_args, "pp_size", 1) or 1) > 1:
            raise ValueError("the kvservice transfer backend does not support pipeline parallelism (pp_size > 1)")
        if getattr(args, "state_types", None):
            raise ValueError(f"the kvservice transfer backend moves KV pages only; this model also has state "
                             f"{[str(s) for s in args.state_types]} (Mamba/SWA/DSA) to transfer")
        self.attn_tp_size = _attn_tp_size(server_args)
        self.tp_rank = int(args.engine_rank) % self.attn_tp_size
        self.dp_rank = int(getattr(args, "system_dp_rank", 0) or 0)
        self.aux = AuxRows(args)
        # from the server's device, as on both sides (SGLang's decode sets ``kv_data_mem_kinds``
        # for its NIXL backend only, its prefill never)
        mem_type = "DRAM" if str(getattr(server_args, "device", "cpu")) == "cpu" else "VRAM"
        self.memory = kv_memory(args, is_mla=self.is_mla_backend, tp_size=self.attn_tp_size, tp_rank=self.tp_rank,
                                mem_type=mem_type, device=_device() if mem_type == "VRAM" else 0)
        self.info = {"attn_tp_size": self.attn_tp_size,
                     "dp_size": int(getattr(server_args, "dp_size", 1) or 1)
                     if getattr(server_args, "enable_dp_attention", False) else 1,
                     "page_size": int(args.page_size), "kv_cache_dtype": str(args.kv_cache_dtype_str),
                     "is_mla": self.is_mla_backend}
        self.engine = KVTransferEngine(service_config(self.aux.row_bytes), memory=self.memory).start()
        #: this rank's member identity: a decode takes a prefill rank only from the member it proves
        self.identity = self.engine.config.identity()
        #: bootstrap address -> the prefill's topology, as SGLang's decode scheduler reads it
        self.prefill_info_table: dict[str, PrefillServerInfo] = {}
        #: bootstrap address -> (when looked up, pool, ranks' addresses, ranks' members or None)
        self._prefill_ranks: dict[str, tuple[float, dict[str, Any], dict[str, str], dict[str, str] | None]] = {}
        self.bootstrap_addr = f"{_bootstrap_host(server_args)}:{int(server_args.disaggregation_bootstrap_port)}"
        if disaggregation_mode == DisaggregationMode.PREFILL:
            self.register_to_bootstrap()

    # -- prefill ---------------------------------------------------------------------------------
    def register_to_bootstrap(self) -> None:
        """Tell this prefill's bootstrap registry where this rank's kvservice listens.  The
        registry starts in the prefill's main process, maybe after this rank: one attempt
        here, then a thread of its own retries for up to ``REGISTER_TIMEOUT_S`` (as SGLang's
        backends, it logs an error then; decodes meanwhile find no rank and retry)."""
        try:
            self._register()
            return
        except bootstrap.BootstrapError as exc:
            log.info("sglang.bootstrap.register_retrying", bootstrap=self.bootstrap_addr, error=str(exc))
        threading.Thread(target=self._register_until, name="kvservice-sglang-register", daemon=True).start()

    def _register(self) -> None:
        bootstrap.register(self.bootstrap_addr, self.dp_rank, self.tp_rank, self.engine.address, self.info,
                           key=self.engine.config.resolve_key().key, incarnation=self.engine.agent_name,
                           identity=self.engine.config.identity())

    def _register_until(self) -> None:
        deadline = time.monotonic() + REGISTER_TIMEOUT_S
        while self.engine.running:
            time.sleep(0.5)
            try:
                self._register()
                return
            except bootstrap.BootstrapError as exc:
                if time.monotonic() > deadline:
                    log.error("sglang.bootstrap.register_failed", bootstrap=self.bootstrap_addr, error=str(exc))
                    return

    # -- decode ----------------------------------------------------------------------------------
    def try_ensure_parallel_info(self, bootstrap_addr: str) -> bool:
        """One attempt to learn the prefill's topology (SGLang's decode scheduler calls it
        before ``_resolve_prefill_dp_rank``); False when the registry is not reachable yet."""
        try:
            self.prefill_ranks(bootstrap_addr)
        except (bootstrap.BootstrapError, ValueError) as exc:
            log.warning("sglang.bootstrap.lookup_failed", bootstrap=bootstrap_addr, error=str(exc))
            return False
        return True

    def prefill_ranks(self, bootstrap_addr: str) -> tuple[dict[str, Any], dict[str, str]]:
        """The prefill's pool description and ranks, looked up again once the last lookup is
        ``PREFILL_CACHE_S`` old (a restarted prefill registers again) or a receiver failed
        to link (``forget_prefill``)."""
        now = time.monotonic()
        entry = self._prefill_ranks.get(bootstrap_addr)
        if entry is not None and now - entry[0] < PREFILL_CACHE_S:
            return entry[1], entry[2]
        cached = registration.lookup_ranks(bootstrap_addr, self.identity)
        info = cached[0]
        self._prefill_ranks[bootstrap_addr] = (now, *cached)
        if entry is None or entry[1] != info:
            self.prefill_info_table[bootstrap_addr] = PrefillServerInfo(
                attn_tp_size=info["attn_tp_size"], attn_cp_size=1, dp_size=info["dp_size"], pp_size=1,
                page_size=info["page_size"], kv_cache_dtype=info["kv_cache_dtype"], follow_bootstrap_room=True)
        return cached[0], cached[1]

    def forget_prefill(self, bootstrap_addr: str) -> None:
        self._prefill_ranks.pop(bootstrap_addr, None)
        self.prefill_info_table.pop(bootstrap_addr, None)

    def prefill_address(self, bootstrap_addr: str, prefill_dp_rank: int) -> tuple[str, str | None]:
        """The kvservice address of the prefill rank that holds this rank's heads, and the
        member that must prove itself there (``registration.pick_rank``)."""
        self.prefill_ranks(bootstrap_addr)
        _, info, ranks, members = self._prefill_ranks[bootstrap_addr]
        return registration.pick_rank(bootstrap_addr, info, ranks, members, self.info, prefill_dp_rank, self.tp_rank)

    def close(self) -> None:
        self.engine.close()


#: how long a decode rank believes a prefill's ranks as looked up.  Shorter than any prefill
#: restart, so a decode never dials a restarted prefill's old address: its registry restarts
#: with it, and any lookup it answers after the restart names the new incarnation
PREFILL_CACHE_S = 1.0


class _Side:
    """What sender and receiver share: a sticky failure of our own (before or beside the
    facade's), the facade object, and the calls that read them.  Every value SGLang hands
    over (the room and the bootstrap address a client's request carries, ranks, indices) is
    checked where it arrives; a bad one fails the request (``REFUSED``, saying which value)."""

    _t: FacadeSender | FacadeReceiver | None

    def __init__(self, mgr: KVManager, bootstrap_addr: Any, bootstrap_room: Any) -> None:
        self.kv_mgr = mgr
        self.bootstrap_room = bootstrap_room
        self.bootstrap_addr = bootstrap_addr
        self._failure: TransferFailed | None = None
        self._t = None
        try:
            self.request_id = checks.request_id(bootstrap_room)
        except ValueError as exc:
            self.request_id = checks.show(bootstrap_room)
            self._fail(FailureReason.REFUSED, "not a bootstrap room", exc)
            return
        try:
            checks.bootstrap_addr(bootstrap_addr)
        except ValueError as exc:
            self.bootstrap_addr = checks.show(bootstrap_addr)  # what failures name as the peer: short
            self._fail(FailureReason.REFUSED, "not a bootstrap address", exc)

    def _peer(self) -> str | None:
        """Who this side's own failures name as the peer."""
        return None

    def _fail(self, reason: FailureReason, message: str, error: BaseException | None = None) -> None:
        """Fail the request here (first failure wins) and abort the facade's, so the peer hears.
        ``error`` (what was raised, if anything) becomes the ``__cause__`` of what
        ``failure_exception()`` raises."""
        if self._failure is None and (self._t is None or self._t.result is None or self._t.result.ok):
            self._failure = TransferFailed(self.request_id, reason, message, peer=self._peer(), error=error)
            log.warning("sglang.request_failed", request_id=self.request_id, reason=reason.value,
                        peer=self._failure.peer, error=str(self._failure))
        if self._t is not None:
            self._t.abort()

    @property
    def conclude_state(self) -> int | None:
        return int(KVPoll.Failed) if self._failure is not None else None

    def failure_exception(self) -> None:
        """Raise ``TransferFailed`` for a failed request: the reason and the peer in its
        message, the original error as its ``__cause__`` (``RuntimeError`` if it has not failed)."""
        if self._failure is not None:
            raise self._failure
        if self._t is None:
            raise RuntimeError(f"request {self.request_id} has not failed")
        self._t.failure_exception()

    def abort(self) -> None:
        if self._t is not None:
            self._t.abort()
        elif self._failure is None:
            self._failure = TransferFailed(self.request_id, FailureReason.ABORTED, "aborted by the scheduler",
                                           peer=self._peer())

    def clear(self) -> None:
        if self._t is not None:
            self._t.clear()


class KVSender(_Side, BaseKVSender):
    """The prefill side of one request."""

    _t: FacadeSender | None

    def __init__(self, mgr: KVManager, bootstrap_addr: str, bootstrap_room: int,
                 req_has_disagg_prefill_dp_rank: bool = False) -> None:
        super().__init__(mgr, bootstrap_addr, bootstrap_room)
        self._created = time.monotonic()
        self._deadline = self._created + mgr.engine.config.bootstrap_timeout_s
        self._num_pages: int | None = None
        self._pages_sent = 0
        self._aux_index: int | None = None
        if self._failure is None:
            try:
                self._t = mgr.engine.sender(self.request_id)
            except ValueError as exc:  # a live sender of the same room on this rank
                self._fail(FailureReason.REFUSED, "the room is in use on this rank", exc)

    def init(self, num_kv_indices: int, aux_index: int | None = None) -> None:
        if self._t is None or self._failure is not None:
            return
        try:
            num_pages = checks.index("num_kv_indices", num_kv_indices, self.kv_mgr.memory.num_pages + 1, low=1)
            if aux_index is not None:
                aux_index = checks.index("aux_index", aux_index, self.kv_mgr.aux.rows)
            self._t.init(num_pages)
        except checks.BAD_INPUT as exc:
            self._fail(FailureReason.REFUSED, "init() refused", exc)
            return
        self._num_pages = num_pages
        self._aux_index = aux_index

    def send(self, kv_indices: Any, state_indices: list[Any] | None = None,
             num_kv_tokens: int | None = None) -> None:
        if self._t is None or self._failure is not None:
            return
        try:
            if self._num_pages is None:
                raise RuntimeError(f"send() before init() for request {self.request_id}")
            if state_indices and any(s is not None for s in state_indices):
                raise ValueError("state_indices (Mamba/SWA state) are not supported by the kvservice backend")
            pages = checks.pages(kv_indices, self.kv_mgr.memory.num_pages)
            last = self._pages_sent + len(pages) >= self._num_pages
            payload = self.kv_mgr.aux.read(self._aux_index) if last and self._aux_index is not None else None
            self._t.send(pages, last=last, payload=payload)
            self._pages_sent += len(pages)
        except checks.BAD_INPUT as exc:
            self._fail(FailureReason.REFUSED, "send() refused", exc)

    def poll(self) -> int:
        if self._failure is not None or self._t is None:
            return int(KVPoll.Failed)
        state = self._t.poll()
        if state is KVPoll.Bootstrapping:
            if self._num_pages is not None:
                return int(KVPoll.WaitingForInput)  # ours to send: no going back to Bootstrapping
            engine = self.kv_mgr.engine
            if engine.expected(self.request_id):
                return int(KVPoll.WaitingForInput)
            if (dropped := engine.expect_dropped(self.request_id)) is not None:
                # Its decode asked, then went away before this sender existed (its link was
                # lost, or it gave the request up): nobody will ask again, so fail now rather
                # than at the bootstrap deadline, with the decode's own reason.
                reason, who = dropped
                self._fail(reason, f"its decode ({who}) asked for it, then was lost or gave it up before the "
                           "first chunk (the expect was dropped)")
                return int(KVPoll.Failed)
            if time.monotonic() > self._deadline:
                self._fail(FailureReason.TIMEOUT, f"no decode asked for it within bootstrap_timeout_s "
                           f"({engine.config.bootstrap_timeout_s}s)")
                return int(KVPoll.Failed)
        return int(state)

    def get_transfer_metric(self) -> KVTransferMetric:
        result = self._t.result if self._t is not None else None
        if result is None or not result.ok:
            return KVTransferMetric()
        return KVTransferMetric(transfer_latency_s=result.transfer_s, transfer_total_bytes=result.bytes)


class KVReceiver(_Side, BaseKVReceiver):
    """The decode side of one request."""

    _t: FacadeReceiver | None

    def __init__(self, mgr: KVManager, bootstrap_addr: str, bootstrap_room: int | None = None) -> None:
        self._t = None  # what ``_peer`` and ``_fail`` read, should the room or the address be refused
        self._address = ""  # the prefill rank's kvservice address, once looked up
        self._metadata_sent = False
        super().__init__(mgr, bootstrap_addr, bootstrap_room)
        self.abort_notified = False
        self.require_staging = False
        self.bootstrap_infos: list[dict[str, Any]] | None = None
        self._aux_index: int | None = None
        self._delivered = False

    def _fail(self, reason: FailureReason, message: str, error: BaseException | None = None) -> None:
        """Also tell the prefill rank, when this side fails a room its expect has not reached
        there: the prefill's sender fails at once (``decline``) instead of at its bootstrap
        timeout."""
        super()._fail(reason, message, error)
        self._decline(f"the decode failed the request: {reason.value}: {message}")

    def _decline(self, message: str) -> None:
        if self._address and not self._metadata_sent:
            self.kv_mgr.engine.decline(self.request_id, sender=self._address, message=message[:200])

    def abort(self) -> None:
        super().abort()
        self._decline("the decode aborted the request")

    def _peer(self) -> str | None:
        return self._t.sender if self._t is not None else f"{self.bootstrap_addr} (bootstrap)"

    def init(self, prefill_dp_rank: int) -> None:
        if self._failure is not None or self._t is not None:
            return
        try:
            dp_rank = checks.index("prefill_dp_rank", prefill_dp_rank, MAX_RANKS)
        except ValueError as exc:
            self._fail(FailureReason.REFUSED, "not a prefill DP rank", exc)
            return
        failure: tuple[FailureReason, str] | None = None  # what failed, in the order tried
        error: BaseException | None = None
        address = ""
        member: str | None = None
        try:
            self.kv_mgr.prefill_ranks(self.bootstrap_addr)
        except registration.UnprovenRanks as exc:
            failure, error = (FailureReason.REFUSED, "the prefill's registry does not prove its ranks' members"), exc
        except bootstrap.BootstrapError as exc:
            failure, error = (FailureReason.PEER_LOST, "the prefill's bootstrap registry cannot be reached"), exc
        except ValueError as exc:
            failure, error = (FailureReason.REFUSED, "not a bootstrap address"), exc
        else:
            try:
                address, member = self.kv_mgr.prefill_address(self.bootstrap_addr, dp_rank)
            except ValueError as exc:
                failure, error = (FailureReason.INCOMPATIBLE, "no prefill rank this rank can pair with"), exc
            else:
                try:  # with identities, only the rank's own member is taken at its address
                    self._t = self.kv_mgr.engine.receiver(self.request_id, sender=address, member=member)
                except ValueError as exc:
                    failure, error = (FailureReason.REFUSED, "the room is in use on this rank"), exc
        if failure is not None:
            self.kv_mgr.forget_prefill(self.bootstrap_addr)  # a restarted prefill registers anew
            self._fail(*failure, error)
            return
        self._address = address
        self.bootstrap_infos = [{"address": address}]

    def send_metadata(self, kv_indices: Any, aux_index: int | None = None, state_indices: list[Any] | None = None,
                      decode_prefix_len: int | None = None,
                      destination: KVTransferDestination = KVTransferDestination.DEVICE) -> None:
        if self._t is None or self._failure is not None:
            return
        try:
            if destination != KVTransferDestination.DEVICE:
                raise ValueError("the kvservice backend writes KV into the decode's device pool only")
            if state_indices and any(s is not None for s in state_indices):
                raise ValueError("state_indices (Mamba/SWA state) are not supported by the kvservice backend")
            if decode_prefix_len:
                raise ValueError("a decode-side prefix (decode radix cache) is not supported by the kvservice backend")
            if aux_index is not None:
                aux_index = checks.index("aux_index", aux_index, self.kv_mgr.aux.rows)
            pages = checks.pages(kv_indices, self.kv_mgr.memory.num_pages)
            self._aux_index = aux_index
            self._t.init(pages)
            self._metadata_sent = True
        except checks.BAD_INPUT as exc:
            self._fail(FailureReason.REFUSED, "send_metadata() refused", exc)

    def poll(self) -> int:
        if self._failure is not None:
            return int(KVPoll.Failed)
        if self._t is None:
            return int(KVPoll.Bootstrapping)
        if not self._metadata_sent:
            return int(KVPoll.WaitingForInput)
        state = self._t.poll()
        if state is KVPoll.Success and not self._delivered:
            result = self._t.result
            try:
                if self._aux_index is not None:
                    self.kv_mgr.aux.write(self._aux_index, (result.payload if result else None) or b"")
            except ValueError as exc:
                self._fail(FailureReason.INCOMPATIBLE, "the prefill's aux row does not fit this rank's", exc)
                return int(KVPoll.Failed)
            self._delivered = True
        if state is KVPoll.Bootstrapping:
            return int(KVPoll.WaitingForInput)
        if state is KVPoll.Failed and self._t.result is not None and \
                self._t.result.reason in (FailureReason.PEER_LOST, FailureReason.INCOMPATIBLE):
            self.kv_mgr.forget_prefill(self.bootstrap_addr)  # look the prefill up again next time
        return int(state)

    def is_abort_release_safe(self) -> bool:
        """Whether a failed request's pages may be reused: nothing of it can land any more."""
        return self._t is None or not self._metadata_sent or self._t.settled

    def ensure_abort_notified(self, *, force_arm: bool = False) -> None:
        """kvservice tells the prefill of an abort itself (``abort()``)."""


class KVBootstrapServer(BaseKVBootstrapServer):
    """The prefill's bootstrap registry (``bootstrap.Registry``), started by SGLang's
    ``start_disagg_service`` in the prefill's main process.  It checks registrations under
    the key the prefill's ranks use: the same configuration's (``service_config``), and with
    its member identity takes ranks only from that member (the ranks')."""

    def __init__(self, host: str, port: int) -> None:
        config = service_config(0)
        self.registry = bootstrap.Registry(host or "0.0.0.0", port, key=config.resolve_key().key,
                                           identity=config.identity())
        self.port = self.registry.port

    def close(self) -> None:
        self.registry.close()
