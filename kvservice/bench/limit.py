"""The memory-copy limit: the same bytes copied by torch within one process, one thread.

Each request's pages are copied pool to pool plane by plane: every run of
pages that is contiguous on both sides is one strided ``copy_`` over all 64
planes, so a contiguous request is one call and a scattered one is one call
per page.  Nothing crosses a process boundary, so this bounds what any
transfer between two processes on this machine can reach.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from kvservice.bench.workloads import plane_bytes


def runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """(src_start, dst_start, length) for each run contiguous on both sides."""
    out: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst, strict=True):
        if out and out[-1][0] + out[-1][2] == s and out[-1][1] + out[-1][2] == d:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((s, d, 1))
    return out


class CopyLimit:
    def __init__(self, layout: dict[str, Any], num_pages: int) -> None:
        torch.set_num_threads(1)
        shape = (layout["layers"], 2, num_pages, plane_bytes(layout) // 2)
        self.src = torch.empty(shape, dtype=torch.bfloat16)
        self.dst = torch.empty(shape, dtype=torch.bfloat16)
        self.src.fill_(1.0)  # touch every page once
        self.dst.zero_()

    def run(self, requests: list[dict[str, Any]]) -> dict[str, Any]:
        plans = [runs(r["src"], r["dst"]) for r in requests]
        src, dst = self.src, self.dst
        lat: list[float] = []
        start = time.monotonic()
        for plan in plans:
            t0 = time.monotonic()
            for s, d, n in plan:
                dst[:, :, d : d + n].copy_(src[:, :, s : s + n])
            lat.append(time.monotonic() - t0)
        end = time.monotonic()
        return {"start": start, "end": end, "latencies": lat, "ok": len(lat)}

    def close(self) -> None:
        del self.src, self.dst
