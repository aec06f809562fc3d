"""SGLang as people run it: ``sglang.launch_server`` prefill and decode servers with
``--disaggregation-transfer-backend kvservice`` (``servers.py``), requests sent to both as
SGLang's ``mini_lb`` router sends them, a random Llama with 8 KV heads (Llama-3-8B's count;
the single-head mapping is the SGLang-free tests' in tests/unit/test_sglang_mapping.py: a second
pair here cost the suite about three minutes).

The pair's greedy tokens are a single server's, sent as ``mini_lb`` does and through SGLang's
own router (``sglang-router``, from its own environment); a prefill or decode SIGKILLed mid-request
ends the request with an error naming the reason, and the pair serves again once the killed
server is back (for the prefill: the first request after the restarted one is ready); a
prefill restarted while idle serves the first request after it is ready; a hostile
``bootstrap_room`` over HTTP is an error answer and both servers stay up.

One pair, shared by the module's tests (``served``, module-scoped, parametrized by the model's
KV heads, so that another model is one more id), and a test that finds a server down starts it
again first (``Pair.ensure_up``): one test's failure is not every later test's.  Runs in SGLang's environment
(``scripts/engine-env.sh sglang``); elsewhere it skips, saying why.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from .needs import HAVE_SGLANG, require_sglang
from .servers import Answer, Pair, Router, Server, greedy, router_python, write_model

#: several prompts of the model's words (token ids 3..252), of different lengths
PROMPTS = [[5, 17, 42, 99, 7], [200, 3, 3, 150, 60, 61, 62, 63, 64, 10, 11], [120, 33], list(range(3, 40))]
#: long enough for the decode's request to reach the prefill (its expect sent) before a kill;
#: a request takes about a second here
SETTLE_S = 3.0

pytestmark = [pytest.mark.nixl, pytest.mark.slow, pytest.mark.timeout(1200)]


@pytest.fixture(autouse=True)
def _sglang() -> None:
    require_sglang()


@dataclass(frozen=True)
class Served:
    pair: Pair
    #: a single server's greedy tokens for each of ``PROMPTS``
    baseline: list[list[int]]


@pytest.fixture(scope="module")
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    if not HAVE_SGLANG:
        pytest.skip("SGLang is not installed here")
    kv_heads: int = request.param
    root = tmp_path_factory.mktemp(f"sglang-{kv_heads}kv")
    model = write_model(root / "model", kv_heads)
    single = Server("single", "single", model, root)
    pair: Pair | None = None
    try:
        pair = Pair(model, root)  # all three start at once: the reference stops before any test
        single.wait_ready()
        baseline = [single.generate(greedy(prompt)).tokens for prompt in PROMPTS]
        single.stop()
        pair.wait_ready()
        yield Served(pair, baseline)
    finally:
        single.stop()
        if pair is not None:
            pair.stop()


def in_background(call: Callable[[], Answer]) -> Future[Answer]:
    pool = ThreadPoolExecutor(1)
    try:
        return pool.submit(call)
    finally:
        pool.shutdown(wait=False)


def outcome(future: Future[Answer]) -> Any:
    """The answer, or what the connection raised (a server killed under it)."""
    try:
        return future.result(timeout=240)
    except OSError as exc:
        return exc


@pytest.mark.parametrize("served", [8], indirect=True, ids=["8-kv-heads"])
def test_the_pairs_greedy_tokens_are_a_single_servers(served: Served) -> None:
    served.pair.ensure_up()
    assert [served.pair.tokens(prompt) for prompt in PROMPTS] == served.baseline


@pytest.mark.parametrize("served", [8], indirect=True, ids=["8-kv-heads"])
def test_sglangs_own_router_serves_the_pair_with_a_single_servers_tokens(served: Served, tmp_path: Path) -> None:
    """What a client of a P/D deployment talks to: ``sglang-router --pd-disaggregation`` (its
    wheel from PyPI, in an environment of its own) in front of the pair, picking the bootstrap
    room itself; the tokens it answers are a single server's."""
    served.pair.ensure_up()
    try:
        python = router_python()
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        if os.environ.get("KVSERVICE_REQUIRE_SGLANG"):
            raise
        pytest.skip(f"SGLang's router cannot be installed here: {exc}")
    router = Router(python, served.pair, tmp_path)
    try:
        router.wait_ready()
        answers = [router.generate(greedy(prompt)) for prompt in PROMPTS]
        assert all(a.status == 200 for a in answers), (answers, router.tail())
        assert [a.tokens for a in answers] == served.baseline
    finally:
        router.stop()


@pytest.mark.parametrize("served", [8], indirect=True, ids=["8-kv-heads"])
@pytest.mark.parametrize("room", [-1, 2**64, 2**70, "abc", 1.5, None, [1]],
                         ids=["negative", "2**64", "huge", "a-string", "a-float", "null", "a-list"])
def test_a_hostile_room_is_an_error_answer_and_both_servers_serve_on(served: Served, room: Any) -> None:
    served.pair.ensure_up()
    pair = served.pair
    body = pair.body(PROMPTS[2])
    body["bootstrap_room"] = room
    prefilled, decoded = answers_of(pair, body)
    assert prefilled.status != 200 and decoded.status != 200, (prefilled, decoded)
    assert pair.prefill.up() and pair.decode.up()
    assert pair.tokens(PROMPTS[2]) == served.baseline[2]


def answers_of(pair: Pair, body: dict[str, Any]) -> tuple[Answer, Answer]:
    prefilling = in_background(lambda: pair.prefill.generate(body))
    decoded = pair.decode.generate(body)
    return outcome(prefilling), decoded


@pytest.mark.parametrize("served", [8], indirect=True, ids=["8-kv-heads"])
def test_a_decode_killed_mid_request_fails_the_prefills_room_and_the_pair_serves_again(served: Served) -> None:
    served.pair.ensure_up()
    pair = served.pair
    body = pair.body(PROMPTS[1])
    # the decode takes the request first: it reserves pages and sends its expect to the prefill
    waiting = in_background(lambda: pair.decode.generate(body))
    time.sleep(SETTLE_S)
    pair.decode.kill()
    assert isinstance(outcome(waiting), OSError)
    # the prefill's request for that room: its KV has nowhere to go
    prefilled = pair.prefill.generate(body)
    assert prefilled.status == 500, prefilled
    # the link's loss (PEER_LOST) or NIXL's own word for the WRITE into the dead decode
    # (REMOTE_DISCONNECT), whichever is seen first
    assert "PEER_LOST" in prefilled.error or "REMOTE_DISCONNECT" in prefilled.error, prefilled.error
    assert pair.prefill.up()
    pair.decode.start()
    pair.decode.wait_ready()
    assert pair.tokens(PROMPTS[1]) == served.baseline[1]


@pytest.mark.parametrize("served", [8], indirect=True, ids=["8-kv-heads"])
def test_a_prefill_killed_mid_request_fails_the_decodes_and_the_pair_serves_again(served: Served) -> None:
    served.pair.ensure_up()
    pair = served.pair
    body = pair.body(PROMPTS[0])
    # the decode takes the request (bootstrapped, its expect sent) and waits for the KV
    waiting = in_background(lambda: pair.decode.generate(body))
    time.sleep(SETTLE_S)
    pair.prefill.kill()
    decoded = outcome(waiting)
    assert isinstance(decoded, Answer) and decoded.status == 500, decoded
    assert "PEER_LOST" in decoded.error and "127.0.0.1:" in decoded.error, decoded.error
    assert pair.decode.up()
    # a prefill restarted on the same ports: the first request once it is ready is served (the
    # decode dials the new incarnation, not the address it knew)
    pair.prefill.start()
    pair.prefill.wait_ready()
    assert pair.tokens(PROMPTS[0]) == served.baseline[0]


@pytest.mark.parametrize("served", [8], indirect=True, ids=["8-kv-heads"])
def test_a_prefill_restarted_while_idle_serves_the_first_request_after_it_is_ready(served: Served) -> None:
    """No request fails in between to tell the decode that its prefill is gone: it must not
    dial the address it knew."""
    served.pair.ensure_up()
    pair = served.pair
    assert pair.tokens(PROMPTS[3]) == served.baseline[3]  # the decode knows this incarnation
    pair.prefill.stop()
    pair.prefill.start()
    pair.prefill.wait_ready()
    assert pair.tokens(PROMPTS[3]) == served.baseline[3]
    assert pair.decode.up()
