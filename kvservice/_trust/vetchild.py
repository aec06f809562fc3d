"""The vetting child: loads a peer's NIXL metadata where an abort hurts no one.

``python -m kvservice._trust.vetchild CONFIG_JSON FD`` holds one bare NIXL agent
(``_nixl.TrialLoader``: UCX backend, the service's UCX settings, no memory) and
answers requests on the socket ``FD`` (one end of a socket pair whose other end
its service holds), one at a time (``vetting``'s ``REQUEST`` and ``REPLY``)::

    request: id (u64) | length (u32) | metadata
    reply:   id (u64) | status (u8)  | length (u32) | message (UTF-8)

``status`` is ``READY`` once (id 0) when the agent exists, or ``BROKEN`` with why
it could not be created; then ``LOADED`` (NIXL loaded the metadata, and it is
unloaded again) or ``REFUSED`` (NIXL raised: the message says what).  If UCX
aborts on the bytes, this process ends and its service sees the socket close.

"One door" holds here too: this module never imports ``nixl``; it asks
``_nixl.TrialLoader``, the door's counterpart, to load.  The child exits when
its socket closes (its service ended, or died), ignores SIGINT (its service
decides when it ends), and sends what native libraries print on stdout to
stderr: an application's stdout stays its own.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import sys
from typing import BinaryIO

from .vetting import BROKEN, LOADED, MAX_REQUEST_BYTES, READY, REFUSED, REPLY, REQUEST

#: how often an idle child drives UCX's progress
IDLE_PROGRESS_S = 0.05


def _read(stream: BinaryIO, n: int) -> bytes | None:
    buf = b""
    while len(buf) < n:
        chunk = stream.read(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return buf


def _reply(sock: socket.socket, rid: int, status: int, message: str) -> None:
    body = message.encode(errors="replace")[:4096]
    sock.sendall(REPLY.pack(rid, status, len(body)) + body)


def main() -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.dup2(2, 1)
    config = json.loads(sys.argv[1])
    sock = socket.socket(fileno=int(sys.argv[2]))
    requests = sock.makefile("rb")
    try:
        from .._nixl.agent import TrialLoader

        loader = TrialLoader(config["agent"], ucx_env=config["ucx_env"])
        loader.warm_up()  # an error here shows in the first real load's answer
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which refuses to load anything
        _reply(sock, 0, BROKEN, f"{type(exc).__name__}: {exc}")
        return 1
    _reply(sock, 0, READY, "")
    while True:
        # Idle, UCX still needs progress: connections a trial load opened to a peer
        # finish closing, and nothing they receive stays queued in the kernel.  (The
        # service sends one request and awaits its reply: nothing waits in ``requests``'
        # buffer here, so the socket itself says when the next one comes.)
        while not select.select([sock], [], [], IDLE_PROGRESS_S)[0]:
            loader.progress()
        head = _read(requests, REQUEST.size)
        if head is None:
            return 0
        rid, n = REQUEST.unpack(head)
        if n > MAX_REQUEST_BYTES:
            return 2
        metadata = _read(requests, n)
        if metadata is None:
            return 0
        why = loader.try_load(metadata)
        _reply(sock, rid, LOADED if why is None else REFUSED, why or "")


if __name__ == "__main__":
    sys.exit(main())
