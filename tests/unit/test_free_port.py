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
    # every port given was claimed first; a claimed port may also be one found in use (by a
    # test running beside this one) and skipped, never given
    claimed = {int(p.name) for p in given.iterdir()}
    assert set(ports) <= claimed
    assert all(helpers._claim(port) is False for port in ports)  # nobody is given them again
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[0]))  # nobody listens on it


def test_free_port_fails_when_every_port_was_given(given: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(helpers, "_PORTS", range(20000, 20003))
    for port in range(20000, 20003):
        assert helpers._claim(port)
    with pytest.raises(RuntimeError, match="no free port"):
        helpers.free_port()


def test_free_port_never_gives_a_port_something_listens_on(given: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        taken = listener.getsockname()[1]
        monkeypatch.setattr(helpers, "_PORTS", range(taken, taken + 1))
        with pytest.raises(RuntimeError, match="no free port"):
            helpers.free_port()
    assert [p.name for p in given.iterdir()] == [str(taken)]  # claimed, found in use, skipped
