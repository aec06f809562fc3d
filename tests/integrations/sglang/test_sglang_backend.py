"""The kvservice transfer backend inside SGLang 0.5.23's own classes (docs/sglang.md).

Runs in SGLang's environment (``scripts/engine-env.sh sglang``; ``scripts/test.sh`` runs this
folder with that environment's python and ``KVSERVICE_REQUIRE_SGLANG=1``).  Elsewhere it
skips, saying why; with ``KVSERVICE_REQUIRE_SGLANG`` set and SGLang missing it fails.

Every SGLang process is a child (``roles.py``): a prefill or decode scheduler rank that
loads the plugin with SGLang's ``load_plugins()``, parses ``--disaggregation-transfer-backend
kvservice`` with SGLang's ``prepare_server_args``, and drives SGLang's sender and receiver
the way its schedulers do, over CPU tensors, two real NIXL agents on 127.0.0.1.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import free_port

from .needs import require_sglang

REPO = Path(__file__).resolve().parents[3]
ROLES = Path(__file__).with_name("roles.py")
PAGE_BYTES = 2 * 2 * 4 * 2 * 8 * 4  # roles.py: 2 layers x K,V x 4 tokens x 2 heads x 8 dims x float32
#: a hang guard for a process that imports SGLang: ~10 s here when idle; the first one of a run,
#: its files not cached yet, took over 120 s on a machine loaded 10-15 times over
START_S = 300.0
FAILED, BOOTSTRAPPING, WAITING, TRANSFERRING, SUCCESS = range(5)

pytestmark = [pytest.mark.nixl, pytest.mark.slow, pytest.mark.timeout(420)]


@pytest.fixture(autouse=True)
def _sglang() -> None:
    require_sglang()


def child_env(tmp_path: Path, name: str, **extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "SGLANG_PLUGINS": "kvservice",
            "KVSERVICE_TEST_GLOO_FILE": str(tmp_path / f"gloo-{name}"), **extra}


class Role:
    """One scheduler rank (``roles.py``) in a child process: commands in, events out."""

    count = 0

    def __init__(self, role: str, port: int, tmp_path: Path, *, serve: bool = False, mla: bool = False,
                 delay: float = 0.0, env: dict[str, str] | None = None) -> None:
        Role.count += 1
        self.name = f"{role}{Role.count}"
        self.log = tmp_path / f"{self.name}.log"
        args = [sys.executable, str(ROLES), role, "--bootstrap-port", str(port)]
        args += ["--serve-bootstrap"] * serve + ["--mla"] * mla + ["--bootstrap-delay", str(delay)]
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True,
                                         env=child_env(tmp_path, self.name, **(env or {})))
        self.events: queue.Queue[dict[str, Any]] = queue.Queue()
        self.seen: list[dict[str, Any]] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self._ready: dict[str, Any] | None = None

    @property
    def ready(self) -> dict[str, Any]:
        """The child's ``ready`` event (waits for it: children start side by side)."""
        if self._ready is None:
            self._ready = self.wait(lambda e: e["event"] == "ready", START_S)
        return self._ready

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.events.put(json.loads(line))
        self.events.put({"event": "eof"})

    def wait(self, pred: Any, timeout: float = 60.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        for e in self.seen:
            if pred(e):
                return e
        while time.monotonic() < deadline:
            try:
                e = self.events.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            self.seen.append(e)
            if e["event"] == "eof":
                break
            if pred(e):
                return e
        raise AssertionError(f"{self.name}: no such event within {timeout}s; seen {self.seen[-8:]}; "
                             f"log tail:\n{self.tail()}")

    def end(self, room: int, timeout: float = 60.0) -> dict[str, Any]:
        return self.wait(lambda e: e["event"] == "end" and e["room"] == room, timeout)

    def send(self, **cmd: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def quit(self, timeout: float = 60.0) -> int:
        """Stop after what is in flight; the exit code says whether the loop ever raised."""
        self.send(quit=True)
        self.wait(lambda e: e["event"] == "exit", timeout)
        return self.proc.wait(timeout)

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def stall_then_kill(self) -> None:
        """SIGSTOP, a moment (shorter than kvservice's peer timeout), then SIGKILL."""
        self.proc.send_signal(signal.SIGSTOP)
        time.sleep(0.5)
        self.kill()

    def tail(self) -> str:
        lines = [ln for ln in self.log.read_text().splitlines() if "Warning" not in ln and "warnings.warn" not in ln]
        return "\n".join(lines[-25:])

    def close(self) -> None:
        if self.proc.poll() is None:
            self.kill()
        self._reader.join(10)
        for pipe in (self.proc.stdin, self.proc.stdout):
            try:
                if pipe is not None:
                    pipe.close()
            except BrokenPipeError:  # stdin of a process that is gone: nothing to flush to
                pass


@pytest.fixture
def roles() -> Any:
    made: list[Role] = []

    def make(*specs: tuple[Any, ...]) -> list[Role]:
        """Start one rank per ``(role, port, tmp_path, kwargs)``, then wait until all are up."""
        new = [Role(*spec[:-1], **spec[-1]) for spec in specs]
        made.extend(new)
        for r in new:
            assert r.ready
        return new

    yield make
    for r in made:
        r.close()


def forward_only(states: list[int]) -> bool:
    """Progress states only move forward, and a request ends where it ended."""
    progress = [s for s in states if s != FAILED]
    return progress == sorted(progress) and (FAILED not in states or states[-1] == FAILED)


def run_sglang(code: str, tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=START_S,
                          env=child_env(tmp_path, "cli", **env))


PARSE = """
import json, sys
from sglang.srt.plugins import load_plugins
load_plugins()
from sglang.srt.server_args import prepare_server_args
args = prepare_server_args(["--model-path", "unused", "--device", "cpu", "--disaggregation-mode", "prefill",
                            "--disaggregation-transfer-backend", "kvservice"])
from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class
from sglang.srt.managers import disagg_service
backend = disagg_service.TransferBackend(args.disaggregation_transfer_backend)
print(json.dumps({
    "backend": args.disaggregation_transfer_backend,
    "same_enum": disagg_service.TransferBackend is TransferBackend,
    "classes": {t.value: getattr(get_kv_class(backend, t), "__module__", None) for t in KVClassType},
    "server": disagg_service.get_kv_class(backend, KVClassType.BOOTSTRAP_SERVER).__name__,
    "rust_registry_stands_in": disagg_service.rust_server_serves_kv_bootstrap("kvservice"),
    "nixl_sender": get_kv_class(TransferBackend.NIXL, KVClassType.SENDER).__name__,
}))
"""


def test_the_flag_parses_through_the_plugin_and_picks_kvservice_classes(tmp_path: Path) -> None:
    """SGLang's own loader and CLI parsing: the plugin adds the choice, the enum member and
    the factory branch; SGLang's other backends are untouched.  Without the plugin the
    same command line is refused by SGLang's argparse."""
    done = run_sglang(PARSE, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["backend"] == "kvservice" and got["same_enum"]
    assert got["classes"] == {"kvargs": "sglang.srt.disaggregation.base.conn",
                              **{k: "kvservice.integrations.sglang.conn"
                                 for k in ("manager", "sender", "receiver", "bootstrap_server")}}
    assert got["server"] == "KVBootstrapServer" and got["rust_registry_stands_in"] is False
    assert got["nixl_sender"] == "NixlKVSender"
    without = run_sglang(PARSE, tmp_path, SGLANG_PLUGINS="none")
    assert without.returncode == 2 and "invalid choice: 'kvservice'" in without.stderr, without.stderr[-2000:]


@pytest.mark.parametrize("layout", ["mha", "mla"])
def test_bootstrap_then_chunked_transfer_bytes_and_aux_verified(tmp_path: Path, roles: Any, layout: str) -> None:
    """The whole flow: the prefill registers in its bootstrap registry, the decode looks it
    up, a sender stays ``Bootstrapping`` until its decode's metadata arrives (one decode
    holds it back a second), then chunks go out one per forward step; the decode checks
    every byte of every page and its aux row (through SGLang's own metadata gate)."""
    port = free_port()
    prefill, decode = roles(("prefill", port, tmp_path, {"serve": True, "mla": layout == "mla"}),
                            ("decode", port, tmp_path, {"mla": layout == "mla"}))
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/kvservice/ranks", timeout=10) as resp:
        registry = json.loads(resp.read())
    assert registry["ranks"] == {"0/0": prefill.ready["address"]}
    assert registry["info"]["is_mla"] is (layout == "mla")
    rooms = {101: (5, 2, 0.0), 102: (3, 1, 1.0), 103: (8, 3, 0.0), 104: (1, 1, 0.0)}
    for room, (pages, chunk, hold) in rooms.items():
        prefill.send(room=room, pages=pages, chunk=chunk)
        decode.send(room=room, pages=pages, hold_s=hold)
    for room, (pages, _, hold) in rooms.items():
        sent, got = prefill.end(room), decode.end(room)
        assert sent["poll"] == "Success" and got["poll"] == "Success", (sent, got)
        assert got["verified"] and got["aux"], got
        if layout == "mha":
            assert sent["bytes"] == pages * PAGE_BYTES
        # Bootstrapping until the decode's metadata arrives: for a room its decode did not hold
        # back, the metadata may arrive before the prefill's first poll (a prefill process slow
        # to read its command on a loaded machine)
        assert sent["states"][0] == BOOTSTRAPPING or (not hold and sent["states"][0] == WAITING), sent
        assert sent["states"][-1] == SUCCESS and forward_only(sent["states"])
        assert forward_only(got["states"]) and got["states"][-1] == SUCCESS
    # the held request: nothing was computed or sent before its decode's metadata arrived
    seq = prefill.seen
    first_chunk = next(i for i, e in enumerate(seq) if e["event"] == "chunk" and e["room"] == 102)
    assert decode.wait(lambda e: e["event"] == "metadata" and e["room"] == 102)
    assert WAITING in prefill.end(102)["states"] and first_chunk > 0
    assert prefill.quit() == 0 and decode.quit() == 0


def says_why(ended: dict[str, Any], *names: str) -> None:
    """What SGLang logs (``str()`` of ``failure_exception()``'s exception) says why by itself:
    the request, the reason and the peer; the original error is its ``__cause__``."""
    assert ended["error_type"] == "TransferFailed", ended
    assert ended["error"].startswith(f"request '{ended['room']}' failed {ended['reason']} ("), ended
    for name in names:
        assert name in ended["error"], (name, ended)


@pytest.mark.parametrize("how", ["kill", "stall_then_kill"])
def test_decode_lost_mid_transfer_fails_the_sender_saying_why(tmp_path: Path, roles: Any, how: str) -> None:
    """A decode SIGKILLed (or stalled by SIGSTOP, then SIGKILLed) after the first chunks:
    the prefill's later chunks post nothing, ``poll()`` says ``Failed``, the string SGLang
    logs of ``failure_exception()`` names the reason and the peer, the error kvservice kept
    (the very object) is its ``__cause__``, and the prefill's loop never sees an
    exception: it serves a new decode."""
    port = free_port()
    prefill, decode, decode2 = roles(("prefill", port, tmp_path, {"serve": True}), ("decode", port, tmp_path, {}),
                                     ("decode", port, tmp_path, {}))
    prefill.send(room=201, pages=12, chunk=1, step_s=0.4)
    decode.send(room=201, pages=12)
    prefill.wait(lambda e: e["event"] == "chunk" and e["room"] == 201 and e["sent"] >= 2)
    getattr(decode, how)()
    ended = prefill.end(201, timeout=90)
    assert ended["poll"] == "Failed", ended
    assert ended["reason"] in ("PEER_LOST", "REMOTE_DISCONNECT"), ended
    says_why(ended, f"(peer {ended['peer']})", *[decode.ready["address"]] * (ended["reason"] == "PEER_LOST"))
    assert ended["original"] is True and ended["cause_type"] is not None, ended
    assert forward_only(ended["states"])
    prefill.send(room=202, pages=4, chunk=2)
    decode2.send(room=202, pages=4)
    assert prefill.end(202)["poll"] == "Success" and decode2.end(202)["verified"]
    assert prefill.quit() == 0 and decode2.quit() == 0


def test_prefill_restart_fails_its_requests_and_the_decode_finds_the_new_one(tmp_path: Path, roles: Any) -> None:
    """A prefill SIGKILLed mid-transfer: the decode's receiver fails at once (``PEER_LOST``)
    with the original error, its pages reported safe to reuse only once nothing can land;
    a new prefill on the same bootstrap port registers and the decode's next request
    succeeds (it looks the prefill up again instead of dialling the dead one).  The new
    prefill's rank comes up before its registry (as SGLang may start them): it registers
    once the registry is there."""
    port = free_port()
    prefill, decode = roles(("prefill", port, tmp_path, {"serve": True}), ("decode", port, tmp_path, {}))
    prefill.send(room=301, pages=2)
    decode.send(room=301, pages=2)
    assert decode.end(301)["poll"] == "Success"
    prefill.send(room=302, pages=12, chunk=1, step_s=0.4)
    decode.send(room=302, pages=12)
    prefill.wait(lambda e: e["event"] == "chunk" and e["room"] == 302 and e["sent"] >= 2)
    prefill.kill()
    ended = decode.end(302, timeout=60)
    assert ended["poll"] == "Failed" and ended["reason"] == "PEER_LOST", ended
    says_why(ended, f"(peer {prefill.ready['address']})")
    # safe once nothing can land: NIXL saw the endpoint drop, or a probe found nobody (the
    # decode asks again every step until then, as SGLang's does)
    assert ended["original"] is True and ended["release_safe"] is True, ended
    (prefill2,) = roles(("prefill", port, tmp_path, {"serve": True, "delay": 2.0}))
    assert prefill2.ready["address"] != prefill.ready["address"]
    assert "sglang.bootstrap.register_retrying" in prefill2.log.read_text()  # up before its registry
    decode.send(room=303, pages=3)
    prefill2.send(room=303, pages=3)
    got = decode.end(303)
    assert got["poll"] == "Success" and got["verified"] and got["aux"], got
    assert prefill2.end(303)["poll"] == "Success"
    assert decode.quit() == 0 and prefill2.quit() == 0


def test_a_prefill_restarted_while_idle_gets_the_decodes_next_request(tmp_path: Path, roles: Any) -> None:
    """The decode knows the prefill's rank from a request it served; the prefill is SIGKILLed
    while idle and a new one starts on the same bootstrap port, at a new address.  The
    decode's first request after that succeeds: it looks the rank up again (its lookup is
    older than ``PREFILL_CACHE_S``) instead of dialling the old address; the new prefill's
    room never waits for its timeout (600 s here)."""
    port = free_port()
    long = {"KVSERVICE_SERVICE_BOOTSTRAP_TIMEOUT_S": "600"}
    prefill, decode = roles(("prefill", port, tmp_path, {"serve": True, "env": long}),
                            ("decode", port, tmp_path, {"env": long}))
    prefill.send(room=601, pages=2)
    decode.send(room=601, pages=2)
    assert decode.end(601)["poll"] == "Success" and prefill.end(601)["poll"] == "Success"
    prefill.kill()
    (prefill2,) = roles(("prefill", port, tmp_path, {"serve": True, "env": long}))
    assert prefill2.ready["address"] != prefill.ready["address"]
    prefill2.send(room=602, pages=3)
    decode.send(room=602, pages=3)
    got = decode.end(602, timeout=120)
    assert got["poll"] == "Success" and got["verified"] and got["aux"], got
    assert prefill2.end(602, timeout=120)["poll"] == "Success"
    assert decode.quit() == 0 and prefill2.quit() == 0


def test_a_room_its_decode_gave_up_fails_on_the_prefill_at_once(tmp_path: Path, roles: Any) -> None:
    """The decode looks the prefill up, then its scheduler aborts the room before sending
    its metadata: the prefill's sender hears it (the decode declines the room) and fails at
    once, ``ABORTED`` saying so, instead of holding the room to its bootstrap timeout
    (600 s here); the next room is served."""
    port = free_port()
    long = {"KVSERVICE_SERVICE_BOOTSTRAP_TIMEOUT_S": "600"}
    prefill, decode = roles(("prefill", port, tmp_path, {"serve": True, "env": long}),
                            ("decode", port, tmp_path, {"env": long}))
    prefill.send(room=701, pages=2)
    decode.send(room=701, pages=2, abort=True)
    assert decode.end(701)["reason"] == "ABORTED"
    ended = prefill.end(701, timeout=120)
    assert ended["poll"] == "Failed" and ended["reason"] == "ABORTED", ended
    says_why(ended, "asked for it, then was lost or gave it up")
    prefill.send(room=702, pages=2)
    decode.send(room=702, pages=2)
    assert decode.end(702)["verified"] and prefill.end(702)["poll"] == "Success"
    assert prefill.quit() == 0 and decode.quit() == 0


def test_bad_input_is_a_clear_failure_never_an_exception_in_the_loop(tmp_path: Path, roles: Any) -> None:
    """A bogus bootstrap address (nothing listens; not an address at all), a bogus room,
    a room no decode ever asks for, and garbage sent to the registry: each is ``Failed``
    with an error that says what was wrong, or a 400; both loops run on and exit 0."""
    port = free_port()
    prefill, decode = roles(("prefill", port, tmp_path, {"serve": True,
                                                         "env": {"KVSERVICE_SERVICE_BOOTSTRAP_TIMEOUT_S": "3"}}),
                            ("decode", port, tmp_path, {}))
    dead = f"127.0.0.1:{free_port()}"
    decode.send(room=401, pages=2, bootstrap=dead)  # SGLang's path: lookups fail, then it aborts
    decode.send(room=402, pages=2, bootstrap=dead, init_direct=True)
    decode.send(room=403, pages=2, bootstrap="no-port-here", init_direct=True)
    prefill.send(room=-5, pages=2)
    prefill.send(room=404, pages=2)  # never asked for
    assert decode.end(401)["poll"] == "Failed"
    e402, e403 = decode.end(402), decode.end(403)
    assert e402["reason"] == "PEER_LOST" and e402["cause_type"] == "BootstrapError" and e402["original"], e402
    says_why(e402, f"(peer {dead} (bootstrap))")
    assert e403["reason"] == "REFUSED" and e403["cause_type"] == "ValueError" and e403["original"], e403
    says_why(e403, "no-port-here", "host:port")
    e_room = prefill.end(-5)
    assert e_room["poll"] == "Failed" and e_room["reason"] == "REFUSED", e_room
    assert e_room["cause_type"] == "ValueError" and e_room["original"], e_room
    says_why(e_room, "bootstrap_room")
    e404 = prefill.end(404, timeout=60)
    assert e404["reason"] == "TIMEOUT" and e404["cause_type"] is None, e404
    says_why(e404, "no peer known yet", "no decode asked for it within bootstrap_timeout_s (3.0s)")
    for body in (b"not json", b'{"dp_rank": -1, "tp_rank": 0, "address": "x:1", "info": {}}'):
        req = urllib.request.Request(f"http://127.0.0.1:{port}/kvservice/ranks", data=body, method="PUT")
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(req, timeout=10)
        assert refused.value.code == 401 and "error" in json.loads(refused.value.read())  # unread: no MAC
    prefill.send(room=405, pages=2)
    decode.send(room=405, pages=2)
    assert decode.end(405)["verified"] and prefill.end(405)["poll"] == "Success"
    assert prefill.quit() == 0 and decode.quit() == 0


def test_a_sender_made_after_its_decode_died_fails_at_once(tmp_path: Path, roles: Any) -> None:
    """The decode's expect for a room reaches the prefill rank before the prefill's scheduler
    made the room's sender; the decode is SIGKILLed; then the sender is made.  It fails at
    once (``PEER_LOST``, from ``Bootstrapping``) instead of waiting out its bootstrap
    timeout (set far beyond this test's waits), saying why."""
    port = free_port()
    prefill, decode = roles(("prefill", port, tmp_path, {"serve": True,
                                                         "env": {"KVSERVICE_SERVICE_BOOTSTRAP_TIMEOUT_S": "600"}}),
                            ("decode", port, tmp_path, {}))
    prefill.send(**{"await": "expected", "room": 501})
    decode.send(room=501, pages=2)
    assert decode.wait(lambda e: e["event"] == "metadata" and e["room"] == 501)
    prefill.wait(lambda e: e["event"] == "expected" and e["room"] == 501)
    decode.kill()
    prefill.send(**{"await": "expect_dropped", "room": 501})  # the prefill has seen the decode go
    prefill.wait(lambda e: e["event"] == "expect_dropped" and e["room"] == 501)
    prefill.send(room=501, pages=2)
    ended = prefill.end(501, timeout=120)
    assert ended["poll"] == "Failed" and ended["phase"] == "bootstrap", ended
    assert ended["reason"] == "PEER_LOST" and ended["states"] == [FAILED], ended  # its first poll
    says_why(ended, "asked for it, then was lost or gave it up")
    assert prefill.quit() == 0


def test_the_registry_believes_only_authenticated_registrations(tmp_path: Path, roles: Any) -> None:
    """The attacks reproduced against the registry: an unauthenticated PUT pointing the
    prefill's rank elsewhere, another claiming a different TP size, and idle connections
    past the per-host cap.  Each is refused; the registry still lists the real rank, and
    the decode finds it and moves a room byte-exact through SGLang's classes."""
    port = free_port()
    prefill, decode = roles(("prefill", port, tmp_path, {"serve": True}), ("decode", port, tmp_path, {}))
    url = f"http://127.0.0.1:{port}/kvservice/ranks"
    with urllib.request.urlopen(url, timeout=10) as resp:
        before = json.loads(resp.read())
    mitm = f"127.0.0.1:{free_port()}"
    for info in (before["info"], {**before["info"], "attn_tp_size": 8}):
        body = json.dumps({"dp_rank": 0, "tp_rank": 0, "address": mitm, "info": info, "incarnation": "mitm",
                           "ts": time.time(), "nonce": os.urandom(16).hex()}).encode()
        req = urllib.request.Request(url, data=body, method="PUT")
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(req, timeout=10)
        assert refused.value.code == 401, refused.value.read()
        refused.value.close()
    flood: list[socket.socket] = []
    try:
        for _ in range(40):  # past the per-host cap (32): the rest are closed at once
            s = socket.socket()
            s.bind(("127.0.0.2", 0))
            s.connect(("127.0.0.1", port))
            flood.append(s)
        with urllib.request.urlopen(url, timeout=10) as resp:
            assert json.loads(resp.read()) == before  # the real rank, the real pool
        prefill.send(room=501, pages=3, chunk=2)
        decode.send(room=501, pages=3)
        got = decode.end(501)
        assert got["poll"] == "Success" and got["verified"] and got["aux"], got
        assert prefill.end(501)["poll"] == "Success"
    finally:
        for s in flood:
            s.close()
    assert prefill.quit() == 0 and decode.quit() == 0
    refusals = [ln for ln in prefill.log.read_text().splitlines() if "sglang.bootstrap.refused" in ln]
    for kind in ("unauthenticated", "peer_connections"):  # counted and logged
        assert any(kind in ln for ln in refusals), (kind, refusals)
