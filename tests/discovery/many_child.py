"""A child process holding many peer services at once, for ``test_many_peers``.

    python -m tests.discovery.many_child '{"n": 64, "config": {...}}'

Each service registers in etcd as ``peer-<i>``, fills pages 0-1 of its pool with the
pattern of request ``m<i>``, and prints one ready line (JSON).  On a line ``go`` on stdin
each sends ``m<i>``; one JSON line per completed send; EOF on stdin ends them all.

These peers load the hub's metadata into NIXL without a vetting child of their own (a
door factory other than the service's NIXL one: what the simulation does): a vetting
child is a process per service (about 160 MiB private memory measured), 64 of them more
than a test machine can spare.  The hub under test vets every peer as usual."""

from __future__ import annotations

import contextlib
import json
import sys
from typing import Any

import anyio

from kvservice import KVLayout, ServiceConfig, TransferService
from kvservice._nixl.agent import NixlDoor
from kvservice._runtime import run
from kvservice.testing import pattern


def _door(agent_name: str, config: ServiceConfig) -> NixlDoor:
    return NixlDoor(agent_name, progress_thread=config.progress_thread, ucx_env=config.ucx_environment)


async def _main(arg: str) -> None:
    spec = json.loads(arg)
    raw: dict[str, Any] = dict(spec["config"])
    layout = KVLayout(**raw.pop("layout"))
    async with contextlib.AsyncExitStack() as stack:
        services: list[TransferService] = []
        for i in range(spec["n"]):
            cfg = ServiceConfig(layout=layout, discovery_name=f"peer-{i}", discovery_role="prefill", **raw)
            svc = await stack.enter_async_context(TransferService(cfg, door_factory=_door))
            svc.kv.write([0, 1], pattern(layout, f"m{i}", 2))
            services.append(svc)
        print(json.dumps({"event": "ready", "n": len(services)}), flush=True)
        stdin = anyio.wrap_file(sys.stdin)
        if (await stdin.readline()).strip() != "go":
            return
        async with anyio.create_task_group() as tg:
            async def send(i: int, svc: TransferService) -> None:
                handle = await svc.send(f"m{i}", [0, 1], last=True)
                result = await svc.await_completion(handle, timeout=60)
                print(json.dumps({"event": "completed", "i": i, "ok": result.ok}), flush=True)

            for i, svc in enumerate(services):
                tg.start_soon(send, i, svc)
        await stdin.readline()  # EOF: the hub is done


if __name__ == "__main__":
    run(_main, sys.argv[1])
