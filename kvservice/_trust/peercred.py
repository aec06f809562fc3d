"""Who is at the other end of a Unix socket: the kernel's word (Linux ``SO_PEERCRED``).

On an accepted connection the credentials are the connecting process's, as of
its ``connect()``; on a connected client socket they are the listening
process's, as of its ``listen()``.  Neither end can forge them, so both the
sidecar (is this worker's uid allowed?) and its client (is this daemon run by a
user I trust, or is the socket a plant?) decide on them before reading a byte.

Where the credentials cannot be read (not Linux, not a Unix socket) callers
refuse: ``PeerCredError``.
"""

from __future__ import annotations

import os
import socket
import struct
from collections.abc import Collection
from dataclasses import dataclass

import anyio
import anyio.abc

from .._results import KVServiceError

#: struct ucred: pid_t pid; uid_t uid; gid_t gid
_UCRED = struct.Struct("iII")
ROOT_UID = 0


class PeerCredError(KVServiceError, OSError):
    """The peer's credentials cannot be read from this socket (not a Unix socket, no
    ``SO_PEERCRED`` on this platform, or the kernel refused).

    Raised by ``peer_cred``; the sidecar and its client then refuse the connection,
    as they would a peer of the wrong user."""


@dataclass(frozen=True, slots=True)
class PeerCred:
    pid: int
    uid: int
    gid: int


def peer_cred(sock: socket.socket) -> PeerCred:
    """The credentials of ``sock``'s peer; ``PeerCredError`` where the kernel cannot say."""
    option = getattr(socket, "SO_PEERCRED", None)
    if option is None:
        raise PeerCredError("SO_PEERCRED is not available on this platform")
    if sock.family != socket.AF_UNIX:
        raise PeerCredError(f"not a Unix socket (family {sock.family!r})")
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, option, _UCRED.size)
    except OSError as exc:
        raise PeerCredError(f"cannot read the peer's credentials: {exc.strerror or exc}") from exc
    pid, uid, gid = _UCRED.unpack(raw)
    return PeerCred(pid, uid, gid)


def stream_peer_cred(stream: anyio.abc.SocketStream) -> PeerCred:
    """``peer_cred`` of the raw socket under an anyio socket stream."""
    try:
        sock = stream.extra(anyio.abc.SocketAttribute.raw_socket)
    except anyio.TypedAttributeLookupError as exc:
        raise PeerCredError("the stream has no socket") from exc
    return peer_cred(sock)


def uid_allowed(uid: int, allowed: Collection[int], *, root_too: bool) -> bool:
    """Whether ``uid`` is this process's effective uid, listed in ``allowed``, or
    (``root_too``) root."""
    return uid == os.geteuid() or uid in allowed or (root_too and uid == ROOT_UID)
