"""Real sidecar daemons as subprocesses, for the sidecar tests.

Each daemon gets its own socket and shared-segment name, ephemeral HTTP and
control ports (``KVSERVICE_*=0``), and reports what it bound on its ready line.
Only processes started here are ever signalled, by pid.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "config"
SMALL_LAYOUT = {"layers": 2, "page_tokens": 16, "kv_heads": 2, "head_dim": 64, "dtype": "bfloat16",
                "num_pages": 64}


def short_tmpdir() -> str:
    """A short directory for sockets (sun_path holds 107 bytes)."""
    return tempfile.mkdtemp(prefix="kvs-", dir="/tmp")


def daemon_env(sock: str, shm: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSERVICE_")}
    env.update({
        "KVSERVICE_SIDECAR_SOCKET_PATH": sock,
        "KVSERVICE_SIDECAR_SHM_NAME": shm,
        "KVSERVICE_HTTP_PORT": "0",
        "KVSERVICE_SERVICE_PORT": "0",
        "KVSERVICE_LOG_FORMAT": "json",
        "KVSERVICE_LOG_LEVEL": "info",
        "KVSERVICE_SERVICE_DRAIN_GRACE_S": "2",
        "KVSERVICE_SERVICE_PEER_TIMEOUT_S": "3",
        "UCX_NET_DEVICES": "lo",
    })
    for key, value in SMALL_LAYOUT.items():
        env[f"KVSERVICE_LAYOUT_{key.upper()}"] = str(value)
    env.update(extra)
    return env


class Sidecar:
    """One ``kvservice serve`` process."""

    def __init__(self, role: str, workdir: str, *, shm: str | None = None, config: str | Path | None = None,
                 env: dict[str, str] | None = None, name: str | None = None) -> None:
        self.role = role
        self.name = name or role
        self.workdir = workdir
        self.socket = os.path.join(workdir, f"{self.name}.sock")
        self.shm = shm or f"kvs-test-{uuid.uuid4().hex[:10]}"
        self.config = str(config or CONFIG / f"{role}.toml")
        self.env = daemon_env(self.socket, self.shm, **(env or {}))
        self.log_path = os.path.join(workdir, f"{self.name}.log")
        self.proc: subprocess.Popen[bytes] | None = None
        self.ready: dict[str, Any] = {}

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    @property
    def address(self) -> str:
        return str(self.ready["address"])

    @property
    def http(self) -> str:
        return str(self.ready["http"])

    def start(self, timeout: float = 60.0) -> Sidecar:
        self.spawn()
        return self.await_ready(timeout)

    def spawn(self) -> None:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kvservice.cli", "serve", "--config", self.config],
                stdout=subprocess.PIPE, stderr=log, env=self.env, cwd=REPO,
            )

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

    def await_ready(self, timeout: float = 60.0) -> Sidecar:
        assert self.proc is not None
        line = self._read_line(timeout)
        if not line:
            code = self.proc.wait(timeout=timeout)
            raise RuntimeError(f"{self.name} exited {code} before ready:\n{self.log()}")
        self.ready = json.loads(line)
        return self

    def _read_line(self, timeout: float) -> bytes:
        assert self.proc is not None and self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            ready, _, _ = select.select([self.proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
            if ready:
                return self.proc.stdout.readline()
        raise TimeoutError(f"{self.name}: no ready line within {timeout}s:\n{self.log()}")

    def signal(self, sig: signal.Signals) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def wait(self, timeout: float = 30.0) -> int:
        assert self.proc is not None
        code = self.proc.wait(timeout=timeout)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        return code

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM, then SIGKILL if it has not exited within ``timeout``."""
        if self.proc is None:
            return None
        self.signal(signal.SIGTERM)
        try:
            return self.wait(timeout)
        except subprocess.TimeoutExpired:
            self.signal(signal.SIGKILL)
            return self.wait(timeout)

    def kill(self) -> int:
        self.signal(signal.SIGKILL)
        return self.wait()

    def cleanup_names(self) -> None:
        """After a SIGKILL: remove what this daemon left (its own names only)."""
        for path in (self.socket, f"/dev/shm/{self.shm}"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)

    def names_gone(self) -> bool:
        """Neither the socket nor the shared segment is left."""
        return not os.path.exists(self.socket) and not os.path.exists(f"/dev/shm/{self.shm}")

    def names_present(self) -> bool:
        return os.path.exists(self.socket) and os.path.exists(f"/dev/shm/{self.shm}")

    def log(self) -> str:
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
            d.await_ready()
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
    with anyio.fail_after(timeout):
        for _ in range(int(timeout / 0.01)):
            if (await aget(address, path))[0] == status:
                return
            await anyio.sleep(0.01)
    raise TimeoutError(f"{path} never answered {status}")


async def wait_bound(client: Any, handle: Any, timeout: float = 30.0) -> None:
    """Wait until the sending sidecar knows the receiver of ``handle``'s request."""
    from kvservice import KVPoll

    with anyio.fail_after(timeout):
        for _ in range(int(timeout / 0.01)):
            if await client.fetch_poll(handle) is not KVPoll.Bootstrapping:
                return
            await anyio.sleep(0.01)


async def metrics(address: str) -> dict[str, float]:
    """``/metrics`` as {'name{labels}': value}."""
    status, body = await aget(address, "/metrics")
    assert status == 200, body
    out: dict[str, float] = {}
    for line in body.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out
