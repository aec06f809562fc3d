"""What a prefill rank tells the bootstrap registry, how it proves it, and the clients.

A registration is a JSON body ``{"dp_rank", "tp_rank", "address", "info", "incarnation",
"ts", "nonce"}`` sent as ``PUT /kvservice/ranks`` with the header ``X-KVService-MAC``: the
hex HMAC-SHA256, under a key derived from the cluster's key (``registry_key``), of the
method, the path and the body's exact bytes.  The registry checks the MAC over the bytes
it read *before* it parses them (an unauthenticated body is never more than a bounded
read); ``ts`` (the sender's wall clock) and ``nonce`` (32 hex digits, fresh per PUT) make
a recorded PUT useless outside ``WINDOW_S`` and, inside it, a nonce the registry has seen
is refused.  ``incarnation`` names the registering service (its agent name, new at every
start): the registry lets a rank's entry move only to a new incarnation, and only an
incarnation's own registration may change the pool it describes.

With a member identity (``identity_cert_file``; docs/security.md "Member identities") a
registration also carries the rank's member certificate (``X-KVService-Cert``, base64 DER)
and its member key's signature (``X-KVService-Signature``, base64) over what the MAC covers
(``signed_part``): the registry, which runs in the prefill's main process with the same
configuration, takes a rank only from its own member (``bootstrap``), so one member cannot
register as another's rank.  A lookup hands each registration on as signed, and a decode
with an identity checks it itself (``lookup_members``, ``rank_members``).

Without a key (``allow_unauthenticated``) registrations carry no MAC and the registry,
which has none either, believes them as before; it says so in its log when it starts.

The clients (``register``, ``lookup``) honour ``timeout`` as a total deadline for the
whole exchange (connect, send, every read), so a server that trickles bytes cannot hold
a caller past it, and read at most ``MAX_ANSWER`` bytes.
"""

from __future__ import annotations

import base64
import hmac
import json
import re
import secrets
import socket
import time
from typing import Any

from ..._control.addresses import split_address
from ..._results import KVServiceError
from ..._trust.identity import Identity, IdentityRefused

PATH = "/kvservice/ranks"
MAC_HEADER = "X-KVService-MAC"
CERT_HEADER = "X-KVService-Cert"
SIGNATURE_HEADER = "X-KVService-Signature"
MAX_BODY = 64 * 1024
MAX_RANKS = 4096
#: the most a client reads of an answer (a full registry's table fits many times over)
MAX_ANSWER = MAX_BODY * 64
#: a registration's ``ts`` must be this close to the registry's clock (either way); a
#: nonce is remembered as long
WINDOW_S = 30.0
#: what a prefill rank says about its pool, and a decode checks against its own
INFO_KEYS = ("attn_tp_size", "dp_size", "page_size", "kv_cache_dtype", "is_mla")
FIELDS = frozenset(("dp_rank", "tp_rank", "address", "info", "incarnation", "ts", "nonce"))
NONCE = re.compile(r"[0-9a-f]{32}")
#: service agent names (``ServiceConfig.agent_prefix`` plus a uuid), with room to spare
INCARNATION = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_KEY_LABEL = b"kvservice-sglang-bootstrap-registration-v1"
_SIGNED_LABEL = b"kvservice-sglang-rank-v1\0"


class BootstrapError(KVServiceError):
    """The bootstrap registry could not be reached, refused a registration, or answered
    something unusable.

    Raised by ``register`` and ``lookup``: a prefill rank retries its registration for
    a while, a decode retries its lookup, and a request that cannot learn its prefill
    fails (``KVPoll.Failed``, this as the original error)."""


def registry_key(cluster_key: bytes | None) -> bytes | None:
    """The registrations' MAC key: derived from the cluster's key, so that a registration's
    MAC can never pass for a proof of the control handshake (which uses the key itself);
    None without a cluster key."""
    return None if cluster_key is None else hmac.digest(cluster_key, _KEY_LABEL, "sha256")


def mac(key: bytes, body: bytes) -> str:
    """A registration's MAC (hex): over method, path and the body's exact bytes."""
    return hmac.digest(key, b"PUT " + PATH.encode() + b"\n" + body, "sha256").hex()


def mac_ok(key: bytes, body: bytes, claimed: str | None) -> bool:
    return claimed is not None and hmac.compare_digest(mac(key, body), claimed)


def signed_part(body: bytes) -> bytes:
    """What a rank's member signature covers: method, path and the body's exact bytes."""
    return _SIGNED_LABEL + b"PUT " + PATH.encode() + b"\n" + body


def signature_headers(identity: Identity, body: bytes) -> dict[str, str]:
    """The headers that prove ``body`` was registered by ``identity``'s member."""
    return {CERT_HEADER: base64.b64encode(identity.der).decode(),
            SIGNATURE_HEADER: base64.b64encode(identity.sign(signed_part(body))).decode()}


def check_registration(body: Any) -> dict[str, Any]:
    """``body`` if it is a registration whose every field is in range; ``ValueError``
    naming the first that is not."""
    if not isinstance(body, dict) or set(body) != FIELDS:
        raise ValueError(f"the body must be a JSON object with exactly the keys {', '.join(sorted(FIELDS))}")
    for name in ("dp_rank", "tp_rank"):
        value = body[name]
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < MAX_RANKS:
            raise ValueError(f"{name} must be an int in 0..{MAX_RANKS - 1}, got {value!r}")
    if not isinstance(body["address"], str):
        raise ValueError(f"address must be 'host:port', got {body['address']!r}")
    split_address(body["address"])  # raises ValueError naming the problem
    info = body["info"]
    if not isinstance(info, dict) or set(info) != set(INFO_KEYS):
        raise ValueError(f"info must be an object with exactly the keys {', '.join(INFO_KEYS)}")
    if not isinstance(body["incarnation"], str) or not INCARNATION.fullmatch(body["incarnation"]):
        raise ValueError("incarnation must be 1-128 of [A-Za-z0-9._-]")
    ts = body["ts"]
    if not isinstance(ts, (int, float)) or isinstance(ts, bool) or ts != ts or abs(ts) > 1e12:
        raise ValueError(f"ts must be a number of seconds since the epoch, got {ts!r}")
    if not isinstance(body["nonce"], str) or not NONCE.fullmatch(body["nonce"]):
        raise ValueError("nonce must be 32 lower-case hex digits")
    return body


# -- the clients ------------------------------------------------------------------------------------

def _exchange(bootstrap_addr: str, request: bytes, timeout: float) -> tuple[int, Any]:
    """Send ``request`` and read the whole answer, all within ``timeout`` seconds."""
    host, port = split_address(bootstrap_addr)
    deadline = time.monotonic() + timeout

    def left() -> float:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"no whole answer within {timeout}s")
        return remaining

    answer = bytearray()
    with socket.create_connection((host, port), timeout=left()) as sock:
        sock.settimeout(left())
        sock.sendall(request)
        while len(answer) <= MAX_ANSWER:  # ends at EOF, at the deadline, or past MAX_ANSWER
            sock.settimeout(left())
            data = sock.recv(65536)
            if not data:
                break
            answer += data
    if len(answer) > MAX_ANSWER:
        raise ValueError(f"an answer larger than {MAX_ANSWER} bytes")
    head, sep, body = bytes(answer).partition(b"\r\n\r\n")
    status = head.split(b"\r\n", 1)[0].split()
    if not sep or len(status) < 2 or not status[0].startswith(b"HTTP/1.") or not status[1].isdigit():
        raise ValueError(f"not an HTTP answer: {bytes(answer[:80])!r}")
    try:
        return int(status[1]), json.loads(body)
    except ValueError:
        return int(status[1]), None


def _call(method: str, bootstrap_addr: str, body: bytes | None, timeout: float,
          headers: dict[str, str] | None = None) -> tuple[int, Any]:
    lines = [f"{method} {PATH} HTTP/1.1", f"Host: {bootstrap_addr}", "Connection: close"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    if body is not None:
        lines += ["Content-Type: application/json", f"Content-Length: {len(body)}"]
    request = ("\r\n".join(lines) + "\r\n\r\n").encode() + (body or b"")
    try:
        return _exchange(bootstrap_addr, request, timeout)
    except (OSError, ValueError) as exc:  # refused, unreachable, timed out, not HTTP
        raise BootstrapError(f"bootstrap server {bootstrap_addr}: {type(exc).__name__}: {exc}") from exc


def register(bootstrap_addr: str, dp_rank: int, tp_rank: int, address: str, info: dict[str, Any], *,
             key: bytes | None, incarnation: str, identity: Identity | None = None, timeout: float = 5.0) -> None:
    """Register one prefill rank with the registry at ``bootstrap_addr`` ("host:port").
    ``key``: the cluster's key (None: unauthenticated); ``incarnation``: the registering
    service's agent name; ``identity``: its member identity, which signs the registration."""
    split_address(bootstrap_addr)  # ValueError for a malformed address
    body = json.dumps({"dp_rank": dp_rank, "tp_rank": tp_rank, "address": address, "info": info,
                       "incarnation": incarnation, "ts": time.time(), "nonce": secrets.token_hex(16)}).encode()
    derived = registry_key(key)
    headers = {MAC_HEADER: mac(derived, body)} if derived is not None else {}
    if identity is not None:
        headers |= signature_headers(identity, body)
    code, answer = _call("PUT", bootstrap_addr, body, timeout, headers)
    if code != 200:
        raise BootstrapError(f"bootstrap server {bootstrap_addr} refused the registration ({code}): {answer}")


def lookup(bootstrap_addr: str, timeout: float = 5.0) -> tuple[dict[str, Any], dict[str, str]]:
    """The prefill's pool description and its ranks' addresses (``"<dp>/<tp>"`` keys).

    A hint, not a proof: the decode dials the address and kvservice's handshake proves
    that whoever answers there holds the cluster's key (docs/sglang.md); with a member
    identity, ``lookup_members``."""
    info, ranks, _ = _lookup(bootstrap_addr, timeout)
    return info, ranks


class UnprovenRanks(BootstrapError):
    """A registry's answer does not prove its ranks' members (``rank_members``): the decode
    refuses the prefill rather than dial an address nobody vouched for."""


def lookup_ranks(bootstrap_addr: str, identity: Identity | None, timeout: float = 5.0
                 ) -> tuple[dict[str, Any], dict[str, str], dict[str, str] | None]:
    """What a decode rank looks up: ``lookup_members`` with a member identity, else
    ``lookup`` (members ``None``: nothing here can prove them)."""
    if identity is None:
        return (*lookup(bootstrap_addr, timeout), None)
    return lookup_members(bootstrap_addr, identity, timeout)


def pick_rank(bootstrap_addr: str, info: dict[str, Any], ranks: dict[str, str], members: dict[str, str] | None,
              mine: dict[str, Any], dp_rank: int, tp_rank: int) -> tuple[str, str | None]:
    """The address of the prefill rank that holds a decode rank's heads (described by
    ``mine``), and the member that must prove itself there (``None`` without identities);
    ``ValueError`` when the pools do not pair or the rank is not registered."""
    mine = {**mine, "dp_size": info["dp_size"]}
    if info != mine:
        raise ValueError(f"the prefill at {bootstrap_addr} has {info}, this decode rank {mine}: the kvservice "
                         "backend needs the same attention TP size, page size, KV dtype and attention kind")
    rank = f"{dp_rank}/{tp_rank}"
    address = ranks.get(rank)
    if address is None:
        raise ValueError(f"the prefill at {bootstrap_addr} has no rank dp={dp_rank} tp={tp_rank} "
                         f"registered (ranks: {sorted(ranks)})")
    return address, None if members is None else members[rank]


def lookup_members(bootstrap_addr: str, identity: Identity, timeout: float = 5.0
                   ) -> tuple[dict[str, Any], dict[str, str], dict[str, str]]:
    """``lookup``, and each rank's member as its own signed registration proves it
    (``rank_members``): the decode then takes the rank's address only from that member."""
    info, ranks, body = _lookup(bootstrap_addr, timeout)
    try:
        return info, ranks, rank_members(identity, ranks, body.get("proofs"))
    except ValueError as exc:
        raise UnprovenRanks(f"bootstrap server {bootstrap_addr}: {exc}") from exc


def rank_members(identity: Identity, ranks: dict[str, str], proofs: Any) -> dict[str, str]:
    """Each rank's member name, from the registration the registry hands on as the rank's
    member signed it: its certificate issued by this cluster's authority, its incarnation
    an agent of that member, its signature good, and the rank and address it names those
    the lookup says.  ``ValueError`` saying why for the first rank that does not check out
    (a registry without an identity hands on none)."""
    if not isinstance(proofs, dict) or not isinstance(proofs.get("certs"), list) or \
            not isinstance(proofs.get("ranks"), dict):
        raise ValueError("its answer carries no signed registrations (a prefill without a member identity, or "
                         "altered on the way), and this decode takes ranks only from members that prove them")
    certs, signed = proofs["certs"], proofs["ranks"]
    members: dict[str, str] = {}
    for rank, address in ranks.items():
        proof = signed.get(rank)
        try:
            if not isinstance(proof, dict) or not isinstance(proof.get("cert"), int) or \
                    not 0 <= proof["cert"] < len(certs):
                raise ValueError("no signed registration")
            body = base64.b64decode(str(proof.get("registration", "")), validate=True)
            signature = base64.b64decode(str(proof.get("signature", "")), validate=True)
            cert = base64.b64decode(str(certs[proof["cert"]]), validate=True)
            reg = check_registration(json.loads(body))
        except ValueError as exc:  # binascii.Error and json.JSONDecodeError are ones
            raise ValueError(f"rank {rank}: its signed registration is unusable: {exc}") from exc
        if f"{reg['dp_rank']}/{reg['tp_rank']}" != rank or reg["address"] != address:
            raise ValueError(f"rank {rank} at {address}: its signed registration is rank "
                             f"{reg['dp_rank']}/{reg['tp_rank']} at {reg['address']} (altered on the way?)")
        try:
            member = identity.check(cert, reg["incarnation"], signature, signed_part(body))
        except IdentityRefused as exc:
            raise ValueError(f"rank {rank}: its registration does not prove a member: {exc}") from exc
        members[rank] = member.name
    return members


def _lookup(bootstrap_addr: str, timeout: float) -> tuple[dict[str, Any], dict[str, str], dict[str, Any]]:
    split_address(bootstrap_addr)  # ValueError for a malformed address
    code, body = _call("GET", bootstrap_addr, None, timeout)
    if code != 200 or not isinstance(body, dict):
        raise BootstrapError(f"bootstrap server {bootstrap_addr} has no kvservice ranks ({code}): {body}")
    info, ranks = body.get("info"), body.get("ranks")
    if not isinstance(info, dict) or set(info) != set(INFO_KEYS) or not isinstance(ranks, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in ranks.items()):
        raise BootstrapError(f"bootstrap server {bootstrap_addr} answered something that is not a kvservice "
                             f"registry: {str(body)[:500]}")
    return info, ranks, body
