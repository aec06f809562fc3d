"""What the metadata-vetting child costs each service: ``kvservice bench``'s memory part.

Every service (every engine rank) starts a vetting child (``kvservice._trust.vetting``)
and pays for it whether it ever peers or not.  This starts ``MetadataVetter``'s child as
a service does, one after another, and for each reads

- ``ready_s``: from ``start()`` until ``ready()`` returns with the child serving (its
  spawn, its imports, its NIXL agent and one warm-up load; on a busy machine mostly time
  waiting for a core),
- ``cpu_s``, ``rss_mib``, ``pss_mib``: the child's CPU time so far and its resident
  memory then (``kvservice.bench.procfs``);

and reports their medians.  It runs in a child of the bench
(``python -m kvservice.bench.vetting LOOP CONFIG``), not in the bench's driver: the
vetting child's parent is then a process like a service, with kvservice imported and NIXL
loaded (``nixl_build()``, which a service's door has called before its child starts, is
called first and not counted), on the event loop the bench's services run.

A child that cannot start is an ``error`` reply naming why (``MetadataVetter``'s
``last_broken``); ``measure`` returns it as ``{"error": ...}`` for the report to print.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import anyio

from kvservice._config import host_ucx_defaults
from kvservice._nixl.trial import nixl_build
from kvservice._results import KVServiceError
from kvservice._trust.vetting import START_TIMEOUT_S, MetadataVetter
from kvservice.bench import procfs
from kvservice.bench._lines import Child, ChildError, emit, take_stdout

#: children measured, one after another: a full run, ``--quick``
RUNS, QUICK_RUNS = 3, 1


class VettingChildError(KVServiceError):
    """The vetting child did not start (or not serve): the message says why."""


@dataclass(frozen=True, slots=True)
class ChildCost:
    """One vetting child, read when it first serves."""

    ready_s: float
    cpu_s: float
    rss_mib: float
    pss_mib: float | None


async def measure_child(ucx_env: Mapping[str, str]) -> ChildCost:
    """Start one vetting child as a service does, wait until it serves, read its cost, stop it.

    The caller has called ``nixl_build()`` (a service's door has, before its child starts)."""
    used: procfs.Usage | None = None
    why = "the vetting process did not start"
    async with anyio.create_task_group() as tg:
        vetter = MetadataVetter(tg, ucx_env)
        t0 = time.perf_counter()
        vetter.start()
        await vetter.ready()
        took = time.perf_counter() - t0
        pid = vetter.pid
        if vetter.serving and pid is not None:
            try:
                used = procfs.usage(pid)
            except OSError as exc:  # it died between ready and the reading
                why = f"the vetting process (pid {pid}) ended as it was read: {exc}"
        elif vetter.last_broken is not None:
            why = vetter.last_broken
        tg.cancel_scope.cancel()  # the child is stopped and reaped as the group ends
    if used is None:
        raise VettingChildError(why)
    return ChildCost(took, used.cpu_s, used.rss_mib, used.pss_mib)


def summarize(children: list[ChildCost]) -> dict[str, Any]:
    """Medians over ``children`` (``pss_mib`` ``None`` where the kernel has no ``smaps_rollup``),
    and each child's own figures."""
    pss = [c.pss_mib for c in children if c.pss_mib is not None]
    return {
        "children": len(children),
        "ready_s": statistics.median(c.ready_s for c in children),
        "cpu_s": statistics.median(c.cpu_s for c in children),
        "rss_mib": statistics.median(c.rss_mib for c in children),
        "pss_mib": statistics.median(pss) if pss else None,
        "per_child": [asdict(c) for c in children],
    }


async def measure_children(runs: int, ucx_env: Mapping[str, str]) -> dict[str, Any]:
    """``runs`` children one after another (NIXL loaded first, not counted): ``summarize``'s
    figures and the load average when the last one was read."""
    nixl_build()
    children = [await measure_child(ucx_env) for _ in range(runs)]
    return {**summarize(children), "load_avg": os.getloadavg()[0]}


# -- the driver's side ------------------------------------------------------------------------------


def measure(loop: str, runs: int, env: dict[str, str | None] | None = None) -> dict[str, Any]:
    """Run ``runs`` children in a bench child on ``loop``: their figures, or ``{"error": why}``.

    ``env``: the UCX variables of the bench's other children (the vetting child inherits them)."""
    child = Child("kvservice.bench.vetting", loop, {"runs": runs}, env=env)
    try:
        got = child.wait("vetting", timeout=runs * (START_TIMEOUT_S + 30) + 60)
    except ChildError as exc:
        return {"error": str(exc)}
    finally:
        child.close()
    got.pop("event")
    return {**got, "loop": loop}


# -- the child's side -------------------------------------------------------------------------------


def main() -> None:
    take_stdout()
    loop, config = sys.argv[1], json.loads(sys.argv[2])
    try:
        # a service's UCX settings when its configuration sets none (``ServiceConfig.ucx_environment``)
        got = anyio.run(measure_children, int(config["runs"]), host_ucx_defaults(), backend="asyncio",
                        backend_options={"use_uvloop": loop == "uvloop"})
    except VettingChildError as exc:
        emit({"event": "error", "message": str(exc)})
        return
    except Exception as exc:  # noqa: BLE001 - NIXL's import, a spawn: the report says what, not a traceback
        emit({"event": "error", "message": f"{type(exc).__name__}: {exc}"})
        return
    emit({"event": "vetting", **got})


if __name__ == "__main__":
    main()
