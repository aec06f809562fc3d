"""The suite's door to ``kvservice.testing.netns`` (namespaces joined by a veth, cut by
link down or by dropping every packet; see there), and ``require``: skip a test, saying
why, where namespaces cannot be used here."""

from __future__ import annotations

import os

import pytest

from kvservice.testing.netns import Host, NetnsError, Wire, _run, delete, existing, unavailable, wire

__all__ = ["Host", "NetnsError", "Wire", "_run", "delete", "existing", "require", "unavailable", "wire"]


def require() -> None:
    """Skip the calling test, saying why, where namespaces cannot be used here; fail it
    instead when ``KVSERVICE_REQUIRE_NETNS`` is set (a CI machine that must run them)."""
    why = unavailable()
    if why is not None:
        if os.environ.get("KVSERVICE_REQUIRE_NETNS"):
            pytest.fail(f"KVSERVICE_REQUIRE_NETNS is set, but {why}")
        pytest.skip(why)
