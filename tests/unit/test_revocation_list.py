"""The cluster's revocation list on disk: ``kvservice keygen revoke``, what a service
refuses to start with and how it reads a changed list (``_trust.revocation``); an own
certificate near its end.  Real services refusing and dropping revoked members:
tests/faults/test_revocation.py."""

from __future__ import annotations

import datetime as dt
import os
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509

from kvservice import ServiceConfig
from kvservice._results import ConfigError
from kvservice._trust.authority import CA_CERT, REVOKED_LIST, create_authority, issue, revoke, serial_of
from kvservice._trust.identity import Member, member_of
from kvservice._trust.keys import generate_key
from kvservice._trust.revocation import (
    MAX_LIST_BYTES,
    REVOKED,
    RevocationWatch,
    expiry_warning,
    parse_revocations,
)
from kvservice.keygen import main as keygen


def _ca(folder: str) -> x509.Certificate:
    return x509.load_pem_x509_certificate(Path(folder, CA_CERT).read_bytes())


def _member(cert: str) -> Member:
    return member_of(x509.load_pem_x509_certificate(Path(cert).read_bytes()))


def test_keygen_revoke_writes_and_extends_the_list(ca: str, capsys: pytest.CaptureFixture[str]) -> None:
    a, _ = issue(ca, "prefill", "a", ca)
    b, _ = issue(ca, "decode", "b", ca)
    listed = os.path.join(ca, REVOKED_LIST)
    assert keygen(["revoke", ca]) == 2  # nothing named
    assert keygen(["revoke", ca, "--cert", a]) == 0
    assert "revokes 1 certificates" in capsys.readouterr().out
    assert keygen(["revoke", ca, "--serial", f"{serial_of(b):x}"]) == 0  # extended, not replaced
    revoked = parse_revocations(Path(listed).read_bytes(), _ca(ca))
    assert revoked.serials == {serial_of(a), serial_of(b)}
    refusal = revoked.refusal(_member(a))
    assert refusal is not None and refusal.kind == REVOKED
    assert "member kvservice://c1/prefill/a is revoked" in str(refusal)
    c, _ = issue(ca, "prefill", "c", ca)
    assert revoked.refusal(_member(c)) is None
    assert keygen(["revoke", ca, "--serial", "zz"]) == 2
    assert keygen(["revoke", ca, "--cert", os.path.join(ca, "missing.crt")]) == 1
    # a list another authority signed is never extended (nor would a service read it)
    other = os.path.join(os.path.dirname(ca), "other")
    os.mkdir(other)
    create_authority(other, "c1")
    assert keygen(["revoke", other, "--cert", c, "--out", listed]) == 1
    assert "not signed by the cluster's authority" in capsys.readouterr().err
    assert parse_revocations(Path(listed).read_bytes(), _ca(ca)).serials == {serial_of(a), serial_of(b)}


def test_a_list_not_the_authoritys_is_refused(ca: str, tmp_path: Path) -> None:
    other = str(tmp_path / "other")
    os.mkdir(other)
    create_authority(other, "c1")  # the same cluster's name, another key
    forged, _ = revoke(other, [12345])
    with pytest.raises(ValueError, match="not signed by the cluster's authority"):
        parse_revocations(Path(forged).read_bytes(), _ca(ca))
    for garbage in (b"", b"garbage", b"-----BEGIN X509 CRL-----\nAAAA\n-----END X509 CRL-----\n"):
        with pytest.raises(ValueError, match=r"not an X\.509 revocation list"):
            parse_revocations(garbage, _ca(ca))
    with pytest.raises(ValueError, match="larger than"):
        parse_revocations(b"0" * (MAX_LIST_BYTES + 1), _ca(ca))


def _config(ca: str, tmp_path: Path, **kw: Any) -> ServiceConfig:
    cert, key = issue(ca, "decode", "decode-0", ca, force=True)
    cluster_key = str(tmp_path / "cluster.key")
    if not os.path.exists(cluster_key):
        generate_key(cluster_key)
    return ServiceConfig(auth_key_file=cluster_key, identity_cert_file=cert, identity_key_file=key,
                         identity_ca_file=os.path.join(ca, CA_CERT), **kw)


def test_a_service_refuses_to_start_with_a_bad_list(ca: str, tmp_path: Path) -> None:
    good, _ = revoke(ca, [])
    assert _config(ca, tmp_path, revoked_file=good).revoked_file == good
    with pytest.raises(ConfigError, match=r"revoked_file: .* needs this service's identity"):
        ServiceConfig(auth_key_file=_config(ca, tmp_path).auth_key_file, revoked_file=good)
    with pytest.raises(ConfigError, match=r"revoked_file: .* cannot be read"):
        _config(ca, tmp_path, revoked_file=str(tmp_path / "missing.crl"))
    other = str(tmp_path / "other")
    os.mkdir(other)
    create_authority(other, "c1")
    forged, _ = revoke(other, [])
    with pytest.raises(ConfigError, match=r"revoked_file: .* not signed by the cluster's authority"):
        _config(ca, tmp_path, revoked_file=forged)


def test_a_changed_list_is_read_again_and_a_bad_one_ignored(ca: str, tmp_path: Path) -> None:
    path, _ = revoke(ca, [])
    watch = RevocationWatch(path, _ca(ca))
    assert watch.current.serials == frozenset()
    assert watch.apply(watch.read()) is False  # unchanged: not read
    revoke(ca, [7])
    assert watch.apply(watch.read()) is True and watch.current.serials == {7}
    good = Path(path).read_bytes()
    Path(path).write_bytes(b"garbage")
    bad = watch.read()
    assert isinstance(bad, ValueError) and "not an X.509 revocation list" in str(bad)
    assert watch.apply(bad) is False and watch.current.serials == {7}  # the last good one stays
    assert watch.read() is None  # a refused file is refused once, not again each poll
    other = str(tmp_path / "other")
    os.mkdir(other)
    create_authority(other, "c1")
    forged, _ = revoke(other, [7, 8], os.path.join(other, "forged.crl"))
    os.replace(forged, path)
    assert isinstance(watch.read(), ValueError) and watch.current.serials == {7}
    Path(path).write_bytes(good)
    revoke(ca, [8])
    assert watch.apply(watch.read()) is True and watch.current.serials == {7, 8}
    os.remove(path)
    gone = watch.read()
    assert isinstance(gone, ValueError) and "cannot be read" in str(gone)
    assert watch.apply(gone) is False and watch.current.serials == {7, 8}


def test_an_own_certificate_near_its_end_is_warned_of(ca: str) -> None:
    now = dt.datetime.now(dt.UTC)
    soon, _ = issue(ca, "decode", "soon", ca, days=10)
    later, _ = issue(ca, "decode", "later", ca, days=90)
    warning = expiry_warning(_member(soon), now)
    assert warning is not None and "kvservice://c1/decode/soon expires" in warning and "keygen issue" in warning
    assert expiry_warning(_member(later), now) is None
    assert expiry_warning(_member(later), now + dt.timedelta(days=80)) is not None
