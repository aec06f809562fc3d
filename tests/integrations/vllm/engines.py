"""Driving ``engine_proc`` processes from a test: spawn, send a command, await answers; and
vLLM's own OpenAI servers (``servers`` in conftest) as docs/vllm.md runs them."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from kvservice.testing.engine_process import ask_to_quit, reap, send_line
from tests.helpers import eventually_sync
from tests.helpers import free_port as free_port  # re-exported: this folder's tests take ports from here

ROOT = Path(__file__).resolve().parents[3]
#: tokens every test decodes
MAX_TOKENS = 8
#: the engine flags of docs/vllm.md, sized for a test on a CPU
ENGINE_FLAGS = ["--dtype", "float32", "--block-size", "32", "--no-enable-prefix-caching",
                "--kv-cache-memory-bytes", str(64 << 20), "--enforce-eager", "--distributed-executor-backend", "uni",
                "--skip-tokenizer-init", "--max-model-len", "1024"]


def engine_env(cpu: int) -> dict[str, str]:
    env = dict(os.environ)
    env.update({"PYTHONPATH": str(ROOT), "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                "VLLM_CPU_OMP_THREADS_BIND": str(cpu % max(os.cpu_count() or 1, 1)),
                "VLLM_LOGGING_LEVEL": "WARNING", "TOKENIZERS_PARALLELISM": "false",
                "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    return env


def http(url: str, body: dict[str, Any] | None = None, timeout: float = 120.0) -> Any:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def wait_up(url: str, proc: subprocess.Popen[bytes], timeout: float = 180.0) -> None:
    def up() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: the server exited (rc={proc.returncode})")
        try:
            with urllib.request.urlopen(url, timeout=2.0) as resp:
                return bool(resp.status == 200)
        except (OSError, urllib.error.URLError):
            return False

    eventually_sync(up, timeout, 0.5, what=f"{url} up")


def kill_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL ``proc``'s process group (its session, started for it), by its id."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def make_model(path: Path) -> None:
    subprocess.run([sys.executable, "-m", "tests.integrations.vllm.engine_proc", "model", str(path)],
                   env=engine_env(0), check=True, capture_output=True, timeout=120)


class Engine:
    """One vLLM engine process; ``stop()`` (by PID) in the test's cleanup."""

    def __init__(self, name: str, model: Path, *, role: str | None = None, extra: dict[str, Any] | None = None,
                 cpu: int = 0, log_dir: Path | None = None, connector: tuple[str, str] | None = None,
                 prefix_caching: bool = False, stepping: str = "busy", max_batched: int | None = None) -> None:
        """``stepping``: ``"busy"`` (vLLM's engine-core loop) or ``"request"`` (only inside a
        request, as ``LLM.generate()`` with the engine core in-process): ``engine_proc``.
        ``max_batched``: vLLM's ``max_num_batched_tokens`` (a prompt longer is prefilled in
        chunks of at most this many tokens)."""
        self.name = name
        cfg = {"model": str(model), "role": role, "extra": extra or {}, "connector": connector,
               "prefix_caching": prefix_caching, "stepping": stepping, "max_batched": max_batched}
        self._stderr = open(log_dir / f"{name}.log", "wb") if log_dir else subprocess.DEVNULL
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.integrations.vllm.engine_proc", "serve", json.dumps(cfg)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr, env=engine_env(cpu), cwd=ROOT)
        self._lines: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._results: dict[str, dict[str, Any]] = {}
        threading.Thread(target=self._read, daemon=True).start()
        self.ready = self._next(lambda m: "ready" in m, 180.0)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            try:
                self._lines.put(json.loads(raw))
            except ValueError:
                continue  # a library's print on stdout
        self._lines.put(None)

    def _next(self, want: Any, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{self.name}: nothing within {timeout} s")
            try:
                msg = self._lines.get(timeout=left)
            except queue.Empty:
                continue
            if msg is None:
                raise RuntimeError(f"{self.name} exited (rc={self.proc.poll()})")
            if "id" in msg:
                self._results[msg["id"]] = msg
            if want(msg):
                return msg

    def send(self, **cmd: Any) -> None:
        send_line(self.proc, cmd)

    def generate(self, rid: str, prompt: list[int], max_tokens: int, params: dict[str, Any] | None = None) -> None:
        self.send(op="generate", id=rid, prompt=prompt, max_tokens=max_tokens, params=params)

    def result(self, rid: str, timeout: float = 120.0) -> dict[str, Any]:
        if rid not in self._results:
            self._next(lambda m: m.get("id") == rid, timeout)
        return self._results.pop(rid)

    def done(self, rid: str) -> bool:
        """Whether request ``rid`` finished (without waiting)."""
        while not self._lines.empty():
            msg = self._lines.get()
            if msg is None:
                self._lines.put(None)
                break
            if "id" in msg:
                self._results[msg["id"]] = msg
        return rid in self._results

    def state(self, timeout: float = 30.0) -> dict[str, Any]:
        self.send(op="state")
        return self._next(lambda m: "state" in m, timeout)["state"]  # type: ignore[no-any-return]

    def signal(self, sig: signal.Signals) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    def wait_state(self, ok: Any, timeout: float = 60.0) -> dict[str, Any]:
        """The engine's state once ``ok(state)`` holds (asked every 0.2 s, at most ``timeout``)."""
        state: dict[str, Any] = {}

        def holds() -> bool:
            nonlocal state
            state = self.state()
            return bool(ok(state))

        eventually_sync(holds, timeout, 0.2, what=lambda: f"{self.name}: the state awaited (last {state})")
        return state

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)
        self.stop()

    def stop(self) -> None:
        if not ask_to_quit(self.proc, 30):
            self.kill()
        reap(self.proc)
        if self._stderr is not subprocess.DEVNULL:
            self._stderr.close()  # type: ignore[union-attr]
