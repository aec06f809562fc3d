"""The mutual challenge-response of the control handshake, and per-frame MACs.

Both peers hold the cluster's shared key ``K``.  Each picks a fresh 32-byte
nonce; the *transcript* binds both nonces, both agent names and both claimed
addresses.  The acceptor proves ``HMAC(K, "acceptor" | transcript)`` first, the
dialer answers ``HMAC(K, "dialer" | transcript)``; each checks the other's with
``hmac.compare_digest``.  A recorded handshake does not replay (the other side's
nonce is new each time), a proof cannot be reflected (the role is in it), and
nothing but the two short Hello frames is read before the peer has proved the
key: its NIXL metadata comes after.

Afterwards every frame carries a MAC under a per-connection, per-direction key
derived from the same transcript, over a sequence number and the body: a party
on the network path can neither inject, alter, reorder nor replay a frame.
Frames are authenticated, not encrypted: they hold request ids and page numbers.

Without a key (loopback only, see ``ServiceConfig``) proofs are empty and
frames carry no MAC.  A keyed and an unkeyed service refuse each other.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import struct

import msgspec

NONCE_BYTES = 32
PROOF_BYTES = hashlib.sha256().digest_size
#: bytes of MAC appended to each frame after the handshake (truncated HMAC-SHA256)
MAC_BYTES = 16
_LABEL = b"kvservice-control-v2 "
_SEQ = struct.Struct(">Q")

DIALER = "dialer"
ACCEPTOR = "acceptor"


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def transcript(
    dialer: tuple[str, str, bytes], acceptor: tuple[str, str, bytes],
) -> bytes:
    """What both proofs cover: (agent, address, nonce) of each side, in role order."""
    return msgspec.msgpack.encode([list(dialer), list(acceptor)])


def prove(key: bytes | None, role: str, script: bytes) -> bytes:
    """``role``'s proof over ``script``; empty without a key."""
    if key is None:
        return b""
    return hmac.digest(key, _LABEL + role.encode() + b"\0" + script, "sha256")


def verify(key: bytes | None, role: str, script: bytes, proof: bytes) -> str | None:
    """``None`` if ``proof`` is ``role``'s valid proof; else why not (for a ``Reject``)."""
    if key is None:
        return None if not proof else "the peer authenticates with a key and this service has none"
    if not proof:
        return "the peer did not authenticate (no key configured there)"
    if not hmac.compare_digest(prove(key, role, script), proof):
        return "authentication failed (wrong key, or a replayed handshake)"
    return None


class FrameMac:
    """Seals outgoing and opens incoming frame bodies of one authenticated connection.

    Not thread-safe; one instance per connection, used from its event loop only."""

    __slots__ = ("_recv_key", "_recv_seq", "_send_key", "_send_seq")

    def __init__(self, key: bytes, script: bytes, role: str) -> None:
        peer = ACCEPTOR if role == DIALER else DIALER
        self._send_key = hmac.digest(key, _LABEL + b"frames " + role.encode() + b"\0" + script, "sha256")
        self._recv_key = hmac.digest(key, _LABEL + b"frames " + peer.encode() + b"\0" + script, "sha256")
        self._send_seq = 0
        self._recv_seq = 0

    def seal(self, body: bytes) -> bytes:
        tag = hmac.digest(self._send_key, _SEQ.pack(self._send_seq) + body, "sha256")[:MAC_BYTES]
        self._send_seq += 1
        return body + tag

    def open(self, sealed: bytes) -> bytes | None:
        """The body, or ``None`` when the MAC does not match (forged, altered, replayed, reordered)."""
        if len(sealed) < MAC_BYTES:
            return None
        body, tag = sealed[:-MAC_BYTES], sealed[-MAC_BYTES:]
        want = hmac.digest(self._recv_key, _SEQ.pack(self._recv_seq) + body, "sha256")[:MAC_BYTES]
        if not hmac.compare_digest(want, tag):
            return None
        self._recv_seq += 1
        return body
