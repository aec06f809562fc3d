"""The sidecar under test: a worker process on the public ``SidecarClient`` API.

``python -m kvservice.bench.sidecar_side send|recv CONFIG`` is ``kvservice.bench.kv_side``
(the same JSON lines, the same sender and receiver, the same loop-lag ticker)
with a ``SidecarClient`` in place of the ``TransferService``: the service runs
in a ``kvservice serve`` daemon (``CONFIG["socket"]``), and this process holds
only the client, its Unix socket and a mapping of the daemon's shared KV pool.
The sender's worker writes its payload into that pool before the first run, as
an engine writes its KV pages.

An arrival counts when the receiving worker learns of it (the daemon's result
has crossed the socket), not when its daemon saw it: end to end, as the decode
engine sees it.
"""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager
from typing import Any

from kvservice import SidecarClient
from kvservice.bench import kv_side


def open_client(cfg: dict[str, Any]) -> AbstractAsyncContextManager[Any]:
    """A connection to this side's daemon, configured as an engine's would be (defaults)."""
    return SidecarClient(cfg["socket"])


if __name__ == "__main__":
    kv_side.main(open_client, seen_at_return=True)
