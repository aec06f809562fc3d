"""A small certificate authority for clusters without one (``kvservice keygen ca`` and
``issue``): Ed25519 keys, X.509 certificates any TLS tool reads.

``create_authority(DIR, cluster)`` writes ``DIR/ca.crt`` and ``DIR/ca.key`` (0600); the
CA's subject names the cluster.  ``issue(DIR, role, name, OUT)`` writes a member's
``OUT/<name>.crt`` and ``OUT/<name>.key`` (0600), the certificate naming
``kvservice://<cluster>/<role>/<name>`` (``identity.member_uri``).  Rotation is issuing
again (``force``: each file written new and renamed over the old, the key first): a
running service puts the new pair in force once both changed (``rotation``).  ``revoke(DIR, serials)`` adds
certificates to the cluster's revocation list ``DIR/revoked.crl`` (a CRL the CA signs;
services with ``revoked_file`` read it again when it changes: ``_trust.revocation``).  Key files are created with
``O_EXCL`` (never overwritten unless ``force``) and never through a symbolic link.
"""

from __future__ import annotations

import datetime as dt
import os

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519
from cryptography.x509.oid import NameOID

from .identity import member_uri
from .keys import KEY_FILE_MODE, load_key
from .revocation import parse_revocations

CA_CERT = "ca.crt"
CA_KEY = "ca.key"
#: a certificate is valid from this long before it is issued (clocks of a cluster differ)
_BACKDATE = dt.timedelta(minutes=5)


def _write(path: str, data: bytes, *, private: bool, force: bool) -> None:
    flags = os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | (os.O_TRUNC if force else os.O_EXCL)
    mode = KEY_FILE_MODE if private else 0o644
    fd = os.open(path, flags, mode)
    try:
        os.fchmod(fd, mode)
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def _put(path: str, data: bytes, *, private: bool, force: bool) -> None:
    """``path`` written whole: new (``O_EXCL``), or with ``force`` written to a new file and
    renamed over the old, so a service watching it never reads half (``rotation``)."""
    if not force:
        _write(path, data, private=private, force=False)
        return
    tmp = f"{path}.{os.getpid()}.tmp"
    _write(tmp, data, private=private, force=True)
    os.replace(tmp, path)


def _pem_key(key: ed25519.Ed25519PrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def create_authority(directory: str, cluster: str, *, days: int = 3650, force: bool = False) -> str:
    """A new CA for ``cluster`` in ``directory``; its certificate's path."""
    member_uri(cluster, "ca", "ca")  # the cluster's characters
    key = ed25519.Ed25519PrivateKey.generate()
    name = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "kvservice"),
                      x509.NameAttribute(NameOID.COMMON_NAME, f"kvservice cluster {cluster} CA")])
    now = dt.datetime.now(dt.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - _BACKDATE)
            .not_valid_after(now + dt.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                         crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectAlternativeName([x509.UniformResourceIdentifier(f"kvservice://{cluster}")]),
                           critical=False)
            .sign(key, None))
    _put(os.path.join(directory, CA_KEY), _pem_key(key), private=True, force=force)
    path = os.path.join(directory, CA_CERT)
    _put(path, cert.public_bytes(serialization.Encoding.PEM), private=False, force=force)
    return path


def cluster_of(ca: x509.Certificate) -> str:
    """The cluster a CA made by ``create_authority`` is for."""
    san = ca.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    for uri in san.get_values_for_type(x509.UniformResourceIdentifier):
        if uri.startswith("kvservice://"):
            return uri.removeprefix("kvservice://")
    raise ValueError("the CA names no kvservice cluster")


def _load_ca(directory: str) -> tuple[x509.Certificate, ed25519.Ed25519PrivateKey]:
    """The CA's certificate and key in ``directory``; ``ValueError`` if the key is not Ed25519."""
    with open(os.path.join(directory, CA_CERT), "rb") as f:
        ca = x509.load_pem_x509_certificate(f.read())
    ca_key = serialization.load_pem_private_key(load_key(os.path.join(directory, CA_KEY), what="the CA's key"),
                                                None)
    if not isinstance(ca_key, ed25519.Ed25519PrivateKey):
        raise ValueError("the CA's key is not an Ed25519 key (this authority makes only those)")
    return ca, ca_key


def issue(directory: str, role: str, name: str, out: str, *, days: int = 90, force: bool = False,
          not_before: dt.datetime | None = None) -> tuple[str, str]:
    """A member's key and certificate from the CA in ``directory``, written to ``out``:
    (certificate path, key path).  ``not_before``: backdate or postdate (tests)."""
    ca, ca_key = _load_ca(directory)
    uri = member_uri(cluster_of(ca), role, name)
    key = ed25519.Ed25519PrivateKey.generate()
    start = not_before or dt.datetime.now(dt.UTC) - _BACKDATE
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(ca.subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(start)
            .not_valid_after(start + dt.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.SubjectAlternativeName([x509.UniformResourceIdentifier(uri)]), critical=False)
            .sign(ca_key, None))
    cert_path, key_path = os.path.join(out, f"{name}.crt"), os.path.join(out, f"{name}.key")
    _put(key_path, _pem_key(key), private=True, force=force)
    _put(cert_path, cert.public_bytes(serialization.Encoding.PEM), private=False, force=force)
    return cert_path, key_path


#: the revocation list ``revoke`` writes in the authority's directory unless told otherwise
REVOKED_LIST = "revoked.crl"


def revoke(directory: str, serials: list[int], out: str | None = None, *, days: int = 365) -> tuple[str, int]:
    """Add ``serials`` to the cluster's revocation list (a CRL signed by the CA in
    ``directory``, written to ``out``, default ``DIR/revoked.crl``; the entries of the
    list already there are kept once it checks out): (its path, how many it revokes).
    Written to a new file then renamed over the old, so a service never reads half."""
    ca, ca_key = _load_ca(directory)
    path = out or os.path.join(directory, REVOKED_LIST)
    now = dt.datetime.now(dt.UTC)
    entries: dict[int, dt.datetime] = {}
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        pass
    else:
        parse_revocations(data, ca)  # raises: a list not ours is not extended
        old = x509.load_pem_x509_crl(data) if data.lstrip().startswith(b"-----") else x509.load_der_x509_crl(data)
        entries = {e.serial_number: e.revocation_date_utc for e in old}
    for serial in serials:
        if serial <= 0:
            raise ValueError(f"serial {serial} is not a certificate serial number (positive)")
        entries.setdefault(serial, now)
    builder = (x509.CertificateRevocationListBuilder().issuer_name(ca.subject).last_update(now)
               .next_update(now + dt.timedelta(days=days)))
    for serial, when in sorted(entries.items()):
        builder = builder.add_revoked_certificate(
            x509.RevokedCertificateBuilder().serial_number(serial).revocation_date(when).build())
    crl = builder.sign(ca_key, None)
    _put(path, crl.public_bytes(serialization.Encoding.PEM), private=False, force=True)
    return path, len(entries)


def serial_of(cert_file: str) -> int:
    """The serial number of the certificate in ``cert_file`` (PEM)."""
    with open(cert_file, "rb") as f:
        return x509.load_pem_x509_certificate(f.read()).serial_number
