"""The SGLang bootstrap registry under hostile input (``integrations/sglang/bootstrap.py``).

Runs without SGLang: the registry and its clients are plain kvservice.  After every attack
the registry still serves, and a legitimate rank still registers and is found where it
registered (``legit_pair_still_works``); every refusal is counted by kind.  The SGLang
classes' own path through a registry under attack is ``tests/integrations/sglang``.
"""

from __future__ import annotations

import json
import secrets
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import anyio
import pytest
import structlog

from kvservice.integrations.sglang import bootstrap, registration
from tests.helpers import eventually_sync

KEY = secrets.token_bytes(32)
INFO = {"attn_tp_size": 2, "dp_size": 1, "page_size": 16, "kv_cache_dtype": "auto", "is_mla": False}


@pytest.fixture
def registry() -> Iterator[bootstrap.Registry]:
    reg = bootstrap.Registry("127.0.0.1", 0, key=KEY, max_connections=8, max_per_peer=4, read_deadline_s=1.0)
    try:
        yield reg
    finally:
        reg.close()


def addr(reg: bootstrap.Registry) -> str:
    return f"127.0.0.1:{reg.port}"


def legit_pair_still_works(reg: bootstrap.Registry, rank: int = 7) -> None:
    """A real rank registers under the cluster's key and a lookup finds it, with the pool
    as the first rank described it."""
    bootstrap.register(addr(reg), 0, rank, f"127.0.0.1:{9000 + rank}", INFO, key=KEY,
                       incarnation=f"legit-{secrets.token_hex(4)}")
    info, ranks = bootstrap.lookup(addr(reg), timeout=5)
    assert info == INFO and ranks[f"0/{rank}"] == f"127.0.0.1:{9000 + rank}"


def signed_put(reg: bootstrap.Registry, body: dict[str, Any], key: bytes | None = KEY) -> bytes:
    """A raw registration request (what a recording of one on the wire holds)."""
    raw = json.dumps(body).encode()
    head = f"PUT {bootstrap.PATH} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(raw)}\r\n"
    derived = registration.registry_key(key)
    if derived is not None:
        head += f"{registration.MAC_HEADER}: {registration.mac(derived, raw)}\r\n"
    return (head + "\r\n").encode() + raw


def send_raw(reg: bootstrap.Registry, request: bytes) -> int:
    """Send ``request``; the answer's HTTP status."""
    code, _ = registration._exchange(addr(reg), request, 5.0)
    return code


def body(rank: int, address: str, incarnation: str, *, info: dict[str, Any] = INFO, ts: float | None = None
         ) -> dict[str, Any]:
    return {"dp_rank": 0, "tp_rank": rank, "address": address, "info": info, "incarnation": incarnation,
            "ts": time.time() if ts is None else ts, "nonce": secrets.token_hex(16)}


def test_an_unauthenticated_or_forged_registration_cannot_redirect_a_rank(registry: bootstrap.Registry) -> None:
    bootstrap.register(addr(registry), 0, 0, "127.0.0.1:7000", INFO, key=KEY, incarnation="prefill-a")
    with structlog.testing.capture_logs() as logs:
        with pytest.raises(bootstrap.BootstrapError, match="401"):  # no MAC: today's redirect
            bootstrap.register(addr(registry), 0, 0, "10.6.6.6:7000", INFO, key=None, incarnation="mitm")
        with pytest.raises(bootstrap.BootstrapError, match="401"):  # a MAC under another key
            bootstrap.register(addr(registry), 0, 0, "10.6.6.6:7000", INFO, key=secrets.token_bytes(32),
                               incarnation="mitm")
        altered = signed_put(registry, body(0, "127.0.0.1:7000", "mitm")).replace(b"127.0.0.1:7000",
                                                                                    b"10.6.6.6:70000")
        assert send_raw(registry, altered) == 401  # signed, then altered on the way
    assert registry.refused == {"unauthenticated": 1, "forged": 2}
    assert [e["kind"] for e in logs if e["event"] == "sglang.bootstrap.refused"] == [
        "unauthenticated", "forged", "forged"]
    assert bootstrap.lookup(addr(registry))[1] == {"0/0": "127.0.0.1:7000"}
    legit_pair_still_works(registry)


def test_a_recorded_registration_does_not_replay(registry: bootstrap.Registry) -> None:
    recorded = signed_put(registry, body(0, "127.0.0.1:7000", "prefill-a"))
    assert send_raw(registry, recorded) == 200
    assert send_raw(registry, recorded) == 401  # the same nonce, inside the window
    old = signed_put(registry, body(1, "127.0.0.1:7001", "prefill-b", ts=time.time() - 10 * registration.WINDOW_S))
    assert send_raw(registry, old) == 401  # recorded long ago: outside the window
    ahead = signed_put(registry, body(1, "127.0.0.1:7001", "prefill-b", ts=time.time() + 10 * registration.WINDOW_S))
    assert send_raw(registry, ahead) == 401
    assert registry.refused == {"replayed": 1, "stale": 2}
    assert bootstrap.lookup(addr(registry))[1] == {"0/0": "127.0.0.1:7000"}
    legit_pair_still_works(registry)


def test_no_registration_changes_the_pool_but_a_restarted_ranks_own(registry: bootstrap.Registry) -> None:
    """The reproduced attack: a PUT with another TP size made every decode refuse the
    prefill.  Unauthenticated it is refused; authenticated, a new rank cannot describe
    another pool and an incarnation cannot change its own; only a restarted rank (a new
    incarnation of a registered rank) can, and the table then starts afresh."""
    bootstrap.register(addr(registry), 0, 0, "127.0.0.1:7000", INFO, key=KEY, incarnation="prefill-a")
    bootstrap.register(addr(registry), 0, 1, "127.0.0.1:7001", INFO, key=KEY, incarnation="prefill-b")
    other = {**INFO, "attn_tp_size": 8}
    tries = [(0, "127.0.0.1:7000", None, "prefill-a"),  # unauthenticated
             (2, "127.0.0.1:7002", KEY, "prefill-c"),  # a new rank with another pool
             (0, "127.0.0.1:7000", KEY, "prefill-a"),  # the same incarnation, another pool
             (1, "127.0.0.1:7009", KEY, "prefill-b"),  # the same incarnation, moved
             (2, "127.0.0.1:7002", KEY, "prefill-a")]  # one incarnation, a second rank
    for rank, address, key, incarnation in tries:
        with pytest.raises(bootstrap.BootstrapError, match="refused"):
            bootstrap.register(addr(registry), 0, rank, address, other if rank != 1 else INFO, key=key,
                               incarnation=incarnation)
    assert registry.refused == {"unauthenticated": 1, "conflict": 4}
    assert bootstrap.lookup(addr(registry)) == (INFO, {"0/0": "127.0.0.1:7000", "0/1": "127.0.0.1:7001"})
    legit_pair_still_works(registry)
    bootstrap.register(addr(registry), 0, 0, "127.0.0.1:7000", INFO, key=KEY, incarnation="prefill-a")  # a retry
    with structlog.testing.capture_logs() as logs:
        bootstrap.register(addr(registry), 0, 0, "127.0.0.1:7100", other, key=KEY, incarnation="prefill-a2")
    assert bootstrap.lookup(addr(registry)) == (other, {"0/0": "127.0.0.1:7100"})
    assert "sglang.bootstrap.pool_changed" in [e["event"] for e in logs]


def idle(source: str, port: int) -> socket.socket:
    s = socket.socket()
    s.bind((source, 0))
    s.connect(("127.0.0.1", port))
    return s


def ended(s: socket.socket, bound_s: float = 30.0) -> bool:
    """Whether the server closed ``s`` (reads EOF or a reset) within ``bound_s``."""
    s.settimeout(bound_s)
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def answer(s: socket.socket, bound_s: float = 30.0) -> bytes:
    """What the server wrote to ``s`` before closing it (b"" for a bare close), within ``bound_s``."""
    s.settimeout(bound_s)
    got = b""
    try:
        while len(got) < 65536:
            data = s.recv(65536)
            if not data:
                break
            got += data
    except ConnectionResetError:
        pass
    return got


def metrics(reg: bootstrap.Registry) -> dict[str, float]:
    """``GET /metrics``, its samples by name and labels, as a scraper reads them."""
    request = f"GET {bootstrap.METRICS_PATH} HTTP/1.1\r\nHost: x\r\n\r\n".encode()
    with socket.create_connection(("127.0.0.1", reg.port), timeout=10) as s:
        s.sendall(request)
        raw = answer(s)
    head, _, text = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), raw[:200]
    samples = {}
    for line in text.decode().splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples


def test_an_idle_flood_from_a_few_addresses_locks_out_no_lookup() -> None:
    """Issue 39's case at the registry's own caps: 4 loopback addresses open 40 idle
    connections each, without any key.  Past the per-host cap each is answered 503 saying
    why (not closed without an answer); the flood fills the cap, and a lookup and a
    registration from another address still get in (the busiest host's oldest connection
    makes room) and are answered.  Every refusal is counted in ``/metrics``."""
    registry = bootstrap.Registry("127.0.0.1", 0, key=KEY, read_deadline_s=120)  # held past the test
    per_peer, cap = bootstrap.MAX_PER_PEER, bootstrap.MAX_CONNECTIONS
    held: list[socket.socket] = []
    try:
        for source in ("127.0.0.2", "127.0.0.3", "127.0.0.4", "127.0.0.5"):
            held += [idle(source, registry.port) for _ in range(40)]
        eventually_sync(lambda: registry.refused["peer_connections"] == 4 * (40 - per_peer), 60,
                        what=lambda: f"per-host refusals, counted {registry.refused}")
        for host in range(4):  # each host's last 8 were told why, then closed
            for s in held[host * 40 + per_peer:(host + 1) * 40]:
                raw = answer(s, 10)
                assert raw.startswith(b"HTTP/1.1 503") and b'"kind": "peer_connections"' in raw, raw[:300]
        assert 4 * per_peer >= cap  # the rest fill the registry
        eventually_sync(lambda: sum(len(q) for q in registry._open.values()) == cap, 60, what="the cap reached")
        legit_pair_still_works(registry, 3)  # a registration and a lookup from 127.0.0.1, answered
        assert registry.refused["evicted"] >= 1, registry.refused  # the first made room; then one was free
        samples = metrics(registry)
        assert samples['kvservice_refused_total{kind="peer_connections",where="sglang_bootstrap"}'] == \
            4 * (40 - per_peer)
        assert samples['kvservice_refused_total{kind="evicted",where="sglang_bootstrap"}'] >= 1
        assert samples["kvservice_sglang_bootstrap_connections"] <= cap
    finally:
        for s in held:
            s.close()
        registry.close()


def test_a_refusal_at_a_cap_is_an_http_503_saying_why(monkeypatch: pytest.MonkeyPatch) -> None:
    """A host past its cap, and a newcomer when every host holds its share of a full
    registry: each reads a 503 whose body names the cap (the decode's lookup then fails
    with that reason, not "not an HTTP answer")."""
    registry = bootstrap.Registry("127.0.0.1", 0, key=KEY, max_connections=4, max_per_peer=2, read_deadline_s=120)
    held: list[socket.socket] = []
    try:
        held += [idle("127.0.0.2", registry.port) for _ in range(2)]
        eventually_sync(lambda: sum(len(q) for q in registry._open.values()) == 2, 30, what="two held")
        original = socket.create_connection
        monkeypatch.setattr(socket, "create_connection",  # the lookup from 127.0.0.2
                            lambda address, timeout=None: original(address, timeout, ("127.0.0.2", 0)))
        with pytest.raises(bootstrap.BootstrapError, match=r"503.*2 connections from 127\.0\.0\.2 are open already"):
            bootstrap.lookup(addr(registry), timeout=10)
        monkeypatch.undo()
        held += [idle("127.0.0.3", registry.port) for _ in range(2)]
        eventually_sync(lambda: sum(len(q) for q in registry._open.values()) == 4, 30, what="four held")
        held += [idle("127.0.0.4", registry.port)]  # at the cap: .4 holds none, so .2's oldest makes room
        eventually_sync(lambda: registry.refused["evicted"] == 1, 30, what=lambda: f"{registry.refused}")
        held += [idle("127.0.0.4", registry.port)]  # 1, 2 and 1: nobody holds more than its share
        raw = answer(held[-1], 10)
        assert raw.startswith(b"HTTP/1.1 503") and b'"kind": "connections"' in raw, raw[:300]
        assert registry.refused["connections"] == 1 and registry.refused["peer_connections"] == 1
    finally:
        for s in held:
            s.close()
        registry.close()


def test_a_slow_loris_request_is_cut_at_the_read_deadline(registry: bootstrap.Registry) -> None:
    request = signed_put(registry, body(0, "127.0.0.1:7000", "prefill-a"))
    with socket.create_connection(("127.0.0.1", registry.port)) as s:
        s.settimeout(0.05)
        cut = False
        for byte in request:  # one byte at a time, each gap shorter than any per-read timeout
            try:
                s.send(bytes([byte]))
                cut = s.recv(1) == b""
            except TimeoutError:
                continue
            except (BrokenPipeError, ConnectionResetError):
                cut = True
            if cut:
                break
    assert cut, "the registry waited for the whole trickle"
    assert registry.refused == {"slow": 1}
    legit_pair_still_works(registry)


def test_an_oversized_request_is_refused_unread(registry: bootstrap.Registry) -> None:
    big = f"PUT {bootstrap.PATH} HTTP/1.1\r\nContent-Length: {bootstrap.MAX_BODY + 1}\r\n\r\n".encode()
    assert send_raw(registry, big) == 413
    head = b"GET /" + b"x" * (bootstrap.MAX_HEAD + 1 - 5)  # one byte past the bound, all of it read
    assert send_raw(registry, head) == 413
    assert registry.refused == {"oversize": 2}
    legit_pair_still_works(registry)


class Trickler:
    """A server that answers one byte at a time, at most ``limit`` bytes, and notes whether
    the client hung up before the bytes ran out."""

    def __init__(self, limit: int = 600, gap_s: float = 0.1) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.client_left = threading.Event()
        self._limit, self._gap = limit, gap_s
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        conn, _ = self.sock.accept()
        with conn:
            answer = b"HTTP/1.1 200 OK\r\n" + b"X: " + b"y" * self._limit
            for byte in answer[:self._limit]:
                try:
                    conn.send(bytes([byte]))
                except OSError:
                    self.client_left.set()
                    return
                time.sleep(self._gap)

    def close(self) -> None:
        self._thread.join(self._limit * self._gap + 10)
        self.sock.close()


@pytest.mark.timeout(60)
def test_a_trickling_registry_cannot_hold_a_lookup_past_its_timeout() -> None:
    """A per-read timeout never fires on a server that sends a byte every 0.1 s; the
    lookup's ``timeout`` is a deadline for the whole exchange.  The trickle (60 s of
    bytes) outlasts the test's own timeout, so a lookup that waits for it fails here."""
    trickler = Trickler()
    try:
        with pytest.raises(bootstrap.BootstrapError, match="TimeoutError"):
            bootstrap.lookup(f"127.0.0.1:{trickler.port}", timeout=1)
        assert trickler.client_left.wait(30), "the lookup gave up, but never closed its connection"
    finally:
        trickler.close()


def _read_to_the_end(s: socket.socket, bound_s: float) -> tuple[bytes, bool]:
    """What the server wrote to ``s``, and whether the connection ended in a reset (else EOF)."""
    s.settimeout(bound_s)
    got = b""
    while True:
        try:
            data = s.recv(65536)
        except ConnectionResetError:
            return got, True
        if not data:
            return got, False
        got += data


@pytest.mark.parametrize("late_s", [0.0, 0.3])
def test_a_refused_client_reads_the_503_whenever_its_request_comes(late_s: float) -> None:
    """The refusal is written as the connection is accepted, before the request is read.
    The client must read that 503 whether its request reached the registry before the
    refusal (``late_s`` 0: sent as it connected) or after it (0.3 s later, as a loaded
    client's may): a request that reaches a closed socket, or one closed on unread bytes,
    is answered with a reset, which throws the 503 away on the client's side ("connection
    reset by peer", seen in ``test_a_refusal_at_a_cap_is_an_http_503_saying_why``).  So the
    registry half-closes after the answer, reads and drops what the client sends until it
    closes (within ``REFUSE_WRITE_S``), then closes."""
    registry = bootstrap.Registry("127.0.0.1", 0, key=KEY, max_connections=4, max_per_peer=1, read_deadline_s=120)
    held: list[socket.socket] = []
    try:
        held.append(idle("127.0.0.2", registry.port))
        eventually_sync(lambda: sum(len(q) for q in registry._open.values()) == 1, 30, what="one held")
        for attempt in range(5):
            s = idle("127.0.0.2", registry.port)
            time.sleep(late_s)
            s.sendall(f"GET /route HTTP/1.1\r\nHost: x\r\nX-Attempt: {attempt}\r\n\r\n".encode())
            time.sleep(0.2)  # the registry has answered by now, whatever it does next
            raw, reset = _read_to_the_end(s, 10)
            s.close()
            assert raw.startswith(b"HTTP/1.1 503") and b'"kind": "peer_connections"' in raw, (attempt, raw[:300])
            # an orderly end: a reset here is one that, sent before the answer left, loses it
            assert not reset, f"attempt {attempt}: the registry reset the connection after its answer"
        assert registry.refused["peer_connections"] == 5, registry.refused
        legit_pair_still_works(registry, 3)
    finally:
        for s in held:
            s.close()
        registry.close()


class _Stream:
    """A connection's stream as the registry's refusal sees it: what it was told, in order."""

    def __init__(self, sent_by_client: list[bytes]) -> None:
        self.events: list[str] = []
        self._incoming = list(sent_by_client)

    async def send(self, data: bytes) -> None:
        self.events.append("answer" if data.startswith(b"HTTP/1.1 503") else f"other {data[:20]!r}")

    async def send_eof(self) -> None:
        self.events.append("eof")

    async def receive(self, max_bytes: int = 65536) -> bytes:
        self.events.append("read")
        if not self._incoming:
            raise anyio.EndOfStream
        return self._incoming.pop(0)[:max_bytes]


def test_a_refusal_half_closes_and_reads_the_request_before_the_socket_closes() -> None:
    """The order that keeps a refusal's answer from being reset away (the race that
    ``test_a_refused_client_reads_the_503_whenever_its_request_comes`` can only sometimes
    meet): the answer, the registry's end closed, the client's request read to its EOF;
    and while ``max_connections`` refused connections linger so, the next is only answered."""
    registry = bootstrap.Registry("127.0.0.1", 0, key=KEY, max_connections=1, max_per_peer=1)
    try:
        refusal = bootstrap.Refusal("peer_connections", 503, "1 connections from 127.0.0.2 are open already")
        stream = _Stream([b"GET /route HTTP/1.1\r\n", b"Host: x\r\n\r\n"])
        anyio.run(registry._tell_refused, stream, refusal)
        assert stream.events == ["answer", "eof", "read", "read", "read"], stream.events
        assert registry._lingering == 0
        flood = _Stream([b"GET"])
        registry._lingering = 1  # one refused connection lingers already: at the cap
        anyio.run(registry._tell_refused, flood, refusal)
        assert flood.events == ["answer"], flood.events
        assert registry._lingering == 1
    finally:
        registry._lingering = 0
        registry.close()
