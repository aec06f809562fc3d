"""Registrations signed by the member they name (docs/security.md, the etcd writer's row).

A service with a member identity (``identity_cert_file``) writes its registration with
its certificate (``cert``, base64 DER), the time it signed (``signed_at``) and a signature
by its member key (``sig``) over what the entry claims: the cluster, the etcd key, the
name, role, agent, address and incarnation, and ``signed_at`` (``signed_part``).  The
load figures (``linked``, ``inflight``, ``memory``) are not covered: they steer nothing.

A reader with an identity checks each entry with ``Identity.check`` (the chain to the
cluster's CA, the dates, the cluster, the agent named by the certificate's member, the
signature) and requires the entry's name to be the certificate's member or its agent:
an etcd writer without a member's key can neither forge an entry nor replace one, and a
member cannot write another's.  An entry older than one already accepted for its name (a
lower incarnation, or the same one signed earlier) is a replay.  Entries without a
signature pass only with ``allow_peers_without_identity`` (a fleet moving to identities),
and never in place of a signed one.  A reader without an identity checks nothing here.
"""

from __future__ import annotations

import base64
import binascii
import time

import msgspec

from .._trust.identity import Identity, IdentityRefused, role_claim
from .member import Ignored, Member

_LABEL = b"kvservice-registration-v1\0"


def signed_part(cluster: str, key: bytes, member: Member) -> bytes:
    """What a registration's signature covers."""
    return _LABEL + msgspec.json.encode([cluster, key.decode(), member.name, member.role, member.agent,
                                         member.address, member.incarnation, member.signed_at])


def sign(identity: Identity, cluster: str, key: bytes, member: Member) -> Member:
    """``member`` as its holder writes it: certificate, time and signature set."""
    member = msgspec.structs.replace(member, signed_at=time.time(), cert=base64.b64encode(identity.der).decode(),
                                     sig="")
    signature = identity.sign(signed_part(cluster, key, member))
    return msgspec.structs.replace(member, sig=base64.b64encode(signature).decode())


class Verifier:
    """A reader's check of each entry (``check``), with what it accepted last per name."""

    def __init__(self, identity: Identity | None, cluster: str, allow_unsigned: bool) -> None:
        self._identity = identity
        self._cluster = cluster
        self._allow_unsigned = allow_unsigned
        #: name -> (incarnation, signed_at, signed) of the last entry accepted for it
        self._last: dict[str, tuple[int, float, bool]] = {}

    def check(self, key: bytes, member: Member) -> Member | Ignored:
        """``member`` read at ``key``, or why it is ignored (``unsigned``, ``signature``,
        ``role``, ``replay``).  An accepted entry is remembered against replays of older ones."""
        if self._identity is None:
            return member
        last = self._last.get(member.name)
        if not member.sig and not member.cert:
            if not self._allow_unsigned:
                return Ignored("unsigned", "a registration without its member's signature (this service has a "
                                           "member identity; allow_peers_without_identity admits such entries)")
            if last is not None and last[2]:
                return Ignored("unsigned", "an unsigned entry in place of its member's signed one")
            self._last[member.name] = (member.incarnation, member.signed_at, False)
            return member
        refused = self._verify(key, member)
        if refused is not None:
            return refused
        if last is not None and last[2] and (member.incarnation, member.signed_at) < last[:2]:
            return Ignored("replay", f"an entry of incarnation {member.incarnation} signed at {member.signed_at:.3f}, "
                                     f"older than the one accepted (incarnation {last[0]}, signed at {last[1]:.3f})")
        self._last[member.name] = (member.incarnation, member.signed_at, True)
        return member

    def _verify(self, key: bytes, member: Member) -> Ignored | None:
        assert self._identity is not None
        try:
            der = base64.b64decode(member.cert, validate=True)
            signature = base64.b64decode(member.sig, validate=True)
        except (binascii.Error, ValueError):
            return Ignored("signature", "its certificate or signature is not base64")
        try:
            proven = self._identity.check(der, member.agent, signature, signed_part(self._cluster, key, member))
        except IdentityRefused as exc:
            return Ignored("signature", str(exc)[:300])
        if member.name not in (proven.name, member.agent):
            return Ignored("signature", f"the entry names member {member.name!r}, its certificate {proven.uri} "
                                        "(a member registers under its own name or agent)")
        if (why := role_claim(proven, member.role)) is not None:
            return Ignored("role", f"the entry for {member.name!r}: {why}")
        return None
