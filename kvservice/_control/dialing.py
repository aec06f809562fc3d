"""The dialling side of a handshake, up to the acceptor's proof: connect, say Hello,
check the answer.  ``ControlPlane`` goes on from there to a link; a *probe* stops
there, having learnt who answers at an address (``addressbook``)."""

from __future__ import annotations

from collections.abc import Callable

import anyio

from .._config import ServiceConfig
from .._results import AuthenticationError, ProtocolError
from .._trust.handshake import ACCEPTOR, DIALER, Agreement, Exchange, check_versions, new_nonce, verify
from .addresses import split_address
from .links import ControlStream, try_send
from .peers import LocalPeer, agree, check_hello, rejected_by
from .protocol import PREAUTH_FRAME_BYTES, PROTOCOL_VERSION, Hello, Reject, hello
from .transport import Transport


class Dialing:
    def __init__(self, transport: Transport, config: ServiceConfig, local: LocalPeer,
                 my_address: Callable[[], str]) -> None:
        self._transport = transport
        self._cfg = config
        self._local = local
        self._my_address = my_address  # known once the plane listens

    async def connect(self, address: str) -> ControlStream:
        """A framed connection to ``address``; ``ConnectionRefusedError`` when nobody listens."""
        host, port = split_address(address)
        try:
            stream = await self._transport.connect(host, port)
        except OSError as exc:
            # anyio reports "all attempts failed"; its cause says whether one was refused
            refused = isinstance(exc, ConnectionRefusedError) or isinstance(exc.__cause__, ConnectionRefusedError)
            cls = ConnectionRefusedError if refused else ConnectionError
            raise cls(f"cannot connect to {address}: {exc.__cause__ or exc}") from exc
        return ControlStream(stream, self._cfg.max_frame_bytes)

    async def hello(self, framed: ControlStream, address: str, *, probe: bool) -> tuple[Hello, Agreement]:
        """Our Hello, the acceptor's, its proof checked: (its Hello, what they settled)."""
        local = self._local
        exchange = Exchange()
        mine = hello(local.agent, self._my_address(), new_nonce(PROTOCOL_VERSION), probe=probe, share=exchange.share)
        await framed.send(mine)
        reply = await framed.recv(PREAUTH_FRAME_BYTES)
        if isinstance(reply, Reject):
            raise rejected_by(address, reply)
        if not isinstance(reply, Hello):
            raise ProtocolError(f"{address} answered {type(reply).__name__}, not hello")
        agreed = agree(check_hello(reply, local.agent), mine, reply, exchange, DIALER)
        why = verify(local.key, ACCEPTOR, agreed.script, reply.proof) or check_versions(
            reply.nonce, PROTOCOL_VERSION, agreed.version)
        if why is not None:
            if not probe:
                await try_send(framed, Reject(why, "auth"))
            raise AuthenticationError(f"{address}: {why}")
        return reply, agreed

    async def probe(self, address: str) -> str:
        """The agent that answers at ``address`` now, proven by its proof over our fresh
        nonce (with a key; without one, as it names itself).  Raises as a dial does:
        ``ConnectionRefusedError`` when nobody listens there."""
        with anyio.fail_after(self._cfg.connect_timeout_s):
            framed = await self.connect(address)
            try:
                reply, _ = await self.hello(framed, address, probe=True)
            finally:
                await framed.aclose()
        return reply.agent
