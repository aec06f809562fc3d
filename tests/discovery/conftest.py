"""The discovery tests run a real etcd (``etcd_server``) and need the etcd client."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from .etcd_server import EtcdServer, etcd_server


def _client_missing() -> str | None:
    try:
        import aetcd  # noqa: F401
    except ImportError:
        return "the etcd client is not installed (pip install 'kvservice[etcd]')"
    return None


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[EtcdServer]:
    missing = _client_missing()
    if missing is not None:
        if os.environ.get("CI"):
            pytest.fail(missing)
        pytest.skip(missing)
    with etcd_server(tmp_path) as server:
        yield server
