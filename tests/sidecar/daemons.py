"""Real sidecar daemons as subprocesses, for the sidecar tests.

``kvservice.sidecar.local`` starts and stops them (names of their own,
ephemeral ports, signals by pid only); here they also read config/<role>.toml
and the small layout, and log JSON to a file the tests read.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import shutil
import signal
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import anyio.abc

from kvservice.sidecar.local import LocalDaemon, short_tmpdir
from kvservice.sidecar.wire import SIDECAR_PROTOCOL_VERSION, Hello, decode_server, encode
from kvservice.testing.forkserver import PRELOAD, ForkedPopen, ForkServer, forkable
from kvservice.testing.peer_process import fork_server_in_use
from tests.helpers import READY_S, eventually

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "config"
SMALL_LAYOUT = {"layers": 2, "page_tokens": 16, "kv_heads": 2, "head_dim": 64, "dtype": "bfloat16",
                "num_pages": 64}


#: the daemons' settings for the tests: JSON logs (``events``), short drain and peer timeouts
TEST_ENV = {
    "KVSERVICE_LOG_FORMAT": "json",
    "KVSERVICE_LOG_LEVEL": "info",
    "KVSERVICE_SERVICE_DRAIN_GRACE_S": "2",
    "KVSERVICE_SERVICE_PEER_TIMEOUT_S": "3",
    "UCX_NET_DEVICES": "lo",
}


class Sidecar(LocalDaemon):
    """One ``kvservice serve`` process with config/<role>.toml, the small layout, and a log to read."""

    def __init__(self, role: str, workdir: str, *, shm: str | None = None, config: str | Path | None = None,
                 env: dict[str, str] | None = None, name: str | None = None) -> None:
        name = name or role
        super().__init__(role, workdir, name=name, shm=shm or f"kvs-test-{uuid.uuid4().hex[:10]}",
                         config=config or CONFIG / f"{role}.toml", layout=SMALL_LAYOUT,
                         env={**TEST_ENV, **(env or {})}, log_path=os.path.join(workdir, f"{name}.log"), cwd=REPO)

    def spawn(self) -> None:
        """Forked from the suite's fork server when it is in use (``tests/conftest.py``): the
        daemon's ``kvservice serve`` then skips 2-3 s of imports; else as ``python -m``."""
        if not fork_server_in_use() or not forkable(self.env):
            super().spawn()
            return
        assert self.log_path is not None
        log = os.open(self.log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            self.proc = ForkedPopen(ForkServer.shared(PRELOAD), "kvservice.cli:main", self.command()[2:],
                                    self.env, stderr=log, cwd=self.cwd)
        finally:
            os.close(log)

    def run_to_exit(self, timeout: float = 60.0) -> int:
        """For daemons that must fail to start: their exit code."""
        self.spawn()
        try:
            return self.wait(timeout)
        finally:
            self.cleanup_names()

    def stderr_lines(self) -> list[str]:
        """What the daemon wrote to stderr that is not a JSON log event."""
        return [line for line in self.log().splitlines() if not line.startswith("{")]

    def log(self) -> str:
        assert self.log_path is not None
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def events(self, name: str | None = None) -> list[dict[str, Any]]:
        out = []
        for line in self.log().splitlines():
            with contextlib.suppress(ValueError):
                ev = json.loads(line)
                if isinstance(ev, dict) and (name is None or ev.get("event") == name):
                    out.append(ev)
        return out


@contextlib.contextmanager
def sidecars(*roles: str, **kw: Any) -> Iterator[list[Sidecar]]:
    """Start one daemon per role (in parallel); stop them (SIGKILL if they hang), remove their names."""
    workdir = short_tmpdir()
    daemons = [Sidecar(role, workdir, **kw) for role in roles]
    try:
        for d in daemons:
            d.spawn()
        for d in daemons:
            d.await_ready(READY_S)
        yield daemons
    finally:
        for d in daemons:
            d.signal(signal.SIGTERM)
        for d in daemons:
            d.stop()
            d.cleanup_names()
        shutil.rmtree(workdir, ignore_errors=True)


# -- HTTP ----------------------------------------------------------------------------------


def http_get(address: str, path: str) -> tuple[int, str]:
    host, port = address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, resp.read().decode()
    finally:
        conn.close()


async def aget(address: str, path: str) -> tuple[int, str]:
    return await anyio.to_thread.run_sync(http_get, address, path)


async def until_status(address: str, path: str, status: int, timeout: float = 30.0) -> None:
    """Poll ``path`` until it answers ``status`` (bounded in count and time)."""
    async def answers() -> bool:
        return (await aget(address, path))[0] == status

    await eventually(answers, timeout, 0.01, what=f"{path} answering {status}")


async def wait_bound(client: Any, handle: Any, timeout: float = 30.0) -> None:
    """Wait until the sending sidecar knows the receiver of ``handle``'s request."""
    from kvservice import KVPoll

    async def bound() -> bool:
        return await client.fetch_poll(handle) is not KVPoll.Bootstrapping

    await eventually(bound, timeout, 0.01, what="the sending sidecar knowing its receiver")


_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def _canonical(key: str) -> str:
    """'name{b="2",a="1"}' -> 'name{a="1",b="2"}': Prometheus ignores the order of labels,
    and the exposition writes them sorted by name; tests may name them in any order."""
    name, brace, rest = key.partition("{")
    if not brace:
        return key
    return name + "{" + ",".join(f'{k}="{v}"' for k, v in sorted(_LABEL.findall(rest))) + "}"


class Samples(dict[str, float]):
    """``/metrics`` samples as {'name{labels}': value}, looked up in any label order."""

    def __getitem__(self, key: str) -> float:
        return super().__getitem__(_canonical(key))

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and super().__contains__(_canonical(key))

    def get(self, key: str, default: Any = None) -> Any:  # type: ignore[override]
        return super().get(_canonical(key), default)


def parse_metrics(text: str) -> Samples:
    """Prometheus text, parsed by prometheus_client's own parser."""
    from prometheus_client.parser import text_string_to_metric_families

    out = Samples()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            out[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return out


async def metrics(address: str) -> Samples:
    """``/metrics`` as {'name{labels}': value}."""
    status, body = await aget(address, "/metrics")
    assert status == 200, body
    return parse_metrics(body)


# -- raw worker connections ----------------------------------------------------------------


def frame(body: bytes) -> bytes:
    return len(body).to_bytes(4, "big") + body


async def read_to_end(stream: anyio.abc.ByteStream, timeout: float = 30.0) -> list[object]:
    """Every frame the daemon sends until it closes the connection (within ``timeout``)."""
    buf = b""
    with anyio.fail_after(timeout):
        try:
            while True:
                buf += await stream.receive()
        except (anyio.EndOfStream, anyio.BrokenResourceError):
            pass
    replies: list[object] = []
    while len(buf) >= 4:
        n = int.from_bytes(buf[:4], "big")
        replies.append(decode_server(buf[4:4 + n]))
        buf = buf[4 + n:]
    return replies


async def raw_exchange(path: str, payload: bytes, *, hello: bool = True, hang_up: bool = False) -> list[object]:
    """Send ``payload`` (after a proper Hello unless told not to); return what came back until EOF."""
    async with await anyio.connect_unix(path) as stream:
        if hello:
            await stream.send(encode(Hello(SIDECAR_PROTOCOL_VERSION, "raw")))
        await stream.send(payload)
        if hang_up:
            return []
        return await read_to_end(stream)
