"""docs/sglang.md's one-machine quick start, run as written: its ``<!-- quickstart -->`` block
in ``bash`` (the ports from the variables it reads, a random Llama as ``$MODEL``), in SGLang's
environment; the decode's answer is a completion, and every process it started is SIGKILLed
by its session's id.  Its own module: its pair is never alive
next to ``test_sglang_servers.py``'s."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import free_port
from tests.unit.test_docs import quickstart_blocks

from .needs import require_sglang
from .servers import MAX_NEW_TOKENS, REPO, write_model

pytestmark = [pytest.mark.nixl, pytest.mark.slow, pytest.mark.timeout(900)]
#: the block's own wait is 600 s; this bounds the whole run
RUN_S = 840.0


def kill_session(pid: int) -> None:
    """SIGKILL every process of the session ``pid`` leads (bash and the servers it started)."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def test_the_docs_quick_start_serves_a_request_through_a_pair(tmp_path: Path) -> None:
    require_sglang()
    (block,) = quickstart_blocks("docs/sglang.md")
    model = write_model(tmp_path / "model", 8)
    env = {**os.environ, "MODEL": str(model), "PREFILL_PORT": str(free_port()), "DECODE_PORT": str(free_port()),
           "BOOTSTRAP_PORT": str(free_port()), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           # `python` in the block is SGLang's environment's, as the page says
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    # "from a checkout's root": the checkout's packages, seen from a folder of the test's own
    # (the block writes its logs and PID files where it runs)
    for package in ("kvservice", "tests"):
        (tmp_path / package).symlink_to(REPO / package)
    script = tmp_path / "quickstart.sh"
    script.write_text(block)
    proc = subprocess.Popen(["bash", str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                            cwd=tmp_path, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=RUN_S)
    finally:
        kill_session(proc.pid)
        proc.wait(timeout=60)
    logs = "".join((tmp_path / f"{side}.log").read_text(errors="replace")[-2000:] for side in ("prefill", "decode"))
    assert proc.returncode == 0, (err, logs)
    answer = json.loads(out.decode().strip().splitlines()[-1])
    assert 0 < answer.get("meta_info", {}).get("completion_tokens", 0) <= MAX_NEW_TOKENS, (answer, logs)
    assert (tmp_path / "prefill.pid").is_file() and (tmp_path / "decode.pid").is_file()
