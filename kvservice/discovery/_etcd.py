"""The one door to etcd: ``aetcd`` (the optional extra ``kvservice[etcd]``) behind a
small typed interface whose every call is bounded in time and whose every failure is
``EtcdUnavailable`` (the client's own error kept as ``__cause__``).

A stopped etcd (SIGSTOP, a partition) does not refuse: its TCP connections stay open
and calls simply wait, so each call here has its own deadline.  Endpoints are tried
in order at connect; TLS uses gRPC's channel credentials (``aetcd`` itself dials only
in the clear, so ``_TlsClient`` opens the channel with them).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import anyio

from .._results import KVServiceError
from .settings import split_endpoint


class EtcdUnavailable(KVServiceError):
    """etcd could not be reached, or did not answer in time.

    Raised by every ``Etcd`` call; discovery rides it out (``etcd_unreachable``), and
    ``kvservice cluster`` reports it and exits ``EXIT_FAILED``."""


class EtcdMissing(KVServiceError):
    """``discovery = "etcd"`` without the etcd client installed.

    Raised on connecting: install ``kvservice[etcd]``, or use ``discovery = "static"``."""


@dataclass(frozen=True, slots=True)
class EtcdOptions:
    endpoints: tuple[str, ...]
    timeout_s: float
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    username: str | None = None
    password: str | None = None


@dataclass(frozen=True, slots=True)
class Entry:
    """A key and its value as etcd holds them.  Both are bytes from whoever could write
    to etcd: nothing here decodes them (``member.read`` does, and never raises)."""

    key: bytes
    value: bytes
    created: int  # the revision that created the key


@dataclass(frozen=True, slots=True)
class Event:
    kind: str  # "PUT" or "DELETE"
    key: bytes
    value: bytes
    revision: int


def _aetcd() -> Any:
    try:
        import aetcd
    except ImportError as exc:
        raise EtcdMissing("discovery = \"etcd\" needs the etcd client: pip install 'kvservice[etcd]'") from exc
    return aetcd


def _credentials(opts: EtcdOptions) -> Any:
    import grpc

    def read(path: str | None) -> bytes | None:
        if path is None:
            return None
        with open(path, "rb") as f:
            return f.read()

    return grpc.ssl_channel_credentials(read(opts.ca_file), read(opts.key_file), read(opts.cert_file))


def _client_class(aetcd: Any) -> Any:
    class TlsClient(aetcd.Client):  # type: ignore[misc]
        """``aetcd.Client`` whose channel is opened with TLS credentials."""

        def __init__(self, *args: Any, credentials: Any, **kw: Any) -> None:
            super().__init__(*args, **kw)
            self._credentials = credentials

        async def connect(self) -> None:
            rpc = aetcd.rpc
            credentials = self._credentials

            def secure_once(target: str, options: Any) -> Any:
                rpc.insecure_channel = _INSECURE[0]  # at once: no other client's channel is made here
                return rpc.secure_channel(target, credentials, options=options)

            # aetcd opens its channel with rpc.insecure_channel, synchronously at the start of
            # connect(): this one is opened with the credentials instead
            rpc.insecure_channel = secure_once
            try:
                await super().connect()
            finally:
                rpc.insecure_channel = _INSECURE[0]

    return TlsClient


_INSECURE: list[Any] = []


class Etcd:
    """A connected client; ``connect()`` makes one."""

    def __init__(self, client: Any, endpoint: str, timeout_s: float) -> None:
        self._client = client
        self.endpoint = endpoint
        self._timeout = timeout_s

    @classmethod
    async def connect(cls, opts: EtcdOptions) -> Etcd:
        """The first endpoint that answers (a status call); ``EtcdUnavailable`` naming each
        endpoint's failure when none does."""
        aetcd = _aetcd()
        if not _INSECURE:
            _INSECURE.append(aetcd.rpc.insecure_channel)
        tls = opts.ca_file is not None or opts.cert_file is not None
        failures: list[str] = []
        for endpoint in opts.endpoints:
            _, host, port = split_endpoint(endpoint)
            kw: dict[str, Any] = {"host": host, "port": port, "username": opts.username,
                                  "password": opts.password, "timeout": opts.timeout_s}
            client = (_client_class(aetcd)(credentials=_credentials(opts), **kw) if tls else aetcd.Client(**kw))
            etcd = cls(client, endpoint, opts.timeout_s)
            try:
                await etcd._call(client.status)
            except EtcdUnavailable as exc:
                failures.append(f"{endpoint}: {exc}")
                await etcd.close()
                continue
            return etcd
        raise EtcdUnavailable("no etcd endpoint answered (" + "; ".join(failures) + ")")

    async def _call(self, fn: Any, *args: Any, **kw: Any) -> Any:
        # gRPC's own deadline (the client's ``timeout``) ends the call: cancelling gRPC's
        # asyncio calls from outside can leave the task's cancellation pending past the
        # scope (measured: it cancelled the service's task group).  The scope here is only
        # a backstop for a call that ignores its deadline.
        try:
            with anyio.fail_after(2 * self._timeout + 1):
                return await fn(*args, **kw)
        except TimeoutError:
            raise EtcdUnavailable(f"no answer within {2 * self._timeout + 1}s") from None
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is None or task.cancelling():
                raise  # this task is being cancelled (the service, or the backstop above)
            # gRPC ended its own call with CancelledError (its channel closing under it): a
            # failed call, not a cancellation of ours; raised on, it broke the service's
            # cancel scopes as it left (measured once at shutdown, revoking the lease)
            raise EtcdUnavailable("the etcd client cancelled the call") from None
        except Exception as exc:
            raise EtcdUnavailable(f"{type(exc).__name__}: {exc}".rstrip(": ")) from exc

    async def close(self) -> None:
        with anyio.move_on_after(self._timeout, shield=True), contextlib.suppress(Exception):
            await self._client.close()

    async def grant(self, ttl: int) -> int:
        lease = await self._call(self._client.lease, ttl)
        return int(lease.id)

    async def keepalive(self, lease_id: int) -> int:
        """The lease's TTL after this keep-alive; 0: it is gone (lapsed or revoked)."""
        reply = await self._call(self._client.refresh_lease, lease_id)
        return int(reply.TTL)

    async def revoke(self, lease_id: int) -> None:
        await self._call(self._client.revoke_lease, lease_id)

    async def put(self, key: str, value: bytes, lease_id: int | None = None) -> int:
        """The store's revision once ``value`` is written (what a watch reports it at)."""
        reply = await self._call(self._client.put, key.encode(), value, lease=lease_id)
        return int(reply.header.revision)

    async def delete(self, key: str) -> None:
        await self._call(self._client.delete, key.encode())

    async def list(self, prefix: str) -> tuple[int, list[Entry]]:
        """The store's revision and every key under ``prefix`` with its value."""
        reply = await self._call(self._client.get_prefix, prefix.encode())
        return int(reply.header.revision), [Entry(bytes(kv.key), bytes(kv.value), int(kv.create_revision))
                                            for kv in reply]

    @contextlib.asynccontextmanager
    async def watch(self, prefix: str, start_revision: int) -> AsyncIterator[AsyncIterator[Event]]:
        """Events under ``prefix`` from ``start_revision`` on; the iterator raises
        ``EtcdUnavailable`` when the watch stream breaks."""
        watch = await self._call(self._client.watch_prefix, prefix.encode(), start_revision=start_revision)

        async def events() -> AsyncIterator[Event]:
            try:
                async for ev in watch:
                    yield Event(str(ev.kind), bytes(ev.kv.key), bytes(ev.kv.value), int(ev.kv.mod_revision))
            except Exception as exc:
                raise EtcdUnavailable(f"watch ended: {type(exc).__name__}: {exc}") from exc
            raise EtcdUnavailable("watch ended")

        try:
            yield events()
        finally:
            with anyio.move_on_after(self._timeout, shield=True), contextlib.suppress(Exception):
                await watch.cancel()


