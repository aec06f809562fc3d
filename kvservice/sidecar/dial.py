"""A worker's side of the handshake: who runs the daemon, and what it announces.

Before a byte is written the daemon's uid is read from the kernel
(``SO_PEERCRED``): it must be this process's own, root's, or one the caller
trusts; anything else may be a socket another user planted where the daemon's
should be.  The Welcome is checked before it is used: the segment's name must
name a file right under ``/dev/shm``, the layout must be a valid ``KVLayout``,
and the segment must be a regular file of the daemon's uid and the pool's size.

A daemon of this release answers a newer or older client with the version both
speak; one from before that (sidecar protocol 2) refuses any version but its own,
naming it, and is greeted once more in that version.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Collection

import anyio
import anyio.abc

from .._control.links import CONNECTION_ERRORS
from .._control.protocol import FrameError
from .._results import KVServiceError
from .._trust.peercred import PeerCred, PeerCredError, stream_peer_cred, uid_allowed
from ..memory._layout import KVLayout
from .frames import SocketFrames, frame_stream
from .shm import Segment, SegmentError, check_shm_name
from .wire import (
    SIDECAR_OLDEST_VERSION,
    SIDECAR_PROTOCOL_VERSION,
    Error,
    Hello,
    ServerMessage,
    Welcome,
    decode_server,
)

#: the largest frame a worker takes from its daemon
MAX_FRAME_BYTES = 64 * 1024 * 1024
_CONNECT_ERRORS: tuple[type[BaseException], ...] = (OSError, TimeoutError, FrameError, *CONNECTION_ERRORS)


#: how a daemon from before versions were negotiated (it speaks sidecar protocol 2 only)
#: refuses any other: this client then says Hello again in that version
_EXACT_ONLY = re.compile(r"protocol version \d+, this sidecar speaks (\d+)")


async def handshake(path: str, name: str, *, timeout: float,
                    trusted_uids: Collection[int]) -> tuple[SocketFrames[ServerMessage], Welcome, PeerCred]:
    """Connect to the daemon at ``path``, check who runs it, say Hello; its Welcome.
    ``KVServiceError`` saying why otherwise."""
    framed, reply, daemon = await _hello(path, name, SIDECAR_PROTOCOL_VERSION, timeout, trusted_uids)
    if (isinstance(reply, Error) and (exact := _EXACT_ONLY.fullmatch(reply.message)) is not None
            and SIDECAR_OLDEST_VERSION <= int(exact[1]) < SIDECAR_PROTOCOL_VERSION):
        await framed.aclose()  # it closes after the refusal: once more, in its version
        framed, reply, daemon = await _hello(path, name, int(exact[1]), timeout, trusted_uids)
    if not isinstance(reply, Welcome):
        await framed.aclose()
        why = reply.message if isinstance(reply, Error) else type(reply).__name__
        raise KVServiceError(f"the sidecar at {path} refused us: {why}")
    if not SIDECAR_OLDEST_VERSION <= reply.version <= SIDECAR_PROTOCOL_VERSION:
        await framed.aclose()
        raise KVServiceError(f"the sidecar at {path} speaks protocol version {reply.version}, this client "
                             f"{SIDECAR_OLDEST_VERSION}-{SIDECAR_PROTOCOL_VERSION}: upgrade the older of the two")
    return framed, reply, daemon


async def _hello(path: str, name: str, version: int, timeout: float,
                 trusted_uids: Collection[int]) -> tuple[SocketFrames[ServerMessage], ServerMessage, PeerCred]:
    """One connection: check who runs the daemon, say Hello in ``version``; its first frame."""
    try:
        with anyio.fail_after(timeout):
            stream = await anyio.connect_unix(path)
            framed = frame_stream(stream, MAX_FRAME_BYTES, decode_server)
            try:
                daemon = check_daemon(stream, path, trusted_uids)
                # a daemon that refuses us may close before our Hello is written: its reason is
                # still there to be read
                with contextlib.suppress(*CONNECTION_ERRORS):
                    await framed.send(Hello(version, name[:256]))
                reply = await framed.recv()
            except BaseException:
                await framed.aclose()
                raise
    except _CONNECT_ERRORS as exc:
        raise KVServiceError(f"cannot connect to the sidecar at {path}: {exc!r}") from exc
    return framed, reply, daemon


def check_daemon(stream: anyio.abc.SocketStream, path: str, trusted_uids: Collection[int]) -> PeerCred:
    """Who listens on the socket: this process's user, root or a trusted uid, else refuse."""
    try:
        cred = stream_peer_cred(stream)
    except PeerCredError as exc:
        raise KVServiceError(f"cannot tell which user runs the sidecar at {path} ({exc}); "
                             "refusing to talk to it") from exc
    if not uid_allowed(cred.uid, trusted_uids, root_too=True):
        raise KVServiceError(
            f"the sidecar at {path} runs as uid {cred.uid}, not as this user ({os.geteuid()}) or root: "
            "refusing to talk to it (a socket planted by another user?); trusted_uids names the users to trust")
    return cred


def map_pool(welcome: Welcome, daemon: PeerCred, path: str) -> tuple[KVLayout, Segment]:
    """Check what the daemon announced, then map its pool."""
    try:
        check_shm_name(welcome.shm_name)
    except ValueError as exc:
        raise KVServiceError(f"the sidecar at {path} announced an invalid shared-memory name: {exc}") from exc
    try:
        layout = KVLayout(**welcome.layout)
    except (TypeError, ValueError) as exc:
        raise KVServiceError(f"the sidecar at {path} announced an invalid layout: {exc}") from exc
    try:
        return layout, Segment.attach(welcome.shm_name, layout, owner_uid=daemon.uid)
    except SegmentError as exc:
        raise KVServiceError(f"cannot map the sidecar's KV pool: {exc}") from exc
