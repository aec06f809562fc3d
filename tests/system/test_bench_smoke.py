"""``kvservice bench --quick`` runs end to end and reports every method and workload.

A smoke test of the benchmark itself: it asserts that each number is there
and positive, never how fast anything is; the engine-memory cases too (engine
layouts, a TP pair, layer-wise sends, fan-out).  The sidecar method starts real
``kvservice serve`` daemons; they must be gone, with their names, afterwards.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvservice._exits import EXIT_INTERRUPTED
from kvservice.bench.methods import NAME_PREFIX
from tests.helpers import descendants, scaled

pytestmark = [pytest.mark.nixl, pytest.mark.slow, pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parents[2]
MEASURED = ("limit", "raw_nixl", "kvservice", "sidecar")


def test_quick_bench_reports_every_method_and_workload(tmp_path: Path) -> None:
    scratch = tmp_path / "tmp"  # the bench's temporary directory: empty again after it
    scratch.mkdir()
    with subprocess.Popen(
        # --no-tcp: the same-transport methods (Mooncake, NIXL over TCP) have test_bench_mooncake.py
        [sys.executable, "-m", "kvservice.cli", "bench", "--quick", "--no-tcp", "--out", str(tmp_path)],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "TMPDIR": str(scratch)},
    ) as bench:
        try:
            stdout, stderr = bench.communicate(timeout=scaled(280))
        except subprocess.TimeoutExpired:
            bench.kill()
            stdout, stderr = bench.communicate(timeout=30)
    assert bench.returncode == 0, stderr[-4000:]
    assert "kv/raw" in stdout and "sc/raw" in stdout  # the terminal table
    # the sidecar's daemons took their socket directory and shared pools with them
    tag = f"{NAME_PREFIX}{bench.pid}-"
    left = [p for d in ("/tmp", "/dev/shm") if os.path.isdir(d) for p in os.listdir(d) if p.startswith(tag)]
    assert not left, left
    assert not list(scratch.iterdir())

    results = json.loads((tmp_path / "bench.json").read_text())
    assert set(MEASURED) <= set(results["methods"])
    assert results["skipped"] == {}, results["skipped"]

    cases = results["cases"]
    assert {c["workload"] for c in cases} == {"w1", "w2", "w3"}
    assert {c["variant"] for c in cases if c["workload"] == "w1"} == {"contiguous", "scattered"}
    for case in cases:
        for method in MEASURED:
            numbers = case["methods"][method]
            for key in ("gbps", "req_s", "lat_p50_ms", "lat_p99_ms"):
                assert numbers[key] > 0, (case["key"], method, key, numbers)
            if method == "limit":  # a copy in the driver: no process of its own
                continue
            # the CPU each side's processes spent per request (every thread), read around the run
            assert numbers["cpu_send_us"] > 0 and numbers["cpu_recv_us"] > 0, (case["key"], method, numbers)
        for method, ratio in (("kvservice", "kv_over_raw"), ("sidecar", "sidecar_over_raw")):
            assert case["methods"][method]["lag_samples"] > 0
            assert case[ratio]["median"] > 0
            numbers = case["methods"][method]
            # the event loops' threads are part of the processes: more than nothing, less than all
            for side in ("send", "recv"):
                assert 0 < numbers[f"loop_cpu_{side}_us"] < numbers[f"cpu_{side}_us"], (case["key"], method, side)

    memory = results["memory"]
    assert memory["ok"] == memory["n"] and memory["peak_per_request"] > 0
    vet = results["vetting"]  # the metadata-vetting child every service starts (memory part)
    assert vet.get("ready_s", 0) > 0 and vet.get("cpu_s", 0) > 0 and vet.get("rss_mib", 0) > 0, vet
    assert "metadata-vetting child (one per service), median of" in stdout
    kill = results["kill"]
    assert kill["tries"] and all(t["inflight"] > 0 for t in kill["tries"])
    targets = {row["target"] for row in results["targets"]}  # every target evaluated
    assert "w3/c1 kvservice loop-thread CPU/request, receiver" in targets, targets
    assert "CPU per request, us, send/recv" in stdout

    # the engine-memory cases: both methods on the same tensors, every number there and positive
    engine = {c["key"]: c for c in results["engines"]["cases"]}
    assert {"engine/sglang_mha", "tp/nhd-1x2", "tp/hnd-1x2", "layerwise", "fanout/1to2"} <= set(engine), engine
    for key, case in engine.items():
        if key == "layerwise":
            continue
        for method in ("raw_nixl", "kvservice"):
            assert case["methods"][method]["gbps"] > 0, (key, method)
        assert case["kv_over_raw"]["median"] > 0 and case["descriptors"] > 0
    # a sliced token-major pair posts a run per token (16), head-major pages one per page
    assert engine["tp/nhd-1x2"]["descriptors"] == 16 * engine["tp/hnd-1x2"]["descriptors"]
    assert engine["tp/nhd-1x2"]["nhd_over_hnd"]["kvservice"] > 0
    fan = engine["fanout/1to2"]["methods"]["kvservice"]
    assert 0.5 <= fan["jain"] <= 1.0 and 0 < fan["min_over_max"] <= 1.0
    layerwise = engine["layerwise"]
    for mode in ("layer", "whole"):
        tails = layerwise["modes"][mode]
        assert tails["samples"] > 0 and 0 < tails["tail_p50_ms"] <= tails["tail_p99_ms"], (mode, tails)
    assert "engine/sglang_mha kv/raw GB/s" in {row["target"] for row in results["targets"]}
    assert "layer-wise" in stdout and "tp/nhd-1x2" in stdout

    chart = tmp_path / "bench.png"
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert not chart.exists()
    else:
        assert chart.stat().st_size > 10_000


@pytest.mark.parametrize(("flag", "arm", "ratio", "title"), [
    ("--verify-landing", "kvservice/verify", "verify_over_kv", "landing checks"),
    ("--identity", "kvservice/identity", "identity_over_kv", "member identities"),
])
def test_an_arm_is_measured_against_kvservice_in_the_same_run(tmp_path: Path, flag: str, arm: str, ratio: str,
                                                              title: str) -> None:
    """``--verify-landing`` adds kvservice with landing checks on both sides, ``--identity``
    kvservice with a member identity on each side; each arm's ratio to kvservice as it is (a
    number there and positive: how large is docs/perf's business)."""
    args = ["bench", "--quick", "--no-tcp", "--no-chart", "--only", "w1,w2", flag,
            "--methods", f"kvservice,{arm}", "--out", str(tmp_path)]
    done = subprocess.run([sys.executable, "-m", "kvservice.cli", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=scaled(280), check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    assert title in done.stdout and f"{arm.split('/')[1]} p50/p99" in done.stdout  # its table
    results = json.loads((tmp_path / "bench.json").read_text())
    assert set(results["methods"]) == {"kvservice", arm}
    for case in results["cases"]:
        assert case["methods"][arm]["req_s"] > 0, case["key"]
        assert case[ratio]["median"] > 0, case["key"]


def test_a_terminated_bench_stops_its_processes(tmp_path: Path) -> None:
    """SIGTERM (a CI job's timeout, ``kill``) ends a bench as Ctrl-C does: status 130, and
    the processes it started (the methods' sides, the sidecar's daemons and workers) go with
    it, their socket directory and shared pools too, and its children's log (it names none).
    SIGTERM's default left a side running its case to the end, orphaned."""
    scratch = tmp_path / "tmp"  # the bench's temporary directory: its log goes there
    scratch.mkdir()
    with subprocess.Popen(
        [sys.executable, "-m", "kvservice.cli", "bench", "--quick", "--no-tcp", "--no-chart", "--only", "w3",
         "--methods", "kvservice,sidecar", "--repeats", "50", "--out", "/dev/null/none"],
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env={**os.environ, "TMPDIR": str(scratch)},
    ) as bench:
        assert bench.stderr is not None
        try:
            seen = b""
            deadline = time.monotonic() + scaled(120)
            with selectors.DefaultSelector() as sel:  # until the first case ran: every side is up
                sel.register(bench.stderr, selectors.EVENT_READ)
                while b"[1/50]" not in seen and time.monotonic() < deadline and bench.poll() is None:
                    if sel.select(timeout=1.0):
                        seen += os.read(bench.stderr.fileno(), 65536)
            assert b"[1/50]" in seen, seen[-2000:]
            children = descendants(bench.pid)
            assert len(children) >= 6, children  # two sides of kvservice; two daemons, two workers
            bench.send_signal(signal.SIGTERM)
            bench.wait(timeout=scaled(60))
            said = bench.stderr.read()
        finally:
            if bench.poll() is None:
                bench.kill()
                bench.wait(30)
    assert bench.returncode == EXIT_INTERRUPTED, (bench.returncode, said[-2000:])
    assert b"bench: interrupted" in said and b"Traceback" not in said, said[-2000:]
    left = [pid for pid in children if running(pid)]
    assert not left, f"processes of the terminated bench still run: {left}"
    tag = f"{NAME_PREFIX}{bench.pid}-"
    assert not [p for d in ("/tmp", "/dev/shm") if os.path.isdir(d) for p in os.listdir(d) if p.startswith(tag)]
    assert not list(scratch.iterdir())


def running(pid: int) -> bool:
    """Whether ``pid`` runs (an exited one its parent has not reaped yet does not: a zombie)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
