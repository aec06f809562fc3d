"""``benchmarks.sglang_pd`` without a server pair (a pair starts in minutes: the benchmark's own
``--quick`` is its end-to-end smoke run): the ``nixl`` arm's host-memory patch applies to the
SGLang installed here, and the router's verdicts (tokens compared across arms, a broken arm
reported) say what happened.  Runs in SGLang's environment (``scripts/engine-env.sh sglang``);
elsewhere the patch's test skips, saying why.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.sglang_pd import DRAM_PATCH, FULL, Phase, arm_env, summarize, tokens_agree
from tests.integrations.sglang.servers import REPO

from .needs import require_sglang

PROBE = ("import json; from sglang.srt.disaggregation.nixl import conn; "
         "print(json.dumps([conn._normalize_kv_mem_kinds(None, 2), conn._normalize_kv_mem_kinds(['VRAM', 'DRAM'], 2),"
         " conn._unpack_kv_mem_kinds(b'VRAM', 1)]))")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_nixl_arms_patch_labels_sglangs_pool_dram(tmp_path: Path) -> None:
    require_sglang()
    env = arm_env("nixl", tmp_path, None)
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(DRAM_PATCH)
    done = subprocess.run([sys.executable, "-c", PROBE], env=env, cwd=REPO, capture_output=True, timeout=240)
    assert done.returncode == 0, done.stderr.decode(errors="replace")[-3000:]
    assert json.loads(done.stdout.decode().strip().splitlines()[-1]) == [["DRAM", "DRAM"], ["DRAM", "DRAM"], ["DRAM"]]


def _run(tokens: list[list[int]], ttft: float) -> dict[str, object]:
    return {"wall_s": 1.0, "ttft_s": [ttft] * len(tokens), "e2e_s": [2 * ttft] * len(tokens), "tok_per_s": 16.0,
            "failed": [], "tokens": tokens}


def test_the_router_says_when_arms_tokens_differ_and_prints_the_ratios() -> None:
    phase = Phase(1, 2)
    same = {"kvservice": {phase.name: _run([[1, 2], [3, 4]], 0.1)}, "nixl": {phase.name: _run([[1, 2], [3, 4]], 0.2)}}
    assert tokens_agree([same], ["kvservice", "nixl"], [phase]) == "equal (2 prompts)"
    other = {**same, "nixl": {phase.name: _run([[1, 2], [3, 5]], 0.2)}}
    assert tokens_agree([other], ["kvservice", "nixl"], [phase]).startswith("differ: 1 in flight prompt 1")
    table = summarize([same], ["kvservice", "nixl"], [phase])
    assert "| nixl | 1 | 0.50 | 0.50 | 1.00 |" in table, table


def test_a_broken_arm_is_reported_not_timed() -> None:
    rounds = [{"kvservice": {FULL[0].name: _run([[1]], 0.1)}, "nixl": {"broken": "warm-up: 500 KVTransferError"}}]
    table = summarize(rounds, ["kvservice", "nixl"], FULL[:1])
    assert "| nixl | 1 | broken: warm-up: 500 KVTransferError |" in table, table
