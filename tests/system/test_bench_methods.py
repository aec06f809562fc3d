"""The benchmark drivers' methods: one that fails to start leaves nothing of the others behind.

``kvservice.bench.methods.running`` starts the methods a driver compares (``benchmarks.cpu``,
``benchmarks.compare``) and closes them all on the way out.  Measured with real parts: a
sidecar (two ``kvservice serve`` daemons and a worker each) starts, then a method whose worker
cannot import kvservice fails to; the sidecar's processes and its files must be gone after.
Before ``running``, ``benchmarks.cpu`` started its methods outside its ``try``, and such a
failure left the daemons running after the driver had exited.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvservice.bench._lines import ChildError
from kvservice.bench.methods import NAME_PREFIX, KvService, Sidecar, processes, running

pytestmark = [pytest.mark.nixl, pytest.mark.slow, pytest.mark.timeout(180)]

LAYOUT = {"layers": 2, "page_tokens": 16, "kv_heads": 2, "head_dim": 64, "dtype": "float16"}
PAGES = 16


class _Watched(Sidecar):
    """A sidecar that records its processes once started."""

    seen: dict[str, int]

    def start(self) -> None:
        super().start()
        self.seen = processes(self)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_a_method_that_fails_to_start_leaves_no_process_of_those_started(tmp_path: Path) -> None:
    broken = tmp_path / "kvservice"
    broken.mkdir()
    (broken / "__init__.py").write_text("raise ImportError('a kvservice that does not import, on purpose')\n")
    sidecar = _Watched(LAYOUT, PAGES)
    failing = KvService(LAYOUT, PAGES, name="kvservice@broken", path_first=tmp_path)
    with pytest.raises(ChildError, match="exited"), running([sidecar, failing]):
        pytest.fail("every method started, one of them from a package that does not import")
    assert set(sidecar.seen) == {"send", "recv", "prefill-daemon", "decode-daemon"}
    assert not [role for role, pid in sidecar.seen.items() if _alive(pid)], sidecar.seen
    assert failing.send is None or not _alive(failing.send.pid)
    tag = f"{NAME_PREFIX}{os.getpid()}-"
    left = [p for d in ("/tmp", "/dev/shm") if os.path.isdir(d) for p in os.listdir(d) if p.startswith(tag)]
    assert not left, left


def test_every_method_is_closed_when_the_run_fails() -> None:
    closed: list[str] = []

    class Fake:
        def __init__(self, name: str, fail: bool = False) -> None:
            self.name, self.fail = name, fail

        def start(self) -> None:
            if self.fail:
                raise ChildError(f"{self.name} did not start")

        def measure(self, case: object, prefix: str) -> dict[str, object]:
            return {}

        def close(self) -> None:
            closed.append(self.name)

    with pytest.raises(ChildError, match="b did not start"), running([Fake("a"), Fake("b", fail=True), Fake("c")]):
        pass
    assert closed == ["a", "b", "c"]  # the one after the failure too: never started, safe to close
    closed.clear()
    with pytest.raises(RuntimeError, match="the run"), running([Fake("a"), Fake("b")]):
        raise RuntimeError("the run failed")
    assert closed == ["a", "b"]
