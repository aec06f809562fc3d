"""``kv_transfer_params``: what a prefill hands its decode (through the router), checked.

A request reaches the prefill with ``{"do_remote_decode": true}`` (optionally
``"decode_tp_size"``).  The prefill answers with the hand-off: where the KV waits
and what it is; the router passes that dict, unchanged, as the decode request's
``kv_transfer_params``.  Everything in it arrives from outside (a client can put
anything in a request), so the decode checks it before it dials or reserves
anything: a malformed hand-off is a clear error and the request is prefilled
locally instead.  A hand-off that names a stranger's address costs a refused
dial, never KV: peers authenticate (README "Security").
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..._control.addresses import split_address
from ..._results import KVServiceError
from ..._transfer.requests import check_request_id

#: the key of the hand-off inside ``kv_transfer_params``
KEY = "kvservice"
#: prefill TP ranks a hand-off may name
MAX_RANKS = 256
MAX_TOKENS = 1 << 31


class HandoffError(KVServiceError, ValueError):
    """A ``kv_transfer_params`` hand-off that cannot be used; the message says why.

    Raised on reading a request's parameters; the scheduler counts and logs why, and
    goes on without the hand-off (a decode prefills the request locally)."""


def wants_remote_decode(params: Mapping[str, Any] | None) -> bool:
    """Whether a prefill request asks for its KV to be handed off."""
    return bool(params) and params.get("do_remote_decode") is True  # type: ignore[union-attr]


def decode_tp_size(params: Mapping[str, Any] | None, default: int) -> int:
    """The decode's TP size a prefill request names (``decode_tp_size``), else ``default``."""
    value = (params or {}).get("decode_tp_size", default)
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_RANKS:
        raise HandoffError(f"decode_tp_size: must be an int in 1..{MAX_RANKS}, got {value!r}")
    return value


@dataclass(frozen=True, slots=True)
class Handoff:
    """A prefill's KV waiting for its decode."""

    #: the kvservice request id (the prefill's own request id)
    request: str
    #: one control address per prefill TP rank
    senders: tuple[str, ...]
    #: tokens whose KV the prefill computed (the prompt)
    num_tokens: int
    block_size: int

    def __post_init__(self) -> None:
        try:
            check_request_id(self.request)
        except ValueError as exc:
            raise HandoffError(f"request: {exc}") from None
        if not isinstance(self.senders, tuple) or not 1 <= len(self.senders) <= MAX_RANKS:
            raise HandoffError(f"senders: one 'host:port' per prefill rank (1..{MAX_RANKS}), got {self.senders!r}")
        for address in self.senders:
            try:
                split_address(address)
            except ValueError as exc:
                raise HandoffError(f"senders: {exc}") from None
        for name, top in (("num_tokens", MAX_TOKENS), ("block_size", 1 << 20)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= top:
                raise HandoffError(f"{name}: must be an int in 1..{top}, got {value!r}")

    @property
    def num_blocks(self) -> int:
        return -(-self.num_tokens // self.block_size)

    def to_params(self) -> dict[str, Any]:
        return {"do_remote_prefill": True, "do_remote_decode": False,
                KEY: {"request": self.request, "senders": list(self.senders),
                      "num_tokens": self.num_tokens, "block_size": self.block_size}}


def handoff_from(params: Mapping[str, Any] | None) -> Handoff | None:
    """The hand-off a decode request carries; None when it carries none.  Raises
    ``HandoffError`` for one it carries but cannot be used."""
    if not params or params.get("do_remote_prefill") is not True or KEY not in params:
        return None
    raw = params[KEY]
    if not isinstance(raw, Mapping):
        raise HandoffError(f"{KEY}: expected an object, got {type(raw).__name__}")
    unknown = set(raw) - {"request", "senders", "num_tokens", "block_size"}
    if unknown:
        raise HandoffError(f"{KEY}: unknown keys {sorted(map(str, unknown))}")
    senders = raw.get("senders")
    if not isinstance(senders, Sequence) or isinstance(senders, str):
        raise HandoffError(f"senders: expected a list of 'host:port', got {senders!r}")
    return Handoff(raw.get("request"), tuple(senders), raw.get("num_tokens"),  # type: ignore[arg-type]
                   raw.get("block_size"))  # type: ignore[arg-type]
