"""The raw-NIXL baseline: the best hand-written loop, no kvservice code on the path.

This module imports ``nixl`` directly, on purpose.  kvservice's rule that only
``kvservice/_nixl.py`` imports nixl is about the service; the baseline the
service is measured against must not run through the service, so it imports
nothing of the service: only the bench's own line protocol and workload sizes.

Two processes (``python -m kvservice.bench.raw_nixl send|recv CONFIG``), each with
one agent and a pool of the benchmark's layout, touched once.  The sender
prepares both descriptor lists once (``prep_xfer_dlist``), computes every
request's index arrays before the clock starts, then per request
``make_prepped_xfer`` (which merges adjacent descriptors) + ``transfer`` and
polls ``check_xfer_state`` to ``DONE``, keeping ``concurrency`` requests in
flight.  The receiver drains ``get_new_notifs`` until it has seen every
request's notification (with the progress thread off, this polling is also
what lets the sender's WRITEs complete).
"""

from __future__ import annotations

import base64
import collections
import json
import logging
import os
import sys
import time
from typing import Any

import numpy as np
import torch

from kvservice.bench._lines import emit, take_stdout
from kvservice.bench.workloads import plane_bytes

POLL_TIMEOUT_S = 120.0
RECV_SLEEP_S = 0.0005
SEND_SLEEP_S = 0.0
CHECK_EVERY_S = 0.0001


def descriptor_table(base: int, planes: int, num_pages: int, pbytes: int) -> np.ndarray:
    n = planes * num_pages
    table = np.empty((n, 3), dtype=np.uint64)
    table[:, 0] = base + np.arange(n, dtype=np.uint64) * np.uint64(pbytes)
    table[:, 1] = pbytes
    table[:, 2] = 0
    return table


def descriptor_indices(pages: list[int], planes: int, num_pages: int) -> np.ndarray:
    p = np.asarray(pages, dtype=np.int32)
    return (np.arange(planes, dtype=np.int32)[:, None] * np.int32(num_pages) + p[None, :]).ravel()


#: one WRITE to post: local dlist, local indices, remote dlist, remote indices, notification
Post = tuple[Any, Any, Any, Any, bytes]


def closed_loop(agent: Any, todo: collections.deque[Post], concurrency: int,
                send_sleep: float = 0.0) -> tuple[float, float, list[float]]:
    """Post ``todo`` keeping ``concurrency`` in flight; returns (start, end, latencies).

    Latency follows the same closed-loop client model as the kvservice side:
    ``concurrency`` clients each issue their next request when their previous one
    completes, so a request's clock starts when a slot frees, not when the loop
    gets round to posting it.  Running handles are checked at least every
    ``CHECK_EVERY_S`` even while posts continue.  The bookkeeping of a finished
    handle is written out twice, not called: this is the baseline's hot loop.
    """
    start = time.monotonic()
    slots = collections.deque([start] * min(concurrency, len(todo)))  # when each slot freed
    inflight: list[tuple[Any, float]] = []
    lat: list[float] = []
    deadline = start + POLL_TIMEOUT_S
    last_check = start
    while todo or inflight:
        if todo and slots:
            local, lidx, remote, ridx, notif = todo.popleft()
            t0 = slots.popleft()
            handle = agent.make_prepped_xfer("WRITE", local, lidx, remote, ridx, notif)
            state = agent.transfer(handle)
            if state == "DONE":
                handle.release()
                now = time.monotonic()
                lat.append(now - t0)
                slots.append(now)
            elif state == "PROC":
                inflight.append((handle, t0))
            else:
                raise RuntimeError(f"transfer returned {state}")
        now = time.monotonic()
        if not inflight or (todo and slots and now - last_check < CHECK_EVERY_S):
            continue
        last_check = now
        still = []
        for handle, t0 in inflight:
            state = agent.check_xfer_state(handle)
            if state == "DONE":
                handle.release()
                now = time.monotonic()
                lat.append(now - t0)
                slots.append(now)
            elif state == "PROC":
                still.append((handle, t0))
            else:
                raise RuntimeError(f"check_xfer_state returned {state}")
        if still and len(still) == len(inflight) and send_sleep:
            time.sleep(send_sleep)  # nothing completed: leave the CPU to the receiver
        inflight = still
        if now > deadline:
            raise TimeoutError("raw sender: requests not done in time")
    return start, time.monotonic(), lat


class Side:
    def __init__(self, role: str, cfg: dict[str, Any]) -> None:
        from nixl._api import nixl_agent, nixl_agent_config

        logging.getLogger("nixl").setLevel(logging.WARNING)
        layout = cfg["layout"]
        self.planes = 2 * int(layout["layers"])
        self.num_pages = int(cfg["num_pages"])
        self.pbytes = plane_bytes(layout)
        elems = self.pbytes // 2
        self.pool = torch.empty((layout["layers"], 2, self.num_pages, elems), dtype=torch.bfloat16)
        self.pool.fill_(1.0 if role == "send" else 0.0)  # touch every page once
        conf = nixl_agent_config(enable_prog_thread=bool(cfg.get("progress_thread", False)),
                                 enable_listen_thread=False, backends=["UCX"])
        self.agent = nixl_agent(f"raw-{role}-{os.getpid()}", conf)
        self.reg = self.agent.register_memory(self.pool)
        self.base = int(self.pool.data_ptr())
        self.local = self.agent.prep_xfer_dlist(
            "NIXL_INIT_AGENT", descriptor_table(self.base, self.planes, self.num_pages, self.pbytes), "DRAM")
        self.remote: Any = None
        self.remote_pages = 0
        self.peer = ""
        self.recv_sleep = float(cfg.get("recv_sleep_s", RECV_SLEEP_S))
        self.send_sleep = float(cfg.get("send_sleep_s", SEND_SLEEP_S))

    def hello(self) -> dict[str, Any]:
        md = base64.b64encode(bytes(self.agent.get_agent_metadata())).decode()
        return {"event": "ready", "metadata": md, "base": self.base, "num_pages": self.num_pages,
                "pid": os.getpid()}

    def connect(self, cmd: dict[str, Any]) -> None:
        self.peer = self.agent.add_remote_agent(base64.b64decode(cmd["metadata"]))
        if isinstance(self.peer, bytes):
            self.peer = self.peer.decode()
        self.remote_pages = int(cmd["num_pages"])
        if cmd.get("prep", False):
            table = descriptor_table(int(cmd["base"]), self.planes, int(cmd["num_pages"]), self.pbytes)
            self.remote = self.agent.prep_xfer_dlist(self.peer, table, "DRAM")
            self.agent.make_connection(self.peer)

    # -- sender ---------------------------------------------------------------
    def run(self, requests: list[dict[str, Any]], concurrency: int) -> dict[str, Any]:
        """Keep ``concurrency`` requests in flight until all are done (``closed_loop``)."""
        local, remote = self.local, self.remote
        todo = collections.deque(
            (local, descriptor_indices(r["src"], self.planes, self.num_pages),
             remote, descriptor_indices(r["dst"], self.planes, self.remote_pages),
             r["rid"].encode())
            for r in requests
        )
        start, end, lat = closed_loop(self.agent, todo, concurrency, self.send_sleep)
        return {"event": "done", "start": start, "end": end, "latencies": lat, "ok": len(lat)}

    # -- receiver -----------------------------------------------------------------
    def expect(self, rids: list[str]) -> dict[str, Any]:
        want = {r.encode() for r in rids}
        emit({"event": "expecting", "n": len(want)})
        agent = self.agent
        deadline = time.monotonic() + POLL_TIMEOUT_S
        last = time.monotonic()
        stale = 0
        sleep = self.recv_sleep
        while want:
            got = agent.get_new_notifs()
            if got:
                now = time.monotonic()
                for msgs in got.values():
                    for m in msgs:
                        if m in want:
                            want.discard(m)
                            last = now
                        else:
                            stale += 1
            elif sleep:
                time.sleep(sleep)
            if time.monotonic() > deadline:
                break
        return {"event": "arrived", "last": last, "missing": len(want), "stale": stale}


def main() -> None:
    role, cfg = sys.argv[1], json.loads(sys.argv[2])
    take_stdout()
    torch.set_num_threads(1)
    side = Side(role, cfg)
    emit(side.hello())
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        if op == "connect":
            side.connect(cmd)
            emit({"event": "connected", "peer": side.peer})
        elif op == "run":
            emit(side.run(cmd["requests"], int(cmd["concurrency"])))
        elif op == "expect":
            emit(side.expect(cmd["rids"]))
        elif op == "exit":
            break
        else:
            emit({"event": "error", "message": f"unknown op {op!r}"})


if __name__ == "__main__":
    main()
