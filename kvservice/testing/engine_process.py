"""An engine in a child process, driven by JSON lines: both ends of the pipe.

The vLLM tests (``tests/integrations/vllm``) and the vLLM benchmark
(``benchmarks.vllm_pd``) each run engines this way: the parent writes one JSON
command a line on the child's stdin, the child answers JSON lines on its stdout.

* The parent's side: ``send_line`` writes a command; ``ask_to_quit`` sends
  ``{"op": "quit"}`` and waits for the exit; ``reap`` waits for the process and
  closes the pipes to it.  How to kill one that does not quit is the caller's
  (one process, or its whole session).
* The child's side: ``say`` prints an answer; ``read_commands`` feeds a queue
  from stdin; ``record_model_executed`` and ``IDLE_STEP_SLEEP_S`` let an in-process vLLM
  engine step as vLLM's engine-core process does (it sleeps after a step that ran no
  model while its scheduler still has requests; the in-process client does not).

Plain standard library, nothing of the engine: the child imports its engine
itself, after this module.
"""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import threading
from typing import Any

#: how long ``reap`` waits for a process that was asked to quit or was killed
REAP_TIMEOUT_S = 30.0
#: what vLLM's engine core process sleeps after a step that executed no model while its
#: scheduler still has requests (``EngineCoreProc._process_engine_step``); the in-process
#: client (``InprocClient.get_output``) steps without it
IDLE_STEP_SLEEP_S = 0.001


# -- the parent's side ------------------------------------------------------------------
def send_line(proc: subprocess.Popen[bytes], cmd: dict[str, Any]) -> None:
    """Write ``cmd`` as one JSON line on the child's stdin."""
    assert proc.stdin is not None
    proc.stdin.write((json.dumps(cmd) + "\n").encode())
    proc.stdin.flush()


def ask_to_quit(proc: subprocess.Popen[bytes], grace: float) -> bool:
    """Send ``{"op": "quit"}`` to a live child and wait up to ``grace`` s for it to exit.
    True when it has exited (or had already), False when it is still there or its pipe is
    gone (then kill it)."""
    if proc.poll() is not None:
        return True
    try:
        send_line(proc, {"op": "quit"})
        proc.wait(timeout=grace)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return True


def reap(proc: subprocess.Popen[bytes], timeout: float = REAP_TIMEOUT_S) -> None:
    """Wait for a child that quit or was killed, then close the pipes to it."""
    proc.wait(timeout=timeout)
    for pipe in (proc.stdin, proc.stdout):
        if pipe is not None:
            try:
                pipe.close()
            except OSError:
                pass


# -- the child's side -------------------------------------------------------------------
def say(msg: dict[str, Any]) -> None:
    """Answer the parent: ``msg`` as one JSON line on stdout."""
    sys.stdout.write(json.dumps(msg) + "\n")
    sys.stdout.flush()


def read_commands() -> queue.Queue[dict[str, Any] | None]:
    """A queue of the parent's commands: a daemon thread puts each JSON line of stdin
    on it (blank lines skipped), then None at the end of stdin."""
    commands: queue.Queue[dict[str, Any] | None] = queue.Queue()

    def read() -> None:
        for line in sys.stdin:
            if line.strip():
                commands.put(json.loads(line))
        commands.put(None)

    threading.Thread(target=read, daemon=True).start()
    return commands


def record_model_executed(core: Any) -> list[bool]:
    """Wrap ``core.step_fn`` (an attribute of vLLM's engine core, which its in-process
    client calls) so that the returned cell holds whether the last step executed the model:
    after a step that did not, while the scheduler has requests, the child sleeps
    ``IDLE_STEP_SLEEP_S`` as vLLM's engine-core process does."""
    cell = [True]
    step_fn = core.step_fn

    def step() -> Any:
        outputs, model_executed = step_fn()
        cell[0] = bool(model_executed)
        return outputs, model_executed

    core.step_fn = step
    return cell
