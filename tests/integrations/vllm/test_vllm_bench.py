"""``benchmarks.vllm_pd --quick`` runs end to end in vLLM's environment: kvservice (its
whole-request and its decode-first layer-wise flow) and a NixlConnector arm each hand off,
every decode's tokens are checked against one engine's, and every configuration produces
every metric.  No timing is asserted (the numbers belong to the benchmark's table, not to
a test).  The smoke leaves out ``nixl`` (``--configs``): it differs from ``nixl-quiet``
only in a connector flag, and its two engines cost the suite about two minutes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: scripts/engine-env.sh vllm builds its environment")

from benchmarks.vllm_pd import METRICS, QUICK, STEP_METRICS, THREAD_METRICS

from .engines import ROOT, engine_env

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
CONFIGS = ("kvservice", "kvservice-lw", "nixl-quiet")


def test_the_quick_benchmark_verifies_tokens_and_times_every_configuration(tmp_path: Path) -> None:
    run = subprocess.run([sys.executable, "-m", "benchmarks.vllm_pd", "--quick", "--out", str(tmp_path),
                          "--configs", ",".join(CONFIGS)],
                         env=engine_env(0), cwd=ROOT, capture_output=True, text=True, timeout=840)
    assert run.returncode == 0, run.stdout + run.stderr
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["broken"] == [], results["broken"]
    # every request of every phase was a verified hand-off (the harness times only those)
    assert results["verified"] == {c: sum(ph.requests for ph in QUICK) for c in CONFIGS}
    for config in CONFIGS:
        for phase in QUICK:
            metrics = results["results"][config][phase.name]
            assert sorted(metrics) == sorted((*METRICS, *THREAD_METRICS, *STEP_METRICS)), (config, phase.name)
            assert len(metrics["handoff_ms"]) == len(metrics["e2e_ms"]) == phase.requests, (config, metrics)
            assert all(v > 0 for m in METRICS if m != "tail_ms" for v in metrics[m]), (config, metrics)
            # after the prefill's answer, a whole request's load takes the decode's part; a
            # layer-wise one may have been reported before it
            assert len(metrics["tail_ms"]) == phase.requests, (config, metrics)
            assert config == "kvservice-lw" or all(v > 0 for v in metrics["tail_ms"]), (config, metrics)
            # every request took part in forwards on both engines (batched: less than one each); waits may be none
            assert all(v > 0 for m in ("prefill_steps", "decode_steps") for v in metrics[m]), (config, metrics)
            assert all(v >= 0 for m in ("prefill_waits", "decode_waits") for v in metrics[m]), (config, metrics)
            # each engine's CPU per request, by thread: the engine's own thread apart, the parts
            # summing to the whole, kvservice's loop among kvservice's engines' threads
            for side in ("prefill", "decode"):
                for whole, by in zip(metrics[f"{side}_cpu_ms"], metrics[f"{side}_threads_ms"], strict=True):
                    assert by["main"] > 0 and abs(sum(by.values()) - whole) < 1e-6, (config, side, by, whole)
                    assert ("kvservice-loop" in by) == config.startswith("kvservice"), (config, side, by)
    assert "CPU per request by thread" in run.stdout and "steps per request" in run.stdout
    assert "kvs/nixl-quiet" in run.stdout and "lw/nixl-quiet" in run.stdout and "broken phases: 0" in run.stdout
    # each pair, and the engine without a connector, measured idle: threads named, CPU spent
    assert results["idle_s"] > 0 and "## Idle:" in run.stdout
    readings = [results["baseline_idle"]["engine"]] + [
        rnd[role] for c in CONFIGS for rnd in results["idle"][c] for role in ("prefill", "decode")]
    assert len(readings) == 1 + 2 * len(CONFIGS)
    for reading in readings:
        assert reading["cpu_pct"] > 0 and reading["wakes_per_s"] > 0, reading
        assert abs(sum(t["cpu_pct"] for t in reading["threads"].values()) - reading["cpu_pct"]) < 1e-6
    assert "kvservice-loop" in results["idle"]["kvservice"][0]["decode"]["threads"]  # kvservice's thread, named
    # every engine the harness started (each the leader of its own process group) is gone
    assert len(results["engine_pids"]) == 1 + 2 * len(CONFIGS)
    for pid in results["engine_pids"]:
        with pytest.raises(ProcessLookupError):
            os.killpg(pid, 0)
