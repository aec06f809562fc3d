"""The test run's sweep of what engines leave under /dev/shm (``tests.helpers.sweep_shm``),
against a real process that maps one file and holds another open: only the new, unheld
names of the engines' families go."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.helpers import held_files, shm_names, sweep_shm

#: a child that maps its first argument, holds its second open, says so and waits
HOLDER = """
import mmap, os, sys
mapped = open(sys.argv[1], "r+b")
m = mmap.mmap(mapped.fileno(), 0)
mapped.close()
fd = os.open(sys.argv[2], os.O_RDONLY)
print("holding", flush=True)
sys.stdin.read()
"""


def test_the_sweep_takes_only_new_unheld_files_of_the_engines_families(tmp_path: Path) -> None:
    (tmp_path / "sem.mp-before").write_bytes(b"\0" * 32)  # there as the run began: not the run's
    before = shm_names(str(tmp_path))
    for name in ("sem.mp-mapped", "sglang_loads_open_1.shm", "sem.mp-left", "sglang_loads_left_2.shm",
                 "kvs-bench-1", "psm_x"):
        (tmp_path / name).write_bytes(b"\0" * 4096)
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path / "sem.mp-mapped"),
                               str(tmp_path / "sglang_loads_open_1.shm")],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "holding\n"
        assert {"sem.mp-mapped", "sglang_loads_open_1.shm"} <= held_files(str(tmp_path))

        assert sweep_shm(before, str(tmp_path)) == ["sem.mp-left", "sglang_loads_left_2.shm"]
        assert shm_names(str(tmp_path)) == {"sem.mp-before", "sem.mp-mapped", "sglang_loads_open_1.shm",
                                            "kvs-bench-1", "psm_x"}
    finally:
        holder.kill()  # by PID: the child this test started
        holder.wait(timeout=30)
        assert holder.stdout is not None
        holder.stdout.close()
        assert holder.stdin is not None
        holder.stdin.close()

    # its holder gone, a file is a leftover like any other
    assert sweep_shm(before, str(tmp_path)) == ["sem.mp-mapped", "sglang_loads_open_1.shm"]
    assert shm_names(str(tmp_path)) == {"sem.mp-before", "kvs-bench-1", "psm_x"}
    assert sweep_shm(before, str(tmp_path)) == []


def test_a_directory_that_does_not_exist_is_empty(tmp_path: Path) -> None:
    assert shm_names(str(tmp_path / "absent")) == set()
    assert sweep_shm(set(), str(tmp_path / "absent")) == []
