"""``KVServiceConnector``: vLLM's KV connector interface over kvservice.

Loaded by module path, nothing patched in vLLM::

    --kv-transfer-config '{"kv_connector": "KVServiceConnector",
                           "kv_connector_module_path": "kvservice.integrations.vllm",
                           "kv_role": "kv_producer",
                           "kv_connector_extra_config": {"kvservice": {"host": "10.0.0.5", "port": 7100}}}'

``kv_connector_extra_config``:

* ``kvservice``: ``ServiceConfig`` keys (the sidecar's ``[service]`` table: ``host``,
  ``port``, ``advertise_host``, ``auth_key_file``, the timeouts...).  TP rank *r* of
  data-parallel rank *d* listens on ``port + d * tp_size + r``.  A producer's hand-offs
  name those ports: without ``port`` (or with 0) it uses ``scheduler.DEFAULT_PORT``
  (7100); a consumer may leave it 0 (any free port).  ``kv_both`` produces and consumes
  with one kvservice per rank.
* ``decode_tp_size``: the decodes' TP size a producer sends to (default: its own); a
  prefill request may name its own in ``kv_transfer_params``.
* ``handoff_skew_s``: how far apart the prefills' and decodes' clocks may be, in seconds
  (default ``params.DEFAULT_SKEW_S``): a decode takes a hand-off until its expiry plus this.

``settings.settings_from`` decodes it; an unknown key, at either level, stops the server.

The scheduler signs (a producer) and checks (a consumer) hand-offs under a key derived from
the service's key (``ServiceConfig.resolve_key``: ``auth_key_file``, or this user's key on
loopback); with ``allow_unauthenticated`` there is none, and hand-offs prove nothing.  With
a member identity (``identity_cert_file`` and the rest) a producer also signs them with its
member key, and a consumer takes only those a prefill member of its cluster signed, not
revoked (``revoked_file``), and loads them from that member alone.

vLLM runs one connector object per role: the scheduler's (``scheduler.SchedulerSide``)
and one per worker (``worker.WorkerSide``); they talk only through the metadata vLLM
carries between them (``KVServiceMetadata``) and the worker's reports.  Each reports its
side's counters (and a worker its transfer times) to vLLM's stats every step
(``get_kv_connector_stats``: ``stats``, ``metrics``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..._control.addresses import join_address
from ..._log import get_logger
from ..._results import ConfigError
from ..._trust.handoff import handoff_key
from ..._trust.revocation import RevocationWatch
from .layerwise import LayerSend
from .metrics import KVServicePromMetrics, KVServiceStats
from .params import MAX_LIFETIME_S, Handoff
from .scheduler import DEFAULT_PORT, Cancel, RecvSpec, SchedulerSide, SendSpec, Work, rank_port
from .settings import settings_from
from .stats import Interval
from .worker import WorkerSide

from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # isort: skip
    KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole, KVConnectorTransferResults)
from vllm.logger import init_logger  # isort: skip

if TYPE_CHECKING:
    import torch

__all__ = ["KVServiceConnector", "KVServiceMetadata", "settings_from"]

#: how long a step that schedules nothing (its only work: sends held for decodes, loads on
#: their way) waits for a transfer to end before vLLM steps again (``WorkerSide._idle``; once
#: one ended, it waits on for those landing after it, ``worker.GATHER_GAP_S`` and
#: ``GATHER_MAX_S``): a request arriving meanwhile waits 5 ms, or while loads land one after
#: another up to 105 ms
IDLE_WAIT_S = 0.005

log = get_logger("kvservice.vllm")
#: vLLM's own logger: the start lines an operator reads among the server's (kvservice's own
#: logger, unconfigured in vLLM's server, shows only warnings)
vllm_log = init_logger("vllm.kvservice")


@dataclass
class KVServiceMetadata(KVConnectorMetadata):
    """The scheduler's work for the workers, one step's worth (pickled to worker processes)."""

    sends: list[SendSpec] = field(default_factory=list)
    recvs: list[RecvSpec] = field(default_factory=list)
    cancels: list[Cancel] = field(default_factory=list)
    declines: list[Handoff] = field(default_factory=list)
    layers: list[LayerSend] = field(default_factory=list)
    #: the step schedules no tokens: its only work is transfers (``WorkerSide.finished``)
    idle: bool = False

    def work(self) -> Work:
        return Work(self.sends, self.recvs, self.cancels, self.declines, self.layers)


class KVServiceConnector(KVConnectorBase_V1):
    """kvservice as a vLLM KV connector (``kv_producer``, ``kv_consumer`` or ``kv_both``)."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        transfer = vllm_config.kv_transfer_config
        settings = settings_from(transfer.kv_connector_extra_config)
        tp_size = vllm_config.parallel_config.tensor_parallel_size
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        service = settings.service
        producer, consumer = bool(transfer.is_kv_producer), bool(transfer.is_kv_consumer)
        dp_rank = int(getattr(vllm_config.parallel_config, "data_parallel_index", 0) or 0)
        base = service.port or (DEFAULT_PORT if producer else 0)
        try:
            ports = [rank_port(base, tp_size=tp_size, tp_rank=r, dp_rank=dp_rank) if base else 0
                     for r in range(tp_size)]
        except ValueError as exc:
            raise ConfigError(f"kv_connector_extra_config.kvservice.port: {exc}") from None
        if role == KVConnectorRole.SCHEDULER:
            host = service.advertise_host or service.host
            key = handoff_key(service.resolve_key().key)
            identity = service.identity()  # ConfigError naming the problem
            watch = (RevocationWatch(service.revoked_file, identity.ca)
                     if identity is not None and service.revoked_file is not None else None)
            if key is None:
                log.warning("vllm.handoff_unauthenticated", why="allow_unauthenticated: no key",
                            then="hand-offs are issued unsigned and taken as given (they prove nothing)")
            self._scheduler = SchedulerSide(
                block_size=vllm_config.cache_config.block_size, producer=producer, consumer=consumer,
                senders=tuple(join_address(host, port) for port in ports) if producer else (),
                key=key, tp_size=tp_size, decode_tp=settings.decode_tp_size,
                lifetime_s=min(service.bootstrap_timeout_s, MAX_LIFETIME_S), skew_s=settings.handoff_skew_s,
                identity=identity, revocations=watch,
                allow_without_identity=service.allow_peers_without_identity)
            self._interval = Interval(self._scheduler.counts)
            vllm_log.info("KVServiceConnector %s: block size %d, hand-offs %s%s", transfer.kv_role,
                          self._scheduler.block_size,
                          ("signed" if key else "UNSIGNED")
                          + (f" by member {identity.member.uri}" if identity is not None else ""),
                          f", naming {', '.join(self._scheduler.senders)}" if producer else "")
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            rank = get_tensor_model_parallel_rank()
            service = service.replace(port=ports[rank])
            self._worker = WorkerSide(service, tp_size=tp_size, tp_rank=rank)
            self._interval = Interval(self._worker.counts, self._worker.samples)

    # -- scheduler side -------------------------------------------------------------------
    def on_new_request(self, request: Any) -> None:
        self._sched.on_new_request(request)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        return self._sched.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        block_ids = blocks.get_block_ids()[0] if num_external_tokens > 0 else []
        self._sched.update_state_after_alloc(request, list(block_ids), num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVServiceMetadata:
        manager = self._kv_cache_manager
        idle = not scheduler_output.total_num_scheduled_tokens
        return self._sched.build(  # type: ignore[no-any-return]
            lambda work: KVServiceMetadata(work.sends, work.recvs, work.cancels, work.declines, work.layers,
                                           idle=idle),
            scheduled=scheduler_output.num_scheduled_tokens, preempted=scheduler_output.preempted_req_ids or (),
            blocks_of=None if manager is None else lambda rid: manager.get_block_ids(rid)[0])

    def update_connector_output(self, connector_output: Any) -> None:
        self._sched.reported(connector_output.finished_sending, connector_output.finished_recving)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._sched.request_finished(request, block_ids)

    def has_pending_push_work(self) -> bool:
        return self._scheduler is not None and self._scheduler.has_pending_push_work()

    # -- worker side ----------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        side = self._work_side
        side.register(kv_caches)
        if side.engine is not None:
            vllm_log.info("KVServiceConnector: kvservice listening on %s (TP rank %d, %d KV caches)",
                          side.engine.address, side.tp_rank, len(kv_caches))

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._connector_metadata
        if isinstance(meta, KVServiceMetadata):
            self._work_side.start(meta.work())

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads are asynchronous: vLLM schedules a request only once its load is reported."""

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        """A ticket's request (decode-first): this layer of the step's blocks, to the decode
        that reserved them.  A hand-off's request is sent whole, after the forward."""
        meta = self._connector_metadata
        if self._worker is not None and isinstance(meta, KVServiceMetadata) and meta.layers:
            self._worker.save_layer(layer_name, meta.layers)

    def wait_for_save(self) -> None:
        """Post the step's sends, after its forward; they run on kvservice's loop, and vLLM
        keeps the blocks until they are reported."""
        meta = self._connector_metadata
        if isinstance(meta, KVServiceMetadata):
            self._work_side.save(meta.work())

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        sending, recving, failed = self._work_side.finished(finished_req_ids, idle_wait_s=self._idle_wait_s())
        return KVConnectorTransferResults(finished_sending=sending, finished_recving=recving,
                                          failed_recving=failed)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sending, recving, _ = self._work_side.finished(finished_req_ids, idle_wait_s=self._idle_wait_s())
        return sending or None, recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._work_side.load_errors() if self._worker is not None else set()

    # -- both: vLLM's stats ---------------------------------------------------------------
    def get_kv_connector_stats(self) -> KVServiceStats | None:
        """This side's counts (and a worker's transfer times) since vLLM last asked."""
        data = self._interval.take()
        return None if data is None else KVServiceStats(data=data)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVServiceStats:
        return KVServiceStats(data=data or {})

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: dict[type, type], labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KVServicePromMetrics:
        return KVServicePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()

    # -------------------------------------------------------------------------------------
    def _idle_wait_s(self) -> float:
        """How long a step without a forward may wait for a transfer to end (none with one)."""
        meta = self._connector_metadata
        return IDLE_WAIT_S if isinstance(meta, KVServiceMetadata) and meta.idle else 0.0

    @property
    def _sched(self) -> SchedulerSide:
        if self._scheduler is None:
            raise RuntimeError("a scheduler-side call on the worker's connector")
        return self._scheduler

    @property
    def _work_side(self) -> WorkerSide:
        if self._worker is None:
            raise RuntimeError("a worker-side call on the scheduler's connector")
        return self._worker

    @property
    def scheduler_side(self) -> SchedulerSide | None:
        return self._scheduler

    @property
    def worker_side(self) -> WorkerSide | None:
        return self._worker
