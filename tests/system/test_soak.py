"""``kvservice soak`` end to end (real processes, real NIXL), and its verdict.

The run: 150 requests with faults; the five counters that must be zero are zero,
requests succeeded (verified on the receiver) and faults did happen and did
fail requests; the leak accounting has every resource for every process, read
from the processes themselves.  A run by ``--duration`` ends by the clock.  The
verdict: a summary with any of those counters above zero, or a resource that
grows, fails the soak, so the runs above could have failed (the leak verdict on
synthetic series: tests/unit/test_soak_leaks.py).
"""

from __future__ import annotations

import collections
import json
import os
import re
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, Any

import anyio
import numpy as np
import pytest

from kvservice.cli import EXIT_INTERRUPTED
from kvservice.soak import MUST_BE_ZERO, Summary, exit_code, main, problems
from kvservice.soak._leaks import PROCESS_RESOURCES
from kvservice.soak._probe import TABLES
from kvservice.soak._run import PROCESS_FAULTS_WITH_CUTS, Options, Soak, process_fault
from kvservice.soak._sampling import STATUS_TABLES
from kvservice.soak._summary import disagreement_cause
from kvservice.testing import netns as package_netns
from tests.faults import netns
from tests.helpers import descendants, scaled

REPO = Path(__file__).resolve().parents[2]


def run_soak(tmp_path: Path, *args: str) -> tuple[dict[str, Any], subprocess.CompletedProcess[str]]:
    """``kvservice soak ARGS`` as a user runs it, once it exited 0: its ``--json`` summary, and
    the process (what it printed)."""
    out = tmp_path / "soak.json"
    proc = subprocess.run(
        [sys.executable, "-m", "kvservice.cli", "soak", *args, "--json", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=scaled(220), check=False,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    summary: dict[str, Any] = json.loads(out.read_text())
    return summary, proc


@pytest.mark.nixl
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_soak_150_transfers_keeps_every_counter_at_zero(tmp_path: Path) -> None:
    summary, proc = run_soak(tmp_path, "--transfers", "150", "--seed", "1")
    assert set(summary) == {
        "transfers", "succeeded_verified", "failed_by_reason", "false_success", "unexplained_disagreements",
        "hung", "leaked_handles", "writes_after_settle", "crashes", "max_loop_lag_ms", "unsettled_pages_max",
        "faults", "seconds", "leaks",
    }
    assert summary["transfers"] == 150
    for key in MUST_BE_ZERO:
        assert summary[key] == 0, (key, summary)
    assert summary["succeeded_verified"] > 0
    # faults happened, and failed requests
    assert summary["faults"].get("sigkill", 0) + summary["faults"].get("sigstop", 0) > 0, summary
    assert sum(summary["faults"].values()) > 0
    assert {"PEER_LOST", "ABORTED", "REMOTE_DISCONNECT", "RECEIVER_KILLED"} & set(summary["failed_by_reason"])
    assert "soak " in proc.stderr  # the progress line
    assert "writes_after_settle" in proc.stdout  # the table
    # with a fault a second, a decode may live between two samples: the rows there are full
    assert_every_resource_of_every_process(summary["leaks"], all_rows=False)
    assert "leak accounting" in proc.stdout and "nixl_remote_agents" in proc.stdout


def assert_every_resource_of_every_process(leaks: dict[str, dict[str, dict[str, object]]],
                                           all_rows: bool = True) -> None:
    """The prefill and the in-process decode: /proc's figures and every table of the probe;
    the sidecar decode (``decode1``): /proc's and what its status() reports; its worker:
    /proc's.  Each sampled from the process itself (a value, never "gone").  Without
    ``all_rows``, a decode row may be missing (every process of it lived between samples)."""
    in_process = set(PROCESS_RESOURCES) | set(TABLES)
    expected = {
        "prefill": in_process,
        "decode0": in_process,
        "decode1": set(PROCESS_RESOURCES) | set(STATUS_TABLES) | {"peers"},
        "decode1 worker": set(PROCESS_RESOURCES),
    }
    rows = {p: set(r) for p, r in leaks.items()}
    if not all_rows:
        expected = {p: r for p, r in expected.items() if p in rows or p == "prefill"}
    assert rows == expected
    for proc, resources in leaks.items():
        for res, t in resources.items():
            assert t["verdict"] != "gone", (proc, res, t)
        assert float(resources["rss_mib"]["peak"]) > 50  # type: ignore[arg-type]
        assert float(resources["threads"]["peak"]) >= 2  # type: ignore[arg-type]
    # the prefill links the decodes: its NIXL agent loads each one's metadata (both of them
    # at once unless faults keep one restarting whenever a sample is taken)
    linked = 2 if all_rows else 1
    assert float(leaks["prefill"]["nixl_remote_agents"]["peak"]) >= linked  # type: ignore[arg-type]
    assert float(leaks["prefill"]["tcp"]["peak"]) >= 2 * linked  # type: ignore[arg-type]
    assert float(leaks["prefill"]["results"]["peak"]) > 0  # type: ignore[arg-type]


@pytest.mark.nixl
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_soak_by_duration_ends_by_the_clock(tmp_path: Path) -> None:
    summary, _ = run_soak(tmp_path, "--duration", "12s", "--seed", "2", "--fault-interval", "0",
                          "--concurrency", "2", "--quiet")
    assert summary["transfers"] > 0 and summary["faults"].get("sigkill", 0) == 0
    # no request starts past the duration; the run lasts at least as long (and ends)
    assert summary["seconds"] >= 12
    assert_every_resource_of_every_process(summary["leaks"])


@pytest.mark.parametrize("counter", MUST_BE_ZERO)
def test_any_must_be_zero_counter_fails_the_soak(counter: str) -> None:
    good = Summary(transfers=10, succeeded_verified=10)
    assert exit_code(good.as_json()) == 0 and problems(good.as_json()) == []
    bad = Summary(transfers=10, succeeded_verified=9)
    setattr(bad, counter, 1)
    assert exit_code(bad.as_json()) == 1
    assert problems(bad.as_json()) == [f"{counter} = 1"]


def test_a_growing_resource_fails_the_soak_naming_it() -> None:
    data = Summary(transfers=10, succeeded_verified=10).as_json()
    data["leaks"] = {"prefill": {"fds": {"start": 40, "end": 400, "peak": 400, "slope_per_h": 720.0,
                                         "verdict": "grows", "cap": None}},
                     "decode0": {"fds": {"start": 40, "end": 40, "peak": 41, "slope_per_h": 0.0,
                                         "verdict": "flat", "cap": None}}}
    assert problems(data) == ["leak: prefill fds grows (after warm-up 40 -> 400, +720.0/h)"]
    assert exit_code(data) == 1


def test_failures_and_faults_alone_do_not_fail_the_soak() -> None:
    s = Summary(transfers=10, succeeded_verified=5, unsettled_pages_max=40, max_loop_lag_ms=900.0)
    s.failed_by_reason.update({"PEER_LOST": 3, "ABORTED": 2})
    s.faults.update({"sigkill": 1})
    assert exit_code(s.as_json()) == 0


# -- network cuts ------------------------------------------------------------------------------


def run_names(pid: int) -> list[str]:
    """The namespaces of the soak with process id ``pid`` that exist now."""
    return [n for n in package_netns.listed() if n.startswith(f"{package_netns.HUB_PREFIX}-{pid}-")]


@pytest.mark.nixl
@pytest.mark.slow
@pytest.mark.timeout(360)
def test_soak_with_network_cuts_heals_and_keeps_every_counter_at_zero(tmp_path: Path) -> None:
    netns.require()
    out = tmp_path / "soak.json"
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvservice.cli", "soak", "--duration", "40s", "--seed", "2", "--decodes", "3",
         "--fault-interval", "0.4", "--network-cuts", "--quiet", "--json", str(out)],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = proc.communicate(timeout=scaled(300))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    summary = json.loads(out.read_text())
    for key in MUST_BE_ZERO:
        assert summary[key] == 0, (key, summary, stdout[-4000:])
    assert summary["faults"].get("netcut", 0) >= 3, summary["faults"]
    assert summary["faults"].get("sigkill", 0) + summary["faults"].get("sigstop", 0) > 0, summary["faults"]
    # a request to a cut decode, begun after the restore, succeeded: its links healed; every
    # other cut's decode was killed first or the run ended first
    row = re.search(r"^network cuts .*healed \(a later request to that decode succeeded\): (\d+) "
                    r"\(at most [\d.]+s after the restore\), "
                    r"killed first: (\d+), not healed by the end: (\d+)$", stdout, re.M)
    assert row is not None, stdout
    healed, killed_first, at_end = (int(n) for n in row.groups())
    # (whether a cut decode is reached again before its next kill or the run's end is chance:
    # under load every cut of a short run can end so; tests/faults/test_network_cut.py proves heals)
    assert healed + killed_first + at_end == summary["faults"]["netcut"], stdout
    # the prefill's connections are counted in its own namespace (none in this one's table)
    assert float(summary["leaks"]["prefill"]["tcp"]["peak"]) >= 2, summary["leaks"]["prefill"]["tcp"]
    assert run_names(proc.pid) == []
    assert proc.returncode == 0, stdout[-4000:] + stderr[-2000:]


@pytest.mark.nixl
@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("how", "cuts"), [(signal.SIGINT, True), (signal.SIGTERM, False)],
                         ids=["ctrl-c, with cuts", "sigterm"])
def test_an_interrupted_soak_removes_its_children_and_namespaces(how: signal.Signals, cuts: bool) -> None:
    """Ctrl-C, or SIGTERM (a CI job's timeout), ends a soak with one line and status 130,
    and nothing of it stays: its children (one a fault stopped, too), their namespaces, its
    children's log."""
    if cuts:
        netns.require()
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvservice.cli", "soak", "--duration", "10m", "--seed", "3", "--decodes", "2",
         "--fault-interval", "0.5", *(["--network-cuts"] if cuts else [])],
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    assert proc.stderr is not None
    children: list[int] = []
    try:
        seen = b""
        deadline = time.monotonic() + scaled(180)
        with selectors.DefaultSelector() as sel:  # until the first progress line: requests are running
            sel.register(proc.stderr, selectors.EVENT_READ)
            while b"soak " not in seen and time.monotonic() < deadline and proc.poll() is None:
                if sel.select(timeout=1.0):
                    seen += os.read(proc.stderr.fileno(), 65536)
        assert b"soak " in seen, seen[-2000:]
        if cuts:
            names = run_names(proc.pid)
            assert f"{package_netns.HUB_PREFIX}-{proc.pid}-hub" in names and len(names) == 4, names
            for name in names:
                children += [int(p) for p in package_netns._run("ip", "netns", "pids", name).split()]
        else:
            children = descendants(proc.pid)
        assert children
        proc.send_signal(how)
        proc.wait(timeout=120)
        said = proc.stderr.read()
        assert proc.returncode == EXIT_INTERRUPTED, (proc.returncode, said[-2000:])
        assert b"soak: interrupted" in said and b"Traceback" not in said, said[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        proc.stderr.close()
    assert run_names(proc.pid) == []
    assert not list(Path(tempfile.gettempdir()).glob(f"kvservice-soak-{proc.pid}-*"))  # nor its children's log
    # and its children went with it: none is left running (in a namespace nobody can name)
    for _ in range(300):
        left = [pid for pid in children if os.path.exists(f"/proc/{pid}")]
        if not left:
            break
        time.sleep(0.1)
    assert not left, f"children of the interrupted soak still run: {left}"


def test_network_cuts_without_namespaces_refuse_with_status_2(monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(package_netns, "unavailable", lambda: "needs Linux with iproute2 (ip, tc, ss)")
    assert main(["--network-cuts", "--transfers", "1", "--quiet"]) == 2
    assert "--network-cuts needs network namespaces, but needs Linux with iproute2" in capsys.readouterr().err


def test_with_network_cuts_a_fault_is_kill_stop_or_cut_at_equal_odds() -> None:
    rng = np.random.default_rng(7)
    with_cuts = collections.Counter(process_fault(rng, True) for _ in range(3000))
    assert set(with_cuts) == set(PROCESS_FAULTS_WITH_CUTS)
    assert all(900 < n < 1100 for n in with_cuts.values()), with_cuts
    without = collections.Counter(process_fault(rng, False) for _ in range(2000))
    assert set(without) == {"kill", "stop"} and all(900 < n < 1100 for n in without.values()), without
    # a run without cuts draws the schedule it always drew: one uniform per fault, below 0.5 a kill
    a, b = np.random.default_rng(1), np.random.default_rng(1)
    assert [process_fault(a, False) for _ in range(50)] == ["kill" if b.random() < 0.5 else "stop" for _ in range(50)]


def test_a_disagreement_a_cut_touched_is_named_cut_never_none() -> None:
    reset = {"status": "FAILED", "reason": "PEER_LOST", "message": "lost peer 10.214.0.1:4242: ConnectionResetError"}
    assert disagreement_cause("none", False, reset, False, cut=True) == "cut"
    assert disagreement_cause("none", False, reset, False) == "none"
    assert disagreement_cause("none", True, reset, False, cut=True) == "stop/kill"
    assert disagreement_cause("abort_send", False, reset, False, cut=True) == "abort_send"


@pytest.mark.nixl
@pytest.mark.timeout(120)
def test_a_decode_killed_as_its_settle_is_asked_is_not_a_hang(tmp_path: Path) -> None:
    """The soak kills a decode while another request is about to ask it whether its pages
    settled, and the command meets the broken pipe before the exit is seen (under load, reaping
    the child lags its stdin breaking).  That decode's pages went with it; counting it ``hung``
    failed a long run (``await_settled did not answer`` within 3 s of the request's start, the
    only way that call answers None while the process is not known dead)."""

    async def main(log: IO[str]) -> tuple[int, int, str]:
        async with anyio.create_task_group() as tg:
            soak = Soak(Options(), tg, log, dict(os.environ))
            try:
                node = await soak._start("decode0")
                node.kill()  # no await until the command: its exit is not seen yet

                async def broken(**cmd: Any) -> None:  # as its stdin answers once the pipe broke
                    raise anyio.BrokenResourceError

                node.proc.command = broken  # type: ignore[method-assign]
                assert not node.dead.is_set()
                await soak._settle("r1", node, [0, 1], {"reason": "ABORTED"}, None)
                with anyio.fail_after(scaled(10)):
                    await node.dead.wait()
                await node.proc.stop()  # closes its pipes
            finally:
                soak.close()
        return soak.s.hung, soak.s.failed_by_reason["ABORTED"], soak.workdir

    with open(os.devnull, "w") as log:
        hung, aborted, workdir = anyio.run(main, log)
    assert (hung, aborted) == (0, 1)
    assert not os.path.exists(workdir)  # the run's directory went with it

