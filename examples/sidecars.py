"""Start ``kvservice serve`` daemons from the examples (``--spawn``).

Each daemon reads config/<role>.toml with a few ``KVSERVICE_*`` overrides
(``kvservice.sidecar.local.daemon_env``): a socket and segment name of its own,
and ephemeral HTTP and control ports, reported on its ready line.  Stopping
sends SIGTERM (SIGKILL after a timeout) to the process started here, by pid.
(Synchronous code can use ``kvservice.sidecar.local.LocalDaemon`` instead.)
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import anyio.abc

from kvservice.sidecar.local import daemon_env, short_tmpdir

REPO = Path(__file__).resolve().parents[1]


@dataclass
class Daemon:
    role: str
    workdir: str
    socket: str
    shm: str
    env: dict[str, str]
    proc: anyio.abc.Process | None = None
    ready: dict[str, Any] = field(default_factory=dict)

    @property
    def http(self) -> str:
        return str(self.ready["http"])

    @property
    def address(self) -> str:
        return str(self.ready["address"])

    async def start(self, timeout: float = 60.0) -> Daemon:
        self.proc = await anyio.open_process(
            [sys.executable, "-m", "kvservice.cli", "serve", "--config", str(REPO / "config" / f"{self.role}.toml")],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=self.env, cwd=REPO,
        )
        assert self.proc.stdout is not None
        buf = b""
        with anyio.fail_after(timeout):
            async for chunk in self.proc.stdout:
                buf += chunk
                if b"\n" in buf:
                    break
        if b"\n" not in buf:
            raise RuntimeError(f"{self.role} sidecar exited before it was ready (code {await self.proc.wait()})")
        self.ready = json.loads(buf.split(b"\n", 1)[0])
        return self

    def kill(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            os.kill(self.proc.pid, signal.SIGKILL)

    async def stop(self, timeout: float = 30.0) -> int | None:
        if self.proc is None:
            return None
        if self.proc.returncode is None:
            os.kill(self.proc.pid, signal.SIGTERM)
        with anyio.move_on_after(timeout):
            await self.proc.wait()
        if self.proc.returncode is None:
            self.kill()
            await self.proc.wait()
        shutil.rmtree(self.workdir, ignore_errors=True)  # our socket directory (empty after a clean exit)
        return self.proc.returncode


def daemon(role: str, workdir: str | None = None, *, shm: str | None = None, **overrides: str) -> Daemon:
    """A daemon of ``role`` (not started) with its own names and ephemeral ports."""
    workdir = workdir or short_tmpdir()
    sock = os.path.join(workdir, f"{role}.sock")
    shm = shm or f"kvservice-example-{role}-{uuid.uuid4().hex[:8]}"
    env = daemon_env(sock, shm, role=role, **{"KVSERVICE_LOG_LEVEL": "warning", **overrides})
    return Daemon(role, workdir, sock, shm, env)
