"""The simulation's clock covers every module of the service's loop that reads the clock.

A module that reads ``time.monotonic()`` but is not in ``vtime.CLOCK_MODULES`` mixes the
host's clock with the simulated one: its deadlines depend on how fast the host runs, and a
seed stops giving the same trace (the heal's rate check did so once).
"""

from __future__ import annotations

import ast
from pathlib import Path

import kvservice

from .vtime import CLOCK_MODULES

ROOT = Path(kvservice.__file__).parent
#: the packages whose code runs on the service's loop (or its NIXL thread), and ``_stats``
LOOP_CODE = ("_transfer", "_control", "_nixl", "_stats.py")
#: modules that read the clock and are not on the loop, each with why
OFF_THE_LOOP = {
    "kvservice._nixl.trial": "runs in the vetting child, a process of its own",
}


def _reads_the_clock(path: Path) -> bool:
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import) and any(alias.name == "time" for alias in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and node.module == "time":
            return True
    return False


def _modules() -> list[tuple[str, Path]]:
    found: list[tuple[str, Path]] = []
    for entry in LOOP_CODE:
        base = ROOT / entry
        for path in sorted(base.rglob("*.py") if base.is_dir() else [base]):
            dotted = ".".join(("kvservice", *path.relative_to(ROOT).with_suffix("").parts))
            found.append((dotted, path))
    return found


def test_every_loop_module_that_reads_the_clock_is_simulated() -> None:
    readers = {name for name, path in _modules() if _reads_the_clock(path)}
    assert readers, "found no module reading the clock: the walk itself is broken"
    missing = readers - set(CLOCK_MODULES) - set(OFF_THE_LOOP)
    assert not missing, f"read time.monotonic() outside the simulated clock: {sorted(missing)}"


def test_the_lists_name_only_modules_that_read_the_clock() -> None:
    readers = {name for name, path in _modules() if _reads_the_clock(path)}
    stale = (set(CLOCK_MODULES) | set(OFF_THE_LOOP)) - readers
    assert not stale, f"listed but reading no clock (remove them): {sorted(stale)}"
