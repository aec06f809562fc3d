"""``kvservice bench --listen`` / ``--peer`` between two network namespaces.

Two "hosts" joined by a veth pair (``tests/faults/netns.py``: private addresses,
removed afterwards), UCX over TCP on that veth only, the control exchange and
both services authenticated with a shared key.  The listener runs in one
namespace and the driver in the other, each as ``ip netns exec NS python -m
kvservice.cli bench ...``; the test only starts them, waits (bounded) and reads
what they wrote.  It asserts that both sides end with a clear result and that
every case reports positive numbers for both methods, never how fast they are.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvservice._trust.keys import generate_key
from tests.faults import netns
from tests.faults.netns import Wire
from tests.helpers import scaled

pytestmark = [pytest.mark.nixl, pytest.mark.slow, pytest.mark.timeout(180)]

PORT = 7390  # inside a namespace of its own: always free
RUN_GUARD_S = 150.0


@pytest.fixture
def link() -> Iterator[Wire]:
    netns.require()
    with netns.wire() as w:
        yield w
    assert not netns.existing(w.a.netns) and not netns.existing(w.b.netns)


def _bench(host: netns.Host, *args: str, cwd: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [*host.prefix, sys.executable, "-m", "kvservice.cli", "bench", *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )


def _finish(proc: subprocess.Popen[str], timeout: float) -> tuple[str, str]:
    try:
        return proc.communicate(timeout=scaled(timeout))
    except subprocess.TimeoutExpired:
        os.kill(proc.pid, signal.SIGKILL)  # our own child, by pid
        _, err = proc.communicate(timeout=30)
        pytest.fail(f"bench pid {proc.pid} did not finish in {timeout} s: {err[-3000:]}")


def test_two_hosts_over_tcp_with_a_key(link: Wire, tmp_path: Path) -> None:
    key = tmp_path / "cluster.key"
    generate_key(key)
    common = ["--ucx-tls", "tcp", "--auth-key-file", str(key)]
    listener = _bench(link.a, "--listen", f"{link.a.ip}:{PORT}", "--wait", "60",
                      "--net-devices", link.a.dev, *common, cwd=tmp_path)
    driver = None
    try:
        driver = _bench(link.b, "--peer", f"{link.a.ip}:{PORT}", "--quick", "--no-chart", "--out",
                        str(tmp_path / "out"), "--wait", "30", "--net-devices", link.b.dev, *common, cwd=tmp_path)
        d_out, d_err = _finish(driver, RUN_GUARD_S)
        l_out, l_err = _finish(listener, 30)
    finally:
        for proc in (driver, listener):
            if proc is not None and proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
    assert driver.returncode == 0, d_err[-4000:]
    assert listener.returncode == 0, l_err[-4000:]
    assert "kv/raw" in d_out  # the table, on the driving side
    assert "kv/raw" in l_out and "done: session with" in l_out.splitlines()[-1]  # and the listener's result

    results = json.loads((tmp_path / "out" / "bench.json").read_text())
    two = results["meta"]["two_hosts"]
    assert two["local"] == link.b.ip and two["peer"] == f"{link.a.ip}:{PORT}" and two["authenticated"]
    assert two["ucx"] == {"UCX_TLS": "tcp", "UCX_NET_DEVICES": link.b.dev}
    assert results["methods"][:2] == ["raw_nixl", "kvservice"] and set(results["skipped"]) == {"limit", "sidecar"}
    assert {c["workload"] for c in results["cases"]} == {"w1", "w2", "w3"}
    for case in results["cases"]:
        for method in ("raw_nixl", "kvservice"):
            numbers = case["methods"][method]
            for k in ("gbps", "req_s", "lat_p50_ms"):
                assert numbers[k] > 0, (case["key"], method, k, numbers)
        assert case["kv_over_raw"]["median"] > 0
    assert results["memory"]["ok"] == results["memory"]["n"]


def test_keyless_between_hosts_is_refused_without_the_flag(link: Wire, tmp_path: Path) -> None:
    proc = _bench(link.a, "--listen", f"{link.a.ip}:{PORT}", "--wait", "5", cwd=tmp_path)
    _, err = _finish(proc, 30)
    assert proc.returncode == 2, err
    assert "--auth-key-file" in err and "--allow-unauthenticated" in err
