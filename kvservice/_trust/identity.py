"""Member identities: each service's own key and an X.509 certificate from the cluster's
authority (docs/security.md "Member identities").

A member certificate names one member in one cluster with one role, as a SAN URI
``kvservice://<cluster>/<role>/<name>`` (``member_uri``); it is issued directly by the
cluster's CA, valid between its dates.  A service with an identity speaks under agent
names ``<name>-<12 hex>`` (``agent_of``), so the name a peer's certificate proves is the
one every claim of its agent name is checked against (``Identity.check``).

In the handshake each side signs the link's transcript, with a role label and both
certificates' digests, under its member key (``Identity.sign``); the other side checks
the chain, the cluster, the dates, the agent name and the signature.  A role is what the
certificate says, wherever a member claims one: a claim of another (a service configured
with another ``discovery_role``, an etcd registration, an SGLang rank's) is refused
(``role_claim``), so a member certified "decode" cannot act as a "prefill".  Ed25519, ECDSA
(P-256/384/521, SHA-256/384/512) and RSA (PSS, SHA-256) member keys are understood;
``kvservice keygen ca`` and ``issue`` make Ed25519 ones (``_trust.authority``).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import re
from dataclasses import dataclass
from urllib.parse import urlsplit

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, padding, rsa

from .._results import ConfigError, ProtocolError
from .keys import load_key

SCHEME = "kvservice"
#: a cluster's, a role's or a member's name: what ``agent_prefix`` allows, at most 63 long
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9-]{0,62}")
#: the suffix a service adds to its member name to make each incarnation's agent name
_AGENT_SUFFIX = re.compile(r"-[0-9a-f]{12}")
#: the largest handshake frame that carries a certificate (a peer's Hello or Proof); a
#: certificate beyond it is not a member's
IDENTITY_FRAME_BYTES = 8192
MAX_CERT_BYTES = 6144
MAX_SIGNATURE_BYTES = 1024
#: refusal kinds (counted in ``status()["refused"]``): a certificate or signature that does
#: not check out; a peer that proves no identity to a service that requires one
IDENTITY = "identity"
NO_IDENTITY = "identity_missing"
#: a claim of a role the member's certificate does not name
ROLE = "identity_role"
#: a peer proving another member than the one named at its address (``_control.named``)
MEMBER = "identity_member"
_LABEL = b"kvservice-member-v1 "


class IdentityRefused(ProtocolError):
    """A peer's member identity did not check out (``kind``: ``IDENTITY`` or ``NO_IDENTITY``)."""


@dataclass(frozen=True, slots=True)
class Member:
    """Who a certificate names."""

    cluster: str
    role: str
    name: str
    not_after: dt.datetime
    serial: int = 0  #: the certificate's serial number (what a revocation list names)

    @property
    def uri(self) -> str:
        return member_uri(self.cluster, self.role, self.name)


def member_uri(cluster: str, role: str, name: str) -> str:
    for what, value in (("cluster", cluster), ("role", role), ("name", name)):
        if not NAME.fullmatch(value):
            raise ValueError(f"member {what} {value[:80]!r} is not 1-63 of [A-Za-z0-9-] (starting with one "
                             "of [A-Za-z0-9])")
    return f"{SCHEME}://{cluster}/{role}/{name}"


def role_claim(member: Member, role: str) -> str | None:
    """Why ``member`` may not claim ``role`` (``None``: it may).  An empty role claims none."""
    if not role or role == member.role:
        return None
    return (f"it claims role {role[:64]!r}, but its certificate for {member.uri} names role {member.role!r} "
            "(a member acts only in the role its certificate names)")


def agent_of(member: str, agent: str) -> bool:
    """Whether ``agent`` is a name a service of ``member`` speaks under."""
    return agent.startswith(member) and _AGENT_SUFFIX.fullmatch(agent[len(member):]) is not None


def member_of(cert: x509.Certificate) -> Member:
    """The member ``cert`` names; ``ValueError`` saying why when it names none (or two)."""
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound as exc:
        raise ValueError("the certificate has no subject alternative name") from exc
    uris = [u for u in san.get_values_for_type(x509.UniformResourceIdentifier) if u.startswith(f"{SCHEME}:")]
    if len(uris) != 1:
        raise ValueError(f"the certificate names {len(uris)} kvservice members (a member certificate "
                         f"names one, as a SAN URI {SCHEME}://<cluster>/<role>/<name>)")
    parts = urlsplit(uris[0])
    path = parts.path.split("/")
    if parts.netloc == "" or len(path) != 3 or path[0] != "" or parts.query or parts.fragment:
        raise ValueError(f"the certificate's member URI {uris[0][:120]!r} is not "
                         f"{SCHEME}://<cluster>/<role>/<name>")
    member = Member(parts.netloc, path[1], path[2], cert.not_valid_after_utc, cert.serial_number)
    member_uri(member.cluster, member.role, member.name)  # each part's characters
    return member


def _verify_signature(cert: x509.Certificate, signature: bytes, data: bytes) -> None:
    """Raises ``InvalidSignature`` (or ``ValueError`` for a key of a kind not understood)."""
    key = cert.public_key()
    if isinstance(key, ed25519.Ed25519PublicKey):
        key.verify(signature, data)
    elif isinstance(key, ec.EllipticCurvePublicKey):
        key.verify(signature, data, ec.ECDSA(_ec_hash(key.curve)))
    elif isinstance(key, rsa.RSAPublicKey):
        key.verify(signature, data, padding.PSS(padding.MGF1(hashes.SHA256()), padding.PSS.DIGEST_LENGTH),
                   hashes.SHA256())
    else:
        raise ValueError(f"a member key of type {type(key).__name__} (Ed25519, ECDSA and RSA are understood)")


def _ec_hash(curve: ec.EllipticCurve) -> hashes.HashAlgorithm:
    return {384: hashes.SHA384(), 521: hashes.SHA512()}.get(curve.key_size, hashes.SHA256())


def signed_part(role: str, script: bytes, own_cert: bytes, peer_cert: bytes = b"") -> bytes:
    """What ``role``'s signature covers: the link's transcript (both nonces, both X25519
    shares, both agent names, the version), its own certificate and (the dialer's) the
    peer's, which the acceptor sends before it sees the dialer's."""
    return (_LABEL + role.encode() + b"\0" + hashlib.sha256(own_cert).digest()
            + hashlib.sha256(peer_cert).digest() + script)


@dataclass(frozen=True)
class Identity:
    """This service's member identity: its certificate, key and the cluster's CA."""

    cert: x509.Certificate
    der: bytes  # the certificate as sent
    key: ed25519.Ed25519PrivateKey | ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey
    ca: x509.Certificate
    member: Member

    def sign(self, data: bytes) -> bytes:
        key = self.key
        if isinstance(key, ed25519.Ed25519PrivateKey):
            return key.sign(data)
        if isinstance(key, ec.EllipticCurvePrivateKey):
            return key.sign(data, ec.ECDSA(_ec_hash(key.curve)))
        return key.sign(data, padding.PSS(padding.MGF1(hashes.SHA256()), padding.PSS.DIGEST_LENGTH),
                        hashes.SHA256())

    def check(self, der: bytes, agent: str | None, signature: bytes, data: bytes,
              now: dt.datetime | None = None) -> Member:
        """The member a peer speaking as ``agent`` proved with certificate ``der`` and
        ``signature`` over ``data``; ``IdentityRefused`` saying why not.  ``agent`` None: a
        claim no agent name comes with (a vLLM hand-off, signed by its prefill's scheduler)."""
        try:
            cert = x509.load_der_x509_certificate(der)
        except ValueError as exc:
            raise IdentityRefused(f"the peer's certificate does not parse: {exc}", IDENTITY) from exc
        try:
            member = member_of(cert)
            cert.verify_directly_issued_by(self.ca)
        except (ValueError, TypeError, InvalidSignature) as exc:
            raise IdentityRefused(f"the peer's certificate was not issued by this cluster's authority "
                                  f"({self.ca.subject.rfc4514_string()}): {exc or 'bad signature'}",
                                  IDENTITY) from exc
        now = now or dt.datetime.now(dt.UTC)
        if not cert.not_valid_before_utc <= now <= cert.not_valid_after_utc:
            raise IdentityRefused(f"the peer's certificate for {member.uri} is valid "
                                  f"{cert.not_valid_before_utc:%Y-%m-%d %H:%M} to "
                                  f"{cert.not_valid_after_utc:%Y-%m-%d %H:%M} UTC, not now", IDENTITY)
        if member.cluster != self.member.cluster:
            raise IdentityRefused(f"the peer's certificate is for cluster {member.cluster!r}, this service's "
                                  f"is {self.member.cluster!r}", IDENTITY)
        if agent is not None and not agent_of(member.name, agent):
            raise IdentityRefused(f"the peer speaks as agent {agent!r}, but its certificate names member "
                                  f"{member.name!r} (whose agents are {member.name}-<12 hex>)", IDENTITY)
        try:
            _verify_signature(cert, signature, data)
        except (InvalidSignature, ValueError) as exc:
            raise IdentityRefused(f"the peer's signature over the handshake does not verify under its "
                                  f"certificate for {member.uri}: {exc or 'not made by its key'}", IDENTITY) from exc
        return member


def load_identity(cert_file: str, key_file: str, ca_file: str, *, role: str = "") -> Identity:
    """This service's identity from its files; ``ConfigError`` naming the key and the
    problem otherwise (the key file is checked as ``auth_key_file`` is: private).  ``role``:
    the role this service is configured to claim (``discovery_role``; empty: none), which
    must be its certificate's."""
    ca = _load_cert(ca_file, "identity_ca_file")
    cert = _load_cert(cert_file, "identity_cert_file")
    pem = load_key(key_file, what="identity_key_file")
    try:
        key = serialization.load_pem_private_key(pem, password=None)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"identity_key_file: {key_file!r} is not an unencrypted PEM private key: {exc}") from exc
    if not isinstance(key, ed25519.Ed25519PrivateKey | ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey):
        raise ConfigError(f"identity_key_file: a key of type {type(key).__name__} (Ed25519, ECDSA and RSA "
                          "are understood)")
    try:
        member = member_of(cert)
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature) as exc:
        raise ConfigError(f"identity_cert_file: {cert_file!r} is not a member certificate issued by "
                          f"identity_ca_file {ca_file!r}: {exc or 'bad signature'}") from exc
    if key.public_key().public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo) \
            != cert.public_key().public_bytes(serialization.Encoding.DER,
                                              serialization.PublicFormat.SubjectPublicKeyInfo):
        raise ConfigError(f"identity_key_file: {key_file!r} is not the key of identity_cert_file {cert_file!r}")
    now = dt.datetime.now(dt.UTC)
    if not cert.not_valid_before_utc <= now <= cert.not_valid_after_utc:
        raise ConfigError(f"identity_cert_file: {cert_file!r} is valid {cert.not_valid_before_utc:%Y-%m-%d %H:%M} "
                          f"to {cert.not_valid_after_utc:%Y-%m-%d %H:%M} UTC, not now (issue a new one: "
                          "kvservice keygen issue)")
    if (why := role_claim(member, role)) is not None:
        raise ConfigError(f"discovery_role: {why}; set discovery_role = {member.role!r} or issue a certificate "
                          f"for role {role[:64]!r}")
    der = cert.public_bytes(serialization.Encoding.DER)
    if len(der) > MAX_CERT_BYTES:
        raise ConfigError(f"identity_cert_file: {len(der)} bytes in DER; a member certificate has at most "
                          f"{MAX_CERT_BYTES}")
    return Identity(cert, der, key, ca, member)


def _load_cert(path: str, what: str) -> x509.Certificate:
    try:
        with open(path, "rb") as f:
            data = f.read(64 * 1024)
    except OSError as exc:
        raise ConfigError(f"{what}: cannot read {path!r}: {exc.strerror or exc}") from exc
    try:
        return x509.load_pem_x509_certificate(data)
    except ValueError as exc:
        raise ConfigError(f"{what}: {path!r} is not a PEM certificate: {exc}") from exc
