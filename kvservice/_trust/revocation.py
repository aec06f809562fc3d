"""Revoked member certificates (docs/security.md "Revocation"): a standard X.509 CRL,
signed by the cluster's authority, naming revoked certificates by serial number
(``kvservice keygen revoke`` writes and extends one: ``_trust.authority.revoke``).

A service with ``revoked_file`` loads the list when it starts (a list that does not
parse, or that the cluster's CA did not sign, is a ``ConfigError`` there), refuses a
handshake from a member whose certificate is on it (``REVOKED``, counted in
``status()["refused"]``), and polls the file's ``stat`` every ``POLL_S`` seconds: when it
changed, the list is read again (at most ``MAX_LIST_BYTES``, in a worker thread) and,
once it checks out, replaces the one in force; the links of members it revokes are then
closed (``_control.plane``).  A changed list that does not check out is logged, counted
(``LIST_REFUSED``) and ignored: the last good one stays in force.
"""

from __future__ import annotations

import datetime as dt
import os
from dataclasses import dataclass

from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa

from .._log import get_logger
from .._results import ConfigError
from .identity import IdentityRefused, Member

log = get_logger("kvservice")

#: refusal kinds: a handshake of a revoked member, or a link of one closed; a changed
#: revocation list refused (kept the last good one)
REVOKED = "identity_revoked"
LIST_REFUSED = "revocation_list"
#: how often the list's file (and the service's own certificate and key: ``rotation``) is
#: looked at (a ``stat``; read again only when it changed)
POLL_S = 2.0
#: the largest list read (about 30 000 revoked serials in DER)
MAX_LIST_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class Revocations:
    """A revocation list that checked out: the serials it revokes, when it was issued."""

    serials: frozenset[int]
    issued: dt.datetime

    def refusal(self, member: Member) -> IdentityRefused | None:
        """Why ``member`` may not link (``None``: it may)."""
        if member.serial not in self.serials:
            return None
        return IdentityRefused(
            f"member {member.uri} is revoked: its certificate (serial {member.serial:x}) is on the cluster's "
            f"revocation list of {self.issued:%Y-%m-%d %H:%M:%S} UTC", REVOKED)


def parse_revocations(data: bytes, ca: x509.Certificate) -> Revocations:
    """The list in ``data`` (PEM or DER); ``ValueError`` saying why it is not one the
    cluster's authority ``ca`` signed."""
    if len(data) > MAX_LIST_BYTES:
        raise ValueError(f"it is larger than {MAX_LIST_BYTES} bytes")
    try:
        crl = (x509.load_pem_x509_crl(data) if data.lstrip().startswith(b"-----")
               else x509.load_der_x509_crl(data))
    except ValueError as exc:
        raise ValueError(f"it is not an X.509 revocation list (CRL), PEM or DER: {exc}") from exc
    key = ca.public_key()
    if not isinstance(key, ed25519.Ed25519PublicKey | ec.EllipticCurvePublicKey | rsa.RSAPublicKey):
        raise ValueError(f"the cluster's CA has a key of type {type(key).__name__}, which cannot sign a list")
    if crl.issuer != ca.subject or not crl.is_signature_valid(key):
        raise ValueError(f"it is not signed by the cluster's authority ({ca.subject.rfc4514_string()}); "
                         f"its issuer says {crl.issuer.rfc4514_string()}")
    return Revocations(frozenset(entry.serial_number for entry in crl), crl.last_update_utc)


#: what says a file changed: its inode (a rename puts a new one in place), size and times
Stamp = tuple[int, int, int, int]


def _stamp(st: os.stat_result) -> Stamp:
    return st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def stamp_of(path: str) -> Stamp | None:
    """``path``'s stamp (``None``: it cannot be looked at)."""
    try:
        return _stamp(os.stat(path))
    except OSError:
        return None


class RevocationWatch:
    """``revoked_file`` as this service holds it: the list in force, and its file watched."""

    def __init__(self, path: str, ca: x509.Certificate) -> None:
        self.path = path
        self._ca = ca
        self._stamp: Stamp | None = None
        loaded = self.read()
        if isinstance(loaded, ValueError):
            raise ConfigError(f"revoked_file: {path!r} {loaded}")
        assert loaded is not None  # nothing read before: never "unchanged"
        self.current: Revocations = loaded[0]
        self._stamp = loaded[1]
        log.info("identity.revocations_loaded", file=path, revoked=len(self.current.serials),
                 issued=self.current.issued.isoformat())

    def read(self) -> tuple[Revocations, Stamp] | ValueError | None:
        """The file's list when it changed since the last read (``None``: unchanged;
        a ``ValueError`` saying why it does not check out).  File I/O: a worker thread's."""
        try:
            with open(self.path, "rb") as f:
                stamp = _stamp(os.fstat(f.fileno()))
                if stamp == self._stamp:
                    return None
                data = f.read(MAX_LIST_BYTES + 1)
        except OSError as exc:
            return ValueError(f"cannot be read: {exc.strerror or exc}")
        try:
            return parse_revocations(data, self._ca), stamp
        except ValueError as exc:
            self._stamp = stamp  # refused once, not again each poll
            return exc

    def apply(self, loaded: tuple[Revocations, Stamp] | ValueError | None) -> bool:
        """Put what ``read`` returned in force; whether a new list now is.  A list that
        did not check out is logged and left (the caller counts it)."""
        if loaded is None:
            return False
        if isinstance(loaded, ValueError):
            log.error("identity.revocations_refused", file=self.path, why=str(loaded),
                      kept_issued=self.current.issued.isoformat())
            return False
        self.current, self._stamp = loaded
        log.warning("identity.revocations_changed", file=self.path, revoked=len(self.current.serials),
                    issued=self.current.issued.isoformat())
        return True


#: a service's own certificate this close to its end is warned of (log and status)
EXPIRY_WARNING = dt.timedelta(days=14)


def expiry_warning(member: Member, now: dt.datetime | None = None) -> str | None:
    """What to warn of when ``member``'s (this service's own) certificate ends within
    ``EXPIRY_WARNING`` (``None``: not yet)."""
    left = member.not_after - (now or dt.datetime.now(dt.UTC))
    if left > EXPIRY_WARNING:
        return None
    return (f"this service's certificate for {member.uri} expires {member.not_after:%Y-%m-%d %H:%M} UTC, in "
            f"{max(left.total_seconds(), 0) / 86400:.1f} days: issue a new one before then (kvservice keygen issue "
            "--force; the service puts it in force when its files change), or peers will refuse it")
