"""The MAC an engine's hand-off carries: proof that a service of the cluster wrote it.

A prefill hands its decode a small record (through a router, and so through anything a
client can put in a request): which request, which addresses to dial, how many tokens and
blocks, until when.  The prefill MACs exactly those fields under ``handoff_key``, a key
derived from the cluster's key (domain-separated, so a hand-off's MAC can never pass for a
handshake proof, a bootstrap registration or a bench control message); the decode checks
the MAC, in constant time, before it reserves or dials anything.

The fields are encoded canonically before they are MACed (``encode``): each one tagged with
its type and, for text and sequences, prefixed with its length, so that no two different
records share an encoding (moving a byte from one string to the next changes a length).
"""

from __future__ import annotations

import hmac
import struct
from collections.abc import Sequence

#: what the hand-off key is derived for (HMAC-SHA256 of the cluster key over this label)
_KEY_LABEL = b"kvservice-engine-handoff-v1"
#: the first bytes every MACed record starts with (a version of this encoding)
_DOMAIN = b"kvservice-handoff-v1\0"
#: a MAC as it travels: HMAC-SHA256, hex
MAC_CHARS = 64

Field = str | int | Sequence[str]


def handoff_key(cluster_key: bytes | None) -> bytes | None:
    """The hand-offs' MAC key, derived from the cluster's key; None without one."""
    return None if cluster_key is None else hmac.digest(cluster_key, _KEY_LABEL, "sha256")


def encode(fields: Sequence[Field]) -> bytes:
    """The canonical bytes of ``fields``: ints (0 .. 2**64-1), text, or sequences of text."""
    out = bytearray(_DOMAIN)
    for value in fields:
        if isinstance(value, bool):
            raise TypeError("a hand-off field is an int, a str or a sequence of str, not a bool")
        if isinstance(value, int):
            out += b"i" + struct.pack(">Q", value)
        elif isinstance(value, str):
            out += b"s" + _text(value)
        else:
            out += b"l" + struct.pack(">I", len(value))
            for item in value:
                if not isinstance(item, str):
                    raise TypeError(f"a hand-off list holds str, got {type(item).__name__}")
                out += _text(item)
    return bytes(out)


def _text(value: str) -> bytes:
    data = value.encode("utf-8", "surrogatepass")
    return struct.pack(">I", len(data)) + data


def mac(key: bytes, fields: Sequence[Field]) -> str:
    """The hex MAC of ``fields`` under the hand-off key ``key``."""
    return hmac.digest(key, encode(fields), "sha256").hex()


def mac_ok(key: bytes, fields: Sequence[Field], claimed: object) -> bool:
    """Whether ``claimed`` is the MAC of ``fields`` under ``key`` (compared in constant time;
    anything but a string of ``MAC_CHARS`` characters is not)."""
    if not isinstance(claimed, str) or len(claimed) != MAC_CHARS or not claimed.isascii():
        return False
    return hmac.compare_digest(mac(key, fields), claimed)
