"""``tests.helpers.free_port``: tests running in parallel (xdist workers, other runs) are never
given the same port while it may still be in use."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import pytest

from tests import helpers


@pytest.fixture
def given(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(helpers, "_PORTS_GIVEN", tmp_path)
    return tmp_path


def test_a_port_is_given_once_until_its_claim_is_stale(given: Path) -> None:
    assert helpers._claim(20001)
    assert not helpers._claim(20001)  # another worker asking now
    old = time.time() - helpers._PORT_HELD_S - 1
    os.utime(given / "20001", (old, old))
    assert helpers._claim(20001)  # stale: given again, and claimed afresh
    assert not helpers._claim(20001)
    assert sorted(p.name for p in given.iterdir()) == ["20001"]


def test_free_port_gives_a_bindable_port_nobody_else_was_given(given: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(helpers, "_PORTS", range(20000, 32000))
    ports = [helpers.free_port() for _ in range(20)]
    assert len(set(ports)) == 20
    assert sorted(int(p.name) for p in given.iterdir()) == sorted(ports)
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[0]))  # nobody listens on it


def test_free_port_fails_when_every_port_was_given(given: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(helpers, "_PORTS", range(20000, 20003))
    for port in range(20000, 20003):
        assert helpers._claim(port)
    with pytest.raises(RuntimeError, match="no free port"):
        helpers.free_port()
