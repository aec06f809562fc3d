"""A member's own pair read again while it runs (``_trust.rotation``), and
``kvservice keygen issue --force`` replacing the files by a rename.  Real services across a
rotation: tests/faults/test_rotation.py."""

from __future__ import annotations

import datetime as dt
import os
import shutil
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from kvservice._trust.authority import CA_CERT, issue, serial_of
from kvservice._trust.identity import load_identity
from kvservice._trust.rotation import IdentityWatch
from kvservice.keygen import main as keygen


def _watch(ca: str, days: int = 90) -> tuple[IdentityWatch, str, str]:
    cert, key = issue(ca, "decode", "d", ca, days=days)
    ca_file = os.path.join(ca, CA_CERT)
    return IdentityWatch(load_identity(cert, key, ca_file), cert, key, ca_file), cert, key


def _replace(src: str, dst: str) -> None:
    shutil.copy2(src, dst + ".new")
    os.replace(dst + ".new", dst)


def test_issue_force_replaces_each_file_by_a_rename(ca: str) -> None:
    """A service reading the files while they are issued again sees the old file or the
    new one, never one being written: each is a new inode, renamed in."""
    cert, key = issue(ca, "decode", "d", ca)
    before = os.stat(cert).st_ino, os.stat(key).st_ino
    assert keygen(["issue", ca, "--role", "decode", "--name", "d", "--force"]) == 0
    assert (os.stat(cert).st_ino, os.stat(key).st_ino) != before
    assert os.stat(cert).st_ino != before[0] and os.stat(key).st_ino != before[1]
    assert os.stat(key).st_mode & 0o777 == 0o600
    assert sorted(os.listdir(ca)) == sorted([CA_CERT, "ca.key", "d.crt", "d.key"])  # no file left behind
    load_identity(cert, key, os.path.join(ca, CA_CERT))


def test_a_rotated_pair_is_read_once(ca: str) -> None:
    watch, cert, _ = _watch(ca)
    assert watch.read() is None  # unchanged
    issue(ca, "decode", "d", ca, force=True)
    new = watch.read()
    assert new is not None and not isinstance(new, ValueError)
    assert new.member.serial == serial_of(cert)
    with capture_logs() as logs:
        assert watch.apply(new)
    assert watch.current is new
    assert [e["event"] for e in logs] == ["identity.rotated"]
    assert watch.read() is None  # in force: not read again


def test_a_pair_mixed_between_two_renames_waits_one_poll(ca: str, tmp_path: Path) -> None:
    """The key renamed in, the certificate not yet: looked at once more, then, when the
    certificate follows, put in force without a refusal."""
    watch, cert, key = _watch(ca)
    new_cert, new_key = issue(ca, "decode", "d", str(tmp_path))
    _replace(new_key, key)
    assert watch.read() is None  # mixed: the next poll decides
    _replace(new_cert, cert)
    new = watch.read()
    assert new is not None and not isinstance(new, ValueError) and new.member.serial == serial_of(new_cert)


def test_a_mixed_pair_left_so_is_refused_once(ca: str, tmp_path: Path) -> None:
    watch, _, key = _watch(ca)
    _, other_key = issue(ca, "decode", "d", str(tmp_path))
    _replace(other_key, key)
    assert watch.read() is None
    refused = watch.read()
    assert isinstance(refused, ValueError) and "is not the key of identity_cert_file" in str(refused)
    with capture_logs() as logs:
        assert not watch.apply(refused)
    assert [e["event"] for e in logs] == ["identity.rotation_refused"]
    assert [watch.read() for _ in range(3)] == [None] * 3  # once per change


@pytest.mark.parametrize(("role", "name", "days", "why"), [
    ("decode", "other", 90, "now names member kvservice://c1/decode/other"),
    ("prefill", "d", 90, "now names member kvservice://c1/prefill/d"),
    ("decode", "d", -1, "not now"),
])
def test_a_pair_of_another_member_or_expired_is_refused(ca: str, tmp_path: Path, role: str, name: str, days: int,
                                                        why: str) -> None:
    watch, cert, key = _watch(ca)
    start = dt.datetime.now(dt.UTC) - dt.timedelta(days=10) if days < 0 else None
    new_cert, new_key = issue(ca, role, name, str(tmp_path), days=abs(days) if days > 0 else 5, not_before=start)
    _replace(new_key, key)
    _replace(new_cert, cert)
    refused = watch.read()
    assert isinstance(refused, ValueError) and why in str(refused), refused
    assert watch.read() is None


def test_the_expiry_warning_follows_the_pair_in_force(ca: str) -> None:
    with capture_logs() as logs:
        watch, _, _ = _watch(ca, days=10)
    assert watch.warning is not None and "expires" in watch.warning
    assert [e["event"] for e in logs] == ["identity.expiring"]
    with capture_logs() as logs:
        assert watch.expiry() is not None  # still near its end: not logged again
    assert logs == []
    issue(ca, "decode", "d", ca, force=True, days=90)
    new = watch.read()
    assert new is not None and not isinstance(new, ValueError)
    with capture_logs() as logs:
        watch.apply(new)
        assert watch.expiry() is None
    assert [e["event"] for e in logs] == ["identity.rotated", "identity.expiry_cleared"]
