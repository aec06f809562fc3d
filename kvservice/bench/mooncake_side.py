"""The Mooncake baseline: Mooncake's Transfer Engine in the best hand-written loop.

``python -m kvservice.bench.mooncake_side send|recv CONFIG``, two processes like
``kvservice.bench.raw_nixl``: each a ``mooncake.engine.TransferEngine`` on
loopback (metadata by ``P2PHANDSHAKE``, no etcd) with a pool of the benchmark's
layout registered once and touched.  The same requests, pages and pools as the
NIXL methods; nothing of kvservice on the path (only the bench's line protocol
and workload sizes).

The sender computes every request's (source, destination, length) lists before
the clock starts, adjacent descriptors merged as NIXL's ``make_prepped_xfer``
merges them, and keeps ``concurrency`` requests in flight.  Each entry is its
own batch (``transfer_submit_write``), and the in-flight ones are swept with
the non-blocking ``transfer_check_status`` oldest first up to the first one
still pending (entries complete about in order), sleeping ``POLL_SLEEP_S``
when none completed.  That check looks at a batch's first entry only, which is why
batches hold one entry: a multi-entry batch would count as done while its
later entries still move.  The other way, one ``batch_transfer_async_write``
per request awaited with ``get_batch_transfer_status`` (which does wait for
every entry), spins a core in C++ while it waits, the core the TCP
transport's threads need: measured here it was slower (``poll: false`` in
the config selects it; see docs/perf/README.md).

Arrival: Mooncake's WRITE is one-sided and has no completion event on the
target for an asynchronous batch (its notify rides only the blocking
``batch_transfer_sync`` call, one request at a time).  So the sender reports
when each request completed, and that is the receiver's arrival: the run ends
with the sender's last completion.  This favours Mooncake over the NIXL
methods, whose receivers wait for a notification to come back to them.

Only ``mooncake.engine`` is imported, in the child, at start: kvservice imports
without the optional ``kvservice[mooncake]`` extra (``available`` says why not).
"""

from __future__ import annotations

import collections
import importlib
import importlib.util
import json
import os
import subprocess
import sys
import time
from typing import Any

import torch

from kvservice.bench._lines import emit, take_stdout
from kvservice.bench.workloads import plane_bytes

MODULE = "mooncake.engine"
EXTRA = "kvservice[mooncake]"
#: the transport this host runs it over (loopback, no RDMA devices): the label of its rows
PROTOCOL = "tcp"
POLL_TIMEOUT_S = 120.0
BAD_BATCH = 2**64 - 1
IMPORT_TIMEOUT_S = 60.0
#: entries per posted batch, and entries queued at once (below the transport's 1,024 slices
#: per peer: ``ENV`` makes a slice as large as the largest merged entry, so an entry is a slice)
BATCH_ENTRIES = 256
INFLIGHT_ENTRIES = 512
#: the default wait: every entry its own batch, swept with non-blocking checks, sleeping this
#: long when none completed (``poll: false``: multi-entry batches, the oldest awaited blocking)
POLL_SLEEP_S = 0.0005
#: the engine's settings for the children: one slice per entry (the largest merged entry of
#: the workloads is 4 MiB); its INFO lines (one per batch) off
ENV: dict[str, str | None] = {"MC_TCP_SLICE_SIZE": str(4 << 20), "GLOG_minloglevel": "1"}


def available() -> str | None:
    """Why the Mooncake baseline cannot run here, or ``None``: its module must import in a
    child as the bench starts it (the package is an optional extra, and its library loads
    the system's libibverbs even for TCP)."""
    if importlib.util.find_spec("mooncake") is None:
        return f"Mooncake's Transfer Engine is not installed: pip install '{EXTRA}'"
    try:
        probe = subprocess.run([sys.executable, "-c", f"import {MODULE}"], capture_output=True, text=True,
                               timeout=IMPORT_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        return f"import {MODULE} took over {IMPORT_TIMEOUT_S:.0f} s"
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["no output"])[-1]
        return f"import {MODULE} failed: {last} (Debian needs libibverbs1 even for TCP; pip install '{EXTRA}')"
    return None


#: one request: source addresses, destination addresses, lengths (merged runs)
Entries = tuple[list[int], list[int], list[int]]


def chunked(request: Entries, size: int) -> collections.deque[Entries]:
    """A request's entries in batches of at most ``size``."""
    srcs, dsts, lens = request
    return collections.deque((srcs[i:i + size], dsts[i:i + size], lens[i:i + size])
                             for i in range(0, len(lens), size))


def entries(src: list[int], dst: list[int], src_base: int, dst_base: int, planes: int,
            src_pages: int, dst_pages: int, pbytes: int) -> Entries:
    """A request's descriptors (plane-major, like NIXL's index arrays), adjacent runs merged:
    an entry grows while both its source and its destination continue where it ends."""
    srcs: list[int] = []
    dsts: list[int] = []
    lens: list[int] = []
    for plane in range(planes):
        for s, d in zip(src, dst, strict=True):
            a = src_base + (plane * src_pages + s) * pbytes
            b = dst_base + (plane * dst_pages + d) * pbytes
            if lens and srcs[-1] + lens[-1] == a and dsts[-1] + lens[-1] == b:
                lens[-1] += pbytes
            else:
                srcs.append(a)
                dsts.append(b)
                lens.append(pbytes)
    return srcs, dsts, lens


class Side:
    def __init__(self, role: str, cfg: dict[str, Any]) -> None:
        engine_mod = importlib.import_module(MODULE)
        layout = cfg["layout"]
        self.planes = 2 * int(layout["layers"])
        self.num_pages = int(cfg["num_pages"])
        self.pbytes = plane_bytes(layout)
        self.pool = torch.empty((layout["layers"], 2, self.num_pages, self.pbytes // 2), dtype=torch.bfloat16)
        self.pool.fill_(1.0 if role == "send" else 0.0)  # touch every page once
        self.base = int(self.pool.data_ptr())
        self.nbytes = self.pool.numel() * self.pool.element_size()
        self.engine: Any = engine_mod.TransferEngine()
        host = str(cfg.get("host", "127.0.0.1"))
        rc = self.engine.initialize(host, "P2PHANDSHAKE", PROTOCOL, "")
        if rc != 0:
            raise RuntimeError(f"TransferEngine.initialize({host!r}, P2PHANDSHAKE, {PROTOCOL}) returned {rc}")
        rc = self.engine.register_memory(self.base, self.nbytes)
        if rc != 0:
            raise RuntimeError(f"register_memory returned {rc}")
        self.address = f"{host}:{self.engine.get_rpc_port()}"
        self.batch_entries = int(cfg.get("batch_entries", BATCH_ENTRIES))
        self.inflight_entries = int(cfg.get("inflight_entries", INFLIGHT_ENTRIES))
        self.poll = bool(cfg.get("poll", True))
        self.poll_sleep = float(cfg.get("poll_sleep_s", POLL_SLEEP_S))
        self.head = bool(cfg.get("head", True))
        self.target = ""
        self.remote_base = 0
        self.remote_pages = 0

    def hello(self) -> dict[str, Any]:
        return {"event": "ready", "target": self.address, "base": self.base, "num_pages": self.num_pages,
                "protocol": PROTOCOL, "pid": os.getpid()}

    def connect(self, cmd: dict[str, Any]) -> None:
        """Sender: the receiver's engine and pool; one small WRITE opens the segment
        (its handshake) before any measurement."""
        self.target = str(cmd["target"])
        self.remote_base = int(cmd["base"])
        self.remote_pages = int(cmd["num_pages"])
        rc = self.engine.transfer_sync_write(self.target, self.base, self.remote_base, self.pbytes)
        if rc != 0:
            raise RuntimeError(f"first WRITE to {self.target} returned {rc}")

    def run(self, requests: list[dict[str, Any]], concurrency: int) -> dict[str, Any]:
        """Keep ``concurrency`` requests in flight until all are done; per request its
        completion time (the receiver's arrival, see the module's docstring).

        At most ``INFLIGHT_ENTRIES`` entries are queued at once: the TCP transport fails
        what does not fit its per-peer queue (1,024 slices by default) instead of waiting.
        Without ``poll``, a request is posted as batches of at most ``BATCH_ENTRIES``."""
        todo = collections.deque(
            chunked(entries(r["src"], r["dst"], self.base, self.remote_base, self.planes, self.num_pages,
                            self.remote_pages, self.pbytes), 1 if self.poll else self.batch_entries)
            for r in requests)
        engine, target = self.engine, self.target
        post, wait = engine.batch_transfer_async_write, engine.get_batch_transfer_status
        submit, check = engine.transfer_submit_write, engine.transfer_check_status
        start = time.monotonic()
        slots = collections.deque([start] * min(concurrency, len(todo)))  # when each slot freed
        # posted batches, oldest first: (batch, entries, its request's [batches left, start])
        inflight: collections.deque[tuple[int, int, list[Any]]] = collections.deque()
        current: tuple[collections.deque[Entries], list[Any]] | None = None  # a request being posted
        queued = 0
        lat: list[float] = []
        deadline = start + POLL_TIMEOUT_S
        while todo or inflight or current:
            while True:
                if current is None and todo and slots:
                    chunks = todo.popleft()
                    current = (chunks, [len(chunks), slots.popleft()])
                if current is None:
                    break
                chunks, state = current
                n = len(chunks[0][2])
                if inflight and queued + n > self.inflight_entries:
                    break
                srcs, dsts, lens = chunks.popleft()
                batch = submit(target, srcs[0], dsts[0], lens[0]) if self.poll else post(target, srcs, dsts, lens)
                if not 0 < batch < BAD_BATCH:  # 0 or -1 (as a signed or an unsigned 64-bit id): refused
                    raise RuntimeError(f"posting a WRITE to {target} returned {batch}")
                inflight.append((batch, n, state))
                queued += n
                if not chunks:
                    current = None
            if self.poll:  # single-entry batches: a sweep of non-blocking checks, completions in any order
                done: list[tuple[int, int, list[Any]]] = []
                still: collections.deque[tuple[int, int, list[Any]]] = collections.deque()
                for item in inflight:
                    rc = check(item[0])
                    if rc == 1:
                        done.append(item)
                    elif rc == 0:
                        still.append(item)
                        if self.head:  # entries complete about in order: stop at the first pending
                            break
                    else:
                        raise RuntimeError(f"transfer_check_status returned {rc}")
                if self.head:
                    for _ in range(len(done) + len(still)):
                        inflight.popleft()
                    inflight.extendleft(reversed(still))
                else:
                    inflight = still
                if not done and self.poll_sleep:
                    time.sleep(self.poll_sleep)
            else:
                done = [inflight.popleft()]
                rc = wait([done[0][0]])  # the oldest: every entry of its batch done
                if rc != 0:
                    raise RuntimeError(f"get_batch_transfer_status returned {rc}")
            for _batch, n, state in done:
                queued -= n
                state[0] -= 1
                if state[0] == 0:
                    now = time.monotonic()
                    lat.append(now - state[1])
                    slots.append(now)
            if time.monotonic() > deadline:
                raise TimeoutError("mooncake sender: requests not done in time")
        end = time.monotonic()
        return {"event": "done", "start": start, "end": end, "latencies": lat, "ok": len(lat)}


def main() -> None:
    role, cfg = sys.argv[1], json.loads(sys.argv[2])
    take_stdout()
    torch.set_num_threads(1)
    try:
        side = Side(role, cfg)
    except Exception as exc:  # noqa: BLE001 - reported to the driver, which says why
        emit({"event": "error", "message": f"mooncake {role}: {type(exc).__name__}: {exc}"})
        return
    emit(side.hello())
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        try:
            if op == "connect":
                side.connect(cmd)
                emit({"event": "connected", "target": side.target})
            elif op == "run":
                emit(side.run(cmd["requests"], int(cmd["concurrency"])))
            elif op == "exit":
                break
            else:
                emit({"event": "error", "message": f"unknown op {op!r}"})
        except (RuntimeError, TimeoutError) as exc:
            emit({"event": "error", "message": f"mooncake {role}: {exc}"})


if __name__ == "__main__":
    main()
