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

With member identities (docs/security.md "Member identities") the prefill also signs the
same encoding under its member key (``prove``: its certificate and signature, under a label
of their own, so that a hand-off's signature never passes for a handshake's or a
registration's); the decode checks it with ``Identity.check`` (the cluster's CA, the
dates, the cluster), the role ``prefill`` and the revocation list in force (``proven``),
and pins its expect to the member that signed: a member can issue hand-offs only for
itself, and only the member that signed can feed the request.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import struct
from collections.abc import Mapping, Sequence

from .identity import IDENTITY, Identity, IdentityRefused, Member, role_claim
from .mac import hmac_sha256
from .revocation import Revocations

#: what the hand-off key is derived for (HMAC-SHA256 of the cluster key over this label)
_KEY_LABEL = b"kvservice-engine-handoff-v1"
#: the first bytes every MACed record starts with (a version of this encoding)
_DOMAIN = b"kvservice-handoff-v1\0"
#: a MAC as it travels: HMAC-SHA256, hex
MAC_CHARS = 64
#: what a member's signature over a hand-off starts with (then ``encode``'s bytes)
_SIGNED_LABEL = b"kvservice-handoff-member-v1\0"
#: the role a hand-off's signer must hold
SIGNER_ROLE = "prefill"
#: a member proof as it travels, base64: a certificate (``identity.MAX_CERT_BYTES``) and a signature
MAX_PROOF_CHARS = 8192 + 1400

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
    return hmac_sha256(key, encode(fields)).hex()


def mac_ok(key: bytes, fields: Sequence[Field], claimed: object) -> bool:
    """Whether ``claimed`` is the MAC of ``fields`` under ``key`` (compared in constant time;
    anything but a string of ``MAC_CHARS`` characters is not)."""
    if not isinstance(claimed, str) or len(claimed) != MAC_CHARS or not claimed.isascii():
        return False
    return hmac.compare_digest(mac(key, fields), claimed)


def signed_part(fields: Sequence[Field]) -> bytes:
    """What a prefill member's signature over a hand-off covers."""
    return _SIGNED_LABEL + encode(fields)


def prove(identity: Identity, fields: Sequence[Field]) -> dict[str, str]:
    """``identity``'s proof that its member issued ``fields``: its certificate and its
    signature, base64, as they travel."""
    return {"cert": base64.b64encode(identity.der).decode(),
            "signature": base64.b64encode(identity.sign(signed_part(fields))).decode()}


def proven(identity: Identity, revocations: Revocations | None, fields: Sequence[Field],
           proof: Mapping[str, object]) -> Member:
    """The member whose ``proof`` (``prove``) covers ``fields``: certified by this service's
    CA, for its cluster, now, in role ``prefill``, not revoked; ``IdentityRefused`` saying
    why not (``kind``: ``identity``, or ``identity_revoked``)."""
    cert, signature = proof.get("cert"), proof.get("signature")
    if not isinstance(cert, str) or not isinstance(signature, str) or len(cert) + len(signature) > MAX_PROOF_CHARS:
        raise IdentityRefused("the member proof is not a certificate and a signature (base64 text)", IDENTITY)
    try:
        der = base64.b64decode(cert, validate=True)
        sig = base64.b64decode(signature, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise IdentityRefused(f"the member proof is not base64: {exc}", IDENTITY) from exc
    member = identity.check(der, None, sig, signed_part(fields))
    if (why := role_claim(member, SIGNER_ROLE)) is not None:
        raise IdentityRefused(f"a hand-off is issued by a prefill: {why}", IDENTITY)
    if revocations is not None and (revoked := revocations.refusal(member)) is not None:
        raise revoked
    return member
