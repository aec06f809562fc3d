"""The connector's scheduler side: which requests hand KV off, which load it, and when
vLLM may free their blocks.

Push, as kvservice moves KV: a prefill request that asked for a remote decode
(``do_remote_decode``) keeps its blocks when it finishes (``request_finished`` returns
True) and answers with a hand-off (``params.Handoff``) naming the prefill's kvservice
addresses; its worker sends the blocks, which wait for the decode's expect.  The decode,
handed those params, reports the prompt as external tokens to load asynchronously; once
vLLM allocated the blocks, its worker expects them.  Blocks are freed only when the
worker reports the request (``finished_sending`` / ``finished_recving``), which it does
once no WRITE of the request can land any more.

Nothing here imports vLLM: requests and block lists are read by the attributes vLLM's
own objects have (``request_id``, ``kv_transfer_params``, ``prompt_token_ids``,
``num_computed_tokens``, ``status``), so the state machine is tested both alone and
under vLLM's real ``Scheduler``.

Trust: a prefill signs each hand-off it issues (``params.Handoff.issue``, under the
hand-off key derived from the cluster's key) with an expiry ``lifetime_s`` away (its
``bootstrap_timeout_s``: the send waits no longer).  A decode acts on a hand-off only once
``params.Handoff.check`` proved it (MAC, expiry, prompt) and no other request presented it:
before that nothing is reserved and nobody is dialled.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from itertools import islice
from typing import Any

from ..._log import Throttle, get_logger
from .params import DEFAULT_SKEW_S, Handoff, HandoffError, decode_tp_size, handoff_from, wants_remote_decode

log = get_logger("kvservice.vllm")

#: a prefill request that ended this way computed its prompt's KV; any other end (aborted,
#: errored) hands nothing off
_HANDS_OFF = frozenset({"FINISHED_LENGTH_CAPPED", "FINISHED_STOPPED"})
#: signed hand-offs a decode remembers (MAC -> the request that presented it, until it
#: expires); past this bound the oldest is forgotten (its replay is then refused only by
#: the prefill, which binds one expect per request)
MAX_REMEMBERED = 1 << 16


@dataclass(frozen=True, slots=True)
class SendSpec:
    """A prefill request whose blocks the worker sends."""

    req_id: str
    blocks: tuple[int, ...]
    decode_tp: int


@dataclass(frozen=True, slots=True)
class RecvSpec:
    """A decode request whose blocks the worker expects."""

    req_id: str
    handoff: Handoff
    blocks: tuple[int, ...]
    #: the hand-off's first blocks this decode had in its prefix cache (not loaded)
    cached: int = 0


@dataclass(slots=True)
class Work:
    """What the scheduler hands the workers for one step (``KVConnectorMetadata``)."""

    sends: list[SendSpec] = field(default_factory=list)
    recvs: list[RecvSpec] = field(default_factory=list)


class SchedulerSide:
    """The scheduler-side state; ``connector.KVServiceConnector`` delegates to it."""

    def __init__(self, *, block_size: int, producer: bool, consumer: bool, senders: tuple[str, ...],
                 key: bytes | None, tp_size: int = 1, decode_tp: int | None = None, lifetime_s: float = 30.0,
                 skew_s: float = DEFAULT_SKEW_S, clock: Callable[[], float] = time.time) -> None:
        """``senders``: this engine's kvservice control addresses, one per TP rank (what a
        hand-off names; needed by a producer).  ``key``: the hand-off key
        (``_trust.handoff.handoff_key`` of the cluster's key; None: hand-offs are issued
        unsigned and taken unproved).  ``decode_tp``: the decodes' TP size when a request
        does not name it (default: ``tp_size``).  ``lifetime_s``: how long a hand-off this
        prefill issues is valid; ``skew_s``: how far apart the engines' clocks (``clock``,
        Unix time) may be."""
        if producer and len(senders) != tp_size:
            raise ValueError(f"a producer names one kvservice address per TP rank ({tp_size}), got {senders!r}")
        if not 0 < lifetime_s <= 3600 or not 0 <= skew_s <= 3600:
            raise ValueError(f"lifetime_s in (0, 3600] and skew_s in [0, 3600], got {lifetime_s}, {skew_s}")
        self.block_size = block_size
        self.producer, self.consumer = producer, consumer
        self.senders = senders
        self.tp_size = tp_size
        self.decode_tp = decode_tp or tp_size
        self.lifetime_s, self.skew_s = lifetime_s, skew_s
        self._key = key
        self._clock = clock
        self._work = Work()
        self._held: dict[str, int] = {}  # prefill: request -> blocks held for its decode
        self._loading: dict[str, Handoff] = {}  # decode: request -> its hand-off, until reported
        # decode: request -> its proved hand-off and the blocks its own prefix cache holds, from
        # the match to the allocation
        self._matched: dict[str, tuple[Handoff, int]] = {}
        self._seen: dict[str, tuple[str, int]] = {}  # decode: MAC -> (request, expires); MAX_REMEMBERED
        self.counts: Counter[str] = Counter()
        self._throttle = Throttle()

    # -- a new request -------------------------------------------------------------------
    def on_new_request(self, request: Any) -> None:
        """Drop ``kv_transfer_params`` that are not an object (a client can send any JSON
        value in ``vllm_xargs``, and vLLM's scheduler calls ``.get`` on them next)."""
        params = request.kv_transfer_params
        if params is not None and not isinstance(params, Mapping):
            request.kv_transfer_params = None
            self._refuse("handoff_invalid", request, f"kv_transfer_params: expected an object, got "
                                                     f"{type(params).__name__}")

    # -- decode: matching and allocation ----------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        rid = request.request_id
        if rid in self._loading:
            return 0, False
        handoff = self._handoff(request)
        if handoff is None:
            return 0, False
        why = None
        if handoff.block_size != self.block_size:
            why = f"block_size {handoff.block_size} there, {self.block_size} here"
        elif num_computed_tokens % self.block_size:
            why = f"{num_computed_tokens} tokens cached here, not whole blocks"
        elif handoff.num_tokens > len(request.prompt_token_ids or ()):
            why = f"{handoff.num_tokens} tokens handed off, the prompt has {len(request.prompt_token_ids or ())}"
        if why is not None:
            self._refuse("handoff_unusable", request, why)
            return 0, False
        if num_computed_tokens >= handoff.num_tokens:
            return 0, False  # all cached here (the prefill frees its copy after bootstrap_timeout_s)
        # the decode's own prefix cache holds the first blocks: load the rest (the prefill
        # sends the last blocks, as many as the decode expects)
        self._matched[rid] = (handoff, num_computed_tokens // self.block_size)
        if handoff.mac:
            self._remember(handoff, rid)
        return handoff.num_tokens - num_computed_tokens, True

    def update_state_after_alloc(self, request: Any, block_ids: list[int], num_external_tokens: int) -> None:
        """``block_ids``: the request's blocks (one KV cache group), those its prefix cache
        supplied first."""
        if num_external_tokens <= 0 or request.request_id in self._loading:
            return
        matched = self._matched.pop(request.request_id, None)
        if matched is None:
            return
        handoff, cached = matched
        blocks = tuple(block_ids[cached: handoff.num_blocks])
        # fewer blocks than the hand-off: the worker fails the load at once (reported, recomputed)
        self._loading[request.request_id] = handoff
        # taken: a load fails at most once, then vLLM recomputes the request (rescheduled, it
        # is matched again; vLLM's own connectors mark their parameters the same way)
        request.kv_transfer_params["do_remote_prefill"] = False
        self._work.recvs.append(RecvSpec(request.request_id, handoff, blocks, cached))
        self.counts["loads"] += 1

    # -- both: a finished request ---------------------------------------------------------
    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        self._matched.pop(rid, None)
        if rid in self._loading:
            # finished (aborted) while its KV was on the way: the worker aborts the load and
            # reports it once nothing can land; vLLM frees the blocks then
            self.counts["loads_abandoned"] += 1
            return True, None
        params = request.kv_transfer_params
        if not self.producer or not wants_remote_decode(params):
            return False, None
        status = getattr(request.status, "name", str(request.status))
        blocks = tuple(block_ids[: -(-request.num_computed_tokens // self.block_size)])
        if status not in _HANDS_OFF or not blocks:
            self.counts["handoffs_skipped"] += 1
            return False, None
        try:
            decode_tp = decode_tp_size(params, self.decode_tp)
            # raises for what a hand-off cannot carry (a request id past 256 characters)
            handoff = Handoff.issue(rid, self.senders, request.prompt_token_ids, request.num_computed_tokens,
                                    self.block_size, key=self._key, lifetime_s=self.lifetime_s, now=self._clock())
        except HandoffError as exc:
            self._refuse("handoff_refused", request, str(exc))
            return False, None
        self._held[rid] = len(blocks)
        self._work.sends.append(SendSpec(rid, blocks, decode_tp))
        self.counts["handoffs"] += 1
        return True, handoff.to_params()

    # -- the step's work, and what the workers reported -----------------------------------
    def build(self, make: Callable[[Work], Any] = lambda w: w) -> Any:
        work, self._work = self._work, Work()
        return make(work)

    def reported(self, finished_sending: Iterable[str] | None, finished_recving: Iterable[str] | None) -> None:
        for rid in finished_sending or ():
            if self._held.pop(rid, None) is not None:
                self.counts["handoffs_freed"] += 1
        for rid in finished_recving or ():
            self._loading.pop(rid, None)

    def has_pending_push_work(self) -> bool:
        """Blocks held for a decode, or sends not handed to the workers yet: vLLM keeps
        stepping (the worker reports them only from a step)."""
        return bool(self._held or self._work.sends)

    @property
    def held(self) -> dict[str, int]:
        """Prefill requests whose blocks are held for their decode -> how many blocks."""
        return dict(self._held)

    # -------------------------------------------------------------------------------------
    def _handoff(self, request: Any) -> Handoff | None:
        """The request's hand-off once proved (``Handoff.check``) and presented by no other
        request; None (the request prefills locally) otherwise, the refusal counted."""
        if not self.consumer:
            return None
        try:
            handoff = handoff_from(request.kv_transfer_params)
            if handoff is None:
                return None
            handoff.check(self._key, now=self._clock(), skew_s=self.skew_s, tokens=request.prompt_token_ids)
        except HandoffError as exc:
            self._refuse(exc.kind, request, str(exc))
            return None
        first = self._seen.get(handoff.mac) if handoff.mac else None
        if first is not None and first[0] != request.request_id:
            self._refuse("handoff_replayed", request, f"presented already, by request {first[0]!r}")
            return None
        return handoff

    def _remember(self, handoff: Handoff, rid: str) -> None:
        """Remember that ``rid`` is loading ``handoff``, until it expires; forget the expired
        first, then the oldest past ``MAX_REMEMBERED``."""
        seen, now = self._seen, self._clock()
        for mac, (_, expires) in list(islice(seen.items(), 64)):  # the oldest few: bounded per call
            if expires + self.skew_s < now or len(seen) >= MAX_REMEMBERED:
                del seen[mac]
        seen[handoff.mac] = (rid, handoff.expires)

    def _refuse(self, kind: str, request: Any, why: str) -> None:
        self.counts[kind] += 1
        if (unlogged := self._throttle.allow(kind)) is not None:
            log.warning(f"vllm.{kind}", request=request.request_id, why=why, unlogged=unlogged,
                        then="the request prefills locally" if kind != "handoff_refused" else "no hand-off")
