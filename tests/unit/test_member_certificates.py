"""Member identities on disk: ``kvservice keygen ca`` / ``issue`` and what a service
refuses to start with (``_trust.identity.load_identity``, ``ServiceConfig``).  The
handshake's checks run against real services in tests/faults/test_member_identity.py."""

from __future__ import annotations

import datetime as dt
import os
import stat
from pathlib import Path
from typing import Any

import pytest

from kvservice import ServiceConfig
from kvservice._results import ConfigError
from kvservice._trust.authority import CA_CERT, create_authority, issue
from kvservice._trust.identity import agent_of, load_identity, member_uri, signed_part
from kvservice._trust.keys import generate_key
from kvservice.keygen import main as keygen


def test_keygen_makes_an_authority_and_members_it_rotates(ca: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert stat.S_IMODE(os.stat(os.path.join(ca, "ca.key")).st_mode) == 0o600
    assert keygen(["issue", ca, "--role", "prefill", "--name", "prefill-0"]) == 0
    assert stat.S_IMODE(os.stat(os.path.join(ca, "prefill-0.key")).st_mode) == 0o600
    first = load_identity(os.path.join(ca, "prefill-0.crt"), os.path.join(ca, "prefill-0.key"),
                          os.path.join(ca, CA_CERT))
    assert first.member.uri == "kvservice://c1/prefill/prefill-0"
    assert keygen(["issue", ca, "--role", "prefill", "--name", "prefill-0"]) == 2  # never overwritten
    assert "--force" in capsys.readouterr().err
    assert keygen(["issue", ca, "--role", "prefill", "--name", "prefill-0", "--force"]) == 0  # rotated
    second = load_identity(os.path.join(ca, "prefill-0.crt"), os.path.join(ca, "prefill-0.key"),
                           os.path.join(ca, CA_CERT))
    assert second.der != first.der and second.member.uri == first.member.uri
    assert keygen(["issue", ca, "--role", "prefill", "--name", "no/slash"]) == 1
    assert keygen(["ca", ca, "--cluster", "c1"]) == 2  # an authority is never replaced unasked


def test_names_and_agents() -> None:
    assert agent_of("prefill-0", "prefill-0-0123456789ab")
    for agent in ("prefill-0", "prefill-0-0123456789abc", "prefill-00-0123456789ab", "prefill-0-0123456789AB",
                  "prefill-1-0123456789ab", "xprefill-0-0123456789ab"):
        assert not agent_of("prefill-0", agent), agent
    for bad in ("", "a/b", "a b", "-a", "x" * 64):
        with pytest.raises(ValueError):
            member_uri("c1", "prefill", bad)
    assert signed_part("dialer", b"t", b"a", b"b") != signed_part("acceptor", b"t", b"a", b"b")
    assert signed_part("dialer", b"t", b"a", b"b") != signed_part("dialer", b"t", b"b", b"a")


def test_a_service_refuses_identity_files_that_do_not_hold_together(ca: str, tmp_path: Path) -> None:
    cert, key = issue(ca, "decode", "decode-0", ca)
    ca_cert = os.path.join(ca, CA_CERT)
    cluster_key = str(tmp_path / "cluster.key")
    generate_key(cluster_key)
    good: dict[str, Any] = {"auth_key_file": cluster_key, "identity_cert_file": cert, "identity_key_file": key,
            "identity_ca_file": ca_cert}
    assert ServiceConfig(**good).agent_base == "decode-0"
    assert ServiceConfig(auth_key_file=cluster_key).agent_base == "kvservice"
    with pytest.raises(ConfigError, match="set all three or none"):
        ServiceConfig(**{**good, "identity_ca_file": None})
    other = str(tmp_path / "other")
    os.mkdir(other)
    create_authority(other, "c1")
    _, other_key = issue(other, "decode", "decode-0", other)
    with pytest.raises(ConfigError, match="is not the key of identity_cert_file"):
        ServiceConfig(**{**good, "identity_key_file": other_key})
    with pytest.raises(ConfigError, match="not a member certificate issued by identity_ca_file"):
        ServiceConfig(**{**good, "identity_ca_file": os.path.join(other, CA_CERT)})
    os.chmod(key, 0o644)
    with pytest.raises(ConfigError, match=r"identity_key_file: .* accessible by group or others"):
        ServiceConfig(**good)
    os.chmod(key, 0o600)
    old_cert, old_key = issue(ca, "decode", "old", ca, days=1,
                              not_before=dt.datetime.now(dt.UTC) - dt.timedelta(days=3))
    with pytest.raises(ConfigError, match="not now"):
        ServiceConfig(**{**good, "identity_cert_file": old_cert, "identity_key_file": old_key})
    with pytest.raises(ConfigError, match="identity_cert_file: cannot read"):
        ServiceConfig(**{**good, "identity_cert_file": str(tmp_path / "missing.crt")})
    with pytest.raises(ConfigError, match="needs a key"):
        ServiceConfig(**{**good, "auth_key_file": None, "allow_unauthenticated": True})
