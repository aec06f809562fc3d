"""``Member``: what a service registers about itself, and reading it back.

The value under ``/kvservice/<cluster>/services/<name>`` is JSON written by another
process: it is decoded into a typed, bounded ``Member`` or ignored (and counted) by
the reader, never trusted further than that.  It names where to dial and what to
expect there; the link's own handshake still authenticates whoever answers.
"""

from __future__ import annotations

import time
from typing import Annotated

import msgspec

from .._control.addresses import split_address

#: the most a registration may hold; a larger value is ignored
MAX_VALUE_BYTES = 4096
PREFIX = "/kvservice"

#: the longest role a service registers under
MAX_ROLE_CHARS = 63
_Name = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")]
_Text = Annotated[str, msgspec.Meta(max_length=255)]


class Member(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    """One registered service.  ``incarnation`` changes when its process restarts (a new
    agent, new NIXL metadata); ``linked`` and ``inflight`` are refreshed while it runs."""

    name: _Name
    address: _Text
    agent: _Text
    incarnation: Annotated[int, msgspec.Meta(ge=0)]
    role: Annotated[str, msgspec.Meta(max_length=MAX_ROLE_CHARS)] = ""
    #: KV memory: bytes, pages, regions, kind
    memory: dict[str, int | str] = msgspec.field(default_factory=dict)
    started_at: float = 0.0
    linked: Annotated[int, msgspec.Meta(ge=0)] = 0
    inflight: Annotated[int, msgspec.Meta(ge=0)] = 0

    def age_s(self, now: float | None = None) -> float:
        return max(0.0, (time.time() if now is None else now) - self.started_at)


_decoder = msgspec.json.Decoder(Member)


def services_prefix(cluster: str) -> str:
    return f"{PREFIX}/{cluster}/services/"


def service_key(cluster: str, name: str) -> str:
    return services_prefix(cluster) + name


def encode(member: Member) -> bytes:
    return msgspec.json.encode(member)


def decode(key: str, value: bytes, prefix: str) -> Member:
    """The member at ``key``; ValueError for anything malformed (too long, wrong types,
    a name that is not its key's, an address that does not parse)."""
    if len(value) > MAX_VALUE_BYTES:
        raise ValueError(f"{len(value)} bytes, at most {MAX_VALUE_BYTES}")
    try:
        member = _decoder.decode(value)
    except msgspec.DecodeError as exc:
        raise ValueError(str(exc)) from None
    if prefix + member.name != key:
        raise ValueError(f"name {member.name!r} is not its key's")
    split_address(member.address)
    if len(member.memory) > 16:
        raise ValueError("memory: at most 16 entries")
    return member
