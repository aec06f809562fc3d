"""A ``TransferService`` in its own process, driven by JSON lines.

Used by ``kvservice demo`` and by the integration and fault tests, so that
peers are real processes that can be SIGKILLed, SIGSTOPped and restarted.

Child side (``python -m kvservice._peerproc CONFIG_JSON``): reads one command
per line on stdin, writes one event per line on stdout::

    -> {"op": "fill", "rid": "r1", "pages": [0, 1]}          <- {"event": "filled", ...}
    -> {"op": "send", "rid": "r1", "pages": [0, 1], "last": true}
                                                           <- {"event": "sent", ...}
                                                           <- {"event": "completed", "status": ...}
    -> {"op": "expect", "rid": "r1", "pages": [5, 6], "sender": "host:port"}
                                                           <- {"event": "expecting", ...}
                                                           <- {"event": "arrived", "verified": true, ...}
    -> {"op": "verify", "rid": "r1", "pages": [5, 6]}        <- {"event": "verified", "ok": true, ...}
    -> {"op": "await_settled", "rid": "r1", "timeout": 10}  <- {"event": "settled", "settled": true, ...}
    -> {"op": "abort" | "status" | "untouched" | "exit", ...}

Pages hold a deterministic pattern per request id (``pattern``), so the
receiver verifies every byte without the sender shipping a checksum.

With ``"engine": {...}`` in its config (a ``memory.synthetic.EngineSpec``) the
child moves engine-shaped tensors (``memory=``) instead of its own pool; ``fill``
and ``verify`` then take ``"pattern"`` (the request id whose pattern to use, default
``rid``; tensor-parallel sub-requests share their request's) and ``"layers"``
(``[lo, hi]``), ``send`` takes ``"layers"`` and ``"payload"`` (text), and
``arrived`` reports the payload and leaves verification to ``verify``.
"""

from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
import time
import zlib
from collections.abc import Callable, Sequence
from typing import IO, Any

import anyio
import anyio.abc
import torch
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from ._config import ServiceConfig
from ._results import KVServiceError, TransferResult
from .memory._layout import KVLayout
from .memory._pool import KVPool, torch_dtype
from .memory.synthetic import EngineSpec, SyntheticKV

# -- the payload pattern -------------------------------------------------------------


def pattern(layout: KVLayout, request_id: str, npages: int) -> torch.Tensor:
    """The bytes request ``request_id`` carries: shape (layers, 2, npages, page_elems)."""
    gen = torch.Generator().manual_seed(zlib.crc32(request_id.encode()))
    values = torch.randn((layout.layers, 2, npages, layout.page_elems), generator=gen)
    return values.to(torch_dtype(layout.dtype))


def holds(kv: KVPool, request_id: str, pages: list[int]) -> bool:
    """Whether ``pages`` of ``kv`` hold exactly what request ``request_id`` carries."""
    return bool(torch.equal(kv.pages(pages), pattern(kv.layout, request_id, len(pages))))


def result_event(event: str, result: TransferResult, **extra: Any) -> dict[str, Any]:
    return {
        "event": event, "rid": result.request_id, "status": result.status.value,
        "reason": result.reason.value if result.reason else None,
        "error_type": type(result.error).__name__ if result.error else None,
        "message": result.message, "bytes": result.bytes, "duration_s": result.duration_s,
        "transfer_s": result.transfer_s, **extra,
    }


# -- child ----------------------------------------------------------------------------


async def _child(config_json: str) -> None:
    from ._runtime import freeze_startup_objects
    from ._service import TransferService
    from .sidecar import SidecarClient

    raw = json.loads(config_json)
    layout = KVLayout(**raw.pop("layout", {}))
    sidecar = raw.pop("sidecar", None)  # a daemon's socket: drive it instead of an own service
    spec = raw.pop("engine", None)
    synthetic = SyntheticKV(EngineSpec(**spec)) if spec is not None else None
    config = ServiceConfig(layout=layout, **raw)
    out_lock = anyio.Lock()

    async def emit(obj: dict[str, Any]) -> None:
        async with out_lock:
            sys.stdout.write(json.dumps(obj) + "\n")
            sys.stdout.flush()

    engine: TransferService | SidecarClient = (
        SidecarClient(sidecar) if sidecar
        else TransferService(config, memory=synthetic.memory if synthetic else None))
    async with engine as svc, anyio.create_task_group() as tg:
        freeze_startup_objects()
        await emit({"event": "ready", "address": svc.address, "agent": svc.agent_name, "pid": os.getpid()})

        async def wait_sent(handle: Any, timeout: float | None) -> None:
            result = await svc.await_completion(handle, timeout=timeout)
            await emit(result_event("completed", result))

        async def wait_arrival(rid: str, pages: list[int], timeout: float | None) -> None:
            result = await svc.await_arrival(rid, timeout=timeout)
            verified = None
            if result.ok and synthetic is None:  # CPU work: off the event loop
                verified = await anyio.to_thread.run_sync(
                    lambda: bool(torch.equal(svc.kv.pages(pages), pattern(layout, rid, len(pages)))))
            payload = result.payload.decode(errors="replace") if result.payload is not None else None
            await emit(result_event("arrived", result, verified=verified, payload=payload))

        async def wait_settled(rid: str, base: dict[str, Any], timeout: float | None) -> None:
            try:
                result = await svc.await_settled(rid, timeout=timeout)
            except KeyError as exc:  # unknown request id
                await emit({"event": "error", **base, "type": type(exc).__name__, "message": str(exc)})
                return
            await emit(result_event("settled", result, id=base["id"], settled=result.settled))

        stdin = anyio.wrap_file(sys.stdin)
        while True:
            line = await stdin.readline()
            if not line:
                break
            cmd = json.loads(line)
            op, rid = cmd.get("op"), cmd.get("rid")
            base = {"id": cmd.get("id"), "rid": rid}
            try:
                layers = range(*cmd["layers"]) if cmd.get("layers") else None
                if synthetic is not None and op in ("fill", "verify", "untouched"):
                    await emit(await anyio.to_thread.run_sync(_synthetic_op, synthetic, op, cmd, layers, base))
                elif op == "fill":
                    data = await anyio.to_thread.run_sync(pattern, layout, rid, len(cmd["pages"]))
                    await anyio.to_thread.run_sync(svc.kv.write, cmd["pages"], data)
                    await emit({"event": "filled", **base})
                elif op == "send":
                    extra: dict[str, Any] = {}
                    if layers is not None:
                        extra["layers"] = layers
                    if cmd.get("payload") is not None:
                        extra["payload"] = cmd["payload"].encode()
                    handle = await svc.send(rid, cmd["pages"], last=cmd.get("last", True), **extra)
                    await emit({"event": "sent", **base, "poll": handle.poll().name})
                    if cmd.get("last", True):
                        tg.start_soon(wait_sent, handle, cmd.get("timeout"))
                elif op == "expect":
                    await svc.expect(rid, cmd["pages"], sender=cmd["sender"], timeout=cmd.get("timeout"))
                    await emit({"event": "expecting", **base})
                    tg.start_soon(wait_arrival, rid, cmd["pages"], cmd.get("wait_timeout"))
                elif op == "abort":
                    result = await svc.abort(rid)
                    await emit({"event": "aborted", **base, "status": result.status.value if result else None})
                elif op == "await_settled":  # in the background: may wait long
                    tg.start_soon(wait_settled, rid, base, cmd.get("timeout"))
                elif op == "verify":  # do ``pages`` hold ``rid``'s pattern (still, or now)?
                    ok = await anyio.to_thread.run_sync(holds, svc.kv, rid, cmd["pages"])
                    await emit({"event": "verified", **base, "ok": ok})
                elif op == "untouched":
                    ok = bool((svc.kv.pages(cmd["pages"]) == 0).all())
                    await emit({"event": "untouched", **base, "ok": ok})
                elif op == "status":
                    st = await svc.fetch_status() if isinstance(svc, SidecarClient) else svc.status()
                    await emit({"event": "status", **base, **st})
                elif op == "exit":
                    break
                else:
                    await emit({"event": "error", **base, "message": f"unknown op {op!r}"})
            except (ValueError, KeyError, KVServiceError) as exc:  # a lost sidecar raises KVServiceError
                await emit({"event": "error", **base, "type": type(exc).__name__, "message": str(exc)})
        tg.cancel_scope.cancel()
    await emit({"event": "exited"})


def _synthetic_op(kv: SyntheticKV, op: str, cmd: dict[str, Any], layers: range | None,
                  base: dict[str, Any]) -> dict[str, Any]:
    if op == "untouched":
        return {"event": "untouched", **base, "ok": kv.untouched(cmd["pages"])}
    key = cmd.get("pattern") or cmd["rid"]
    if op == "fill":
        kv.fill(key, cmd["pages"], layers)
        return {"event": "filled", **base}
    return {"event": "verified", **base, "ok": kv.holds(key, cmd["pages"], layers)}


def main() -> None:
    from ._runtime import configure_logging, run

    configure_logging(os.environ.get("KVSERVICE_LOG_LEVEL", "warning"), json=True)
    run(_child, sys.argv[1])


# -- parent ---------------------------------------------------------------------------


class PeerProcess:
    """Parent-side handle on a child service process."""

    def __init__(self, proc: anyio.abc.Process, events: MemoryObjectReceiveStream[dict[str, Any]],
                 sink: MemoryObjectSendStream[dict[str, Any]]) -> None:
        self.proc = proc
        self._events = events
        self._sink = sink  # the pump's end: closed here too, in case the pump never ran
        self.backlog: list[dict[str, Any]] = []
        self.address = ""
        self.agent = ""
        self.pid = proc.pid

    @classmethod
    async def start(
        cls, tg: anyio.abc.TaskGroup, config: dict[str, Any] | None = None, *,
        env: dict[str, str] | None = None, ready_timeout: float = 30.0, prefix: Sequence[str] = (),
        stderr: int | IO[Any] | None = None,
    ) -> PeerProcess:
        """Start a child service.  ``prefix`` goes before the Python command line: a
        launcher that must ``exec`` it (so ``pid`` is the service's own), e.g.
        ``("ip", "netns", "exec", NAME)`` to run the child in a network namespace.
        ``stderr``: where the child's log goes (default: this process's stderr)."""
        cmd = [*prefix, sys.executable, "-m", "kvservice._peerproc", json.dumps(config or {})]
        proc = await anyio.open_process(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr,
            env={**os.environ, **(env or {})},
        )
        send, recv = anyio.create_memory_object_stream[dict[str, Any]](1000)
        tg.start_soon(_pump, proc, send)
        peer = cls(proc, recv, send)
        try:
            ready = await peer.wait_for(lambda e: e["event"] == "ready", timeout=ready_timeout)
        except BaseException:
            # Not ready (it exited, timed out, or we were cancelled): nobody gets this
            # handle to stop, so stop the child and close its event streams here.
            with anyio.CancelScope(shield=True):
                await peer.stop(timeout=5)
            raise
        peer.address, peer.agent = ready["address"], ready["agent"]
        return peer

    @property
    def events(self) -> MemoryObjectReceiveStream[dict[str, Any]]:
        """Every event, in order, for one reader that routes them itself (not
        together with ``wait_for``/``event``, which keep a backlog of their own)."""
        return self._events

    async def command(self, **cmd: Any) -> None:
        assert self.proc.stdin is not None
        await self.proc.stdin.send((json.dumps(cmd) + "\n").encode())

    async def wait_for(self, match: Callable[[dict[str, Any]], bool], timeout: float = 30.0) -> dict[str, Any]:
        for i, ev in enumerate(self.backlog):
            if match(ev):
                return self.backlog.pop(i)
        with anyio.fail_after(timeout):
            async for ev in self._events:
                if match(ev):
                    return ev
                self.backlog.append(ev)
        raise EOFError(f"peer {self.pid} exited before the awaited event")

    async def event(self, name: str, rid: str | None = None, timeout: float = 30.0) -> dict[str, Any]:
        return await self.wait_for(lambda e: e["event"] == name and (rid is None or e.get("rid") == rid), timeout)

    def signal(self, sig: signal.Signals) -> None:
        if self.proc.returncode is None:
            os.kill(self.pid, sig)

    async def stop(self, timeout: float = 10.0) -> int | None:
        """Ask the child to exit; SIGKILL it if it does not within ``timeout``.  Its event
        streams are closed however this ends (cancelled included)."""
        try:
            try:
                if self.proc.returncode is None:
                    await self.command(op="exit")
            except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                pass
            with anyio.move_on_after(timeout):
                await self.proc.wait()
            if self.proc.returncode is None:
                self.signal(signal.SIGCONT)
                self.signal(signal.SIGKILL)
                await self.proc.wait()
        finally:
            self._events.close()
            self._sink.close()
        return self.proc.returncode


_json = json.JSONDecoder()


def _events_in(line: str) -> list[dict[str, Any]]:
    """The JSON objects in one line of a child's stdout.  Something else in the child
    (a native library) may write to the same descriptor, so text that is not an event
    is skipped (and counted in ``stray_output``) rather than ending the parent."""
    events: list[dict[str, Any]] = []
    i = 0
    while i < len(line):
        start = line.find("{", i)
        if start < 0:
            break
        try:
            obj, i = _json.raw_decode(line, start)
        except json.JSONDecodeError:
            i = start + 1
            continue
        if isinstance(obj, dict) and "event" in obj:
            events.append(obj)
    if line.strip() and not events:
        stray_output.append(line[:200])
    return events


#: lines of children's stdout that held no event (the last few)
stray_output: collections.deque[str] = collections.deque(maxlen=20)


async def _pump(proc: anyio.abc.Process, send: anyio.abc.ObjectSendStream[dict[str, Any]]) -> None:
    assert proc.stdout is not None
    buf = b""
    async with send:
        try:
            async for chunk in proc.stdout:
                buf += chunk
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    for ev in _events_in(line.decode(errors="replace")):
                        ev["_t"] = time.monotonic()
                        await send.send(ev)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            pass


if __name__ == "__main__":
    main()
