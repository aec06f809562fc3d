"""The bootstrap registry: where a decode finds the prefill ranks' kvservice addresses.

SGLang gives a request the prefill's *bootstrap* address (its host and
``--disaggregation-bootstrap-port``), not its transfer endpoint.  The prefill's main
process runs this registry there (``KVBootstrapServer`` in ``conn``); each prefill rank's
``KVManager`` registers its kvservice control address, and a decode rank looks the ranks
up once per prefill and caches them.  Everything after that goes over kvservice's own
authenticated control link: a lookup's answer is a hint, the handshake is the proof.

HTTP/1.1, one request per connection, JSON bodies, served by an event loop on a thread of
its own (``Registry``):

* ``PUT /kvservice/ranks``: a prefill rank registers, authenticated (``registration``):
  refused unless its MAC verifies under the cluster's key, its ``ts`` is within
  ``WINDOW_S`` and its nonce is new.  A rank's entry moves only to a *new* incarnation (a
  restarted rank); an incarnation does not move or change its pool once registered, and
  holds one rank.  The pool description (``info``: TP size, page size, dtype...) is fixed
  by the first registration and changes only with an existing rank's new incarnation,
  which then starts the table afresh (the old pool's ranks register again when they
  restart).  Without a key, registrations are believed as before: the newest wins.
  With a member identity (the prefill's configuration has one, and so has each of its
  ranks: they read the same file) a registration must also be signed by this prefill's
  own member (``registration.signature_headers``): one without a signature is refused
  (``identity_missing``), one whose certificate or signature does not check out, or
  whose incarnation is not an agent of the certificate's member (``identity``), one by
  another member (``member``), or by this member's name certified for another role
  (``identity_role``): so a member of the cluster, holding the cluster's key and a
  certificate of its own, cannot take this prefill's ranks.
* ``GET /kvservice/ranks``: ``{"info": {...}, "ranks": {"<dp>/<tp>": "host:port"}}``;
  503 while no rank has registered.  Unauthenticated: what it says can only point a
  decode at an address whose service must still pass the handshake.  With a member
  identity it also carries each rank's registration as its member signed it
  (``"proofs"``): a decode with an identity checks each itself
  (``registration.rank_members``) and takes a rank's address only from the member that
  proves itself there (``expect(member=)``), so neither whoever sits on the lookup's path
  nor a member answering on the rank's address can point the decode at another member.
* ``GET /metrics``: Prometheus text, the refusals below as
  ``kvservice_refused_total{where="sglang_bootstrap", kind}`` and the connections open.

Bounded (each a refusal, counted in ``refused`` by kind, in ``/metrics``, and logged at
most ``Throttle``'s burst): ``max_per_peer`` connections open from one host (past it a
connection is answered 503 with the reason, ``peer_connections``) and ``max_connections``
in all.  At that cap a host is not locked out by others' connections: a connection from a
host holding fewer than the busiest host closes that host's oldest (``evicted``), so
idle connections from a few addresses cannot keep a lookup or a registration out; only
when every host holds as many as the newcomer's is it answered 503 (``connections``).
A request must arrive whole within ``read_deadline_s`` (a slow or idle connection is
cut); a head of at most ``MAX_HEAD`` bytes and a body of at most ``MAX_BODY``; at most
``MAX_RANKS`` ranks and ``MAX_NONCES`` remembered nonces.  A failed ``accept()`` backs
off (``_control.accept``).
"""

from __future__ import annotations

import base64
import binascii
import collections
import json
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.abc
import anyio.from_thread
from anyio.abc import SocketAttribute
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ..._control.accept import accept_loop
from ..._log import Throttle, get_logger
from ..._metrics import refused_family
from ..._results import KVServiceError
from ..._trust.identity import IDENTITY, NO_IDENTITY, ROLE, Identity, IdentityRefused, Member, role_claim
from .registration import (
    CERT_HEADER,
    INFO_KEYS,
    MAC_HEADER,
    MAX_BODY,
    MAX_RANKS,
    PATH,
    SIGNATURE_HEADER,
    WINDOW_S,
    BootstrapError,
    check_registration,
    lookup,
    mac_ok,
    register,
    registry_key,
    signed_part,
)

__all__ = ["INFO_KEYS", "MAX_BODY", "PATH", "BootstrapError", "Registry", "lookup", "register"]

log = get_logger("kvservice.sglang")

METRICS_PATH = "/metrics"
#: a head with a member certificate (at most ``MAX_CERT_BYTES``, base64) and its signature fits
MAX_HEAD = 16 * 1024
MAX_CONNECTIONS = 128
MAX_PER_PEER = 32
READ_DEADLINE_S = 5.0
WRITE_DEADLINE_S = 5.0
#: how long a connection refused at a cap may take to be told why and to close its end (then
#: it is just closed)
REFUSE_WRITE_S = 1.0
#: nonces remembered for ``WINDOW_S``; a full book refuses new registrations (only
#: authenticated ones are remembered, so only a member could fill it)
MAX_NONCES = 65536
_REASONS = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 403: "Forbidden", 404: "Not Found", 409: "Conflict",
            413: "Payload Too Large", 503: "Service Unavailable"}


class Refusal(KVServiceError):
    """Raised inside the registry's request handler when a request is refused (unauthenticated,
    replayed, oversized, a pool change, ...): ``kind`` is its counter, ``code`` the HTTP status
    the client gets.  It never leaves the handler: the connection is answered and closed."""

    def __init__(self, kind: str, code: int, why: str) -> None:
        super().__init__(why)
        self.kind, self.code = kind, code

    def __reduce__(self) -> tuple[object, ...]:  # pickle rebuilds it from __init__'s arguments
        return type(self), (self.kind, self.code, str(self)), self.__dict__


@dataclass(frozen=True, slots=True)
class _Entry:
    address: str
    incarnation: str
    info: dict[str, Any]
    #: with a member identity: the registration as signed (its body, certificate and
    #: signature, base64), which a lookup hands on so a decode can check it itself
    proof: tuple[str, str, str] | None = field(default=None, compare=False)


def _b64(value: str | None) -> bytes:
    try:
        return base64.b64decode(value or "", validate=True)
    except (binascii.Error, ValueError) as exc:
        raise Refusal(IDENTITY, 401, "the registration's certificate or signature is not base64") from exc


def _http(code: int, data: bytes, content_type: str = "application/json") -> bytes:
    return (f"HTTP/1.1 {code} {_REASONS.get(code, '')}\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n").encode() + data


def _refusal_answer(exc: Refusal) -> bytes:
    return _http(exc.code, json.dumps({"error": str(exc), "kind": exc.kind}).encode())


async def _read_request(stream: anyio.abc.ByteStream) -> tuple[str, str, dict[str, str], bytes]:
    """Method, path, headers (lower-case names) and body of one request; ``Refusal`` when
    it is not a small, well-formed one."""
    buf = bytearray()
    while (end := buf.find(b"\r\n\r\n")) < 0:
        if len(buf) > MAX_HEAD:
            raise Refusal("oversize", 413, f"a request head larger than {MAX_HEAD} bytes")
        buf += await stream.receive(MAX_HEAD)
    lines = bytes(buf[:end]).decode("latin-1").split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        raise Refusal("request", 400, f"not an HTTP/1 request line: {lines[0][:80]!r}")
    method, path = parts[0], parts[1]
    if path not in (PATH, METRICS_PATH):
        raise Refusal("request", 404, f"unknown path {path[:80]!r}")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if not sep:
            raise Refusal("request", 400, "a header line without ':'")
        headers[name.strip().lower()] = value.strip()
    body = bytearray(buf[end + 4:])
    if method == "PUT":
        raw = headers.get("content-length", "")
        if not raw.isdigit() or int(raw) > MAX_BODY:
            raise Refusal("oversize" if raw.isdigit() else "request", 413 if raw.isdigit() else 400,
                          f"a body of 0..{MAX_BODY} bytes with a Content-Length is required")
        while len(body) < int(raw):
            body += await stream.receive(int(raw) - len(body))
        if len(body) > int(raw):
            raise Refusal("request", 400, "more bytes than the Content-Length")
    elif method != "GET":
        raise Refusal("request", 400, f"method {method[:16]!r} is not GET or PUT")
    if path == METRICS_PATH and method != "GET":
        raise Refusal("request", 400, f"{METRICS_PATH} takes GET only")
    return method, path, headers, bytes(body)


class Registry:
    """The registry's state and server.  ``port=0`` picks a free port (``port``);
    ``key`` is the cluster's key (None: registrations are believed unauthenticated);
    ``identity`` the prefill's member identity (its ranks' registrations must be signed
    by that member)."""

    def __init__(self, host: str, port: int, *, key: bytes | None, identity: Identity | None = None,
                 max_connections: int = MAX_CONNECTIONS,
                 max_per_peer: int = MAX_PER_PEER, read_deadline_s: float = READ_DEADLINE_S,
                 window_s: float = WINDOW_S, clock: Callable[[], float] = time.time) -> None:
        self._key = registry_key(key)
        if identity is not None and self._key is None:
            raise ValueError("a registry with a member identity needs the cluster's key (registrations are MAC'd "
                             "before a certificate is parsed)")
        self._identity = identity
        self._max_connections, self._max_per_peer = max_connections, max_per_peer
        self._read_deadline, self._window, self._clock = read_deadline_s, window_s, clock
        self._lock = threading.Lock()  # the loop writes, ``snapshot`` may be called from anywhere
        self._ranks: dict[str, _Entry] = {}
        self._info: dict[str, Any] | None = None
        self._holds: dict[str, str] = {}  # incarnation -> the rank it registered
        self._nonces: dict[str, float] = {}  # nonce -> when it may be forgotten
        #: peer host -> its open connections' cancel scopes, oldest first
        self._open: dict[str, collections.deque[anyio.CancelScope]] = {}
        self._lingering = 0  # refused connections waiting for their client to close (``_tell_refused``)
        #: refusals by kind; ``errors``: failed accepts and crashed handlers
        self.refused: collections.Counter[str] = collections.Counter()
        self.errors: collections.Counter[str] = collections.Counter()
        self._throttle = Throttle()
        if self._key is None:
            log.warning("sglang.bootstrap.unauthenticated", host=host, port=port,
                        detail="allow_unauthenticated: anyone who reaches this port can register "
                               "a prefill rank; decodes still dial only services that pass the handshake")
        self._portal_cm = anyio.from_thread.start_blocking_portal(name="kvservice-sglang-bootstrap")
        self._portal = self._portal_cm.__enter__()
        try:
            self._task, self.port = self._portal.start_task(self._serve, host, port)
        except BaseException:
            self._portal_cm.__exit__(None, None, None)
            raise

    # -- state ---------------------------------------------------------------------------------
    def register(self, body: bytes, claimed_mac: str | None, peer: str, cert: str | None = None,
                 signature: str | None = None) -> None:
        """Check and apply one registration's raw body (with its MAC and, where this
        registry has an identity, its member certificate and signature, base64 as sent);
        ``Refusal`` naming what is wrong."""
        keyed = self._key is not None
        if self._key is not None and claimed_mac is None:
            raise Refusal("unauthenticated", 401, "registrations must carry a MAC under the cluster's key")
        if self._key is not None and not mac_ok(self._key, body, claimed_mac):
            raise Refusal("forged", 401, "the registration's MAC does not verify (wrong key, or altered)")
        try:
            reg = check_registration(json.loads(body))
        except ValueError as exc:  # json.JSONDecodeError is one
            raise Refusal("registration", 400, str(exc)) from exc
        rank, new = f"{reg['dp_rank']}/{reg['tp_rank']}", _Entry(reg["address"], reg["incarnation"], reg["info"])
        member = self._prove(body, reg["incarnation"], rank, cert, signature)
        if member is not None and cert and signature:
            new = _Entry(new.address, new.incarnation, new.info, (base64.b64encode(body).decode(), cert, signature))
        now = self._clock()
        with self._lock:
            if keyed:
                self._fresh(reg["ts"], reg["nonce"], now)
            old = self._ranks.get(rank)
            if keyed:
                self._check_move(rank, old, new)
            elif self._info is not None and new.info != self._info and old is None:
                raise Refusal("conflict", 409, f"rank {rank} describes its pool as {new.info}, "
                                               f"the registered ranks as {self._info}")
            if old is None and len(self._ranks) >= MAX_RANKS:
                raise Refusal("registration", 400, f"the registry holds {MAX_RANKS} ranks already")
            restart = keyed and old is not None and new.info != self._info
            if restart:  # a restarted rank describes another pool: the old pool's table goes
                self._ranks.clear()
                self._holds.clear()
            if old is not None:
                self._holds.pop(old.incarnation, None)
            self._ranks[rank] = new
            self._holds[new.incarnation] = rank
            self._info = new.info
        if restart:
            log.warning("sglang.bootstrap.pool_changed", rank=rank, incarnation=new.incarnation, info=new.info)
        log.info("sglang.bootstrap.registered", rank=rank, address=new.address, incarnation=new.incarnation,
                 peer=peer, authenticated=keyed, member=member.uri if member is not None else None)

    def _prove(self, body: bytes, incarnation: str, rank: str, cert: str | None,
               signature: str | None) -> Member | None:
        """The member that signed a registration of ``rank`` (``None`` without an identity
        here); ``Refusal`` unless it is this prefill's own member, in its own role."""
        own = self._identity
        if own is None:
            return None
        if not cert or not signature:
            raise Refusal(NO_IDENTITY, 401, f"a registration of rank {rank} without its member's certificate and "
                                            f"signature ({CERT_HEADER}, {SIGNATURE_HEADER}): this registry takes "
                                            f"ranks only from member {own.member.uri}")
        try:
            member = own.check(_b64(cert), incarnation, _b64(signature), signed_part(body))
        except IdentityRefused as exc:
            raise Refusal(IDENTITY, 401, f"rank {rank}: {exc}") from exc
        if member.name != own.member.name:
            raise Refusal("member", 403, f"rank {rank} registered by member {member.uri}: this registry takes ranks "
                                         f"only from the prefill it runs in, member {own.member.uri}")
        if (why := role_claim(member, own.member.role)) is not None:
            raise Refusal(ROLE, 403, f"rank {rank} registered as this prefill's member {own.member.uri}: {why}")
        return member

    def _fresh(self, ts: float, nonce: str, now: float) -> None:
        if abs(now - ts) > self._window:
            raise Refusal("stale", 401, f"the registration's time is {now - ts:.0f}s from the registry's "
                                        f"(at most {self._window:.0f}s): replayed, or a clock is wrong")
        if nonce in self._nonces:
            raise Refusal("replayed", 401, "a registration with this nonce was seen already")
        if len(self._nonces) >= MAX_NONCES:
            self._nonces = {n: t for n, t in self._nonces.items() if t > now}
            if len(self._nonces) >= MAX_NONCES:
                raise Refusal("busy", 503, "too many registrations in the last window")
        self._nonces[nonce] = now + 2 * self._window

    def _check_move(self, rank: str, old: _Entry | None, new: _Entry) -> None:
        held = self._holds.get(new.incarnation)
        if held is not None and held != rank:
            raise Refusal("conflict", 409, f"incarnation {new.incarnation} holds rank {held} already")
        if old is not None and old.incarnation == new.incarnation and old != new:
            raise Refusal("conflict", 409, f"incarnation {new.incarnation} registered rank {rank} at "
                                           f"{old.address} with {old.info}: an incarnation does not move")
        if old is None and self._info is not None and new.info != self._info:
            raise Refusal("conflict", 409, f"rank {rank} describes its pool as {new.info}, the registered "
                                           f"ranks as {self._info}: only a restarted rank may change it")

    def snapshot(self) -> dict[str, Any]:
        """What ``GET`` answers; with a member identity also each rank's registration as its
        member signed it (``proofs``: the certificates once, ``registration.rank_members``)."""
        with self._lock:
            entries = dict(self._ranks)
            answer: dict[str, Any] = {"info": self._info, "ranks": {k: e.address for k, e in entries.items()}}
        if self._identity is not None:
            certs: list[str] = []
            proofs: dict[str, dict[str, Any]] = {}
            for rank, entry in entries.items():
                if entry.proof is not None:
                    body, cert, signature = entry.proof
                    if cert not in certs:
                        certs.append(cert)
                    proofs[rank] = {"registration": body, "signature": signature, "cert": certs.index(cert)}
            answer["proofs"] = {"certs": certs, "ranks": proofs}
        return answer

    def metrics(self) -> bytes:
        """``GET /metrics``: the refusals by kind and the connections open, Prometheus text."""
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Families(self))
        return generate_latest(registry)

    def refuse(self, kind: str, why: str, peer: str) -> None:
        self.refused[kind] += 1
        if (unlogged := self._throttle.allow(kind)) is not None:
            log.warning("sglang.bootstrap.refused", kind=kind, why=why, peer=peer, unlogged=unlogged)

    # -- serving -------------------------------------------------------------------------------
    async def _serve(self, host: str, port: int, *, task_status: anyio.abc.TaskStatus[int]) -> None:
        async with await anyio.create_tcp_listener(local_host=host, local_port=port) as listener:
            task_status.started(int(listener.extra(SocketAttribute.local_port)))
            async with anyio.create_task_group() as tg:
                await accept_loop(listener, self._connection, tg, self._error, name="sglang-bootstrap")

    def _error(self, kind: str, exc: BaseException) -> None:
        self.errors[kind] += 1

    def _admit(self, peer: str) -> Refusal | None:
        """Make room for a connection from ``peer``, or say why not (on the loop)."""
        mine = len(self._open.get(peer, ()))
        if mine >= self._max_per_peer:
            return Refusal("peer_connections", 503, f"{self._max_per_peer} connections from {peer} are open "
                                                    "already; retry when one is answered")
        if sum(len(q) for q in self._open.values()) < self._max_connections:
            return None
        busiest = max(self._open, key=lambda host: len(self._open[host]))
        if len(self._open[busiest]) <= mine + 1:  # every host holds its share: nobody to shed
            return Refusal("connections", 503, f"{self._max_connections} connections are open already; "
                                               "retry when one is answered")
        self._open[busiest].popleft().cancel()  # the busiest host's oldest makes room
        self.refuse("evicted", f"{busiest}'s oldest connection closed for one from {peer}", busiest)
        return None

    async def _connection(self, stream: anyio.abc.SocketStream) -> None:
        """One request, under the caps and the read deadline; whatever happens ends here."""
        peer = str(stream.extra(SocketAttribute.remote_address, ("?",))[0])
        refusal = self._admit(peer)
        if refusal is not None:
            self.refuse(refusal.kind, str(refusal), peer)
            await self._tell_refused(stream, refusal)
            return
        scope = anyio.CancelScope()
        self._open.setdefault(peer, collections.deque()).append(scope)
        try:
            with scope:
                await self._answer_one(stream, peer)
        except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            pass  # the client went away: nothing to answer
        finally:
            held = self._open.get(peer)
            if held is not None:
                if scope in held:
                    held.remove(scope)
                if not held:
                    del self._open[peer]

    async def _tell_refused(self, stream: anyio.abc.SocketStream, refusal: Refusal) -> None:
        """Answer a connection refused at a cap, before its request is read, and end it so
        that the answer reaches it: half-close after the answer, then read and drop what the
        client sends until it closes its end (``MAX_HEAD`` bytes at most), all within
        ``REFUSE_WRITE_S``.  Closed at once instead, a socket with the client's request unread
        in it resets the connection, and a reset throws away whatever of the answer was not
        sent yet, or not read (the client then saw "connection reset by peer", not why).
        While as many refused connections as ``max_connections`` linger so, the next is
        answered and closed at once (a flood of them holds no more sockets than that)."""
        linger = self._lingering < self._max_connections
        if linger:
            self._lingering += 1
        try:
            with anyio.move_on_after(REFUSE_WRITE_S):  # told why, if it reads; never waited on long
                await stream.send(_refusal_answer(refusal))
                if linger:
                    await stream.send_eof()
                    dropped = 0
                    while dropped <= MAX_HEAD:
                        dropped += len(await stream.receive(MAX_HEAD))
        except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            pass  # the client closed its end (or went away): nothing unread is left to reset it
        finally:
            if linger:
                self._lingering -= 1

    async def _answer_one(self, stream: anyio.abc.SocketStream, peer: str) -> None:
        try:
            with anyio.fail_after(self._read_deadline):
                method, path, headers, body = await _read_request(stream)
            if path == METRICS_PATH:
                data = _http(200, self.metrics(), "text/plain; version=0.0.4; charset=utf-8")
            elif method == "GET":
                answer = self.snapshot()
                data = _http(200 if answer["ranks"] else 503, json.dumps(answer).encode())
            else:
                self.register(body, headers.get(MAC_HEADER.lower()), peer, headers.get(CERT_HEADER.lower()),
                              headers.get(SIGNATURE_HEADER.lower()))
                data = _http(200, json.dumps({"ok": True}).encode())
        except TimeoutError:
            self.refuse("slow", f"no whole request within {self._read_deadline}s", peer)
            return
        except Refusal as exc:
            self.refuse(exc.kind, str(exc), peer)
            data = _refusal_answer(exc)
        with anyio.move_on_after(WRITE_DEADLINE_S):
            await stream.send(data)

    def close(self) -> None:
        self._task.cancel()
        self._portal_cm.__exit__(None, None, None)


class _Families(Collector):
    """The registry's families, read at each scrape."""

    def __init__(self, registry: Registry) -> None:
        self._registry = registry

    def collect(self) -> Iterator[Metric]:
        reg = self._registry
        refused = [("sglang_bootstrap", kind, n) for kind, n in sorted(dict(reg.refused).items())]
        errors = [("sglang_bootstrap", f"error_{kind}", n) for kind, n in sorted(dict(reg.errors).items())]
        yield refused_family(refused + errors)
        open_now = GaugeMetricFamily("kvservice_sglang_bootstrap_connections",
                                     "Connections open to the SGLang bootstrap registry")
        open_now.add_metric([], sum(len(q) for q in dict(reg._open).values()))
        yield open_now
