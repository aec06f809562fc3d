"""The Mooncake baseline of ``kvservice bench``, and the bench without it.

``--quick --only w1,w2`` with the same-transport methods alone (raw NIXL and
kvservice with ``UCX_TLS=tcp``, Mooncake's Transfer Engine over TCP): every
number of the ``mooncake/tcp`` rows is there and positive, labelled by the
transport that ran, with the per-case kvservice/Mooncake ratio and its table.
Nothing about speed is asserted.  Without a working Mooncake (here: a package
that fails to import, as a missing libibverbs does) the bench says why its
rows are skipped and measures the rest.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvservice._exits import EXIT_USAGE
from kvservice.bench import mooncake_side
from tests.helpers import scaled

pytestmark = [pytest.mark.nixl, pytest.mark.slow, pytest.mark.timeout(240)]

REPO = Path(__file__).resolve().parents[2]
TCP = ("raw_nixl/tcp", "kvservice/tcp")
MOONCAKE = "mooncake/tcp"


def bench(out: Path, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    cmd = [sys.executable, "-m", "kvservice.cli", "bench", "--quick", "--only", "w1,w2", "--no-chart",
           "--methods", ",".join((*TCP, MOONCAKE)), "--out", str(out)]
    with subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env=env) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=scaled(200))
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, stderr = proc.communicate(timeout=30)
    return proc.returncode, stdout, stderr


def results(out: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((out / "bench.json").read_text())
    return data


def test_mooncake_rows_report_positive_numbers_over_tcp(tmp_path: Path) -> None:
    why = mooncake_side.available()
    if why is not None:
        if os.environ.get("KVSERVICE_REQUIRE_MOONCAKE"):  # CI: scripts/setup.sh installs it
            pytest.fail(why)
        pytest.skip(why)
    code, stdout, stderr = bench(tmp_path)
    assert code == 0, stderr[-4000:]
    got = results(tmp_path)
    assert got["methods"] == [*TCP, MOONCAKE] and got["skipped"] == {}, (got["methods"], got["skipped"])
    cases = got["cases"]
    assert {c["workload"] for c in cases} == {"w1", "w2"}
    for case in cases:
        for method in (*TCP, MOONCAKE):
            numbers = case["methods"][method]
            for key in ("gbps", "req_s", "lat_p50_ms", "lat_p99_ms"):
                assert numbers[key] > 0, (case["key"], method, key, numbers)
        for ratio in ("kv_over_mooncake", "kv_over_raw_tcp", "raw_over_mooncake"):
            assert case[ratio]["median"] > 0, (case["key"], ratio)
    targets = {t["target"] for t in got["targets"]}
    assert "w2/c1 kv/mooncake req/s, both over TCP" in targets, targets
    assert "over TCP on both sides" in stdout and "kv/mc" in stdout


def test_bench_without_a_working_mooncake_says_why_and_measures_the_rest(tmp_path: Path) -> None:
    broken = tmp_path / "site" / "mooncake"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("raise ImportError('libibverbs.so.1: cannot open shared object file')\n")
    env = {**os.environ, "PYTHONPATH": f"{broken.parent}:{REPO}"}
    out = tmp_path / "out"
    code, stdout, stderr = bench(out, env)
    assert code == 0, stderr[-4000:]
    got = results(out)
    why = got["skipped"].get(MOONCAKE, "")
    assert "libibverbs" in why and "kvservice[mooncake]" in why, got["skipped"]
    assert f"{MOONCAKE}: skipped" in stderr and f"{MOONCAKE}: skipped" in stdout
    for case in got["cases"]:
        assert MOONCAKE not in case["methods"]
        for method in TCP:
            assert case["methods"][method]["req_s"] > 0


def test_methods_that_cannot_run_are_refused_with_the_reason(tmp_path: Path) -> None:
    def usage(*args: str, env: dict[str, str] | None = None) -> str:
        proc = subprocess.run([sys.executable, "-m", "kvservice.cli", "bench", "--out", str(tmp_path / "out"), *args],
                              cwd=REPO, capture_output=True, text=True, timeout=scaled(120), env=env, check=False)
        assert proc.returncode == EXIT_USAGE, (proc.returncode, proc.stderr[-2000:])
        return proc.stderr

    assert "--methods takes a comma-separated subset of" in usage("--methods", "mooncake")
    assert "memory and kill measure kvservice" in usage("--methods", MOONCAKE)
    broken = tmp_path / "site" / "mooncake"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("raise ImportError('no libibverbs here')\n")
    env = {**os.environ, "PYTHONPATH": f"{broken.parent}:{REPO}"}
    why = usage("--methods", MOONCAKE, "--only", "w2", env=env)
    assert "nothing of --methods can run here: mooncake/tcp: import mooncake.engine failed" in why, why
    assert not (tmp_path / "out").exists()
