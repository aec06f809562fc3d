"""The vetting child: loads a peer's NIXL metadata where an abort hurts no one.

``python -P <this file> CONFIG_JSON FD`` (``-P``: this folder stays off
``sys.path``) holds one bare NIXL agent (``_nixl.trial.TrialLoader``: UCX
backend, the service's UCX settings and NIXL build, no memory) and answers
requests on the socket ``FD`` (one end of a socket pair whose other end its
service holds), one at a time (``REQUEST`` and ``REPLY``)::

    request: id (u64) | length (u32) | metadata
    reply:   id (u64) | status (u8)  | length (u32) | message (UTF-8)

``status`` is ``READY`` once (id 0) when the agent exists, or ``BROKEN`` with why
it could not be created; then ``LOADED`` (NIXL loaded the metadata, and it is
unloaded again) or ``REFUSED`` (NIXL raised: the message says what).  If UCX
aborts on the bytes, this process ends and its service sees the socket close.

Every service (every engine rank) runs one, and a peer's first link may wait for
it to serve, so it starts light (the whole service and torch: in SGLang's
environment ~590 MiB resident and ~2.3 s of CPU; this way ~57 MiB and ~0.3 s:
docs/perf).  It is run by path, not with ``-m``: ``kvservice/__init__`` now loads
its names lazily and imports neither, but entering bare keeps this child's
imports this module's own choice, whatever ``__init__`` grows.  It enters ``kvservice`` as a bare package (its folder,
none of its ``__init__``) and imports ``_nixl.trial`` and what that imports;
until then only the standard library, which is also all that ``vetting``
imports from here (the wire below).

"One door" holds here too: this module never imports ``nixl``; it asks
``_nixl.trial.TrialLoader``, the door's counterpart, to load.  The child exits
when its socket closes (its service ended, or died), ignores SIGINT (its service
decides when it ends), and sends what native libraries print on stdout to
stderr: an application's stdout stays its own.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import os
import select
import signal
import socket
import struct
import sys
from pathlib import Path
from typing import BinaryIO

#: the wire: request id, length, metadata; reply id, status, length, message
REQUEST = struct.Struct(">QI")
REPLY = struct.Struct(">QBI")
LOADED, REFUSED, READY, BROKEN = 0, 1, 2, 3
#: larger requests end the child: the service never sends them (its frames are smaller)
MAX_REQUEST_BYTES = 1 << 26
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
        from kvservice._nixl.trial import TrialLoader  # absolute: this file runs as ``__main__``

        loader = TrialLoader(config["agent"], ucx_env=config["ucx_env"], build=config["nixl"])
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


def enter_package_bare() -> None:
    """Make ``kvservice``'s modules importable without running its ``__init__``: this
    process needs ``_nixl.trial``, not the service (nor the torch it imports)."""
    spec = importlib.machinery.ModuleSpec("kvservice", None, is_package=True)
    spec.submodule_search_locations = [str(Path(__file__).resolve().parents[1])]
    sys.modules["kvservice"] = importlib.util.module_from_spec(spec)


if __name__ == "__main__":
    enter_package_bare()
    try:
        sys.exit(main())
    except (BrokenPipeError, ConnectionResetError):
        # Its service went away first (a service that failed to start closes the socket
        # while the child boots): nobody is left to tell, and nothing to print about it.
        sys.exit(0)
