"""A worker process for the disconnect tests: ``python -m tests.sidecar.worker SOCKET RID PAGE...``.

Connects, writes the request's pattern into the pages, sends them as the first
chunk (``last=False``, so the request stays open), prints ``sent``, then idles
(at most 120 s) until the test SIGKILLs it.
"""

from __future__ import annotations

import sys

import anyio

from kvservice import SidecarClient
from kvservice.testing import pattern


async def main(socket_path: str, rid: str, pages: list[int]) -> None:
    async with SidecarClient(socket_path, name="doomed-worker") as svc:
        svc.kv.write(pages, pattern(svc.layout, rid, len(pages)))
        await svc.send(rid, pages, last=False)
        print("sent", flush=True)
        await anyio.sleep(120)


if __name__ == "__main__":
    anyio.run(main, sys.argv[1], sys.argv[2], [int(p) for p in sys.argv[3:]])
