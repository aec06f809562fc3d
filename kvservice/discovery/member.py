"""``Member``: what a service registers about itself, and reading it back.

The value under ``/kvservice/<cluster>/services/<name>`` is JSON written by another
process: it is decoded into a typed, bounded ``Member`` or ignored (and counted) by
the reader, never trusted further than that.  It names where to dial and what to
expect there; the link's own handshake still authenticates whoever answers.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Annotated

import msgspec

from .._control.addresses import split_address
from ._etcd import Entry

#: the most a registration may hold; a larger value is ignored
MAX_VALUE_BYTES = 4096
PREFIX = "/kvservice"

#: the longest role a service registers under
MAX_ROLE_CHARS = 63
#: the longest member name; a key whose name is longer is ignored before it is decoded
MAX_NAME_CHARS = 63
_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$"
_NAME = re.compile(_NAME_PATTERN)
_Name = Annotated[str, msgspec.Meta(pattern=_NAME_PATTERN)]

#: why an entry read from etcd is ignored (each counted, in ``Registry.status()["ignored"]``)
IGNORED = ("key_outside_prefix", "key_too_long", "key_not_utf8", "name_invalid", "value_too_long", "value_invalid",
           "agent_taken", "unsigned", "signature", "role", "replay")
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
    #: with a member identity (``signing``): when it was signed, its certificate (base64
    #: DER) and its member key's signature; empty without one
    signed_at: float = 0.0
    cert: Annotated[str, msgspec.Meta(max_length=MAX_VALUE_BYTES)] = ""
    sig: Annotated[str, msgspec.Meta(max_length=2048)] = ""

    def age_s(self, now: float | None = None) -> float:
        return max(0.0, (time.time() if now is None else now) - self.started_at)


_decoder = msgspec.json.Decoder(Member)


@dataclass(frozen=True, slots=True)
class Ignored:
    """Why an entry from etcd is no member: ``why`` is one of ``IGNORED``; ``detail`` is
    bounded and never echoes the entry's bytes (they may be anything, of any size)."""

    why: str
    detail: str


def services_prefix(cluster: str) -> str:
    return f"{PREFIX}/{cluster}/services/"


def service_key(cluster: str, name: str) -> str:
    return services_prefix(cluster) + name


def encode(member: Member) -> bytes:
    return msgspec.json.encode(member)


def name_of(key: bytes, prefix: str) -> str | Ignored:
    """The member name ``key`` holds under ``prefix``, or why it is no member's key.  The
    key is read as bytes: etcd takes any, and none of them may raise here."""
    raw = prefix.encode()
    if not key.startswith(raw):
        return Ignored("key_outside_prefix", f"not under {prefix}")
    name = key[len(raw):]
    if len(name) > MAX_NAME_CHARS:
        return Ignored("key_too_long", f"a name of {len(name)} bytes, at most {MAX_NAME_CHARS}")
    try:
        text = name.decode()
    except UnicodeDecodeError:
        return Ignored("key_not_utf8", "its name is not UTF-8")
    if not _NAME.match(text):
        return Ignored("name_invalid", "a name is letters, digits, '.', '_', '-' (1..63, not starting with a symbol)")
    return text


def read(key: bytes, value: bytes, prefix: str) -> Member | Ignored:
    """The member at ``key``, or why it is ignored: its key (``name_of``), or its value
    (``value_too_long``; ``value_invalid``: not JSON, wrong types, a name that is not its
    key's, an address that does not parse)."""
    name = name_of(key, prefix)
    if isinstance(name, Ignored):
        return name
    if len(value) > MAX_VALUE_BYTES:
        return Ignored("value_too_long", f"{len(value)} bytes, at most {MAX_VALUE_BYTES}")
    try:
        member = _decoder.decode(value)
        split_address(member.address)
    except (msgspec.DecodeError, ValueError) as exc:
        return Ignored("value_invalid", str(exc)[:200])
    if member.name != name:
        return Ignored("value_invalid", f"name {member.name!r} is not its key's")
    if len(member.memory) > 16:
        return Ignored("value_invalid", "memory: at most 16 entries")
    return member


def claimed_elsewhere(member: Member, claims: Mapping[str, str]) -> bool:
    """Whether ``member``'s agent is already claimed under another name (``claims``:
    agent -> name, the earlier claims).  Agent names are new at each start of a
    process, so one agent under two names is a forgery, and the later claim is it."""
    return claims.get(member.agent, member.name) != member.name


def read_listing(entries: Iterable[Entry], prefix: str, claims: Mapping[str, str] | None = None,
                 check: Callable[[bytes, Member], Member | Ignored] | None = None,
                 ) -> tuple[list[Member], list[tuple[bytes, Ignored]]]:
    """The members a listing holds, and the entries ignored (key, why).  Entries are read
    in the order they were created, so of two claims of one agent the earlier stands
    (``claimed_elsewhere``), after the caller's own ``claims`` (agent -> name); each is
    first passed through ``check`` (a signature's: ``signing.Verifier.check``)."""
    found: list[Member] = []
    ignored: list[tuple[bytes, Ignored]] = []
    taken = dict(claims or {})
    for entry in sorted(entries, key=lambda e: e.created):
        got = read(entry.key, entry.value, prefix)
        if isinstance(got, Member) and check is not None:
            got = check(entry.key, got)
        if isinstance(got, Member) and claimed_elsewhere(got, taken):
            got = Ignored("agent_taken", f"agent {got.agent!r} is {taken[got.agent]!r}'s")
        if isinstance(got, Ignored):
            ignored.append((entry.key, got))
            continue
        taken[got.agent] = got.name
        found.append(got)
    return found, ignored


def shown(key: bytes, prefix: str) -> str:
    """``key`` as a log line may show it: its name, bounded, non-ASCII bytes escaped."""
    name = key[len(prefix.encode()):] if key.startswith(prefix.encode()) else key
    text = ascii(name[:MAX_NAME_CHARS])[2:-1]
    return text + (f"... ({len(name)} bytes)" if len(name) > MAX_NAME_CHARS else "")
