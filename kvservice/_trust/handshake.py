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
Frames are authenticated, not encrypted (they hold request ids and page
numbers), except the ``Join``: it carries the NIXL metadata, the keys to our
memory in effect, and travels encrypted (ChaCha20-Poly1305) under a key of its
own, derived from the transcript, used for that one frame each way.

NIXL notifications (a chunk's completion, a settle fence) do not travel on the
control link: NIXL delivers them with a sender *name* that whoever sends them
chooses.  Each carries a MAC under the link's per-direction notification key
(``LinkSecrets.notif_out`` / ``notif_in``), so only the peer at the other end of
this link can complete or settle anything here.

Versions and forward secrecy.  Each Hello names the versions its sender speaks,
and the link speaks the newest both know (``_control.protocol.negotiate``).  From
version 6 every nonce ends with its sender's newest version (``new_nonce``), and
the proofs cover the nonces: whoever strips or lowers a Hello's version on the path
is caught once the proofs check (``check_versions``).  From version 6 each side
also sends an ephemeral X25519 public key (``Exchange``); the transcript covers
both keys and the link's secrets are derived from the cluster key *and* the
exchange's shared secret, so a recorded handshake opens nothing, even to a
holder of the cluster key (forward secrecy).  Links of version 5 derive them from
the key and the transcript alone.

Without a key (``allow_unauthenticated``) proofs are empty, frames carry no MAC
and the Join is sent in clear; notification keys are then derived from the
transcript alone, which an agent that was not on this link never saw.  A keyed
and an unkeyed service refuse each other.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import struct
from dataclasses import dataclass

import msgspec
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

from .mac import HmacSha256, hmac_sha256

NONCE_BYTES = 32
PROOF_BYTES = hashlib.sha256().digest_size
#: bytes of MAC appended to each frame after the handshake (truncated HMAC-SHA256)
MAC_BYTES = 16
_LABEL = b"kvservice-control-v2 "
_SEQ = struct.Struct(">Q")

DIALER = "dialer"
ACCEPTOR = "acceptor"
#: stands in for the cluster key when there is none (notification keys only)
_UNKEYED = b"kvservice-unkeyed"
#: bytes of MAC appended to each NIXL notification
NOTIF_MAC_BYTES = 16
_JOIN_NONCE = bytes(12)  # each Join key encrypts exactly one message
#: the first protocol version whose links use the X25519 exchange and versioned nonces
EXCHANGE_SINCE = 6
#: bytes of an X25519 public key (``Hello.share``)
SHARE_BYTES = 32
#: a nonce's last bytes from version 6: this marker and its sender's newest version
_TOP_MARK = b"kvs-top:"
_TOP = struct.Struct(">I")
_RANDOM_BYTES = NONCE_BYTES - len(_TOP_MARK) - _TOP.size  # 20: 160 random bits


def new_nonce(newest: int | None = None) -> bytes:
    """A fresh nonce; given ``newest``, the newest protocol version its sender speaks,
    the nonce carries it (an older peer sees 32 opaque bytes).  Both proofs cover both
    nonces, so the versions two peers said cannot be changed on the path
    (``check_versions``)."""
    if newest is None:
        return secrets.token_bytes(NONCE_BYTES)
    return secrets.token_bytes(_RANDOM_BYTES) + _TOP_MARK + _TOP.pack(newest)


def newest_in(nonce: bytes) -> int | None:
    """The newest version a nonce's sender speaks, or ``None`` for a nonce of version 5
    (random throughout: it carries the marker by chance once in 2**64)."""
    if len(nonce) != NONCE_BYTES or nonce[_RANDOM_BYTES:-_TOP.size] != _TOP_MARK:
        return None
    newest: int = _TOP.unpack(nonce[-_TOP.size:])[0]
    return newest


def check_versions(their_nonce: bytes, ours: int, agreed: int) -> str | None:
    """After the peer's proof checked out: ``None`` if ``agreed`` is what its (proven)
    nonce says both sides speak; else why not.  ``ours``: our newest version."""
    theirs = newest_in(their_nonce)
    if theirs is None or min(theirs, ours) == agreed:
        return None
    return (f"the handshake was tampered with: the peer speaks up to protocol version {theirs}, "
            f"yet version {agreed} was agreed")


class Exchange:
    """One side's ephemeral X25519 key for one handshake (from version 6)."""

    __slots__ = ("_private", "share")

    def __init__(self) -> None:
        self._private = X25519PrivateKey.generate()
        self.share = self._private.public_key().public_bytes_raw()

    def shared(self, theirs: bytes) -> bytes:
        """The shared secret with the peer's public key ``theirs``; raises ``ValueError``
        for a key that is not one (wrong length, or a low-order point)."""
        if len(theirs) != SHARE_BYTES:
            raise ValueError(f"key exchange: a public key of {len(theirs)} bytes, not {SHARE_BYTES}")
        try:
            return self._private.exchange(X25519PublicKey.from_public_bytes(theirs))
        except ValueError as exc:  # the library's words name neither the key nor the peer
            raise ValueError("key exchange: the peer's public key is a point of small order, which "
                             "gives no shared secret (no genuine peer sends one)") from exc


def transcript(
    dialer: tuple[str, str, bytes], acceptor: tuple[str, str, bytes],
    version: int = EXCHANGE_SINCE - 1, shares: tuple[bytes, bytes] = (b"", b""),
) -> bytes:
    """What both proofs cover: (agent, address, nonce) of each side, in role order; from
    version 6 also each side's X25519 public key and the agreed version."""
    if version < EXCHANGE_SINCE:
        return msgspec.msgpack.encode([list(dialer), list(acceptor)])
    return msgspec.msgpack.encode([[*dialer, shares[0]], [*acceptor, shares[1]], version])


@dataclass(frozen=True)
class Agreement:
    """What two Hellos settled: the link's version, the transcript both proofs cover,
    and (from version 6) the exchange's shared secret."""

    version: int
    script: bytes
    shared: bytes | None = None

    def secrets(self, key: bytes | None, role: str) -> LinkSecrets:
        return LinkSecrets(key, self.script, role, shared=self.shared)


def with_identities(agreed: Agreement, dialer: int, acceptor: int) -> Agreement:
    """``agreed`` with both Hellos' ``ident`` in its transcript when both sides know member
    identities (each > 0; an older release sends 0 and its transcript is as before): whoever
    lowers either on the path, to talk a link out of proving its members, is caught by the
    proofs."""
    if dialer == 0 or acceptor == 0:
        return agreed
    script = agreed.script + msgspec.msgpack.encode(["ident", dialer, acceptor])
    return Agreement(agreed.version, script, agreed.shared)


def _derive(key: bytes, purpose: bytes, role: str, script: bytes) -> bytes:
    return hmac.digest(key, _LABEL + purpose + role.encode() + b"\0" + script, "sha256")


def _peer_role(role: str) -> str:
    return ACCEPTOR if role == DIALER else DIALER


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

    __slots__ = ("_recv_mac", "_recv_seq", "_send_mac", "_send_seq")

    def __init__(self, key: bytes, script: bytes, role: str) -> None:
        self._send_mac = HmacSha256(_derive(key, b"frames ", role, script))
        self._recv_mac = HmacSha256(_derive(key, b"frames ", _peer_role(role), script))
        self._send_seq = 0
        self._recv_seq = 0

    def seal(self, body: bytes) -> bytes:
        tag = self._send_mac.digest(_SEQ.pack(self._send_seq) + body)[:MAC_BYTES]
        self._send_seq += 1
        return body + tag

    def open(self, sealed: bytes) -> bytes | None:
        """The body, or ``None`` when the MAC does not match (forged, altered, replayed, reordered)."""
        if len(sealed) < MAC_BYTES:
            return None
        body, tag = sealed[:-MAC_BYTES], sealed[-MAC_BYTES:]
        want = self._recv_mac.digest(_SEQ.pack(self._recv_seq) + body)[:MAC_BYTES]
        if not hmac.compare_digest(want, tag):
            return None
        self._recv_seq += 1
        return body


class LinkSecrets:
    """Everything one authenticated link derives from its handshake transcript, as
    seen by ``role``: the frame MAC (keyed links only), the Join's encryption (keyed
    links only) and the notification keys (always)."""

    __slots__ = ("_join_in", "_join_out", "frame_mac", "notif_in", "notif_out")

    def __init__(self, key: bytes | None, script: bytes, role: str, shared: bytes | None = None) -> None:
        peer = _peer_role(role)
        if shared is not None:  # version 6: what the transcript alone does not give away
            key = None if key is None else hmac.digest(key, _LABEL + b"exchange " + shared, "sha256")
            base = key or hmac.digest(_UNKEYED, _LABEL + b"exchange " + shared, "sha256")
        else:
            base = key if key is not None else _UNKEYED
        self.notif_out = _derive(base, b"notifs ", role, script)
        self.notif_in = _derive(base, b"notifs ", peer, script)
        self.frame_mac = FrameMac(key, script, role) if key is not None else None
        self._join_out = ChaCha20Poly1305(_derive(key, b"join ", role, script)) if key is not None else None
        self._join_in = ChaCha20Poly1305(_derive(key, b"join ", peer, script)) if key is not None else None

    @property
    def keyed(self) -> bool:
        return self.frame_mac is not None

    def seal_join(self, body: bytes) -> bytes:
        assert self._join_out is not None
        return self._join_out.encrypt(_JOIN_NONCE, body, b"join")

    def open_join(self, box: bytes) -> bytes | None:
        """The Join's body, or ``None`` if ``box`` was not sealed by this link's peer."""
        if self._join_in is None:
            return None
        try:
            return self._join_in.decrypt(_JOIN_NONCE, box, b"join")
        except InvalidTag:
            return None


def notif_mac(key: bytes, body: bytes) -> bytes:
    """The MAC a notification's ``body`` carries under ``key``."""
    return hmac_sha256(key, body)[:NOTIF_MAC_BYTES]
