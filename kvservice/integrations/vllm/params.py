"""``kv_transfer_params``: what a prefill hands its decode (through the router), signed and checked.

A request reaches the prefill with ``{"do_remote_decode": true}`` (optionally
``"decode_tp_size"``).  The prefill answers with the hand-off: where the KV waits, what it
is, until when, and a MAC over all of it (``_trust.handoff``, under a key derived from the
cluster's key); the router passes that dict, unchanged, as the decode request's
``kv_transfer_params``.  Everything in it arrives from outside (a client can put anything
in a request), so the decode checks it before it dials or reserves anything: its shape and
ranges first (``handoff_from``), then the MAC, the expiry and the prompt (``check``).  A
hand-off that fails is a clear error, counted by kind, and the request is prefilled locally
instead.

What a verified hand-off proves: a service holding the cluster's key issued exactly these
fields, for a prompt whose first ``num_tokens`` token ids are this request's, and it has
not expired.  Within its life a copy can be presented again: the decode's scheduler refuses
a second request presenting it, and the prefill binds one expect per request.  Without a
key (``allow_unauthenticated``) hand-offs carry no MAC and prove nothing: a decode without
a key takes one as given (docs/vllm.md "Trust").

With member identities a hand-off also carries its prefill member's proof (certificate and
signature over the same fields, ``_trust.handoff.prove``) beside the record, under
``MEMBER_KEY`` (a decode of a release without it reads only ``KEY`` and checks the MAC, as
before).  A decode with an identity believes a hand-off only from the member that signed it
(``Handoff.proven``) and expects its KV from that member alone (``Handoff.member``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import sys
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..._control.addresses import split_address
from ..._results import KVServiceError
from ..._transfer.requests import check_request_id
from ..._trust.handoff import MAC_CHARS, MAX_PROOF_CHARS, mac, mac_ok, prove, proven
from ..._trust.identity import Identity, IdentityRefused
from ..._trust.revocation import REVOKED, Revocations

#: the key of the hand-off inside ``kv_transfer_params``
KEY = "kvservice"
#: the key, beside ``KEY``, of the prefill member's proof (``{"cert", "signature"}``, base64)
MEMBER_KEY = "kvservice_member"
#: prefill TP ranks a hand-off may name
MAX_RANKS = 256
MAX_TOKENS = 1 << 31
#: the latest expiry a decode accepts, past its own clock (plus the skew): a hand-off is
#: useful only while the prefill's send waits (``bootstrap_timeout_s``)
MAX_LIFETIME_S = 3600
#: how far the decode's clock may be behind or ahead of the prefill's, by default
DEFAULT_SKEW_S = 10.0
FIELDS = frozenset({"request", "senders", "num_tokens", "block_size", "expires", "prompt", "mac", "ticket"})
_DIGEST_CHARS = 64


class HandoffError(KVServiceError, ValueError):
    """A ``kv_transfer_params`` hand-off that cannot be used; the message says why and
    ``kind`` names the counter it is counted under (``handoff_invalid``: malformed;
    ``handoff_unsigned``, ``handoff_forged``, ``handoff_expired``: not proved;
    ``handoff_unusable``: proved, but not for this decode or this prompt; with member
    identities ``handoff_identity``, ``handoff_revoked``, ``handoff_identity_missing``: not
    proved by a prefill member of this cluster).

    Raised on reading a request's parameters; the scheduler counts and logs why, and
    goes on without the hand-off (a decode prefills the request locally)."""

    def __init__(self, message: str, kind: str = "handoff_invalid") -> None:
        super().__init__(message)
        self.kind = kind


def wants_remote_decode(params: Any) -> bool:
    """Whether a prefill request asks for its KV to be handed off."""
    return isinstance(params, Mapping) and params.get("do_remote_decode") is True


def decode_tp_size(params: Any, default: int) -> int:
    """The decode's TP size a prefill request names (``decode_tp_size``), else ``default``."""
    value = params.get("decode_tp_size", default) if isinstance(params, Mapping) else default
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_RANKS:
        raise HandoffError(f"decode_tp_size: must be an int in 1..{MAX_RANKS}, got {value!r}")
    return value


def prompt_digest(tokens: Sequence[int] | None, num_tokens: int) -> str:
    """SHA-256 (hex) of the first ``num_tokens`` token ids, as little-endian int64s."""
    ids = array("q", list(tokens or ())[:num_tokens])
    if sys.byteorder != "little":
        ids.byteswap()
    return hashlib.sha256(ids.tobytes()).hexdigest()


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
    #: the wall-clock second (Unix time) after which the decode must not act on it
    expires: int
    #: ``prompt_digest`` of the prompt's first ``num_tokens`` token ids
    prompt: str
    #: the MAC over every field above (``_trust.handoff``); "" when issued without a key
    mac: str = ""
    #: issued by the router before the prefill computed anything (decode-first, layer-wise):
    #: the KV is still to come; covered by the MAC
    ticket: bool = False
    #: the issuing member's proof (base64 certificate, base64 signature over ``fields``); None
    #: from a prefill without a member identity
    proof: tuple[str, str] | None = None
    #: the member that proved it, once a decode checked the proof (``proven``): the senders
    #: must prove this member on the link; "" (not checked, or no identity): any sender
    member: str = ""

    def __post_init__(self) -> None:
        try:
            check_request_id(self.request)
        except ValueError as exc:
            raise HandoffError(f"request: {_short(exc)}") from None
        if not isinstance(self.senders, tuple) or not 1 <= len(self.senders) <= MAX_RANKS:
            raise HandoffError(f"senders: one 'host:port' per prefill rank (1..{MAX_RANKS}), got {len(self.senders)}")
        for address in self.senders:
            try:
                split_address(address)
            except ValueError as exc:
                raise HandoffError(f"senders: {_short(exc)}") from None
        for name, top in (("num_tokens", MAX_TOKENS), ("block_size", 1 << 20), ("expires", 1 << 40)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= top:
                raise HandoffError(f"{name}: must be an int in 1..{top}, got {_short(repr(value))}")
        if not _is_hex(self.prompt, _DIGEST_CHARS):
            raise HandoffError(f"prompt: must be {_DIGEST_CHARS} lower-case hex digits")
        if self.mac and not _is_hex(self.mac, MAC_CHARS):
            raise HandoffError(f"mac: must be {MAC_CHARS} lower-case hex digits")
        if not isinstance(self.ticket, bool):
            raise HandoffError(f"ticket: must be true or absent, got {_short(repr(self.ticket))}")
        if self.proof is not None and (
                not isinstance(self.proof, tuple) or len(self.proof) != 2
                or not all(isinstance(p, str) and p for p in self.proof)
                or sum(map(len, self.proof)) > MAX_PROOF_CHARS):
            raise HandoffError(f"{MEMBER_KEY}: must be an object with a certificate and a signature, base64, "
                               f"{MAX_PROOF_CHARS} characters at most")

    @classmethod
    def issue(cls, request: str, senders: tuple[str, ...], tokens: Sequence[int] | None, num_tokens: int,
              block_size: int, *, key: bytes | None, lifetime_s: float, now: float,
              ticket: bool = False, identity: Identity | None = None) -> Handoff:
        """A hand-off of the first ``num_tokens`` of ``tokens``, valid for ``lifetime_s`` from
        ``now`` (Unix time), MACed under the hand-off key ``key`` (unsigned without one) and,
        with ``identity``, signed by its member; ``ticket``: a router's, before the prefill
        computed anything."""
        unsigned = cls(request, senders, num_tokens, block_size, math.ceil(now + lifetime_s),
                       prompt_digest(tokens, num_tokens), ticket=ticket)
        issued = unsigned if key is None else unsigned.signed(key)
        if identity is not None:
            proof = prove(identity, issued.fields)
            issued = dataclasses.replace(issued, proof=(proof["cert"], proof["signature"]))
        return issued

    def signed(self, key: bytes) -> Handoff:
        return Handoff(self.request, self.senders, self.num_tokens, self.block_size, self.expires, self.prompt,
                       mac(key, self.fields), self.ticket)

    def proven(self, identity: Identity | None, revocations: Revocations | None, *,
               allow_without: bool) -> Handoff:
        """This hand-off bound to the prefill member that signed it (``member``), once
        ``check`` passed; raises ``HandoffError`` unless a member of this cluster, in role
        ``prefill`` and not revoked, signed exactly these fields.  Without ``identity``
        (this decode has none) it is returned as it is: the MAC is all it checks.
        ``allow_without`` (``allow_peers_without_identity``): one carrying no proof is taken
        unbound (the caller counts it, ``handoffs_without_identity``)."""
        if identity is None:
            return self
        if self.proof is None:
            if allow_without:
                return self
            raise HandoffError("no member proof: this decode takes hand-offs only from prefill members of its "
                               "cluster (give the prefill identity_cert_file, identity_key_file and "
                               "identity_ca_file, or set allow_peers_without_identity here while a fleet moves "
                               "to identities)", "handoff_identity_missing")
        try:
            member = proven(identity, revocations, self.fields, {"cert": self.proof[0], "signature": self.proof[1]})
        except IdentityRefused as exc:
            kind = "handoff_revoked" if exc.kind == REVOKED else "handoff_identity"
            raise HandoffError(f"the prefill member's proof does not hold: {exc}", kind) from None
        return dataclasses.replace(self, member=member.name)

    @property
    def fields(self) -> tuple[str | int | tuple[str, ...], ...]:
        """What the MAC covers: everything the decode acts on (a ticket's flag appended, so a
        hand-off's fields, and its MAC, are those of before tickets existed)."""
        base = (self.request, self.senders, self.num_tokens, self.block_size, self.expires, self.prompt)
        return (*base, 1) if self.ticket else base

    @property
    def num_blocks(self) -> int:
        return -(-self.num_tokens // self.block_size)

    def body(self) -> dict[str, Any]:
        """The record as it travels (the object under ``KEY``)."""
        body: dict[str, Any] = {"request": self.request, "senders": list(self.senders),
                                "num_tokens": self.num_tokens, "block_size": self.block_size,
                                "expires": self.expires, "prompt": self.prompt}
        if self.mac:
            body["mac"] = self.mac
        if self.ticket:
            body["ticket"] = True
        return body

    def to_params(self) -> dict[str, Any]:
        """The decode request's ``kv_transfer_params`` (with the member proof beside the
        record, when there is one)."""
        params: dict[str, Any] = {"do_remote_prefill": True, "do_remote_decode": False, KEY: self.body()}
        if self.proof is not None:
            params[MEMBER_KEY] = {"cert": self.proof[0], "signature": self.proof[1]}
        return params

    def to_prefill_params(self) -> dict[str, Any]:
        """A ticket's prefill request's ``kv_transfer_params``: compute, and write each layer
        to the decode that expects ``request``."""
        return {"do_remote_decode": True, KEY: self.body()}

    def check(self, key: bytes | None, *, now: float, skew_s: float, tokens: Sequence[int] | None) -> None:
        """Raise ``HandoffError`` (its ``kind`` says which check) unless this hand-off may be
        acted on, at ``now`` (Unix time), for a request whose prompt is ``tokens``: its MAC
        verifies under the hand-off key ``key`` (none is checked without a key), it has not
        expired (``skew_s`` allowed either way), and it is for this prompt."""
        if key is not None:
            if not self.mac:
                raise HandoffError("no MAC: this decode takes only hand-offs signed under the cluster's key",
                                   "handoff_unsigned")
            if not mac_ok(key, self.fields, self.mac):
                raise HandoffError("the MAC does not verify (altered, or not signed under this cluster's key)",
                                   "handoff_forged")
        if now > self.expires + skew_s:
            raise HandoffError(f"expired {now - self.expires:.0f} s ago (clock skew allowed: {skew_s} s)",
                               "handoff_expired")
        if self.expires > now + skew_s + MAX_LIFETIME_S:
            raise HandoffError(f"expires {self.expires - now:.0f} s from now, past the {MAX_LIFETIME_S} s a "
                               "hand-off may live", "handoff_expired")
        if self.prompt != prompt_digest(tokens, self.num_tokens):
            raise HandoffError(f"handed off for another prompt (its first {self.num_tokens} tokens differ)",
                               "handoff_unusable")


def _short(text: object, limit: int = 200) -> str:
    """``text`` cut to ``limit`` characters: what a refusal quotes of a client's input."""
    text = str(text)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def _is_hex(value: object, length: int) -> bool:
    return (isinstance(value, str) and len(value) == length
            and all(c in "0123456789abcdef" for c in value))


def handoff_from(params: Any) -> Handoff | None:
    """The hand-off (or ticket) a decode request carries; None when it carries none.  Raises
    ``HandoffError`` for one it carries but cannot be used (``check`` then proves it)."""
    if not isinstance(params, Mapping):
        if params:
            raise HandoffError(f"kv_transfer_params: expected an object, got {type(params).__name__}")
        return None
    if params.get("do_remote_prefill") is not True or KEY not in params:
        return None
    handoff = _parse(params[KEY])
    if MEMBER_KEY not in params:
        return handoff
    raw = params[MEMBER_KEY]
    if not isinstance(raw, Mapping) or set(raw) != {"cert", "signature"}:
        raise HandoffError(f"{MEMBER_KEY}: expected an object with exactly the keys cert and signature")
    return dataclasses.replace(handoff, proof=(raw["cert"], raw["signature"]))


def ticket_from(params: Any) -> Handoff | None:
    """The ticket a prefill request carries (``to_prefill_params``); None when it carries
    none.  Raises ``HandoffError`` for one it carries but cannot be used (``check`` then
    proves it; a record without ``ticket`` is no ticket: its MAC, if any, is a hand-off's)."""
    if not wants_remote_decode(params) or KEY not in params:
        return None
    return _parse(params[KEY])


def _parse(raw: Any) -> Handoff:
    if not isinstance(raw, Mapping):
        raise HandoffError(f"{KEY}: expected an object, got {type(raw).__name__}")
    unknown = set(raw) - FIELDS
    if unknown:
        raise HandoffError(f"{KEY}: unknown keys {sorted(str(k)[:40] for k in unknown)[:8]}")
    senders = raw.get("senders")
    if not isinstance(senders, Sequence) or isinstance(senders, str):
        raise HandoffError(f"senders: expected a list of 'host:port', got {type(senders).__name__}")
    if len(senders) > MAX_RANKS:
        raise HandoffError(f"senders: one 'host:port' per prefill rank (1..{MAX_RANKS}), got {len(senders)}")
    mac_text = raw.get("mac", "")
    if not isinstance(mac_text, str) or (not mac_text and "mac" in raw):
        raise HandoffError(f"mac: must be {MAC_CHARS} lower-case hex digits")
    ticket = raw.get("ticket", False)
    if ticket is not True and "ticket" in raw:
        raise HandoffError(f"ticket: must be true or absent, got {_short(repr(ticket))}")
    return Handoff(raw.get("request"), tuple(senders), raw.get("num_tokens"),  # type: ignore[arg-type]
                   raw.get("block_size"), raw.get("expires"), raw.get("prompt"), mac_text,  # type: ignore[arg-type]
                   bool(ticket))
