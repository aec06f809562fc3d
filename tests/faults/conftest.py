"""Fixtures the fault tests share: the cluster key a test's services hold, and two network
namespaces joined by a veth (``netns.wire``) for the tests that cut or break the network."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvservice._trust.keys import generate_key
from tests.faults import netns
from tests.faults.netns import Wire


@pytest.fixture
def key_file(tmp_path: Path) -> str:
    path = tmp_path / "cluster.key"
    generate_key(path)  # 32 random bytes as hex, mode 0600: what `kvservice keygen` writes
    return str(path)


@pytest.fixture(scope="module")
def namespaces_usable() -> None:
    netns.require()


@pytest.fixture
def link(namespaces_usable: None) -> Iterator[Wire]:
    """Two namespaces joined by a veth, removed after the test (checked)."""
    with netns.wire() as w:
        yield w
    assert not netns.existing(w.a.netns) and not netns.existing(w.b.netns)
