"""A process of another user, for the uid tests: ``python -m tests.sidecar.foreign UID MODE ARG...``.

Started as root, it loads and exercises everything it will need first (the
interpreter's own files need not be readable by that user), then drops to
``UID`` (group ``UID``, no other groups) and, printing one JSON line per step:

* ``worker SOCKET``: connect as a worker; ``{"refused": message}`` or ``{"connected": uid}``.
* ``receive SOCKET SENDER RID PAGE...``: expect RID into PAGEs from SENDER
  (``{"expecting": RID}``), wait for it (at most 60 s), check its bytes:
  ``{"arrived": ok, "exact": bool}``.
* ``plant SOCKET``: listen on SOCKET as a fake daemon (``{"listening": uid}``),
  accept one connection and report what it sent within 3 s: ``{"received": nbytes}``.
"""

from __future__ import annotations

import json
import os
import socket
import sys

import anyio
import torch

from kvservice import KVServiceError, SidecarClient
from kvservice._trust.peercred import peer_cred
from kvservice.testing import pattern


def say(**what: object) -> None:
    print(json.dumps(what), flush=True)


def warm_up() -> None:
    """Import lazily loaded modules while their files are readable."""
    anyio.run(anyio.sleep, 0)
    import kvservice.sidecar.shm  # noqa: F401
    from kvservice import KVLayout

    layout = KVLayout(layers=2, page_tokens=16, kv_heads=2, head_dim=64, dtype="bfloat16", num_pages=4)
    assert torch.equal(pattern(layout, "warm", 1), pattern(layout, "warm", 1))
    a, b = socket.socketpair()
    peer_cred(a)
    a.close()
    b.close()


def drop_to(uid: int) -> None:
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)


async def worker(path: str) -> None:
    try:
        async with SidecarClient(path, name="foreign", connect_timeout=10):
            say(connected=os.getuid())
    except KVServiceError as exc:
        say(refused=str(exc))


async def receive(path: str, sender: str, rid: str, pages: list[int]) -> None:
    async with SidecarClient(path, name="foreign") as svc:
        await svc.expect(rid, pages, sender=sender)
        say(expecting=rid)
        result = await svc.await_arrival(rid, timeout=60)
        exact = torch.equal(svc.kv.pages(pages), pattern(svc.layout, rid, len(pages)))
        say(arrived=result.ok, exact=bool(exact), message=result.message)


def plant(path: str) -> None:
    with socket.socket(socket.AF_UNIX) as srv:
        srv.bind(path)
        srv.listen()
        say(listening=os.getuid())
        conn, _ = srv.accept()
        conn.settimeout(3.0)
        got = b""
        try:
            while chunk := conn.recv(65536):
                got += chunk
        except TimeoutError:
            pass
        conn.close()
        say(received=len(got))


def main(argv: list[str]) -> None:
    uid, mode, path, *rest = argv
    warm_up()
    drop_to(int(uid))
    if mode == "worker":
        anyio.run(worker, path)
    elif mode == "receive":
        anyio.run(receive, path, rest[0], rest[1], [int(p) for p in rest[2:]])
    elif mode == "plant":
        plant(path)
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
