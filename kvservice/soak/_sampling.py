"""One sample of the leak accounting: every running process's ``/proc`` figures and its
service's tables, into the run's ``Ledger``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import anyio

from ._leaks import Ledger
from ._nodes import Node
from ._usage import established, net_namespace, usage

#: a sidecar daemon's tables as its ``status()`` reports them; the rest are not on its wire
STATUS_TABLES = {"requests": ("sending", "receiving"), "early_expects": ("expects_before_send",),
                 "nixl_live_handles": ("live_nixl_handles",)}
TABLES_S = 1.0  # the most a child takes to answer ``tables``; a stopped one is not asked


async def sample(ledger: Ledger, running: Sequence[Node], statuses: Sequence[tuple[Node, dict[str, Any]]],
                 t: float) -> None:
    """Sample ``running`` (neither stopped nor killed) at ``t`` seconds into the run.  A
    sidecar node is two rows: the daemon (it owns the service: its tables from the
    ``status()`` in ``statuses``) and ``"NAME worker"`` (the process driving it)."""
    ledger.samples += 1
    status = {node.name: st for node, st in statuses}
    tcp: dict[int, set[str]] = {}  # per network namespace (one, or one per host with network cuts)

    def proc_row(row: str, pid: int) -> None:
        try:
            ns = net_namespace(pid)
            if ns not in tcp:
                tcp[ns] = established(pid)
            got = usage(pid, tcp[ns])
        except OSError:  # it just died
            return
        ledger.pids[row].add(pid)
        for res, v in got.items():
            ledger.add(row, res, t, v)

    async def tables(node: Node) -> None:
        ev = await node.call(TABLES_S, op="tables")
        if ev is not None and ev["event"] == "tables":
            for name, tab in ev["tables"].items():
                ledger.add(node.name, name, t, tab["size"], tab["cap"])

    async with anyio.create_task_group() as tg:
        for node in running:
            if node.daemon is not None and node.daemon.proc is not None:
                proc_row(node.name, node.daemon.pid)
                proc_row(f"{node.name} worker", node.proc.pid)
                st = status.get(node.name)
                if st is not None:
                    for name, keys in STATUS_TABLES.items():
                        ledger.add(node.name, name, t, sum(int(st[k]) for k in keys))
                    ledger.add(node.name, "peers", t, len(st["peers"]))
            else:
                proc_row(node.name, node.proc.pid)
                tg.start_soon(tables, node)
