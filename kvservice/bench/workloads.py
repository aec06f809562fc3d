"""The benchmark's layout and workloads, generated deterministically from a seed.

KV is shaped like Llama-3-8B: 32 layers, 8 KV heads, head dim 128, bf16,
16-token pages, a K and a V plane per layer.  One page is 64 page-planes
(descriptors) of 32 KiB, 2 MiB in all.

Page indices follow kvservice's pool layout ``(layers, 2, num_pages, page_elems)``:
descriptor ``plane * num_pages + page``.  The raw-NIXL baseline computes the same
indices itself (``raw_nixl.descriptor_indices``) so that no kvservice code is on
its path.

Short requests take their pages from a ring over the pool.  When more pages
are in flight than the pool holds, concurrent requests may share destination
pages; NIXL allows that and the benchmark does not check bytes (the
integration tests do), so only speed is affected, not correctness of the run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

#: Llama-3-8B KV shape; ``num_pages`` is set per run
LLAMA3_8B: dict[str, Any] = {
    "layers": 32, "page_tokens": 16, "kv_heads": 8, "head_dim": 128, "dtype": "bfloat16",
}
ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4}


def plane_bytes(layout: dict[str, Any]) -> int:
    return int(layout["page_tokens"] * layout["kv_heads"] * layout["head_dim"] * ITEMSIZE[layout["dtype"]])


def page_bytes(layout: dict[str, Any]) -> int:
    return 2 * int(layout["layers"]) * plane_bytes(layout)


@dataclass(frozen=True)
class Request:
    rid: str
    src: list[int]
    dst: list[int]


@dataclass
class Case:
    """One measured configuration: a list of requests and how many run at once."""

    workload: str  # "w1" | "w2" | "w3"
    variant: str  # e.g. "contiguous", "scattered", "c16"
    concurrency: int
    requests: list[Request] = field(default_factory=list)
    #: the sender's loop-lag probe runs during it (``kv_side.Ticker``): a load of its own
    lag: bool = True

    @property
    def key(self) -> str:
        return f"{self.workload}/{self.variant}"

    @property
    def pages(self) -> int:
        return sum(len(r.src) for r in self.requests)

    def with_prefix(self, prefix: str) -> list[dict[str, Any]]:
        """The requests as JSON, request ids made unique by ``prefix``."""
        return [{"rid": f"{prefix}-{r.rid}", "src": r.src, "dst": r.dst} for r in self.requests]


@dataclass(frozen=True)
class Plan:
    """Sizes of one benchmark run (full or quick)."""

    pool_pages: int  # pages in every pool (sender and receiver)
    w1_pages: int  # pages of the one long request
    w2_requests: int
    w2_concurrency: tuple[int, ...]
    w3_concurrency: tuple[int, ...]
    w3_min_requests: int
    repeats: int
    kill_tries: int
    kill_requests: int  # requests in flight when the receiver is killed
    kill_pages: int  # pages per such request


FULL = Plan(pool_pages=256, w1_pages=128, w2_requests=1000, w2_concurrency=(1, 16, 256),
            w3_concurrency=(1, 4, 16, 64, 256, 1024, 4096), w3_min_requests=256, repeats=5,
            kill_tries=20, kill_requests=64, kill_pages=4)
QUICK = Plan(pool_pages=48, w1_pages=16, w2_requests=60, w2_concurrency=(1, 16),
             w3_concurrency=(1, 64), w3_min_requests=64, repeats=1,
             kill_tries=2, kill_requests=16, kill_pages=2)


def w1_cases(plan: Plan, seed: int) -> list[Case]:
    """One long request (``w1_pages`` pages), pages contiguous and pages scattered.

    Scattered: even pages on the sender, odd pages on the receiver, each in a
    random order, so no two neighbours in a descriptor list are adjacent in
    memory and NIXL can merge nothing (``w1_pages * 64`` descriptors).
    """
    n = plan.w1_pages
    if 2 * n > plan.pool_pages:
        raise ValueError(f"w1 needs a pool of at least {2 * n} pages")
    rng = np.random.default_rng(seed)
    contiguous = Case("w1", "contiguous", 1, [Request("w1c", list(range(n)), list(range(n, 2 * n)))])
    src = (2 * rng.permutation(n)).tolist()
    dst = (2 * rng.permutation(n) + 1).tolist()
    scattered = Case("w1", "scattered", 1, [Request("w1s", src, dst)])
    return [contiguous, scattered]


def ring_requests(prefix: str, sizes: list[int], src_pool: int, dst_pool: int,
                  src_start: int = 0, dst_start: int = 0) -> list[Request]:
    """Requests of ``sizes`` pages, each a contiguous run taken from a ring over each pool."""
    out: list[Request] = []
    s, d = src_start % src_pool, dst_start % dst_pool
    for i, size in enumerate(sizes):
        if s + size > src_pool:
            s = 0
        if d + size > dst_pool:
            d = 0
        out.append(Request(f"{prefix}{i}", list(range(s, s + size)), list(range(d, d + size))))
        s += size
        d += size
    return out


def w2_cases(plan: Plan, seed: int) -> list[Case]:
    """``w2_requests`` short requests of 1-4 pages at each concurrency."""
    rng = np.random.default_rng(seed + 2)
    sizes = rng.integers(1, 5, size=plan.w2_requests).tolist()
    reqs = ring_requests("s", sizes, plan.pool_pages, plan.pool_pages, 0, plan.pool_pages // 2)
    return [Case("w2", f"c{c}", c, reqs) for c in plan.w2_concurrency]


def w3_cases(plan: Plan) -> list[Case]:
    """In-flight scaling: one-page requests, ``max(w3_min_requests, c)`` of them at concurrency c."""
    cases = []
    for c in plan.w3_concurrency:
        n = max(plan.w3_min_requests, c)
        cases.append(Case("w3", f"c{c}", c, ring_requests("f", [1] * n, plan.pool_pages, plan.pool_pages)))
    return cases


def all_cases(plan: Plan, seed: int) -> list[Case]:
    return [*w1_cases(plan, seed), *w2_cases(plan, seed), *w3_cases(plan)]
