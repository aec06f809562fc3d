"""A real etcd for the discovery tests: Debian's ``etcd`` binary (package ``etcd-server``),
started by the test on free loopback ports with its data in a temporary directory, and
stopped, paused (SIGSTOP) or killed by its own PID.  Nothing else is touched."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from tests.helpers import eventually_sync, free_port

#: etcd answers its health endpoint within this long of starting (it takes well under 1 s)
READY_TIMEOUT_S = 20.0


def etcd_binary() -> str | None:
    return shutil.which("etcd")


def require_etcd() -> str:
    """The etcd binary; skip (saying how to get it) where it is missing, fail under CI."""
    binary = etcd_binary()
    if binary is None:
        why = "etcd not installed (Debian: apt-get install etcd-server; scripts/setup.sh does it as root)"
        if os.environ.get("CI"):
            pytest.fail(why)
        pytest.skip(why)
    return binary


class EtcdServer:
    """One single-member etcd.  ``start`` again after ``kill`` reuses the same ports and
    data (a restart); ``pause``/``resume`` stop and continue the process."""

    def __init__(self, data_dir: Path, host: str = "127.0.0.1", prefix: Sequence[str] = (),
                 client_port: int | None = None, peer_port: int | None = None,
                 tls: tuple[str, str, str] | None = None) -> None:
        """``tls``: (CA, certificate, key) files: clients connect over https and must
        present a certificate that CA signed."""
        self.binary = require_etcd()
        self.data_dir = data_dir
        self.host = host
        self.prefix = tuple(prefix)  # e.g. ("ip", "netns", "exec", NAME)
        self.client_port = client_port or free_port()
        self.peer_port = peer_port or free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.tls = tls
        self.log_path = data_dir.parent / f"{data_dir.name}.log"
        self._log_from = 0

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.client_port}"

    def start(self) -> None:
        client = f"{'https' if self.tls else 'http'}://{self.host}:{self.client_port}"
        peer = f"http://{self.host}:{self.peer_port}"
        argv = [*self.prefix, self.binary, "--name", "kv", "--data-dir", str(self.data_dir),
                "--listen-client-urls", client, "--advertise-client-urls", client,
                "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                "--initial-cluster", f"kv={peer}", "--logger", "zap", "--log-outputs", "stderr"]
        if self.tls:
            ca, cert, key = self.tls
            argv += ["--trusted-ca-file", ca, "--cert-file", cert, "--key-file", key, "--client-cert-auth"]
        self._log_from = self.log_path.stat().st_size if self.log_path.exists() else 0
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=log, stdin=subprocess.DEVNULL)
        self._wait_ready()

    def _wait_ready(self) -> None:
        def listening() -> bool:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited {self.proc.returncode}: {self.log_path.read_text()[-2000:]}")
            if self.prefix:  # in another namespace: not reachable from here; etcd says when it serves
                return b"serving client traffic" in self.log_path.read_bytes()[self._log_from:]
            with contextlib.suppress(OSError), socket.create_connection((self.host, self.client_port), 0.2):
                return True
            return False

        eventually_sync(listening, READY_TIMEOUT_S, 0.05,
                        what=lambda: f"etcd listening (log: {self.log_path.read_text()[-2000:]})")

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def pause(self) -> None:
        os.kill(self.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.pid, signal.SIGCONT)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.pid, signal.SIGCONT)  # a paused one cannot die until continued
            self.proc.kill()
            self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.pid, signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


@contextlib.contextmanager
def etcd_server(tmp_path: Path, **kw: object) -> Iterator[EtcdServer]:
    server = EtcdServer(tmp_path / "etcd", **kw)  # type: ignore[arg-type]
    server.start()
    try:
        yield server
    finally:
        server.stop()
