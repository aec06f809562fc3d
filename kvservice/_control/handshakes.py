"""The handshake, both sides, up to the Joins: connect, Hellos with their proofs, the
link's secrets, the sealed Joins.  ``ControlPlane`` admits the peer from there (checks
its pool, vets and loads its metadata, links it); a *probe* stops after the acceptor's
proof, having learnt who answers at an address (``addressbook``).

The order, which the proofs depend on: the dialler sends Hello; the acceptor answers
Hello with its proof over the transcript; the dialler sends its Proof, then its sealed
Join; the acceptor checks the proof, opens the Join, admits the dialler and only then
seals its own Join back (so a Join received means "you are loaded here")."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import anyio
import msgspec

from .._config import ServiceConfig
from .._results import AuthenticationError, ProtocolError
from .._trust.handshake import (
    ACCEPTOR,
    DIALER,
    Agreement,
    Exchange,
    LinkSecrets,
    check_versions,
    new_nonce,
    prove,
    verify,
)
from .addresses import split_address
from .links import CONNECTION_ERRORS, ControlStream, try_send
from .peers import LocalPeer, agree, check_hello, rejected_by
from .protocol import (
    PREAUTH_FRAME_BYTES,
    PROTOCOL_VERSION,
    FrameError,
    Hello,
    Join,
    Message,
    Proof,
    Reject,
    Sealed,
    decode_body,
    encode_body,
    hello,
)
from .transport import Transport


@dataclass(frozen=True, slots=True)
class Met:
    """An authenticated peer, as the handshake leaves it for admission."""

    hello: Hello  # its Hello (agent, claimed address)
    join: Join  # its Join, opened (pool, NIXL metadata)
    secrets: LinkSecrets
    version: int  # the protocol version the link speaks


class Handshakes:
    def __init__(self, transport: Transport, config: ServiceConfig, local: LocalPeer,
                 my_address: Callable[[], str]) -> None:
        self._transport = transport
        self._cfg = config
        self._local = local
        self._my_address = my_address  # known once the plane listens

    @contextmanager
    def deadline(self, address: str) -> Iterator[None]:
        """A handshake with ``address`` (connect, Hellos, Joins, admission) given
        ``connect_timeout_s``; past it, ``TimeoutError`` saying so (anyio's says nothing)."""
        limit = self._cfg.connect_timeout_s
        with anyio.move_on_after(limit) as scope:
            yield
        if scope.cancelled_caught:
            raise TimeoutError(f"the handshake with {address} did not complete within connect_timeout_s "
                               f"({limit:g} s)")

    # -- the dialler --------------------------------------------------------------------
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
        with broken_off(address, "before its hello"):
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

    async def dial(self, framed: ControlStream, address: str) -> Met:
        """The dialler's whole handshake on ``framed``: Hellos, our Proof, the Joins."""
        local = self._local
        reply, agreed = await self.hello(framed, address, probe=False)
        secrets = agreed.secrets(local.key, DIALER)
        with broken_off(address, "before its join"):
            await framed.send(Proof(prove(local.key, DIALER, agreed.script)))
            framed.mac = secrets.frame_mac
            await send_join(framed, local.join, secrets)
            answer = await recv_join_or_reject(framed)
        if isinstance(answer, Reject):
            raise rejected_by(address, answer)
        return Met(reply, open_join(answer, secrets), secrets, agreed.version)

    async def probe(self, address: str) -> str:
        """The agent that answers at ``address`` now, proven by its proof over our fresh
        nonce (with a key; without one, as it names itself).  Raises as a dial does:
        ``ConnectionRefusedError`` when nobody listens there."""
        with self.deadline(address):
            framed = await self.connect(address)
            try:
                reply, _ = await self.hello(framed, address, probe=True)
            finally:
                await framed.aclose()
        return reply.agent

    # -- the acceptor --------------------------------------------------------------------
    async def accept(self, framed: ControlStream) -> Met | None:
        """The acceptor's handshake on ``framed`` up to the dialler's Join (ours is sent
        after admission: ``send_join``); ``None`` for a probe, answered."""
        local = self._local
        theirs = await framed.recv(PREAUTH_FRAME_BYTES)
        if not isinstance(theirs, Hello):
            raise ProtocolError(f"expected hello, got {type(theirs).__name__}", "hello_invalid")
        version = check_hello(theirs, local.agent)
        exchange = Exchange()
        mine = hello(local.agent, self._my_address(), new_nonce(PROTOCOL_VERSION), share=exchange.share)
        agreed = agree(version, mine, theirs, exchange, ACCEPTOR)
        await framed.send(msgspec.structs.replace(mine, proof=prove(local.key, ACCEPTOR, agreed.script)))
        if theirs.probe:  # "who answers here?": our proof says it; nothing else follows
            return None
        answer = await framed.recv(PREAUTH_FRAME_BYTES)
        if isinstance(answer, Reject):
            raise rejected_by(theirs.address, answer)
        if not isinstance(answer, Proof):
            raise ProtocolError(f"expected proof, got {type(answer).__name__}", "hello_invalid")
        why = verify(local.key, DIALER, agreed.script, answer.proof) or check_versions(
            theirs.nonce, PROTOCOL_VERSION, version)
        if why is not None:
            raise AuthenticationError(why)
        secrets = agreed.secrets(local.key, ACCEPTOR)
        framed.mac = secrets.frame_mac
        return Met(theirs, open_join(await framed.recv(), secrets), secrets, version)


@contextmanager
def broken_off(address: str, stage: str) -> Iterator[None]:
    """The connection to ``address`` lost during a handshake's ``stage``, said as such:
    ``ConnectionResetError`` naming both, the stream's error its cause (anyio's
    ``BrokenResourceError`` has no words, ``IncompleteRead`` not ours)."""
    try:
        yield
    except TimeoutError:
        raise
    except CONNECTION_ERRORS as exc:
        raise ConnectionResetError(f"{address} closed the connection during the handshake, {stage}") from exc


# -- the sealed Joins -----------------------------------------------------------------------
async def send_join(framed: ControlStream, join: Join, secrets: LinkSecrets) -> None:
    """Our Join as ``Sealed``: encrypted under the link's Join key when keyed."""
    body = encode_body(join)
    await framed.send(Sealed(secrets.seal_join(body) if secrets.keyed else body))


def open_join(msg: Message, secrets: LinkSecrets) -> Join:
    """The peer's Join out of its ``Sealed``; ``FrameError`` for anything else, or a box
    this link's peer did not seal."""
    if not isinstance(msg, Sealed):
        raise FrameError(f"expected a sealed join, got {type(msg).__name__}")
    body = secrets.open_join(msg.box) if secrets.keyed else msg.box
    if body is None:
        raise FrameError("the join failed decryption (not sealed by this link's peer)")
    join = decode_body(body)
    if not isinstance(join, Join):
        raise FrameError(f"expected a join inside the seal, got {type(join).__name__}")
    return join


async def recv_join_or_reject(framed: ControlStream) -> Message:
    """The acceptor's answer to our proof: a sealed Join, or a Reject, which is
    unsealed when the acceptor refused the proof itself (it has no session key)."""
    body = await framed.recv_body()
    if framed.mac is None:
        return decode_body(body)
    opened = framed.mac.open(body)
    if opened is not None:
        return decode_body(opened)
    try:
        msg = decode_body(body)
    except FrameError:
        msg = None
    if isinstance(msg, Reject):
        return msg
    raise FrameError("frame failed authentication (forged, altered or replayed)")
