"""What the cyclic GC walks per waiting transfer of the engine facade (``KVTransferEngine``),
as a scheduler (SGLang's, vLLM's) keeps them: objects tracked per transfer, and one full
collection's CPU time.

    PYTHONPATH=$PWD .venv/bin/python -m benchmarks.gc_engine --transfers 4096 --repeats 3

Two engines in this process on fake NIXL doors (the facade's and the service's Python
objects are those of a real run; NIXL's own are not Python objects), ``--transfers``
receivers waiting for an arrival and as many senders waiting for an expect.  Run it with
another checkout's ``kvservice`` first on ``PYTHONPATH`` to compare versions.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence

import kvservice
from kvservice import KVPoll, ServiceConfig, TransferService
from kvservice.engine import KVReceiver, KVSender, KVTransferEngine
from kvservice.memory import KVLayout
from kvservice.testing import FakeFabric

LAYOUT = KVLayout(layers=2, page_tokens=16, kv_heads=2, head_dim=64, dtype="bfloat16", num_pages=64)


def until(check: Callable[[], bool], timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise SystemExit("timed out waiting for the engines")
        time.sleep(0.01)


def cpu_of_collection() -> float:
    t0 = time.thread_time()
    gc.collect()
    return time.thread_time() - t0


def once(n: int, rep: int) -> tuple[float, float, Counter[str]]:
    fabric = FakeFabric()
    # long deadlines: nothing may end while the objects are counted
    cfg = ServiceConfig(layout=LAYOUT, host="127.0.0.1", bootstrap_timeout_s=600.0, arrival_timeout_s=600.0,
                        drain_grace_s=0.2)

    def factory(c: ServiceConfig) -> TransferService:
        return TransferService(c, door_factory=fabric.factory)

    with (KVTransferEngine(cfg, service_factory=factory) as prefill,
          KVTransferEngine(cfg, service_factory=factory) as decode):
        gc.collect()
        before = {id(o) for o in gc.get_objects()}
        base = cpu_of_collection()
        receivers: list[KVReceiver] = []
        senders: list[KVSender] = []
        for i in range(n):
            r = decode.receiver(f"r{rep}-{i}", sender=prefill.address)
            r.init([i % LAYOUT.num_pages])
            receivers.append(r)
            s = prefill.sender(f"s{rep}-{i}")
            s.send([i % LAYOUT.num_pages], last=True)
            senders.append(s)
        everyone = (*receivers, *senders)
        until(lambda: all(t._owned and not t._running for t in everyone))
        time.sleep(0.2)  # the loops settle
        assert all(t.poll() is not KVPoll.Failed for t in everyone)
        gc.collect()
        new = Counter(type(o).__qualname__ for o in gc.get_objects() if id(o) not in before)
        took = cpu_of_collection()
        for t in everyone:
            t.abort()
        until(lambda: all(t.settled for t in everyone))
    return sum(new.values()) / (2 * n), (took - base) * 1e3, new


def main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gc_engine", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--transfers", type=int, default=4096, help="receivers waiting, and as many senders")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(list(argv))
    gc.freeze()  # what the imports left: a serving process freezes it too
    runs = [once(args.transfers, rep) for rep in range(args.repeats)]
    per = statistics.median(r[0] for r in runs)
    cpu = statistics.median(r[1] for r in runs)
    print(f"kvservice from {kvservice.__file__}")
    print(f"{2 * args.transfers} transfers waiting: {per:.2f} tracked objects per transfer, "
          f"a full collection +{cpu:.2f} ms of CPU over none waiting (medians of {args.repeats})")
    top = runs[0][2].most_common(12)
    print("  " + ", ".join(f"{k} {v / (2 * args.transfers):.2f}" for k, v in top))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
