"""SGLang's own servers as docs/sglang.md runs them: ``python -m sglang.launch_server`` processes
(a prefill and a decode with ``--disaggregation-transfer-backend kvservice``, or one plain
server for reference tokens), a random Llama made here, and requests sent the way SGLang's
``mini_lb`` router sends them (the same body, with the bootstrap fields, to both servers at
once; the client's answer is the decode's).

What a server needs to serve on a CPU (ENGINES-NOTES in the docs' words: docs/sglang.md):
``SGLANG_USE_CPU_ENGINE=1``, the ``sgl_kernel`` stand-in of ``kernels/`` first on
``PYTHONPATH``, the flags of ``SERVE_FLAGS`` and of each role.  A server is three processes
(~1.1 GB each) and starts in 1-4 minutes here: a test module starts one pair and shares it.

Run as a script, it writes the random model: ``python -m tests.integrations.sglang.servers
model DIR KV_HEADS``.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.helpers import eventually_sync, free_port

REPO = Path(__file__).resolve().parents[3]
KERNELS = Path(__file__).with_name("kernels")
#: SGLang's two disaggregation waits (300 s each by default), lowered so that no failure waits
#: 300 s; a request takes about a second here idle, tens of seconds on a machine loaded 10 times
TIMEOUT_S = 60
#: a server starts in 1-4 minutes on 2 busy cores; a hang guard
START_S = 420.0
#: every server: the CPU engine, small memory
SERVE_FLAGS = ["--device", "cpu", "--attention-backend", "torch_native", "--dtype", "bfloat16",
               "--mem-fraction-static", "0.3", "--max-total-tokens", "4096", "--disable-cuda-graph",
               "--host", "127.0.0.1"]
#: each role's own: the prefill's radix cache raises on CPU streams for a repeated prompt
#: (SGLang's ``maybe_send_cached_prefix_chunk``); the decode's default retraction backup pins
#: host memory through CUDA
ROLE_FLAGS = {
    "prefill": ["--disaggregation-mode", "prefill", "--disaggregation-transfer-backend", "kvservice",
                "--disable-radix-cache"],
    "decode": ["--disaggregation-mode", "decode", "--disaggregation-transfer-backend", "kvservice",
               "--disaggregation-decode-retraction-backup", "cpu_tensor"],
    "single": [],
}
#: the model's words: token ids 3.. (0-2 are <unk>, <s>, </s>)
WORDS = 250
MAX_NEW_TOKENS = 8


def server_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": f"{KERNELS}{os.pathsep}{REPO}", "SGLANG_USE_CPU_ENGINE": "1",
            "SGLANG_PLUGINS": "kvservice", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": str(TIMEOUT_S),
            "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": str(TIMEOUT_S)}


def make_model(path: Path, kv_heads: int) -> None:
    """A random 2-layer Llama (8 attention heads, ``kv_heads`` KV heads, bfloat16) and a
    word-level tokenizer in ``path``; nothing downloaded."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i + 3 for i in range(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(path)
    config = LlamaConfig(vocab_size=len(vocab), hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=kv_heads, max_position_embeddings=1024,
                         bos_token_id=1, eos_token_id=2)
    torch.manual_seed(kv_heads)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path)


def write_model(path: Path, kv_heads: int) -> Path:
    """``make_model`` in a child (the test process stays free of torch)."""
    subprocess.run([sys.executable, "-m", "tests.integrations.sglang.servers", "model", str(path), str(kv_heads)],
                   env=server_env(), cwd=REPO, check=True, capture_output=True, timeout=300)
    return path


@dataclass(frozen=True)
class Answer:
    """One server's answer to ``/generate``: the HTTP status and the JSON body."""

    status: int
    body: dict[str, Any]

    @property
    def tokens(self) -> list[int]:
        assert self.status == 200, self
        return list(self.body["output_ids"])

    @property
    def error(self) -> str:
        assert self.status != 200, self
        return str(self.body.get("message", self.body))


def post(url: str, body: dict[str, Any], timeout: float = 180.0) -> Answer:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return Answer(resp.status, json.loads(resp.read()))
    except urllib.error.HTTPError as exc:
        raw = exc.read()
        try:
            return Answer(exc.code, json.loads(raw))
        except ValueError:
            return Answer(exc.code, {"message": raw.decode(errors="replace")})


def greedy(prompt: list[int], **extra: Any) -> dict[str, Any]:
    return {"input_ids": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": MAX_NEW_TOKENS,
                                                     "ignore_eos": True}, **extra}


class Server:
    """One ``sglang.launch_server`` (its own process group); ``stop()`` or ``kill()`` by PID."""

    def __init__(self, name: str, role: str, model: Path, log_dir: Path, *, port: int | None = None,
                 bootstrap_port: int | None = None) -> None:
        self.name, self.role, self.model, self.log_dir = name, role, model, log_dir
        self.port = port or free_port()
        self.bootstrap_port = bootstrap_port or (free_port() if role == "prefill" else None)
        self.url = f"http://127.0.0.1:{self.port}"
        self.starts = 0
        self.proc: subprocess.Popen[bytes] | None = None
        #: the group was SIGKILLed and its leader reaped: its id is not ours to signal again
        self.ended = True
        self.start()

    @property
    def log(self) -> Path:
        return self.log_dir / f"{self.name}-{self.starts}.log"

    def start(self) -> None:
        """Start (again, on the same ports): returns at once; ``wait_ready()`` waits."""
        assert self.proc is None or self.proc.poll() is not None, f"{self.name} is running"
        self.starts += 1
        self.ended = False
        args = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(self.model),
                "--port", str(self.port), *SERVE_FLAGS, *ROLE_FLAGS[self.role]]
        if self.bootstrap_port:
            args += ["--disaggregation-bootstrap-port", str(self.bootstrap_port)]
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=server_env(), cwd=self.log_dir,
                                         start_new_session=True)

    def ready(self) -> bool:
        """SGLang's own word that it serves (after its warm-up request), and ``/health``."""
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise RuntimeError(f"{self.name} exited (rc={self.proc.returncode}): {self.tail()}")
        if b"The server is fired up and ready to roll" not in self.log.read_bytes():
            return False
        return self.up()

    def up(self) -> bool:
        """Alive and answering ``/health``."""
        if self.proc is None or self.proc.poll() is not None:
            return False
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=10) as resp:
                return bool(resp.status == 200)
        except OSError:
            return False

    def wait_ready(self) -> None:
        eventually_sync(self.ready, START_S, 1.0, what=lambda: f"{self.name} ready: {self.tail()}")

    def tail(self, n: int = 4000) -> str:
        try:
            return self.log.read_bytes()[-n:].decode(errors="replace")
        except OSError:
            return ""

    def generate(self, body: dict[str, Any]) -> Answer:
        return post(f"{self.url}/generate", body)

    def signal(self, sig: signal.Signals) -> None:
        """``sig`` to the server's process group (the server and its scheduler and detokenizer)."""
        assert self.proc is not None
        if self.ended:
            return
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def kill(self) -> None:
        """SIGKILL, as a machine that dies: every process of the server at once."""
        self.signal(signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait(timeout=60)
        self.ended = True

    def stop(self) -> None:
        """SIGTERM, then SIGKILL for what is left after 30 s."""
        if self.proc is None:
            return
        self.signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        self.signal(signal.SIGKILL)  # the scheduler and detokenizer, if they outlived the server
        self.proc.wait(timeout=60)
        self.ended = True


class Pair:
    """A prefill and a decode server, and requests the way ``mini_lb`` sends them."""

    def __init__(self, model: Path, log_dir: Path) -> None:
        self.prefill = Server("prefill", "prefill", model, log_dir)
        try:
            self.decode = Server("decode", "decode", model, log_dir)
        except BaseException:
            self.prefill.stop()
            raise

    def wait_ready(self) -> None:
        self.prefill.wait_ready()
        self.decode.wait_ready()

    def ensure_up(self) -> None:
        """Both servers serving: one a test left down (a kill before its assertion failed) is
        reaped and started again, so that one test's failure is not every later test's."""
        down = [server for server in (self.prefill, self.decode) if not server.up()]
        for server in down:
            server.stop()
            server.start()
        for server in down:
            server.wait_ready()

    def body(self, prompt: list[int], room: Any = None) -> dict[str, Any]:
        assert self.prefill.bootstrap_port is not None
        return greedy(prompt, bootstrap_host="127.0.0.1", bootstrap_port=self.prefill.bootstrap_port,
                       bootstrap_room=secrets.randbits(63) if room is None else room)

    def generate(self, prompt: list[int], room: Any = None) -> tuple[Answer, Answer]:
        """The same request to both at once; the prefill's answer and the decode's."""
        body = self.body(prompt, room)
        answers: dict[str, Answer] = {}
        sent = threading.Thread(target=lambda: answers.setdefault("prefill", self.prefill.generate(body)))
        sent.start()
        try:
            decoded = self.decode.generate(body)
        finally:
            sent.join(timeout=240)
        assert not sent.is_alive(), "the prefill did not answer"
        return answers["prefill"], decoded

    def tokens(self, prompt: list[int]) -> list[int]:
        prefilled, decoded = self.generate(prompt)
        assert prefilled.status == 200, (prefilled, decoded)
        return decoded.tokens

    def stop(self) -> None:
        try:
            self.decode.stop()
        finally:
            self.prefill.stop()


class Router:
    """SGLang's own router (``sglang_router.launch_router --pd-disaggregation``) in front of a
    ``Pair``, run from its environment (``scripts/engine-env.sh sglang-router``, built once):
    what a client of a P/D deployment talks to.  ``stop()`` by PID."""

    def __init__(self, python: Path, pair: Pair, log_dir: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log_dir / "router.log"
        args = [str(python), "-m", "sglang_router.launch_router", "--pd-disaggregation", "--host", "127.0.0.1",
                "--port", str(self.port), "--prefill", pair.prefill.url, str(pair.prefill.bootstrap_port),
                "--decode", pair.decode.url, "--policy", "round_robin"]
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def tail(self, n: int = 3000) -> str:
        try:
            return self.log.read_bytes()[-n:].decode(errors="replace")
        except OSError:
            return ""

    def wait_ready(self, timeout: float = 120.0) -> None:
        def answers() -> bool:
            assert self.proc.poll() is None, f"the router exited {self.proc.returncode}: {self.tail()}"
            try:
                # /health answers from its first second; /readiness once its workers are
                # registered and healthy (seconds later: it probes them in the background)
                with urllib.request.urlopen(f"{self.url}/readiness", timeout=5) as resp:
                    return bool(resp.status == 200)
            except OSError:
                return False

        eventually_sync(answers, timeout, 0.5, what=lambda: f"the router ready: {self.tail()}")

    def generate(self, body: dict[str, Any]) -> Answer:
        return post(f"{self.url}/generate", body)

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=15)


def router_python() -> Path:
    """The python of SGLang's router's environment, built here once (seconds) if need be."""
    done = subprocess.run(["bash", str(REPO / "scripts" / "engine-env.sh"), "sglang-router"], capture_output=True,
                          text=True, timeout=600, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"scripts/engine-env.sh sglang-router failed: {done.stderr[-2000:]}")
    return Path(done.stdout.strip()) / "bin" / "python"


if __name__ == "__main__":
    if sys.argv[1:2] != ["model"] or len(sys.argv) != 4:
        sys.exit("usage: python -m tests.integrations.sglang.servers model DIR KV_HEADS")
    make_model(Path(sys.argv[2]), int(sys.argv[3]))
