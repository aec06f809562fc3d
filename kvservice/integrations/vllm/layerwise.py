"""Decode-first, layer-wise push on the prefill's scheduler side: which blocks each step of a
ticket's request writes, layer by layer, as its forward computes them.

A prefill request carrying a proved ticket (``params.ticket_from``, checked by the
scheduler) is not handed off after it finished: its decode holds the ticket already, has
reserved the prompt's blocks and expects them.  In every step that computes some of its
prompt the worker sends, after each attention layer (``save_kv_layer``), that layer of the
blocks the step completed (``send(..., layers=range(i, i + 1))``); in the step that reaches
the ticket's ``num_tokens`` also the last, partial block, and the last layer's call says
``last=True``.  Blocks the prefill's own prefix cache supplied go with the first step's
(their KV is there already).  kvservice holds the chunks until the decode's expect binds the
request, as it holds a whole send.

Each layer keeps its own position in the request on the receiver's side (kvservice's
``send(layers=)``), so chunk after chunk (vLLM's chunked prefill) lands in the decode's
blocks in order.  Nothing here imports vLLM (tested alone, like ``scheduler``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .params import Handoff


@dataclass(frozen=True, slots=True)
class LayerSend:
    """One step's chunk of a ticket's request: the worker sends it layer by layer."""

    #: vLLM's request id (what the worker reports to vLLM)
    req_id: str
    #: the kvservice request id: the ticket's ``request`` (the decode expects it)
    transfer: str
    #: the blocks this step completed (every layer of each)
    blocks: tuple[int, ...]
    #: the request's first chunk: the worker makes its senders
    first: bool
    #: the request's last chunk: its last layer ends the send (``last=True``)
    last: bool
    decode_tp: int


@dataclass(slots=True)
class Plan:
    request: Any
    ticket: Handoff
    decode_tp: int
    #: blocks posted so far (every layer)
    sent: int = 0
    #: a chunk was posted: the worker has senders for this request
    posted: bool = False
    #: the last chunk was posted
    done: bool = False
    #: preempted after a chunk was posted: the send was aborted, nothing more is sent
    cancelled: bool = False


class Plans:
    """The ticket requests of one prefill scheduler, by vLLM request id, until they finish."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._plans: dict[str, Plan] = {}

    def __contains__(self, rid: object) -> bool:
        return rid in self._plans

    def __len__(self) -> int:
        return len(self._plans)

    def add(self, request: Any, ticket: Handoff, decode_tp: int) -> None:
        self._plans[request.request_id] = Plan(request, ticket, decode_tp)

    def step(self, rid: str, n: int, blocks_of: Callable[[str], Sequence[int]]) -> LayerSend | None:
        """The chunk a step computing ``n`` of ``rid``'s tokens sends (read before vLLM
        advances the request's ``num_computed_tokens``); None when it completes no block."""
        plan = self._plans.get(rid)
        if plan is None or plan.done or plan.cancelled or n <= 0:
            return None
        ticket = plan.ticket
        computed = plan.request.num_computed_tokens + n
        last = computed >= ticket.num_tokens
        upto = ticket.num_blocks if last else min(computed // self.block_size, ticket.num_blocks)
        if upto <= plan.sent and not last:
            return None
        blocks = tuple(blocks_of(rid)[plan.sent: upto])
        if len(blocks) != upto - plan.sent:
            return None  # fewer blocks than computed tokens: not a state vLLM makes; sent by nobody
        first = not plan.posted
        plan.sent, plan.posted, plan.done = upto, True, last
        return LayerSend(rid, ticket.request, blocks, first, last, plan.decode_tp)

    def preempted(self, rid: str) -> bool:
        """``rid`` was preempted (vLLM took its blocks back): whether a send was posted (the
        worker aborts it; the decode's load fails and is recomputed there)."""
        plan = self._plans.get(rid)
        if plan is None or not plan.posted or plan.cancelled:
            return False
        plan.cancelled = True
        return True

    def pop(self, rid: str) -> Plan | None:
        return self._plans.pop(rid, None)
