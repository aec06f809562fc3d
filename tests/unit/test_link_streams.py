"""A control link's outbox (a memory object stream) is closed on every path, including a
link admitted and then dropped before it ever ran: an unclosed stream is a ResourceWarning,
an error under the suite's ``filterwarnings = error`` at whichever test collects it."""

from __future__ import annotations

import socket

import anyio
import anyio.abc

from kvservice._control.links import ControlStream, PeerLink
from kvservice._control.protocol import Expect

from ..helpers import unclosed_resources


async def _link(sock: socket.socket) -> PeerLink:
    async def on_lost(link: PeerLink, cause: BaseException | None, graceful: bool) -> None:
        pass

    stream = await anyio.abc.SocketStream.from_socket(sock)
    return PeerLink(
        ControlStream(stream, 1 << 16), agent="a", address="127.0.0.1:1", generation=1,
        on_message=lambda link, msg: None, on_lost=on_lost, heartbeat_interval=1.0,
        peer_timeout=5.0, max_outbox_bytes=1 << 20,
    )


async def test_a_link_closed_before_it_ran_closes_its_outbox() -> None:
    ours, theirs = socket.socketpair()
    with theirs, unclosed_resources() as unclosed:
        link = await _link(ours)
        link.send(Expect("r1", [1]))  # queued before the drop, as a link's first Expect can be
        link.close(ConnectionResetError("handshake broke off"))
        link.send(Expect("r2", [2]))  # after the close: dropped, not raised
        assert link.closed
        await link._framed.aclose()  # the handshake's failure handler closes the connection
        del link
    assert unclosed == []


async def test_a_link_that_ran_closes_its_outbox() -> None:
    ours, theirs = socket.socketpair()
    with unclosed_resources() as unclosed:
        link = await _link(ours)
        theirs.close()  # the peer goes: the link's reader sees the end
        with anyio.fail_after(5):
            await link.run()
        assert link.ended.is_set() and link.closed
        del link
    assert unclosed == []
