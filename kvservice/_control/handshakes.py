"""The handshake, both sides, up to the Joins: connect, Hellos with their proofs, the
link's secrets, the sealed Joins.  ``ControlPlane`` admits the peer from there (checks
its pool, vets and loads its metadata, links it); a *probe* stops after the acceptor's
proof, having learnt who answers at an address (``addressbook``).

The order, which the proofs depend on: the dialler sends Hello; the acceptor answers
Hello with its proof over the transcript; the dialler sends its Proof, then its sealed
Join; the acceptor checks the proof, opens the Join, admits the dialler and only then
seals its own Join back (so a Join received means "you are loaded here").

Member identities (``_trust.identity``), when this service has one: the acceptor's Hello
carries its certificate and its signature over the transcript, the dialler's Proof its
own; each side checks the other's once the cluster key's proof checked out (a stranger
never makes it parse a certificate).  A peer that proves none is refused
(``identity_missing``) unless ``allow_peers_without_identity``; an agent name once proven
by a member is never again accepted from a link that proves another or none."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import anyio
import msgspec

from .._config import ServiceConfig
from .._log import get_logger
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
    with_identities,
)
from .._trust.identity import (
    IDENTITY,
    IDENTITY_FRAME_BYTES,
    NO_IDENTITY,
    Identity,
    IdentityRefused,
    Member,
    signed_part,
)
from .._trust.revocation import RevocationWatch
from .._trust.rotation import IdentityWatch
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

log = get_logger("kvservice")

#: ``Hello.ident``: this release knows member identities; and has one
KNOWS_IDENTITIES = 1
HAS_IDENTITY = 2
#: agents remembered with the member that proved them (an agent name is one incarnation's)
MEMBERS_KEPT = 4096


@dataclass(frozen=True, slots=True)
class Met:
    """An authenticated peer, as the handshake leaves it for admission."""

    hello: Hello  # its Hello (agent, claimed address)
    join: Join  # its Join, opened (pool, NIXL metadata)
    secrets: LinkSecrets
    version: int  # the protocol version the link speaks
    member: Member | None = None  # the member it proved (None: no identity here, or none there)


class Handshakes:
    def __init__(self, transport: Transport, config: ServiceConfig, local: LocalPeer,
                 my_address: Callable[[], str], refuse: Callable[[str], int | None]) -> None:
        self._transport = transport
        self._cfg = config
        self._local = local
        self._my_address = my_address  # known once the plane listens
        self._refuse = refuse  # counts a refusal of ours as a dialler (an acceptor's: handshake_failed)
        self._identity: Identity | None = config.identity()
        #: the revocation list in force (``revoked_file``): a member on it is refused here, and
        #: its links closed by the plane's watch
        self.revocations = (RevocationWatch(config.revoked_file, self._identity.ca)
                            if config.revoked_file is not None and self._identity is not None else None)
        #: the identity's files watched (``_trust.rotation``): a pair rotated in is put in
        #: force here for new handshakes (``rotated``), links made before are left as they are
        self.identity_watch = (IdentityWatch(self._identity, str(config.identity_cert_file),
                                             str(config.identity_key_file), str(config.identity_ca_file),
                                             role=config.discovery_role)
                               if self._identity is not None else None)
        #: agent -> the member it proved (None: it linked proving none), most recent last
        self.members: OrderedDict[str, Member | None] = OrderedDict()

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

    async def hello(self, framed: ControlStream, address: str, *, probe: bool
                    ) -> tuple[Hello, Agreement, Member | None]:
        """Our Hello, the acceptor's, its proof (and identity) checked: (its Hello, what
        they settled, the member it proved)."""
        local = self._local
        exchange = Exchange()
        mine = msgspec.structs.replace(
            hello(local.agent, self._my_address(), new_nonce(PROTOCOL_VERSION), probe=probe, share=exchange.share),
            ident=self._ident)
        with broken_off(address, "before its hello"):
            await framed.send(mine)
            reply = await framed.recv(IDENTITY_FRAME_BYTES if self._identity else PREAUTH_FRAME_BYTES)
        if isinstance(reply, Reject):
            raise rejected_by(address, reply)
        if not isinstance(reply, Hello):
            raise ProtocolError(f"{address} answered {type(reply).__name__}, not hello")
        agreed = with_identities(agree(check_hello(reply, local.agent), mine, reply, exchange, DIALER),
                                 mine.ident, reply.ident)
        why = verify(local.key, ACCEPTOR, agreed.script, reply.proof) or check_versions(
            reply.nonce, PROTOCOL_VERSION, agreed.version)
        if why is not None:
            if not probe:
                await try_send(framed, Reject(why, "auth"))
            raise AuthenticationError(f"{address}: {why}")
        try:
            member = self._member(reply.agent, reply.ident, reply.cert, reply.signature,
                                  signed_part(ACCEPTOR, agreed.script, reply.cert))
        except IdentityRefused as exc:
            self._refuse(exc.kind)
            if not probe:
                await try_send(framed, Reject(str(exc), exc.kind))
            raise IdentityRefused(f"{address}: {exc}", exc.kind) from exc
        return reply, agreed, member

    async def dial(self, framed: ControlStream, address: str) -> Met:
        """The dialler's whole handshake on ``framed``: Hellos, our Proof, the Joins."""
        local = self._local
        reply, agreed, member = await self.hello(framed, address, probe=False)
        secrets = agreed.secrets(local.key, DIALER)
        proof = Proof(prove(local.key, DIALER, agreed.script))
        if self._identity is not None and reply.ident == HAS_IDENTITY:
            own = self._identity.der
            proof = Proof(proof.proof, own, self._identity.sign(signed_part(DIALER, agreed.script, own, reply.cert)))
        with broken_off(address, "before its join"):
            await framed.send(proof)
            framed.mac = secrets.frame_mac
            await send_join(framed, local.join, secrets)
            answer = await recv_join_or_reject(framed)
        if isinstance(answer, Reject):
            raise rejected_by(address, answer)
        met = Met(reply, open_join(answer, secrets), secrets, agreed.version, member)
        self._proven(reply.agent, member)
        return met

    async def probe(self, address: str) -> str:
        """The agent that answers at ``address`` now, proven by its proof over our fresh
        nonce (with a key; without one, as it names itself).  Raises as a dial does:
        ``ConnectionRefusedError`` when nobody listens there."""
        with self.deadline(address):
            framed = await self.connect(address)
            try:
                reply, _, _ = await self.hello(framed, address, probe=True)
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
        mine = msgspec.structs.replace(
            hello(local.agent, self._my_address(), new_nonce(PROTOCOL_VERSION), share=exchange.share),
            ident=self._ident)
        agreed = with_identities(agree(version, mine, theirs, exchange, ACCEPTOR), theirs.ident, mine.ident)
        mine = msgspec.structs.replace(mine, proof=prove(local.key, ACCEPTOR, agreed.script))
        # our certificate only to a dialler that checks it: an older one reads a short Hello only
        both = self._identity is not None and theirs.ident == HAS_IDENTITY
        if both:
            assert self._identity is not None
            own = self._identity.der
            mine = msgspec.structs.replace(mine, cert=own,
                                           signature=self._identity.sign(signed_part(ACCEPTOR, agreed.script, own)))
        await framed.send(mine)
        if theirs.probe:  # "who answers here?": our proof says it; nothing else follows
            return None
        answer = await framed.recv(IDENTITY_FRAME_BYTES if both else PREAUTH_FRAME_BYTES)
        if isinstance(answer, Reject):
            raise rejected_by(theirs.address, answer)
        if not isinstance(answer, Proof):
            raise ProtocolError(f"expected proof, got {type(answer).__name__}", "hello_invalid")
        why = verify(local.key, DIALER, agreed.script, answer.proof) or check_versions(
            theirs.nonce, PROTOCOL_VERSION, version)
        if why is not None:
            raise AuthenticationError(why)
        member = self._member(theirs.agent, theirs.ident, answer.cert, answer.signature,
                              signed_part(DIALER, agreed.script, answer.cert, mine.cert))
        secrets = agreed.secrets(local.key, ACCEPTOR)
        framed.mac = secrets.frame_mac
        met = Met(theirs, open_join(await framed.recv(), secrets), secrets, version, member)
        self._proven(theirs.agent, member)
        return met

    # -- member identities ----------------------------------------------------------------
    def rotated(self, identity: Identity) -> None:
        """``identity`` proves this service in its handshakes from now on (same member)."""
        self._identity = identity

    @property
    def own_member(self) -> Member | None:
        """The member this service proves (``None``: it has no identity)."""
        return self._identity.member if self._identity is not None else None

    @property
    def _ident(self) -> int:
        return HAS_IDENTITY if self._identity is not None else KNOWS_IDENTITIES

    def _member(self, agent: str, ident: int, cert: bytes, signature: bytes, signed: bytes) -> Member | None:
        """The member a peer speaking as ``agent`` proved (``None``: this service has no
        identity, or, when allowed, the peer proves none); ``IdentityRefused`` otherwise."""
        identity = self._identity
        if identity is None:
            return None
        if ident == HAS_IDENTITY and cert:
            member: Member | None = identity.check(cert, agent, signature, signed)
            if self.revocations is not None and member is not None \
                    and (revoked := self.revocations.current.refusal(member)) is not None:
                raise revoked
        elif not self._cfg.allow_peers_without_identity:
            why = "it has no certificate" if ident else "it has no certificate, or runs a release without identities"
            raise IdentityRefused(
                f"agent {agent!r} proves no member identity ({why}), and this service requires one "
                "(identity_cert_file; allow_peers_without_identity lets such peers link while a fleet moves "
                "to identities)", NO_IDENTITY)
        else:
            member = None
        before = self.members.get(agent, member)
        if (before and before.uri) != (member and member.uri):
            raise IdentityRefused(f"agent {agent!r} was proven by member "
                                  f"{before.uri if before else 'none'} on an earlier link; this link proves "
                                  f"{member.uri if member else 'none'}", IDENTITY)
        return member

    def _proven(self, agent: str, member: Member | None) -> None:
        """Remember which member ``agent`` proved (bounded: agent names are per incarnation)."""
        if self._identity is None:
            return
        self.members[agent] = member
        self.members.move_to_end(agent)
        while len(self.members) > MEMBERS_KEPT:
            self.members.popitem(last=False)
        if member is not None:
            log.info("peer.member_proven", agent=agent, member=member.uri, expires=member.not_after.isoformat())


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
