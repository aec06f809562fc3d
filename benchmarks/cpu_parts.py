"""Fold py-spy's raw stacks into the parts of a request's path (``benchmarks.cpu``).

A sample counts for the innermost frame's part: a frame running a C call (a
NIXL binding, a socket write) is the Python frame that made it, so a sample in
``kvservice/_nixl/agent.py`` is time in NIXL.  py-spy cannot tell a thread blocked in
a C call (uvloop's epoll, a futex) from one running: the parts say where the
threads were, per request; ``benchmarks.cpu``'s CPU column says what ran.  Parts are kvservice's own modules
(``kv:_transfer/watchdog``, ``kv:sidecar/wire``...) and the libraries beneath them.
"""

from __future__ import annotations

import re
from collections import Counter

#: (part, substrings of the innermost frame's file), first match wins
LIBRARIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("NIXL", ("/kvservice/_nixl/agent.py", "/nixl/", "/nixl_cu", "nixl_bindings", "/kvservice/bench/raw_nixl.py")),
    ("logging", ("/structlog/", "/logging/")),
    ("MAC (hmac)", ("/hmac.py", "/hashlib.py")),
    ("msgspec", ("/msgspec/",)),
    ("numpy", ("/numpy/",)),
    ("event loop, threads", ("/asyncio/", "/uvloop/", "/anyio/", "/threading.py", "/queue.py",
                             "/selectors.py", "/concurrent/", "/sniffio/")),
)
_FRAME = re.compile(r"^(?P<func>.*) \((?P<file>.*):(?P<line>\d+)\)$")


def part_of(file: str) -> str:
    for part, needles in LIBRARIES:
        if any(n in file for n in needles):
            return part
    if "/kvservice/" in file:
        module = file.rsplit("/kvservice/", 1)[1].removesuffix(".py")
        return f"kv:{module}"
    return "other"


def fold(raw: str, rate_hz: int, requests: int) -> dict[str, float]:
    """µs per request in each part, largest first, from py-spy's ``--format raw``."""
    counts: Counter[str] = Counter()
    for line in raw.splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        frames = stack.split(";")
        leaf = _FRAME.match(frames[-1])
        counts[part_of(leaf.group("file")) if leaf else "other"] += int(n)
    us = 1e6 / rate_hz / max(1, requests)
    return {part: c * us for part, c in counts.most_common()}
