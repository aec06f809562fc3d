"""The two-host bench's control exchange: frames, the handshake and the messages.

``kvservice bench --listen HOST:PORT`` (the *listener*: the receiving side) and
``kvservice bench --peer HOST:PORT`` (the *driver*: the sending side, which
chooses the workloads and writes the report) talk over one TCP connection.

Frames are a 4-byte big-endian length and a JSON object whose ``op`` names its
type (the structs below, every field bounded by its type).  Before the peer has
authenticated a frame may hold at most ``MAX_HELLO_BYTES``; after, at most
``MAX_FRAME_BYTES``.  Every read has a deadline; a frame that does not decode
into one of the types its direction allows ends the session with an ``Error``
naming the problem.

Handshake, as kvservice's control plane does it (``kvservice._trust.handshake``)
but under a key derived for the bench, so a bench proof is never a proof of the
service's protocol: the driver sends ``Hello`` (a fresh nonce), the listener
answers ``Hello`` with its own nonce and its proof, the driver checks it and
answers ``Proof``, the listener checks that and answers ``Welcome``.  Without a
key on both sides proofs are empty (loopback, or ``--allow-unauthenticated``); a
keyed and an unkeyed side refuse each other.  With a key every later frame
carries a MAC with a sequence number (``FrameMac``).

Session, after ``Welcome``: the driver measures the clock offset (``Clock``
round trips: the two hosts' monotonic clocks differ, and a run ends when the
receiver saw its last arrival), sends ``Setup`` (the plan and the methods; the
listener derives the pool size from the plan itself), and the listener starts
its receiving children.  From then on the driver's commands for them travel as
``ToRaw``/``ToKv`` (checked here field by field: page numbers inside the pool,
the sender the receiver dials on the driver's own address) and their replies
come back as ``Relay``.  ``Stop`` ends the session (the listener answers
``Bye``), ``Error`` ends it with a reason, and so do EOF and silence past the
reading side's deadline.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import socket
import struct
import time
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

from kvservice._results import KVServiceError
from kvservice._trust import handshake

VERSION = 1
MAX_HELLO_BYTES = 1024
MAX_FRAME_BYTES = 16 * 2**20
#: the listener's and the driver's longest wait for one reply or command (a run is at most
#: ``methods.RUN_TIMEOUT_S``; setting up a side's children at most ``SETUP_TIMEOUT_S``)
HANDSHAKE_TIMEOUT_S = 10.0
MAX_REQUESTS = 100_000
MAX_PAGES = 2**24
_LEN = struct.Struct(">I")
_KEY_LABEL = b"kvservice-bench-control-v1"

Hex32 = Annotated[str, Meta(min_length=64, max_length=64, pattern="^[0-9a-f]{64}$")]
HexProof = Annotated[str, Meta(max_length=64, pattern="^([0-9a-f]{64})?$")]
Rid = Annotated[str, Meta(min_length=1, max_length=128)]
Page = Annotated[int, Meta(ge=0, lt=MAX_PAGES)]
Pages = Annotated[list[Page], Meta(min_length=1, max_length=4096)]
Text = Annotated[str, Meta(max_length=2000)]
MethodName = Literal["raw_nixl", "kvservice"]


class ControlError(KVServiceError, RuntimeError):
    """The other side broke the exchange: gone, silent, malformed, refused or reported an error.

    Raised by ``Channel`` and the handshakes of a two-host bench; the run (or the
    listener's session) ends, saying why."""


class Hello(Struct, tag="hello", tag_field="op", forbid_unknown_fields=True):
    version: Annotated[int, Meta(ge=0, lt=2**16)]
    nonce: Hex32
    proof: HexProof = ""


class Proof(Struct, tag="proof", tag_field="op", forbid_unknown_fields=True):
    proof: HexProof


class Welcome(Struct, tag="welcome", tag_field="op", forbid_unknown_fields=True):
    kvservice: Annotated[str, Meta(max_length=64)] = ""


class Clock(Struct, tag="clock", tag_field="op", forbid_unknown_fields=True):
    t: float
    now: float = 0.0


class Setup(Struct, tag="setup", tag_field="op", forbid_unknown_fields=True):
    plan: Literal["quick", "full"]
    methods: Annotated[list[MethodName], Meta(min_length=1, max_length=2)]
    loop: Literal["uvloop", "asyncio"] = "uvloop"
    gc: Literal["freeze", "off"] = "freeze"


class RawConnect(Struct, tag="connect", tag_field="op", forbid_unknown_fields=True):
    metadata: Annotated[str, Meta(max_length=2**20)]
    base: Annotated[int, Meta(ge=0, le=2**63 - 1)]
    num_pages: Annotated[int, Meta(ge=1, le=MAX_PAGES)]
    prep: bool = False


class RawExpect(Struct, tag="expect", tag_field="op", forbid_unknown_fields=True):
    rids: Annotated[list[Rid], Meta(max_length=MAX_REQUESTS)]


class KvRequest(Struct, forbid_unknown_fields=True):
    rid: Rid
    dst: Pages
    src: Annotated[list[Page], Meta(max_length=4096)] = []


class KvExpect(Struct, tag="expect", tag_field="op", forbid_unknown_fields=True):
    requests: Annotated[list[KvRequest], Meta(max_length=MAX_REQUESTS)]
    sender: Annotated[str, Meta(max_length=300)]
    wait: bool = True


class ToRaw(Struct, tag="to_raw", tag_field="op", forbid_unknown_fields=True):
    cmd: RawConnect | RawExpect


class ToKv(Struct, tag="to_kv", tag_field="op", forbid_unknown_fields=True):
    cmd: KvExpect


class Relay(Struct, tag="relay", tag_field="op", forbid_unknown_fields=True):
    source: MethodName
    msg: dict[str, Any]


class Stop(Struct, tag="stop", tag_field="op", forbid_unknown_fields=True):
    ok: bool
    report: Annotated[str, Meta(max_length=2**16)] = ""


class Bye(Struct, tag="bye", tag_field="op", forbid_unknown_fields=True):
    pass


class Error(Struct, tag="error", tag_field="op", forbid_unknown_fields=True):
    message: Text


#: what each side may receive
ToListener = Hello | Proof | Clock | Setup | ToRaw | ToKv | Stop | Error
ToDriver = Hello | Welcome | Clock | Relay | Bye | Error


def bench_key(key: bytes | None) -> bytes | None:
    """The bench's own key, derived from the cluster key (domain separation)."""
    return None if key is None else hmac.digest(key, _KEY_LABEL, hashlib.sha256)


def transcript(driver_nonce: str, listener_nonce: str) -> bytes:
    return handshake.transcript(("bench-driver", "", bytes.fromhex(driver_nonce)),
                                ("bench-listener", "", bytes.fromhex(listener_nonce)))


def remaining(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise ControlError("the other side did not answer in time")
    return left


class Channel:
    """One side of the control connection: framing, limits, deadlines and (keyed) MACs."""

    def __init__(self, sock: socket.socket, peer: str) -> None:
        self.sock = sock
        self.peer = peer  # "host:port" of the other side, for messages
        self.mac: handshake.FrameMac | None = None
        self.limit = MAX_HELLO_BYTES

    def _recv_exact(self, n: int, deadline: float) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            self.sock.settimeout(remaining(deadline))
            try:
                chunk = self.sock.recv(min(n - len(buf), 1 << 20))
            except TimeoutError as exc:
                raise ControlError(f"{self.peer} did not answer in time") from exc
            except OSError as exc:
                raise ControlError(f"connection to {self.peer} failed: {exc}") from exc
            if not chunk:
                raise ControlError(f"{self.peer} closed the connection")
            buf += chunk
        return bytes(buf)

    def recv_body(self, deadline: float) -> bytes:
        (n,) = _LEN.unpack(self._recv_exact(_LEN.size, deadline))
        extra = handshake.MAC_BYTES if self.mac is not None else 0
        if n > self.limit + extra:
            raise ControlError(f"{self.peer} sent a frame of {n} bytes (limit {self.limit})")
        body = self._recv_exact(n, deadline)
        if self.mac is not None:
            opened = self.mac.open(body)
            if opened is None:
                raise ControlError(f"a frame from {self.peer} failed its MAC check (altered, replayed or forged)")
            body = opened
        return body

    def recv(self, allowed: Any, deadline: float) -> Any:
        """The next frame, decoded as one of ``allowed``; an ``Error`` frame raises."""
        body = self.recv_body(deadline)
        try:
            msg = msgspec.json.decode(body, type=allowed)
        except msgspec.ValidationError as exc:
            raise ControlError(f"{self.peer} sent an invalid frame: {exc}") from exc
        except msgspec.DecodeError as exc:
            raise ControlError(f"{self.peer} sent a malformed frame: {exc}") from exc
        if isinstance(msg, Error):
            raise ControlError(f"{self.peer} reported: {msg.message}")
        return msg

    def send(self, msg: Struct, timeout: float = HANDSHAKE_TIMEOUT_S) -> None:
        body = msgspec.json.encode(msg)
        if self.mac is not None:
            body = self.mac.seal(body)
        self.sock.settimeout(timeout)
        try:
            self.sock.sendall(_LEN.pack(len(body)) + body)
        except OSError as exc:
            raise ControlError(f"sending to {self.peer} failed: {exc}") from exc

    def try_error(self, message: str) -> None:
        """Tell the other side why this one ends the session, if it still listens."""
        try:
            self.send(Error(message=message[:2000]), timeout=2.0)
        except ControlError:
            pass

    def authenticated(self, key: bytes | None, script: bytes, role: str) -> None:
        """The handshake is done: MACs from now on (with a key), and the full frame limit."""
        if key is not None:
            self.mac = handshake.FrameMac(key, script, role)
        self.limit = MAX_FRAME_BYTES


def driver_handshake(chan: Channel, key: bytes | None) -> Welcome:
    """The dialing side's part; raises ``ControlError`` with the reason on refusal."""
    deadline = time.monotonic() + HANDSHAKE_TIMEOUT_S
    nonce = handshake.new_nonce().hex()
    chan.send(Hello(version=VERSION, nonce=nonce))
    theirs: Hello = chan.recv(Hello | Error, deadline)
    if theirs.version != VERSION:
        raise ControlError(f"{chan.peer} speaks bench control version {theirs.version}, this side {VERSION}")
    script = transcript(nonce, theirs.nonce)
    why = handshake.verify(key, handshake.ACCEPTOR, script, bytes.fromhex(theirs.proof))
    if why is not None:
        chan.try_error(why)
        raise ControlError(f"{chan.peer}: {why}")
    chan.send(Proof(proof=handshake.prove(key, handshake.DIALER, script).hex()))
    chan.authenticated(key, script, handshake.DIALER)
    welcome: Welcome = chan.recv(Welcome | Error, deadline)
    return welcome


def listener_handshake(chan: Channel, key: bytes | None, version: str) -> None:
    """The accepting side's part; raises ``ControlError`` (and tells the dialer) on refusal."""
    deadline = time.monotonic() + HANDSHAKE_TIMEOUT_S
    theirs: Hello = chan.recv(Hello, deadline)
    if theirs.version != VERSION:
        chan.try_error(f"this listener speaks bench control version {VERSION}, not {theirs.version}")
        raise ControlError(f"{chan.peer} speaks bench control version {theirs.version}")
    nonce = handshake.new_nonce().hex()
    script = transcript(theirs.nonce, nonce)
    chan.send(Hello(version=VERSION, nonce=nonce, proof=handshake.prove(key, handshake.ACCEPTOR, script).hex()))
    proof: Proof = chan.recv(Proof | Error, deadline)
    why = handshake.verify(key, handshake.DIALER, script, bytes.fromhex(proof.proof))
    if why is not None:
        chan.try_error(why)
        raise ControlError(f"{chan.peer}: {why}")
    chan.authenticated(key, script, handshake.ACCEPTOR)
    chan.send(Welcome(kvservice=version))


def as_line(cmd: Struct) -> dict[str, Any]:
    """A validated command as the JSON object a child reads."""
    out: dict[str, Any] = json.loads(msgspec.json.encode(cmd))
    return out
