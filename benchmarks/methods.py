"""The methods compared, each behind the same three calls: ``start``, ``measure``, ``close``.

``measure(case, prefix)`` moves every request of ``case`` once and returns a
sample: ``start``/``end`` (``time.monotonic()``, which is one clock for every
process of the machine), per-request ``latencies`` (seconds), and for
kvservice the sender's loop ``lags``.  A two-process run ends when both the
sender has seen its last completion and the receiver its last arrival.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from benchmarks._lines import Child, ChildError
from benchmarks.limit import CopyLimit
from benchmarks.workloads import Case

SETUP_TIMEOUT_S = 120.0
RUN_TIMEOUT_S = 180.0


class Method(Protocol):
    name: str

    def start(self) -> None: ...
    def measure(self, case: Case, prefix: str) -> dict[str, Any]: ...
    def close(self) -> None: ...


class Limit:
    """The local memory-copy limit (in the driver process)."""

    name = "limit"

    def __init__(self, layout: dict[str, Any], num_pages: int) -> None:
        self._layout, self._pages = layout, num_pages
        self._copy: CopyLimit | None = None

    def start(self) -> None:
        self._copy = CopyLimit(self._layout, self._pages)

    def measure(self, case: Case, prefix: str) -> dict[str, Any]:
        assert self._copy is not None
        return self._copy.run(case.with_prefix(prefix))

    def close(self) -> None:
        if self._copy is not None:
            self._copy.close()
            self._copy = None


def _two_sided(sample: dict[str, Any], arrived: dict[str, Any], n: int) -> dict[str, Any]:
    if sample.get("nfailed") or arrived.get("nfailed") or arrived.get("missing"):
        raise ChildError(f"requests failed: sender {sample.get('failed')}, receiver {arrived}")
    if sample["ok"] != n:
        raise ChildError(f"{sample['ok']} of {n} requests completed")
    sample["recv_last"] = arrived["last"]
    sample["end"] = max(sample["end"], arrived["last"])
    return sample


class _TwoChildren:
    """A method measured by a sending and a receiving child process."""

    send: Child | None
    recv: Child | None

    def close(self) -> None:
        for child in (self.send, self.recv):
            if child is not None:
                child.close()


class RawNixl(_TwoChildren):
    """Hand-written NIXL loop in two child processes (``benchmarks.raw_nixl``)."""

    name = "raw_nixl"

    def __init__(self, layout: dict[str, Any], num_pages: int, **options: Any) -> None:
        self._cfg = {"layout": layout, "num_pages": num_pages, "progress_thread": False, **options}
        self.send: Child | None = None
        self.recv: Child | None = None

    def start(self) -> None:
        self.send = Child("benchmarks.raw_nixl", "send", self._cfg)
        self.recv = Child("benchmarks.raw_nixl", "recv", self._cfg)
        hs, hr = self.send.wait("ready", SETUP_TIMEOUT_S), self.recv.wait("ready", SETUP_TIMEOUT_S)
        self.recv.call("connect", "connected", metadata=hs["metadata"], base=hs["base"],
                       num_pages=hs["num_pages"], prep=False)
        self.send.call("connect", "connected", metadata=hr["metadata"], base=hr["base"],
                       num_pages=hr["num_pages"], prep=True)

    def measure(self, case: Case, prefix: str) -> dict[str, Any]:
        assert self.send is not None and self.recv is not None
        reqs = case.with_prefix(prefix)
        self.recv.call("expect", "expecting", rids=[r["rid"] for r in reqs])
        sample = self.send.call("run", "done", RUN_TIMEOUT_S, requests=reqs, concurrency=case.concurrency)
        return _two_sided(sample, self.recv.wait("arrived", RUN_TIMEOUT_S), len(reqs))



class KvService(_TwoChildren):
    """kvservice's public API in two child processes (``benchmarks.kv_side``)."""

    name = "kvservice"

    def __init__(self, layout: dict[str, Any], num_pages: int, *, loop: str = "uvloop", gc: str = "freeze",
                 service: dict[str, Any] | None = None, name: str = "kvservice",
                 path_first: Path | None = None) -> None:
        """``path_first``: a directory holding another ``kvservice`` package for the two
        processes to import instead of this checkout's (see ``benchmarks.compare``)."""
        self.name = name
        self.path_first = path_first
        self.cfg: dict[str, Any] = {"layout": layout, "num_pages": num_pages, "loop": loop, "gc": gc,
                                    "service": service or {}}
        self.send: Child | None = None
        self.recv: Child | None = None
        self.address = ""

    def start(self) -> None:
        self.send = Child("benchmarks.kv_side", "send", self.cfg, path_first=self.path_first)
        self.recv = Child("benchmarks.kv_side", "recv", self.cfg, path_first=self.path_first)
        self.address = self.send.wait("ready", SETUP_TIMEOUT_S)["address"]
        self.recv.wait("ready", SETUP_TIMEOUT_S)

    def measure(self, case: Case, prefix: str) -> dict[str, Any]:
        assert self.send is not None and self.recv is not None
        reqs = case.with_prefix(prefix)
        self.recv.call("expect", "expecting", RUN_TIMEOUT_S, requests=reqs, sender=self.address)
        sample = self.send.call("run", "done", RUN_TIMEOUT_S, requests=reqs, concurrency=case.concurrency)
        return _two_sided(sample, self.recv.wait("arrived", RUN_TIMEOUT_S), len(reqs))



class Sidecar:
    """HOOK (sidecar): not measured yet; the tables and the JSON list it as skipped.

    The sidecar (``kvservice serve`` daemons, workers speaking to them through
    ``kvservice.sidecar.client.SidecarClient`` over a Unix socket and shared
    pages) is still being built.  To measure it, give ``start`` / ``measure`` /
    ``close`` the meaning they have in ``KvService``: a prefill and a decode
    daemon with this layout, one worker process on each side driving the public
    client API end to end, one sample per ``measure`` with the same keys; then
    make ``unavailable()`` return ``None``.  Nothing else in the benchmark changes.
    """

    name = "sidecar"

    def __init__(self, layout: dict[str, Any], num_pages: int) -> None:
        self._layout, self._pages = layout, num_pages

    @staticmethod
    def unavailable() -> str | None:
        """Why the sidecar cannot be measured, or ``None`` once it can."""
        return "sidecar method not wired into the benchmark yet (hook: benchmarks/methods.py, class Sidecar)"

    def start(self) -> None:
        raise NotImplementedError(self.unavailable())

    def measure(self, case: Case, prefix: str) -> dict[str, Any]:
        raise NotImplementedError(self.unavailable())

    def close(self) -> None:
        pass
