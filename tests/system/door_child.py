"""A bare NIXL door in a child process: prints its metadata, then waits.

Used to drive ``NixlDoor`` against a real remote agent that the test can kill."""

from __future__ import annotations

import json
import select
import sys
import time

from kvservice._nixl.agent import NixlDoor
from kvservice.memory._pool import KVPool
from tests.helpers import LOOPBACK_UCX, SMALL, register_pool


def main() -> None:
    door = NixlDoor("door-child", progress_thread=False, ucx_env=LOOPBACK_UCX)
    pool = KVPool(SMALL)
    register_pool(door, pool)
    sys.stdout.write(json.dumps({"metadata": door.metadata().hex(), "base": pool.base_addr}) + "\n")
    sys.stdout.flush()
    # Drive NIXL progress (this agent runs without a progress thread) until the
    # parent closes stdin or kills us; bounded in time whatever happens.
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        door.notifs()
        readable, _, _ = select.select([sys.stdin], [], [], 0.0005)
        if readable and not sys.stdin.readline():
            break
    door.close()


if __name__ == "__main__":
    main()
