"""A kvservice peer in its own process, driven by JSON lines: the child's side.

``python -m kvservice.testing.peer CONFIG_JSON`` runs a ``TransferService`` (or, with
``"sidecar": PATH``, drives a ``kvservice serve`` daemon through ``SidecarClient``)
and reads one command per line on stdin, writes one event per line on stdout::

    -> {"op": "fill", "rid": "r1", "pages": [0, 1]}          <- {"event": "filled", ...}
    -> {"op": "send", "rid": "r1", "pages": [0, 1], "last": true}
                                                           <- {"event": "sent", ...}
                                                           <- {"event": "completed", "status": ...}
    -> {"op": "expect", "rid": "r1", "pages": [5, 6], "sender": "host:port", "verify": true, "member": "prefill-0"}
                                                           <- {"event": "expecting", ...}
                                                           <- {"event": "arrived", "verified": true, ...}
    -> {"op": "verify", "rid": "r1", "pages": [5, 6]}        <- {"event": "verified", "ok": true, ...}
    -> {"op": "await_settled", "rid": "r1", "timeout": 10}  <- {"event": "settled", "settled": true, ...}
    -> {"op": "decline", "rid": "r1", "sender": "host:port"}  <- {"event": "declined", "ok": true, ...}
    -> {"op": "stall", "seconds": 2.5}                       <- {"event": "stalled", ...}
    -> {"op": "abort" | "status" | "untouched" | "exit", ...}
                   (the status event adds "stalls": [[ended, seconds], ...], this loop's
                    stalls of STALL_MIN_S or more since the last status, on CLOCK_MONOTONIC)
    -> {"op": "tables"}                                    <- {"event": "tables", "tables": {...}}

The first event is ``{"event": "ready", "address", "agent", "pid"}``; the last,
``{"event": "exited"}``.  CONFIG_JSON holds ``ServiceConfig`` settings, with the
layout as ``"layout": {"layers": ..., ...}`` (``peer_config`` writes it).  Pages hold
a deterministic pattern per request id (``kvservice.testing.pages``), so the
receiver verifies every byte without the sender shipping a checksum.

With ``"engine": {...}`` in its config (a ``memory.synthetic.EngineSpec``) the
child moves engine-shaped tensors (``memory=``) instead of its own pool; ``fill``
and ``verify`` then take ``"pattern"`` (the request id whose pattern to use, default
``rid``; tensor-parallel sub-requests share their request's) and ``"layers"``
(``[lo, hi]``), ``send`` takes ``"layers"`` and ``"payload"`` (text), and
``arrived`` reports the payload and leaves verification to ``verify``.

The parent's side, ``PeerProcess``, is in ``kvservice.testing.peer_process``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import anyio
import torch

from .._config import ServiceConfig
from .._results import KVServiceError, TransferResult
from ..memory._layout import KVLayout
from ..memory.synthetic import EngineSpec, SyntheticKV
from .pages import holds, pattern

#: a loop held this long is recorded, with when it ended, for the next ``status`` (``watch_stalls``)
STALL_MIN_S = 0.5
STALL_EVERY_S = 0.1
STALLS_KEPT = 100  # the newest, if nobody asks for a while


async def watch_stalls(stalls: list[list[float]]) -> None:
    """Append ``[ended, seconds]`` to ``stalls`` each time this loop wakes ``STALL_MIN_S`` or
    more late.  ``time.monotonic`` is CLOCK_MONOTONIC, one clock for every process of the
    machine, so the parent can place a stall among its own events (the soak does)."""
    while True:
        t0 = time.monotonic()
        await anyio.sleep(STALL_EVERY_S)
        now = time.monotonic()
        if (late := now - t0 - STALL_EVERY_S) >= STALL_MIN_S:
            stalls.append([now, late])
            del stalls[:-STALLS_KEPT]


def result_event(event: str, result: TransferResult, **extra: Any) -> dict[str, Any]:
    """``result`` as one line of JSON: its outcome, and the error's type by name."""
    return {
        "event": event, "rid": result.request_id, "status": result.status.value,
        "reason": result.reason.value if result.reason else None,
        "error_type": type(result.error).__name__ if result.error else None,
        "message": result.message, "bytes": result.bytes, "duration_s": result.duration_s,
        "transfer_s": result.transfer_s, **extra,
    }


async def _child(config_json: str) -> None:
    from .._runtime import freeze_startup_objects
    from .._service import TransferService
    from ..sidecar import SidecarClient

    raw = json.loads(config_json)
    layout = KVLayout(**raw.pop("layout", {}))
    sidecar = raw.pop("sidecar", None)  # a daemon's socket: drive it instead of an own service
    spec = raw.pop("engine", None)
    synthetic = SyntheticKV(EngineSpec(**spec)) if spec is not None else None
    config = ServiceConfig(layout=layout, **raw)
    out_lock = anyio.Lock()

    def write_line(line: str) -> None:
        sys.stdout.write(line)
        sys.stdout.flush()

    async def emit(obj: dict[str, Any]) -> None:
        # Off the event loop: a parent slow to read must not stall this peer's service
        # (its heartbeats), only the next event.
        line = json.dumps(obj) + "\n"
        async with out_lock:
            await anyio.to_thread.run_sync(write_line, line)

    engine: TransferService | SidecarClient = (
        SidecarClient(sidecar) if sidecar
        else TransferService(config, memory=synthetic.memory if synthetic else None))
    stalls: list[list[float]] = []  # this loop's, since the last status (a sidecar's loop is its daemon's)
    async with engine as svc, anyio.create_task_group() as tg:
        freeze_startup_objects()
        if isinstance(svc, TransferService):
            tg.start_soon(watch_stalls, stalls)
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
                    # "verify": landing checks (absent: the service's setting)
                    checks = {"verify": cmd["verify"]} if cmd.get("verify") is not None else {}
                    if cmd.get("member") is not None:  # the sender must prove this member
                        checks["member"] = cmd["member"]
                    await svc.expect(rid, cmd["pages"], sender=cmd["sender"], timeout=cmd.get("timeout"), **checks)
                    await emit({"event": "expecting", **base})
                    tg.start_soon(wait_arrival, rid, cmd["pages"], cmd.get("wait_timeout"))
                elif op == "abort":
                    result = await svc.abort(rid)
                    await emit({"event": "aborted", **base, "status": result.status.value if result else None})
                elif op == "decline" and isinstance(svc, TransferService):
                    ok = await svc.decline(rid, sender=cmd["sender"], message=cmd.get("message", ""))
                    await emit({"event": "declined", **base, "ok": ok})
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
                    await emit({"event": "status", **base, **st, "stalls": stalls[:]})
                    stalls.clear()
                elif op == "tables" and isinstance(svc, TransferService):  # the soak's leak accounting
                    # imported here: every other child (every test's peer) skips the soak's package
                    from ..soak._probe import service_tables

                    await emit({"event": "tables", **base, "tables": service_tables(svc)})
                elif op == "stall":  # the loop itself held: a GC pause, an engine holding the GIL
                    hold_the_loop(float(cmd["seconds"]))
                    await emit({"event": "stalled", **base})
                elif op == "exit":
                    break
                else:
                    await emit({"event": "error", **base, "message": f"unknown op {op!r}"})
            except (ValueError, KeyError, KVServiceError) as exc:  # a lost sidecar raises KVServiceError
                await emit({"event": "error", **base, "type": type(exc).__name__, "message": str(exc)})
        tg.cancel_scope.cancel()
    await emit({"event": "exited"})


def hold_the_loop(seconds: float) -> None:
    """Block the calling thread; called from the event loop, the whole loop stalls (the
    ``stall`` command's fault)."""
    time.sleep(seconds)


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
    from .._runtime import configure_logging, run

    configure_logging(os.environ.get("KVSERVICE_LOG_LEVEL", "warning"), json=True)
    run(_child, sys.argv[1])


if __name__ == "__main__":
    main()
