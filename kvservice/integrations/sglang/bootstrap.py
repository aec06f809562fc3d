"""The bootstrap registry: where a decode finds the prefill ranks' kvservice addresses.

SGLang gives a request the prefill's *bootstrap* address (its host and
``--disaggregation-bootstrap-port``), not its transfer endpoint.  The prefill's main
process runs this registry there (``KVBootstrapServer`` in ``conn``); each prefill rank's
``KVManager`` registers its kvservice control address, and a decode rank looks the ranks
up once per prefill and caches them.  Everything after that goes over kvservice's own
authenticated control link: the registry only says where to dial, and a wrong answer
can only point a decode at an endpoint that fails its handshake.

Plain HTTP with JSON bodies, served from a thread of its own (``ThreadingHTTPServer``):

* ``PUT /kvservice/ranks`` ``{"dp_rank", "tp_rank", "address", "info": {...}}``: a prefill
  rank registers (again after a restart: the newest registration wins).
* ``GET /kvservice/ranks``: ``{"info": {...}, "ranks": {"<dp>/<tp>": "host:port"}}``;
  503 while no rank has registered.

Bounded: bodies up to ``MAX_BODY`` bytes, at most ``MAX_RANKS`` ranks; anything else is a
400 naming the problem, counted in ``refused`` and logged at most ``Throttle``'s burst.
"""

from __future__ import annotations

import collections
import json
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from ..._control.addresses import split_address
from ..._log import Throttle, get_logger
from ..._results import KVServiceError

log = get_logger("kvservice.sglang")

PATH = "/kvservice/ranks"
MAX_BODY = 64 * 1024
MAX_RANKS = 4096
#: what a prefill rank says about its pool, and a decode checks against its own
INFO_KEYS = ("attn_tp_size", "dp_size", "page_size", "kv_cache_dtype", "is_mla")


class BootstrapError(KVServiceError):
    """The bootstrap registry could not be reached, refused a registration, or answered
    something unusable.

    Raised by ``register`` and ``lookup``: a prefill rank retries its registration for
    a while, a decode retries its lookup, and a request that cannot learn its prefill
    fails (``KVPoll.Failed``, this as the original error)."""


def _check_registration(body: Any) -> tuple[str, str, dict[str, Any]]:
    if not isinstance(body, dict):
        raise ValueError("the body must be a JSON object")
    dp, tp, address, info = body.get("dp_rank"), body.get("tp_rank"), body.get("address"), body.get("info")
    for name, value in (("dp_rank", dp), ("tp_rank", tp)):
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < MAX_RANKS:
            raise ValueError(f"{name} must be an int in 0..{MAX_RANKS - 1}, got {value!r}")
    if not isinstance(address, str):
        raise ValueError(f"address must be 'host:port', got {address!r}")
    split_address(address)  # raises ValueError naming the problem
    if not isinstance(info, dict) or set(info) != set(INFO_KEYS):
        raise ValueError(f"info must be an object with exactly the keys {', '.join(INFO_KEYS)}")
    return f"{dp}/{tp}", address, info


class Registry:
    """The registry's state and HTTP server.  ``port=0`` picks a free port (``port``)."""

    def __init__(self, host: str, port: int) -> None:
        self._lock = threading.Lock()
        self._ranks: dict[str, str] = {}
        self._info: dict[str, Any] | None = None
        self.refused: collections.Counter[str] = collections.Counter()
        self._throttle = Throttle()
        registry = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                pass  # refusals are logged by the registry (rate-limited); success is not news

            def _answer(self, code: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                if self.path != PATH:
                    self._answer(404, {"error": f"unknown path {self.path!r}"})
                    return
                snapshot = registry.snapshot()
                self._answer(200 if snapshot["ranks"] else 503, snapshot)

            def do_PUT(self) -> None:
                try:
                    if self.path != PATH:
                        raise ValueError(f"unknown path {self.path!r}")
                    length = int(self.headers.get("Content-Length") or -1)
                    if not 0 <= length <= MAX_BODY:
                        raise ValueError(f"a body of 0..{MAX_BODY} bytes with a Content-Length is required")
                    key, address, info = _check_registration(json.loads(self.rfile.read(length)))
                    registry.register(key, address, info)
                except ValueError as exc:  # json.JSONDecodeError is one
                    registry.refuse("registration", str(exc), self.client_address[0])
                    self._answer(400, {"error": str(exc)})
                    return
                self._answer(200, {"ok": True})

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="kvservice-sglang-bootstrap",
                                        daemon=True)
        self._thread.start()

    def register(self, key: str, address: str, info: dict[str, Any]) -> None:
        with self._lock:
            if key not in self._ranks and len(self._ranks) >= MAX_RANKS:
                raise ValueError(f"the registry holds {MAX_RANKS} ranks already")
            if self._info is not None and info != self._info and key not in self._ranks:
                raise ValueError(f"rank {key} describes its pool as {info}, the registered ranks as {self._info}")
            self._ranks[key] = address
            self._info = info
        log.info("sglang.bootstrap.registered", rank=key, address=address)

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {"info": self._info, "ranks": dict(self._ranks)}

    def refuse(self, kind: str, why: str, peer: str) -> None:
        self.refused[kind] += 1
        if (unlogged := self._throttle.allow(kind)) is not None:
            log.warning("sglang.bootstrap.refused", kind=kind, why=why, peer=peer, unlogged=unlogged)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def _http(method: str, url: str, body: dict[str, Any] | None, timeout: float) -> tuple[int, Any]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read(MAX_BODY * 64))
    except urllib.error.HTTPError as exc:
        try:
            return exc.code, json.loads(exc.read(MAX_BODY))
        except ValueError:
            return exc.code, None
    except (OSError, ValueError) as exc:  # refused, unreachable, timed out, not JSON
        raise BootstrapError(f"bootstrap server {url}: {type(exc).__name__}: {exc}") from exc


def register(bootstrap_addr: str, dp_rank: int, tp_rank: int, address: str, info: dict[str, Any],
             timeout: float = 5.0) -> None:
    """Register one prefill rank with the registry at ``bootstrap_addr`` ("host:port")."""
    code, body = _http("PUT", f"http://{bootstrap_addr}{PATH}",
                       {"dp_rank": dp_rank, "tp_rank": tp_rank, "address": address, "info": info}, timeout)
    if code != 200:
        raise BootstrapError(f"bootstrap server {bootstrap_addr} refused the registration ({code}): {body}")


def lookup(bootstrap_addr: str, timeout: float = 5.0) -> tuple[dict[str, Any], dict[str, str]]:
    """The prefill's pool description and its ranks' addresses (``"<dp>/<tp>"`` keys)."""
    split_address(bootstrap_addr)  # ValueError for a malformed address
    code, body = _http("GET", f"http://{bootstrap_addr}{PATH}", None, timeout)
    if code != 200 or not isinstance(body, dict):
        raise BootstrapError(f"bootstrap server {bootstrap_addr} has no kvservice ranks ({code}): {body}")
    info, ranks = body.get("info"), body.get("ranks")
    if not isinstance(info, dict) or set(info) != set(INFO_KEYS) or not isinstance(ranks, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in ranks.items()):
        raise BootstrapError(f"bootstrap server {bootstrap_addr} answered something that is not a kvservice "
                             f"registry: {body}")
    return info, ranks
