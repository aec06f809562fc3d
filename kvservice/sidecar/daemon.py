"""``kvservice serve``: the sidecar daemon's lifecycle, and ``kvservice check-config``.

Startup, in order; any failure prints one line and exits ``EXIT_FAILED``
(``EXIT_USAGE`` for a bad config), undoing what was done::

    shared segment (stale one removed) -> HTTP listener -> Unix socket (stale one removed)
    -> TransferService (NIXL agent, pool registered, control listener) -> serve workers
    -> ready: one JSON line on stdout (and ``sidecar.ready_file``), /readyz 200

Shutdown on the first SIGTERM/SIGINT, like uvicorn's: stop accepting workers
and requests (/readyz 503), let in-flight transfers finish within
``service.drain_grace_s``, fail the rest ``SHUTDOWN`` and tell the peers (the
service's own exit), push the last results and a Bye to the workers, release
NIXL, remove the socket and the segment, exit ``EXIT_OK``.  A second signal
exits at once with ``EXIT_FORCED``, removing only the socket and segment names.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import resource
import signal
import stat
import sys
from collections.abc import Sequence
from typing import Any

import anyio
import anyio.abc
from prometheus_client import generate_latest

from .._config import ConfigError
from .._exits import EXIT_FAILED, EXIT_OK, EXIT_USAGE
from .._log import get_logger
from .._results import KVServiceError, NixlUnavailable
from .._runtime import configure_logging, freeze_startup_objects, run
from .._service import TransferService
from ..discovery._etcd import EtcdMissing, EtcdUnavailable
from . import metrics
from .http import OpsServer
from .server import SidecarServer
from .settings import SidecarConfig, load, to_toml
from .shm import Segment, SegmentError, segment_path

log = get_logger("kvservice.sidecar")

#: a second signal during shutdown: exit now, skipping the drain
EXIT_FORCED = 3


class StartupError(KVServiceError):
    """The daemon cannot start (its socket, port or shared segment is in the way, or the
    service failed to start); the message is the one line the operator sees.

    Raised while starting; ``Daemon.run`` prints it and exits ``EXIT_FAILED``."""


class Daemon:
    def __init__(self, config: SidecarConfig) -> None:
        self.cfg = config
        self.svc: TransferService | None = None
        self.server: SidecarServer | None = None
        self.ops: OpsServer | None = None
        self.ready = False
        self.http_address = ""
        self._socket_ino: int | None = None
        self.metrics = metrics.registry(metrics.SidecarCollector(
            lambda: self.svc, lambda: self.server, lambda: self.ops, lambda: self.ready))

    # -- the whole life -------------------------------------------------------------------
    async def run(self) -> int:
        self._stop = anyio.Event()
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._watch_signals, signals)
                code = EXIT_FAILED
                try:
                    code = await self._serve()
                except* StartupError as group:  # raised inside task groups, so maybe wrapped
                    print(f"kvservice serve: cannot start: {group.exceptions[0]}", file=sys.stderr, flush=True)
                tg.cancel_scope.cancel()
        log.info("sidecar.exited", code=code)
        return code

    async def _watch_signals(self, signals: Any) -> None:
        count = 0
        async for signum in signals:
            count += 1
            name = signal.Signals(signum).name
            if count == 1:
                log.info("shutdown.requested", signal=name, drain_grace_s=self.cfg.service.drain_grace_s)
                self._stop.set()  # during startup: stop as soon as the service is up
            else:
                log.warning("shutdown.forced", signal=name)
                self._remove_names()
                sys.stderr.flush()
                os._exit(EXIT_FORCED)

    async def _serve(self) -> int:
        cfg = self.cfg
        try:
            segment = await anyio.to_thread.run_sync(
                functools.partial(Segment.create, cfg.sidecar.shm_name, cfg.layout, gid=cfg.sidecar.gid))
        except SegmentError as exc:
            raise StartupError(str(exc)) from exc
        try:
            with segment:
                return await self._serve_http(segment)
        finally:
            self._remove_ready_file()

    async def _serve_http(self, segment: Segment) -> int:
        host, port = self.cfg.http.host, self.cfg.http.port
        try:
            listener = await anyio.create_tcp_listener(local_host=host, local_port=port)
        except OSError as exc:
            raise StartupError(f"http.port {port} on {host}: {exc.strerror or exc}") from exc
        bound = listener.extra(anyio.abc.SocketAttribute.local_port)
        self.http_address = f"{host}:{bound}"
        self.ops = ops = OpsServer({"/healthz": self._healthz, "/readyz": self._readyz, "/metrics": self._metrics})
        async with anyio.create_task_group() as tg:
            await tg.start(ops.serve, listener)
            try:
                code = await self._serve_socket(segment, tg)
            finally:
                tg.cancel_scope.cancel()
        return code

    async def _serve_socket(self, segment: Segment, tg: anyio.abc.TaskGroup) -> int:
        uds = await self._bind_socket()
        try:
            return await self._serve_service(segment, uds, tg)
        finally:
            self._remove_socket()

    async def _serve_service(self, segment: Segment, uds: anyio.abc.Listener[Any], tg: anyio.abc.TaskGroup) -> int:
        svc = TransferService(self.cfg.service, pool=segment.tensor)
        try:
            await svc.__aenter__()  # not cancellable from outside: it opens the service's task group
        except Exception as exc:
            await uds.aclose()
            raise StartupError(self._start_failure(exc)) from exc
        self.svc = svc
        self.server = server = SidecarServer(svc, self.cfg, segment.name)
        failure: BaseException | None = None
        try:
            await tg.start(server.serve, uds)
            self._announce(segment)
            await self._stop.wait()
            log.info("shutdown.draining", sending=svc.status()["sending"], receiving=svc.status()["receiving"])
            self.ready = False
            server.stop_accepting()
        except BaseException as exc:
            failure = exc
            raise
        finally:
            # Drain within the grace period, fail the rest SHUTDOWN, Bye to peers, release
            # NIXL.  The service shields this itself (and must exit its own task group here).
            await svc.__aexit__(type(failure) if failure else None, failure,
                                failure.__traceback__ if failure else None)
            with anyio.CancelScope(shield=True):
                await server.close()  # the last Finished frames, then Bye, to every worker
        log.info("shutdown.complete", outcomes=svc.status().outcomes)
        return EXIT_OK

    def _start_failure(self, exc: Exception) -> str:
        """One line for why the service did not start."""
        cause = exc
        if isinstance(cause, NixlUnavailable):
            return f"NIXL is unavailable: {cause}"
        if isinstance(cause, EtcdUnavailable | EtcdMissing):  # says what and why, naming the key
            return str(cause)
        if isinstance(cause, OSError):
            svc = self.cfg.service
            return f"service.port {svc.port} on {svc.host}: {cause.strerror or cause}"
        return f"the transfer service failed to start: {cause!r}"

    # -- the Unix socket ------------------------------------------------------------------
    async def _bind_socket(self) -> anyio.abc.Listener[Any]:
        path = self.cfg.sidecar.socket_path
        if _existing_socket(path):
            try:
                probe = await anyio.connect_unix(path)
            except OSError:
                os.unlink(path)  # nobody listens: left by a daemon that crashed
                log.warning("socket.stale_removed", path=path)
            else:
                await probe.aclose()
                raise StartupError(f"sidecar.socket_path {path} is in use by a running daemon")
        old = os.umask(0o177)  # the socket is born 0600: no window where others may connect
        try:
            listener = await anyio.create_unix_listener(path, mode=0o600)
        except OSError as exc:
            raise StartupError(f"sidecar.socket_path {path}: {exc.strerror or exc}") from exc
        finally:
            os.umask(old)
        self._socket_ino = os.lstat(path).st_ino
        gid = self.cfg.sidecar.gid
        if gid is not None:  # 0600 -> 0660: only ever wider for the group, never for others
            try:
                os.chown(path, -1, gid, follow_symlinks=False)
                os.chmod(path, 0o660)
            except OSError as exc:
                await listener.aclose()
                self._remove_socket()
                raise StartupError(f"sidecar.group: cannot give {path} to group {gid}: {exc.strerror}") from exc
        return listener

    def _remove_socket(self) -> None:
        path = self.cfg.sidecar.socket_path
        with contextlib.suppress(OSError):
            if self._socket_ino is not None and os.lstat(path).st_ino == self._socket_ino:
                os.unlink(path)  # only our own: a successor may already have bound the path
        self._socket_ino = None

    def _remove_names(self) -> None:
        """For a forced exit: the kernel reclaims the rest."""
        self._remove_socket()
        with contextlib.suppress(OSError):
            os.unlink(segment_path(self.cfg.sidecar.shm_name))
        self._remove_ready_file()

    # -- ready ------------------------------------------------------------------------------
    def _announce(self, segment: Segment) -> None:
        assert self.svc is not None
        freeze_startup_objects()  # long-lived from here on: keep GC passes short
        self.ready = True
        info = {
            "event": "sidecar.ready", "pid": os.getpid(), "roles": list(self.cfg.sidecar.roles),
            "socket": self.cfg.sidecar.socket_path, "shm": segment.name, "http": self.http_address,
            "address": self.svc.address, "agent": self.svc.agent_name,
        }
        log.info("sidecar.ready", **{k: v for k, v in info.items() if k != "event"})
        print(json.dumps(info), flush=True)
        ready_file = self.cfg.sidecar.ready_file
        if ready_file:
            tmp = f"{ready_file}.tmp"
            with open(tmp, "w") as f:
                f.write(json.dumps(info) + "\n")
            os.replace(tmp, ready_file)

    def _remove_ready_file(self) -> None:
        if self.cfg.sidecar.ready_file:
            with contextlib.suppress(OSError):
                os.unlink(self.cfg.sidecar.ready_file)

    # -- ops endpoints ------------------------------------------------------------------------
    def _healthz(self) -> tuple[int, str, str]:
        return 200, "text/plain; charset=utf-8", "ok\n"

    def _readyz(self) -> tuple[int, str, str]:
        if self.ready:
            return 200, "text/plain; charset=utf-8", "ready\n"
        state = "draining" if self._stop.is_set() else "starting"
        return 503, "text/plain; charset=utf-8", f"{state}\n"

    def _metrics(self) -> tuple[int, str, str]:
        return 200, metrics.CONTENT_TYPE, generate_latest(self.metrics).decode()


def _existing_socket(path: str) -> bool:
    """True if a socket file is at ``path``; raises ``StartupError`` for anything in the way."""
    parent = os.path.dirname(path)
    if parent and not os.path.isdir(parent):
        raise StartupError(f"sidecar.socket_path: directory {parent} does not exist")
    if not os.path.lexists(path):
        return False
    st = os.lstat(path)
    if not stat.S_ISSOCK(st.st_mode):
        raise StartupError(f"sidecar.socket_path {path} exists and is not a socket")
    if st.st_uid != os.geteuid():  # not ours to probe or remove, even as root
        raise StartupError(f"sidecar.socket_path {path} belongs to uid {st.st_uid}, not to this user "
                           f"({os.geteuid()}); remove it or choose another path")
    return True


# -- entry points ----------------------------------------------------------------------------


def serve_main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="kvservice serve", description="Run the KV transfer sidecar daemon (see docs/sidecar.md).")
    parser.add_argument("--config", "-c", metavar="FILE", help="TOML config (config/prefill.toml, ...)")
    args = parser.parse_args(argv)
    try:
        cfg = load(args.config)
    except ConfigError as exc:
        print(f"kvservice serve: config error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    fmt = cfg.log.format
    configure_logging(cfg.log.level, json=None if fmt == "auto" else fmt == "json")
    _raise_descriptor_limit()
    try:
        return run(Daemon(cfg).run, loop=cfg.sidecar.loop)
    except ConfigError as exc:  # e.g. loop = "uvloop" without uvloop
        print(f"kvservice serve: config error: sidecar.{exc}", file=sys.stderr)
        return EXIT_USAGE


def _raise_descriptor_limit() -> None:
    """Raise the soft descriptor limit to the hard one, as servers do: every worker, peer and
    UCX endpoint holds descriptors, and running out costs more than a failed accept(): UCX's own
    listener was seen refusing every later peer after one accept() failed for want of them."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (OSError, ValueError) as exc:
            log.warning("sidecar.fd_limit", soft=soft, hard=hard, error=repr(exc))
            return
    log.info("sidecar.fd_limit", soft=hard, was=soft)


def check_config_main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="kvservice check-config",
        description="Validate a sidecar config (with KVSERVICE_* overrides) and print the effective config.")
    parser.add_argument("file", help="TOML config file")
    args = parser.parse_args(argv)
    try:
        cfg = load(args.file)
    except ConfigError as exc:
        print(f"kvservice check-config: {exc}", file=sys.stderr)
        return EXIT_USAGE
    sys.stdout.write(f"# effective configuration of {args.file}\n{to_toml(cfg)}")
    return EXIT_OK
