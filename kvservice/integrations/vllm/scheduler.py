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

When the send is posted: in the step that samples the request's last token when the
scheduler knows it is the last (its ``max_tokens``-th: the router's prefill asks for one,
so the step that computes the prompt), else in the step after it finished.  The first
needs no further step of the prefill engine: an engine core stepped only inside
``generate()`` (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) returns the prefill's output and
never steps again until its next request, while the send waits in kvservice for the
decode's expect.  A request posted early that does not hand off after all (aborted in that
step, or a hand-off it cannot carry) keeps its blocks until the worker has aborted the
send and reports it; one preempted before its output (async scheduling) loses its blocks
to vLLM at once, and the worker aborts the send in the next step: no hand-off was issued,
so no decode can have expected it.

A decode whose own prefix cache holds every block a hand-off names loads nothing and
declines the hand-off (the worker's ``decline``: the control link's ``Abort``), so the
prefill frees its blocks at once instead of after its ``bootstrap_timeout_s``.

A prefill request carrying a router's ticket (decode-first, ``layerwise``) is not handed
off: once the ticket is proved here as a decode proves a hand-off, each step that computes
some of its prompt names the blocks it completed (``Work.layers``), the worker sends them
layer by layer during the forward, and the blocks are held, like a hand-off's, until the
send ended.  A ticket not proved is counted and the request goes the hand-off way.

Nothing here imports vLLM: requests and block lists are read by the attributes vLLM's
own objects have (``request_id``, ``kv_transfer_params``, ``prompt_token_ids``,
``num_computed_tokens``, ``status``), so the state machine is tested both alone and
under vLLM's real ``Scheduler``.

Trust: a prefill signs each hand-off it issues (``params.Handoff.issue``, under the
hand-off key derived from the cluster's key) with an expiry ``lifetime_s`` away (its
``bootstrap_timeout_s``: the send waits no longer).  A decode acts on a hand-off only once
``params.Handoff.check`` proved it (MAC, expiry, prompt) and no other request presented it:
before that nothing is reserved and nobody is dialled.  With member identities the prefill
also signs each hand-off under its member key, and a decode with an identity takes only one
its prefill member signed (``params.Handoff.proven``: the cluster's CA, role ``prefill``, the
revocation list in force) and loads it only from that member (``Handoff.member``); a
router's tickets carry the cluster key's MAC alone (the router is no member).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import islice
from typing import Any

from ..._log import Throttle, get_logger
from ..._trust.identity import Identity
from ..._trust.revocation import LIST_REFUSED, POLL_S, Revocations, RevocationWatch
from .layerwise import LayerSend, Plan, Plans
from .params import (
    DEFAULT_SKEW_S,
    Handoff,
    HandoffError,
    decode_tp_size,
    handoff_from,
    ticket_from,
    wants_remote_decode,
)

log = get_logger("kvservice.vllm")

#: a prefill request that ended this way computed its prompt's KV; any other end (aborted,
#: errored) hands nothing off
_HANDS_OFF = frozenset({"FINISHED_LENGTH_CAPPED", "FINISHED_STOPPED"})
#: a producer's kvservice port when its settings name none: TP rank r of data-parallel rank
#: d listens on this + d * tp_size + r (vLLM's NIXL connector's side channel is 5600 + d)
DEFAULT_PORT = 7100
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


def rank_port(base: int, *, tp_size: int, tp_rank: int, dp_rank: int = 0) -> int:
    """The kvservice port of TP rank ``tp_rank`` of data-parallel rank ``dp_rank``:
    ``base + dp_rank * tp_size + tp_rank`` (``base``: the settings' ``port``, else
    ``DEFAULT_PORT``)."""
    port = base + dp_rank * tp_size + tp_rank
    if not 0 < port <= 65535:
        raise ValueError(f"kvservice port {port} (base {base} + data-parallel rank {dp_rank} * TP size {tp_size} "
                         f"+ TP rank {tp_rank}) is not in 1..65535")
    return port


@dataclass(frozen=True, slots=True)
class Cancel:
    """A send posted early whose request hands nothing off: the worker aborts it."""

    req_id: str
    #: vLLM finished the request and holds its blocks until the worker reports the send;
    #: False: preempted, its blocks already vLLM's (never reported)
    finished: bool


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
    cancels: list[Cancel] = field(default_factory=list)
    #: hand-offs whose every block this decode's prefix cache holds: their senders are told
    declines: list[Handoff] = field(default_factory=list)
    #: ticket requests' chunks computed in this step, sent layer by layer (``layerwise``)
    layers: list[LayerSend] = field(default_factory=list)


class SchedulerSide:
    """The scheduler-side state; ``connector.KVServiceConnector`` delegates to it."""

    def __init__(self, *, block_size: int, producer: bool, consumer: bool, senders: tuple[str, ...],
                 key: bytes | None, tp_size: int = 1, decode_tp: int | None = None, lifetime_s: float = 30.0,
                 skew_s: float = DEFAULT_SKEW_S, clock: Callable[[], float] = time.time,
                 identity: Identity | None = None, revocations: RevocationWatch | None = None,
                 allow_without_identity: bool = False) -> None:
        """``senders``: this engine's kvservice control addresses, one per TP rank (what a
        hand-off names; needed by a producer).  ``key``: the hand-off key
        (``_trust.handoff.handoff_key`` of the cluster's key; None: hand-offs are issued
        unsigned and taken unproved).  ``decode_tp``: the decodes' TP size when a request
        does not name it (default: ``tp_size``).  ``lifetime_s``: how long a hand-off this
        prefill issues is valid; ``skew_s``: how far apart the engines' clocks (``clock``,
        Unix time) may be.  ``identity``: this engine's member identity (a prefill signs its
        hand-offs with it, a decode takes hand-offs only from prefill members of its
        cluster); ``revocations``: the revocation list it watches (``revoked_file``);
        ``allow_without_identity``: a decode with an identity still takes a hand-off that
        carries no member proof (counted)."""
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
        self._identity = identity
        self._revocations = revocations
        self._allow_without_identity = allow_without_identity
        self._polled = time.monotonic()
        self._work = Work()
        self._held: dict[str, int] = {}  # prefill: request -> blocks held for its decode
        # prefill: requests to hand off, by id, until they finish
        self._producing: dict[str, Any] = {}
        self._early: dict[str, SendSpec] = {}  # prefill: sends posted before the request finished
        self._loading: dict[str, Handoff] = {}  # decode: request -> its hand-off, until reported
        # decode: request -> its proved hand-off and the blocks its own prefix cache holds, from
        # the match to the allocation
        self._matched: dict[str, tuple[Handoff, int]] = {}
        # (MAC, proving member) -> (request, expires); MAX_REMEMBERED
        self._seen: dict[tuple[str, str], tuple[str, int]] = {}
        self._plans = Plans(block_size)  # prefill: ticket requests, sent layer by layer
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
        elif self.producer and wants_remote_decode(params):
            ticket = self._ticket(request)
            try:
                decode_tp = decode_tp_size(params, self.decode_tp)
            except HandoffError:
                ticket = None  # refused (counted) when it finishes, as without a ticket
            if ticket is not None:
                self._plans.add(request, ticket, decode_tp)
            else:
                self._producing[request.request_id] = request

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
        # the decode's own prefix cache holds the first blocks: load the rest (the prefill
        # sends the last blocks, as many as the decode expects); all of them: load nothing
        # and tell the prefill (update_state_after_alloc)
        if handoff.ticket and num_computed_tokens:
            # the prefill writes every block, layer by layer, from the first: fitting its chunks
            # to a decode that holds the first ones is not done (docs/vllm.md "Layer-wise push")
            if handoff.mac:
                self._remember(handoff, rid)
            request.kv_transfer_params["do_remote_prefill"] = False
            self._work.declines.append(handoff)
            self.counts["tickets_declined"] += 1
            return 0, False
        self._matched[rid] = (handoff, num_computed_tokens // self.block_size)
        if handoff.mac:
            self._remember(handoff, rid)
        if num_computed_tokens >= handoff.num_tokens:
            return 0, False
        return handoff.num_tokens - num_computed_tokens, True

    def update_state_after_alloc(self, request: Any, block_ids: list[int], num_external_tokens: int) -> None:
        """``block_ids``: the request's blocks (one KV cache group), those its prefix cache
        supplied first."""
        if request.request_id in self._loading:
            return
        matched = self._matched.pop(request.request_id, None)
        if matched is None:
            return
        handoff, cached = matched
        if num_external_tokens <= 0:
            # this decode's cache holds every block the hand-off names (vLLM may also keep a
            # local hit over the few tokens it would load): nothing to load, and the prefill
            # can free its copy now
            request.kv_transfer_params["do_remote_prefill"] = False
            self._work.declines.append(handoff)
            self.counts["loads_cached"] += 1
            return
        blocks = tuple(block_ids[cached: handoff.num_blocks])
        # fewer blocks than the hand-off: the worker fails the load at once (reported, recomputed)
        if self._identity is not None and not handoff.member and not handoff.ticket:
            self.counts["loads_without_identity"] += 1  # allow_peers_without_identity took it unbound
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
        self._producing.pop(rid, None)
        early = self._early.pop(rid, None)
        plan = self._plans.pop(rid)
        if plan is not None:
            return self._finished_layerwise(request, plan)
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
        handoff = None
        if status not in _HANDS_OFF or not blocks:
            self.counts["handoffs_skipped"] += 1
        elif early is not None and early.blocks != blocks:
            # the step did not end as planned (speculative tokens rejected...): what was
            # sent is not what a hand-off would name
            self.counts["handoffs_skipped"] += 1
        else:
            try:
                decode_tp = decode_tp_size(params, self.decode_tp)
                # raises for what a hand-off cannot carry (a request id past 256 characters)
                handoff = Handoff.issue(rid, self.senders, request.prompt_token_ids, request.num_computed_tokens,
                                        self.block_size, key=self._key, lifetime_s=self.lifetime_s,
                                        now=self._clock(), identity=self._identity)
            except HandoffError as exc:
                self._refuse("handoff_refused", request, str(exc))
        if early is not None:
            # its send is posted: the blocks stay held until the worker reports it ended
            self._held[rid] = len(early.blocks)
            if handoff is None:
                self._work.cancels.append(Cancel(rid, finished=True))
                return True, None
        if handoff is None:
            return False, None
        if early is None:
            self._held[rid] = len(blocks)
            self._work.sends.append(SendSpec(rid, blocks, decode_tp))
        self.counts["handoffs"] += 1
        return True, handoff.to_params()

    # -- the step's work, and what the workers reported -----------------------------------
    def build(self, make: Callable[[Work], Any] = lambda w: w, *, scheduled: Mapping[str, int] | None = None,
              preempted: Iterable[str] = (), blocks_of: Callable[[str], Sequence[int]] | None = None) -> Any:
        """The step's work for the workers.  ``scheduled``: the step's tokens per request
        (``SchedulerOutput.num_scheduled_tokens``, read before vLLM advances the requests);
        ``preempted``: the requests preempted since the last step; ``blocks_of``: a
        request's block ids.  A request to hand off whose last token this step samples has
        its send posted in this step (the module's docstring)."""
        for rid in preempted:
            if self._early.pop(rid, None) is not None or self._plans.preempted(rid):
                self._work.cancels.append(Cancel(rid, finished=False))
                self.counts["sends_preempted"] += 1
        for rid, n in (scheduled or {}).items():
            if rid in self._plans:
                chunk = self._plans.step(rid, n, blocks_of) if blocks_of is not None else None
                if chunk is not None:
                    self._work.layers.append(chunk)
                continue
            request = self._producing.get(rid)
            if request is None or rid in self._early or blocks_of is None or not _last_token_in(request, n):
                continue
            try:
                decode_tp = decode_tp_size(request.kv_transfer_params, self.decode_tp)
            except HandoffError:
                continue  # refused when it finishes
            computed = request.num_computed_tokens + n
            spec = SendSpec(rid, tuple(blocks_of(rid)[: -(-computed // self.block_size)]), decode_tp)
            self._early[rid] = spec
            self._work.sends.append(spec)
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
        return bool(self._held or self._work.sends or self._work.cancels)

    @property
    def held(self) -> dict[str, int]:
        """Prefill requests whose blocks are held for their decode -> how many blocks."""
        return dict(self._held)

    # -- prefill: tickets (decode-first, layer-wise) --------------------------------------
    def _ticket(self, request: Any) -> Handoff | None:
        """The request's ticket once proved as a decode proves a hand-off, for this prefill
        (its senders, block size, the whole prompt) and presented by no other request; None
        (the request is prefilled and handed off as without one) otherwise, counted."""
        try:
            ticket = ticket_from(request.kv_transfer_params)
            if ticket is None:
                return None
            ticket.check(self._key, now=self._clock(), skew_s=self.skew_s, tokens=request.prompt_token_ids)
            why = None
            if not ticket.ticket:
                why = "a prefill's hand-off, not a router's ticket"
            elif ticket.senders != self.senders:
                why = f"names senders {list(ticket.senders)}, this prefill is {list(self.senders)}"
            elif ticket.block_size != self.block_size:
                why = f"block_size {ticket.block_size} there, {self.block_size} here"
            elif ticket.num_tokens != len(request.prompt_token_ids or ()):
                why = f"{ticket.num_tokens} tokens, the prompt has {len(request.prompt_token_ids or ())}"
            if why is not None:
                raise HandoffError(why, "handoff_unusable")
        except HandoffError as exc:
            self._refuse(exc.kind, request, str(exc), then="prefilled and handed off whole, not layer-wise")
            return None
        first = self._seen.get((ticket.mac, "")) if ticket.mac else None
        if first is not None and first[0] != request.request_id:
            self._refuse("handoff_replayed", request, f"presented already, by request {first[0]!r}",
                         then="prefilled and handed off whole, not layer-wise")
            return None
        if ticket.mac:
            self._remember(ticket, request.request_id)
        return ticket

    def _finished_layerwise(self, request: Any, plan: Plan) -> tuple[bool, dict[str, Any] | None]:
        """A ticket's request finished: its blocks stay held until every layer's send ended."""
        rid = request.request_id
        status = getattr(request.status, "name", str(request.status))
        if not plan.posted or plan.cancelled:
            # nothing posted (aborted before its first step), or preempted and aborted already
            # (vLLM has those blocks back): nothing reads these blocks
            self.counts["handoffs_skipped"] += 1
            return False, None
        self._held[rid] = plan.sent
        if status in _HANDS_OFF and plan.done:
            self.counts["layerwise"] += 1
        else:  # aborted mid-prompt: the decode's load fails (recomputed there)
            self.counts["handoffs_skipped"] += 1
            self._work.cancels.append(Cancel(rid, finished=True))
        return True, None

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
            if not handoff.ticket:  # a router's ticket carries the cluster key's MAC alone
                handoff = handoff.proven(self._identity, self._revoked(),
                                         allow_without=self._allow_without_identity)
        except HandoffError as exc:
            self._refuse(exc.kind, request, str(exc))
            return None
        # by MAC and member: a member's copy of another's fields (which any key holder can MAC)
        # is bound to her, and does not use up the hand-off the member that sends signed
        first = self._seen.get((handoff.mac, handoff.member)) if handoff.mac else None
        if first is not None and first[0] != request.request_id:
            self._refuse("handoff_replayed", request, f"presented already, by request {first[0]!r}")
            return None
        return handoff

    def _revoked(self) -> Revocations | None:
        """The revocation list in force, its file looked at again at most every ``POLL_S``
        (a ``stat``; read only when it changed, as a service does)."""
        watch = self._revocations
        if watch is None:
            return None
        if time.monotonic() - self._polled >= POLL_S:
            self._polled = time.monotonic()
            loaded = watch.read()
            if isinstance(loaded, ValueError):
                self.counts[LIST_REFUSED] += 1
            watch.apply(loaded)
        return watch.current

    def _remember(self, handoff: Handoff, rid: str) -> None:
        """Remember that ``rid`` is loading ``handoff``, until it expires; forget the expired
        first, then the oldest past ``MAX_REMEMBERED``."""
        seen, now = self._seen, self._clock()
        for mac, (_, expires) in list(islice(seen.items(), 64)):  # the oldest few: bounded per call
            if expires + self.skew_s < now or len(seen) >= MAX_REMEMBERED:
                del seen[mac]
        seen[(handoff.mac, handoff.member)] = (rid, handoff.expires)

    def _refuse(self, kind: str, request: Any, why: str, then: str | None = None) -> None:
        self.counts[kind] += 1
        if (unlogged := self._throttle.allow(kind)) is not None:
            if then is None:
                then = "the request prefills locally" if kind != "handoff_refused" else "no hand-off"
            log.warning(f"vllm.{kind}", request=request.request_id, why=why, unlogged=unlogged, then=then)


def _last_token_in(request: Any, n: int) -> bool:
    """Whether a step computing ``n`` of ``request``'s tokens samples its last one: it
    reaches the end of the prompt and the token it samples is the ``max_tokens``-th
    (``max_tokens=1``: the router's prefill).  A request that stops earlier (an EOS before
    ``max_tokens``) hands off from the step after it finished."""
    computed = request.num_computed_tokens + n
    return bool(computed >= request.num_prompt_tokens and computed >= request.num_tokens
                and request.num_output_tokens + 1 >= request.max_tokens)
