"""The vLLM connector's parts that need no vLLM: the hand-off a prefill answers with (and
what a decode refuses of it), the mapping of vLLM's cache tensors to ``kvservice.memory``,
and the scheduler side's state machine with requests shaped like vLLM's.  vLLM's own engines
and ``Scheduler`` drive the same code in ``tests/integrations/vllm``."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import pytest
import torch

from kvservice._trust.handoff import handoff_key
from kvservice.integrations.vllm.memory import kv_memory
from kvservice.integrations.vllm.params import Handoff, HandoffError, decode_tp_size, handoff_from, prompt_digest
from kvservice.integrations.vllm.scheduler import DEFAULT_PORT, Cancel, SchedulerSide, SendSpec, rank_port

KEY = handoff_key(b"k" * 32)
NOW = 1_800_000_000.0
PROMPT = list(range(70))
GOOD = {"request": "p0-1", "senders": ["127.0.0.1:7100"], "num_tokens": 70, "block_size": 32,
        "expires": int(NOW) + 30, "prompt": prompt_digest(PROMPT, 70)}


def make(rid: str, senders: tuple[str, ...], num_tokens: int, block_size: int, *, key: bytes | None = KEY,
         tokens: list[int] | None = None) -> Handoff:
    """A hand-off as a prefill issues it at ``NOW`` for ``tokens`` (``PROMPT``)."""
    return Handoff.issue(rid, senders, PROMPT if tokens is None else tokens, num_tokens, block_size, key=key,
                         lifetime_s=30, now=NOW)


def test_a_handoff_round_trips() -> None:
    h = make("p0-1", ("10.0.0.5:7100", "10.0.0.5:7101"), 70, 32)
    assert handoff_from(h.to_params()) == h and h.num_blocks == 3 and h.mac and h.expires == NOW + 30
    assert handoff_from(None) is None and handoff_from({"do_remote_decode": True}) is None
    assert handoff_from({"do_remote_prefill": False, "kvservice": GOOD}) is None  # taken already
    unsigned = make("p0-1", ("10.0.0.5:7100",), 70, 32, key=None)
    assert not unsigned.mac and "mac" not in unsigned.to_params()["kvservice"]
    assert handoff_from(unsigned.to_params()) == unsigned


@pytest.mark.parametrize(("raw", "why"), [
    ("junk", "expected an object"),
    ({**GOOD, "request": 5}, "request"),
    ({**GOOD, "request": "x" * 257}, "request"),
    ({**GOOD, "senders": "127.0.0.1:7100"}, "senders"),
    ({**GOOD, "senders": []}, "senders"),
    ({**GOOD, "senders": ["127.0.0.1:7100"] * 257}, "senders"),
    ({**GOOD, "senders": ["nohost"]}, "senders"),
    ({**GOOD, "senders": ["127.0.0.1:99999"]}, "senders"),
    ({**GOOD, "senders": [7100]}, "senders"),
    ({**GOOD, "num_tokens": 0}, "num_tokens"),
    ({**GOOD, "num_tokens": True}, "num_tokens"),
    ({**GOOD, "num_tokens": 1 << 40}, "num_tokens"),
    ({**GOOD, "block_size": "32"}, "block_size"),
    ({**GOOD, "expires": -1}, "expires"),
    ({**GOOD, "expires": 1.5e9}, "expires"),
    ({k: v for k, v in GOOD.items() if k != "expires"}, "expires"),
    ({**GOOD, "prompt": "ab"}, "prompt"),
    ({**GOOD, "prompt": GOOD["prompt"].upper()}, "prompt"),
    ({**GOOD, "mac": ""}, "mac"),
    ({**GOOD, "mac": "0" * 63}, "mac"),
    ({**GOOD, "mac": "x" * 10_000}, "mac"),
    ({**GOOD, "mac": ["0" * 64]}, "mac"),
    ({**GOOD, "more": 1}, "unknown keys"),
])
def test_a_malformed_handoff_is_refused_naming_the_field(raw: Any, why: str) -> None:
    with pytest.raises(HandoffError, match=why) as caught:
        handoff_from({"do_remote_prefill": True, "kvservice": raw})
    assert caught.value.kind == "handoff_invalid"


@pytest.mark.parametrize("params", ["junk", ["do_remote_prefill"], 7])
def test_kv_transfer_params_that_are_not_an_object_are_refused(params: Any) -> None:
    # vLLM takes kv_transfer_params from a request's ``vllm_xargs`` too, where a client can
    # make it a string or a list
    with pytest.raises(HandoffError, match="kv_transfer_params: expected an object"):
        handoff_from(params)
    assert decode_tp_size(params, 2) == 2


def test_decode_tp_size() -> None:
    assert decode_tp_size({"do_remote_decode": True}, 2) == 2
    assert decode_tp_size({"decode_tp_size": 4}, 2) == 4
    for bad in (0, -1, "4", True, 1000):
        with pytest.raises(HandoffError, match="decode_tp_size"):
            decode_tp_size({"decode_tp_size": bad}, 1)


# -- memory: vLLM's caches as kvservice regions ---------------------------------------------


def test_cpu_caches_are_one_fused_region_per_layer() -> None:
    caches = [torch.zeros(8, 2, 32, 64) for _ in range(3)]
    m = kv_memory(caches)
    assert [r.kind for r in m.regions] == ["kv"] * 3 and m.num_pages == 8
    assert m.regions[0].page_bytes == 2 * 32 * 64 * 4 and m.regions[0].head_dim == 32


@pytest.mark.parametrize("kv_first", [True, False])
def test_gpu_layouts_nhd_and_hnd_as_vllm_allocates_them(kv_first: bool) -> None:
    blocks, size, heads, dim = 6, 16, 4, 8
    nhd = [torch.zeros((2, blocks, size, heads, dim) if kv_first else (blocks, 2, size, heads, dim))
           for _ in range(2)]
    m = kv_memory(nhd)
    assert [r.order for r in m.regions] == ["NHD"] * 4 and m.num_pages == blocks
    # head-major storage under vLLM's logical shape: a permuted view of (..., heads, size, dim)
    storage = [torch.zeros((2, blocks, heads, size, dim) if kv_first else (blocks, 2, heads, size, dim))
               for _ in range(2)]
    hnd = kv_memory([t.permute(0, 1, 3, 2, 4) for t in storage])
    assert [r.order for r in hnd.regions] == ["HND"] * 4
    block = heads * size * dim * 4
    k, v = hnd.regions[0], hnd.regions[1]
    assert k.addr == storage[0].data_ptr() and k.heads == heads and k.tokens == size
    assert v.addr - k.addr == (blocks * block if kv_first else block)


def test_an_unknown_layout_is_refused_naming_the_shape() -> None:
    with pytest.raises(ValueError, match=r"KV cache of shape \(4, 8\)"):
        kv_memory([torch.zeros(4, 8)])
    with pytest.raises(ValueError, match="no KV cache tensors"):
        kv_memory([])
    strided = torch.zeros(2, 6, 16, 4, 16)[..., ::2]  # neither NHD nor HND storage
    with pytest.raises(ValueError, match="not a layout kvservice knows"):
        kv_memory([strided])


# -- the scheduler side, with requests shaped like vLLM's ------------------------------------


class Status(Enum):
    FINISHED_LENGTH_CAPPED = 1
    FINISHED_ABORTED = 2


@dataclass
class Req:
    request_id: str
    kv_transfer_params: dict[str, Any] | None
    prompt_token_ids: list[int] = field(default_factory=lambda: list(range(70)))
    num_computed_tokens: int = 0
    status: Status = Status.FINISHED_LENGTH_CAPPED
    max_tokens: int = 1
    num_output_tokens: int = 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + self.num_output_tokens


def side(*, producer: bool = False, key: bytes | None = KEY, now: float = NOW) -> SchedulerSide:
    return SchedulerSide(block_size=32, producer=producer, consumer=not producer,
                         senders=("127.0.0.1:7100",) if producer else (), key=key, clock=lambda: now)


def test_the_scheduler_side_hands_off_loads_and_frees_once() -> None:
    p = side(producer=True)
    prefill = Req("p0", {"do_remote_decode": True}, num_computed_tokens=70)
    delay, params = p.request_finished(prefill, [4, 5, 6, 7])
    assert delay and params == make("p0", ("127.0.0.1:7100",), 70, 32).to_params()
    (send,) = p.build().sends
    assert send.blocks == (4, 5, 6) and p.has_pending_push_work()
    p.reported(["p0", "p0"], None)
    assert not p.has_pending_push_work() and p.counts == {"handoffs": 1, "handoffs_freed": 1}

    d = side(now=NOW + 29)
    decode = Req("d0", dict(params))
    assert d.get_num_new_matched_tokens(decode, 0) == (70, True)
    d.update_state_after_alloc(decode, [9, 10, 11], 70)
    assert decode.kv_transfer_params is not None and decode.kv_transfer_params["do_remote_prefill"] is False
    assert d.get_num_new_matched_tokens(decode, 0) == (0, False)  # taken: never matched again
    (recv,) = d.build().recvs
    assert recv.blocks == (9, 10, 11) and recv.handoff.request == "p0"
    aborted = Req("d0", None, status=Status.FINISHED_ABORTED)
    assert d.request_finished(aborted, [9, 10, 11]) == (True, None)  # held until the load settles
    d.reported(None, ["d0"])
    assert d.request_finished(aborted, [9, 10, 11]) == (False, None)


def test_the_scheduler_side_refuses_what_it_cannot_load() -> None:
    d = side()
    params = make("p0", ("127.0.0.1:7100",), 70, 32).to_params()
    assert d.get_num_new_matched_tokens(Req("a", dict(params)), 20) == (0, False)  # not whole blocks
    cached = make("p9", ("127.0.0.1:7100",), 70, 32).to_params()
    assert d.get_num_new_matched_tokens(Req("f", cached), 96) == (0, False)  # all cached here: declined
    assert d.get_num_new_matched_tokens(Req("b", dict(params), prompt_token_ids=[1] * 40), 0) == (0, False)
    other = make("p1", ("127.0.0.1:7100",), 70, 16).to_params()
    assert d.get_num_new_matched_tokens(Req("c", other), 0) == (0, False)
    assert d.get_num_new_matched_tokens(Req("e", {"do_remote_prefill": True, "kvservice": 1}), 0) == (0, False)
    assert d.counts == {"handoff_unusable": 3, "handoff_invalid": 1}
    p = side(producer=True)
    assert p.request_finished(Req("p", {"do_remote_decode": True}, status=Status.FINISHED_ABORTED), [1]) == \
        (False, None)
    assert p.request_finished(Req("q", {"do_remote_decode": True, "decode_tp_size": 0},
                                  num_computed_tokens=70), [1, 2, 3]) == (False, None)
    assert p.request_finished(Req("r" * 257, {"do_remote_decode": True}, num_computed_tokens=70), [1, 2, 3]) == \
        (False, None)  # an id no hand-off can carry: refused, nothing held
    assert p.counts == {"handoffs_skipped": 1, "handoff_refused": 2} and not p.has_pending_push_work()
    with pytest.raises(ValueError, match="one kvservice address per TP rank"):
        SchedulerSide(block_size=32, producer=True, consumer=False, senders=(), key=KEY, tp_size=2)


def test_the_decode_refuses_an_unproved_or_replayed_handoff_before_it_reserves_anything() -> None:
    d = side(now=NOW + 1)
    good = make("p0", ("127.0.0.1:7100",), 70, 32).to_params()
    altered = make("p0", ("127.0.0.1:7100",), 70, 32).to_params()
    altered["kvservice"]["senders"] = ["10.6.6.6:7100"]
    hostile = {
        "handoff_unsigned": make("p1", ("127.0.0.1:7100",), 70, 32, key=None).to_params(),
        "handoff_forged": make("p2", ("127.0.0.1:7100",), 70, 32, key=handoff_key(b"x" * 32)).to_params(),
        "handoff_expired": Handoff.issue("p3", ("127.0.0.1:7100",), PROMPT, 70, 32, key=KEY, lifetime_s=30,
                                         now=NOW - 60).to_params(),
    }
    for kind, params in [*hostile.items(), ("handoff_forged", altered)]:
        assert d.get_num_new_matched_tokens(Req(kind, params), 0) == (0, False), kind
    assert d.counts == {"handoff_unsigned": 1, "handoff_forged": 2, "handoff_expired": 1}
    assert d.build().recvs == []
    # the genuine one loads; presented again, by another request, it is refused
    first = Req("d0", dict(good))
    assert d.get_num_new_matched_tokens(first, 0) == (70, True)
    assert d.get_num_new_matched_tokens(first, 0) == (70, True)  # the same request, matched again (no blocks yet)
    assert d.get_num_new_matched_tokens(Req("d1", dict(good)), 0) == (0, False)
    assert d.counts["handoff_replayed"] == 1
    d.update_state_after_alloc(first, [1, 2, 3], 70)
    assert [r.req_id for r in d.build().recvs] == ["d0"]
    # a decode without a key takes an unsigned hand-off as given (it proves nothing)
    unkeyed = side(key=None)
    assert unkeyed.get_num_new_matched_tokens(Req("u", hostile["handoff_unsigned"]), 0) == (70, True)


def test_the_decode_forgets_expired_handoffs_and_stays_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvservice.integrations.vllm import scheduler

    monkeypatch.setattr(scheduler, "MAX_REMEMBERED", 8)
    now = [NOW]
    d = SchedulerSide(block_size=32, producer=False, consumer=True, senders=(), key=KEY, clock=lambda: now[0])
    for i in range(20):
        params = make(f"p{i}", ("127.0.0.1:7100",), 70, 32).to_params()
        assert d.get_num_new_matched_tokens(Req(f"d{i}", params), 0) == (70, True)
    assert len(d._seen) <= 8
    now[0] = NOW + 60  # all expired: the next one sweeps them
    late = Handoff.issue("q", ("127.0.0.1:7100",), PROMPT, 70, 32, key=KEY, lifetime_s=30, now=now[0])
    assert d.get_num_new_matched_tokens(Req("e", late.to_params()), 0) == (70, True)
    assert list(d._seen) == [(late.mac, "")]


# -- the worker side's bookkeeping, over a scripted engine ------------------------------------
# (real engines: tests/integrations/vllm; here the TP routing and the settle rule, one by one)


class FakeTransfer:
    def __init__(self, request_id: str, peer: str | None = None) -> None:
        self.request_id, self.peer = request_id, peer
        self.state = "Transferring"
        self.settled = False
        self.result: Any = None
        self.calls: list[str] = []

    def poll(self) -> Any:
        from kvservice.engine import KVPoll
        return getattr(KVPoll, self.state)

    def send(self, pages: list[int], *, last: bool, fit: str | None = None) -> None:
        self.calls.append(f"send {pages} last={last} fit={fit}")

    def init(self, pages: list[int]) -> None:
        self.calls.append(f"init {pages}")

    def abort(self) -> None:
        self.calls.append("abort")
        if self.state not in ("Success", "Failed"):
            self.state = "Failed"

    def clear(self) -> None:
        self.calls.append("clear")


class FakeEngine:
    running = True
    address = "127.0.0.1:1"

    def __init__(self) -> None:
        self.made: dict[str, FakeTransfer] = {}
        self.declined: list[tuple[str, str]] = []
        self.members: dict[str, str | None] = {}  # request -> the member its receiver was pinned to
        self.waits: list[float] = []

    def start(self) -> FakeEngine:
        return self

    def sender(self, request_id: str) -> FakeTransfer:
        return self.made.setdefault(request_id, FakeTransfer(request_id))

    def receiver(self, request_id: str, *, sender: str, member: str | None = None) -> FakeTransfer:
        self.members[request_id] = member
        return self.made.setdefault(request_id, FakeTransfer(request_id, sender))

    def decline(self, request_id: str, *, sender: str, message: str = "") -> bool:
        self.declined.append((request_id, sender))
        return True

    def wait_for_end(self, timeout: float) -> bool:
        self.waits.append(timeout)
        return False

    def close(self) -> None:
        self.running = False


def ok(request_id: str, *, pages: int, page_bytes: int = 4096, created: float = 10.0, started: float | None = 10.5,
       finished: float = 11.0) -> Any:
    """A successful transfer's result as the engine's ``result`` has it."""
    from kvservice._results import TransferResult, TransferStatus

    return TransferResult(request_id, TransferStatus.SUCCESS, bytes=pages * page_bytes, pages=pages,
                          created_at=created, started_at=started, finished_at=finished, settled=True)


def worker(tp_size: int, tp_rank: int, **config: Any) -> tuple[Any, FakeEngine]:
    from kvservice import ServiceConfig
    from kvservice.integrations.vllm.worker import WorkerSide

    engine = FakeEngine()
    side = WorkerSide(ServiceConfig(**config), tp_size=tp_size, tp_rank=tp_rank, engine=lambda cfg, memory: engine)
    side.register({"layer.0": torch.zeros(4, 2, 32, 64)})
    return side, engine


def test_the_worker_routes_tp_ranks_and_reports_a_failed_load_only_once_settled() -> None:
    from kvservice.integrations.vllm.scheduler import RecvSpec, SendSpec, Work

    # prefill rank 1 of 2 sends to the one decode rank; decode rank 0 of 1 loads from both
    p, pe = worker(2, 1)
    p.save(Work(sends=[SendSpec("r", (1, 2), decode_tp=1)]))
    # sent in the step that handed it over, before its decode asked: the service fits it
    assert list(pe.made) == ["r@tp1.0"] and pe.made["r@tp1.0"].calls == ["send [1, 2] last=True fit=tail"]
    assert p.finished({"r"}) == (set(), set(), set())  # still on its way: the blocks stay held
    pe.made["r@tp1.0"].state, pe.made["r@tp1.0"].settled = "Success", True
    pe.made["r@tp1.0"].result = ok("r@tp1.0", pages=2)
    assert p.finished(set()) == ({"r"}, set(), set()) and p.counts == {"sends_ok": 1}

    d, de = worker(1, 0)
    handoff = make("r", ("10.0.0.5:7100", "10.0.0.5:7101"), 40, 32)
    d.start(Work(recvs=[RecvSpec("d", handoff, (5, 6))]))
    a, b = de.made["r@tp0.0"], de.made["r@tp1.0"]
    assert (a.peer, b.peer) == ("10.0.0.5:7100", "10.0.0.5:7101") and a.calls == b.calls == ["init [5, 6]"]
    a.state = "Failed"
    assert d.finished(set()) == (set(), set(), set())  # b is aborted; nothing is settled yet
    assert b.calls[-1] == "abort"
    assert d.finished(set()) == (set(), set(), set()) and d.load_errors() == set()
    a.settled = b.settled = True  # nothing of either can land any more
    assert d.finished(set()) == (set(), {"d"}, {"d"}) and d.load_errors() == {5, 6}
    assert d.counts == {"load_failed": 1}


def test_the_worker_refuses_a_load_whose_blocks_do_not_match_and_aborts_a_finished_request() -> None:
    from kvservice.integrations.vllm.scheduler import RecvSpec, Work

    d, de = worker(1, 0)
    d.start(Work(recvs=[RecvSpec("short", make("r", ("10.0.0.5:7100",), 70, 32), (5, 6))]))
    assert de.made == {} and d.finished(set()) == (set(), {"short"}, {"short"})
    d.start(Work(recvs=[RecvSpec("gone", make("s", ("10.0.0.5:7100",), 40, 32), (7, 8))]))
    d.finished({"gone"})  # vLLM finished it (aborted): the load is aborted at once
    assert de.made["s@tp0.0"].calls[-1] == "abort"
    de.made["s@tp0.0"].settled = True
    assert d.finished(set()) == (set(), {"gone"}, {"gone"})


def test_the_prefill_sends_at_once_and_frees_its_blocks_only_when_each_send_ended() -> None:
    from kvservice._results import FailureReason, TransferResult, TransferStatus
    from kvservice.integrations.vllm.scheduler import SendSpec, Work

    p, pe = worker(1, 0)
    p.save(Work(sends=[SendSpec("tail", (1, 2, 3), 1), SendSpec("lost", (7, 8), 1)]))
    tail, lost = pe.made["tail@tp0.0"], pe.made["lost@tp0.0"]
    assert tail.calls == ["send [1, 2, 3] last=True fit=tail"] and lost.calls == ["send [7, 8] last=True fit=tail"]
    assert p.finished({"tail", "lost"}) == (set(), set(), set())  # neither ended: nothing is freed
    tail.state, tail.result = "Success", ok("tail@tp0.0", pages=1)  # its decode had two blocks cached
    lost.state = "Failed"  # its decode is gone (or never came: the service's bootstrap timeout)
    assert p.finished(set()) == (set(), set(), set())  # ended, but the service may still read the blocks
    tail.settled = lost.settled = True
    lost.result = TransferResult("lost@tp0.0", TransferStatus.FAILED, FailureReason.PEER_LOST, message="gone",
                                 peer="127.0.0.1:7200")
    assert p.finished(set()) == ({"tail", "lost"}, set(), set())
    assert tail.calls[-1] == lost.calls[-1] == "clear"
    assert p.counts == {"sends_ok": 1, "sends_partial": 1, "send_failed": 1}


def test_a_send_the_engine_refuses_is_reported_and_freed() -> None:
    from kvservice.integrations.vllm.scheduler import SendSpec, Work

    p, pe = worker(1, 0)
    pe.running = False  # closed under it
    p.save(Work(sends=[SendSpec("late", (1, 2), 1)]))
    assert pe.made == {} and p.finished({"late"}) == ({"late"}, set(), set())
    assert p.counts == {"send_refused": 1}


# -- when a prefill's send is posted, and what undoes it --------------------------------------


def test_a_request_whose_last_token_this_step_samples_is_sent_in_that_step() -> None:
    p = side(producer=True)
    req = Req("p0", {"do_remote_decode": True})
    p.on_new_request(req)

    def blocks(rid: str) -> list[int]:
        return [4, 5, 6, 7]

    # a first chunk of the prompt: not yet
    assert p.build(scheduled={"p0": 40}, blocks_of=blocks).sends == []
    req.num_computed_tokens = 40
    # the last chunk, and max_tokens=1: the token it samples ends it
    assert p.build(scheduled={"p0": 30}, blocks_of=blocks).sends == [SendSpec("p0", (4, 5, 6), 1)]
    req.num_computed_tokens = 70
    assert not p.has_pending_push_work()  # nothing held until it finished
    delay, params = p.request_finished(req, [4, 5, 6, 7])
    assert delay and params == make("p0", ("127.0.0.1:7100",), 70, 32).to_params()
    assert p.build().sends == [] and p.held == {"p0": 3}  # posted already: not again
    p.reported(["p0"], None)
    assert p.held == {} and p.counts == {"handoffs": 1, "handoffs_freed": 1}

    # max_tokens=2: the prompt's step does not end it; sent from the step after it finished
    q = Req("q0", {"do_remote_decode": True}, max_tokens=2)
    p.on_new_request(q)
    assert p.build(scheduled={"q0": 70}, blocks_of=blocks).sends == []
    q.num_computed_tokens = 70
    assert p.request_finished(q, [4, 5, 6])[0] is True
    assert p.build().sends == [SendSpec("q0", (4, 5, 6), 1)]


def test_an_early_send_whose_request_hands_nothing_off_is_cancelled_and_held_until_reported() -> None:
    p = side(producer=True)
    req = Req("p0", {"do_remote_decode": True})
    p.on_new_request(req)
    assert len(p.build(scheduled={"p0": 70}, blocks_of=lambda rid: [4, 5, 6]).sends) == 1
    req.num_computed_tokens, req.status = 70, Status.FINISHED_ABORTED  # aborted during its step
    assert p.request_finished(req, [4, 5, 6]) == (True, None)  # the send may still read the blocks
    assert p.has_pending_push_work() and p.build().cancels == [Cancel("p0", finished=True)]
    assert p.held == {"p0": 3}
    p.reported(["p0"], None)
    assert p.held == {} and not p.has_pending_push_work()

    # preempted before its output (async scheduling): vLLM has its blocks back; the send is
    # aborted, and the request, recomputed, is sent again in its new last step
    r = Req("r0", {"do_remote_decode": True})
    p.on_new_request(r)
    assert len(p.build(scheduled={"r0": 70}, blocks_of=lambda rid: [1, 2, 3]).sends) == 1
    assert p.build(preempted=["r0"]).cancels == [Cancel("r0", finished=False)] and p.held == {}
    assert p.build(scheduled={"r0": 70}, blocks_of=lambda rid: [8, 9, 10]).sends == [SendSpec("r0", (8, 9, 10), 1)]
    assert p.counts["sends_preempted"] == 1


def test_a_decode_whose_cache_holds_every_block_declines_the_handoff() -> None:
    from kvservice.integrations.vllm.scheduler import Work

    d = side(now=NOW + 1)
    prompt = PROMPT[:64] + list(range(500, 540))  # the prefill's 64 tokens, then the decode's own
    handoff = make("p0", ("127.0.0.1:7100",), 64, 32, tokens=prompt)
    req = Req("d0", handoff.to_params(), prompt_token_ids=prompt)
    assert d.get_num_new_matched_tokens(req, 96) == (0, False)  # 96 tokens cached here
    d.update_state_after_alloc(req, [1, 2, 3, 4], 0)
    work = d.build()
    assert work.declines == [handoff] and work.recvs == [] and d.counts == {"loads_cached": 1}
    assert req.kv_transfer_params is not None and req.kv_transfer_params["do_remote_prefill"] is False
    assert d.get_num_new_matched_tokens(req, 96) == (0, False) and d.build().declines == []
    assert d.request_finished(req, [1, 2, 3, 4]) == (False, None)

    w, we = worker(1, 0)
    w.start(Work(declines=work.declines))
    assert we.declined == [("p0@tp0.0", "127.0.0.1:7100")] and w.counts == {"declines": 1}


def test_the_worker_reports_a_send_only_once_vllm_finished_it_and_it_settled() -> None:
    from kvservice._results import FailureReason, TransferResult, TransferStatus
    from kvservice.integrations.vllm.scheduler import Work

    p, pe = worker(1, 0)
    p.save(Work(sends=[SendSpec("a", (1, 2), 1), SendSpec("b", (3,), 1), SendSpec("c", (4,), 1)]))
    a, b, c = pe.made["a@tp0.0"], pe.made["b@tp0.0"], pe.made["c@tp0.0"]
    for t, pages in ((a, 2), (b, 1), (c, 1)):
        t.state, t.settled = "Success", True
        t.result = ok(t.request_id, pages=pages)
    # ended before vLLM finished them (posted in their last step): not reported yet
    assert p.finished(set()) == (set(), set(), set())
    assert p.finished({"a"}) == ({"a"}, set(), set())
    # cancelled (its request aborted in that step): aborted, reported once settled
    b.state, b.settled = "Transferring", False
    p.start(Work(cancels=[Cancel("b", finished=True), Cancel("c", finished=False)]))
    assert b.calls[-1] == "abort" and p.finished(set()) == (set(), set(), set())
    b.settled = True
    assert p.finished(set()) == ({"b"}, set(), set())
    # preempted: aborted, forgotten, never reported (vLLM has the blocks back)
    assert c.calls[-2:] == ["abort", "clear"] and p.finished({"c"}) == (set(), set(), set())
    # declined by its decode: the decode's abort
    p.save(Work(sends=[SendSpec("d", (5,), 1)]))
    d = pe.made["d@tp0.0"]
    d.state, d.settled = "Failed", True
    d.result = TransferResult("d@tp0.0", TransferStatus.FAILED, FailureReason.ABORTED, message="declined")
    assert p.finished({"d"}) == ({"d"}, set(), set())
    assert p.counts == {"sends_ok": 1, "sends_cancelled": 2, "sends_declined": 1}


def test_a_producers_ports() -> None:
    assert [rank_port(DEFAULT_PORT, tp_size=2, tp_rank=r) for r in range(2)] == [7100, 7101]
    assert [rank_port(9000, tp_size=2, tp_rank=r, dp_rank=1) for r in range(2)] == [9002, 9003]
    with pytest.raises(ValueError, match=r"not in 1\.\.65535"):
        rank_port(65535, tp_size=2, tp_rank=1)


def test_a_step_without_a_forward_waits_for_a_transfer_only_while_one_is_on_its_way() -> None:
    from kvservice.integrations.vllm.scheduler import Work

    p, pe = worker(1, 0)
    assert p.finished(set(), idle_wait_s=0.005) == (set(), set(), set()) and pe.waits == []  # nothing moving
    p.save(Work(sends=[SendSpec("a", (1, 2), 1)]))
    a = pe.made["a@tp0.0"]
    assert p.finished(set()) == (set(), set(), set()) and pe.waits == []  # a step with a forward never waits
    assert p.finished(set(), idle_wait_s=0.005) == (set(), set(), set()) and pe.waits == [0.005]
    a.state, a.settled, a.result = "Success", True, ok(a.request_id, pages=2)
    assert p.finished({"a"}, idle_wait_s=0.005) == ({"a"}, set(), set()) and pe.waits == [0.005]  # ended: no wait
    assert p.counts == {"sends_ok": 1}  # what vLLM's stats show: no count of its own


def test_an_idle_step_reports_loads_landing_one_after_another_together(monkeypatch: pytest.MonkeyPatch) -> None:
    """Loads of requests prefilled together land milliseconds apart: a step without a forward
    reports them in one batch, not the first alone (whose decode forward would hold the rest
    back a whole step); it stops at a gap with nothing ended, and after GATHER_MAX_S in all."""
    from kvservice.integrations.vllm import worker as worker_module
    from kvservice.integrations.vllm.scheduler import RecvSpec, Work
    from kvservice.integrations.vllm.worker import GATHER_GAP_S, GATHER_MAX_S

    clock = [100.0]
    monkeypatch.setattr(worker_module.time, "monotonic", lambda: clock[0])
    d, de = worker(1, 0)
    landing: list[str] = []

    def land_next(timeout: float) -> bool:  # each wait: the next load in line lands 15 ms on
        de.waits.append(timeout)
        if not landing:
            clock[0] += timeout
            return False
        clock[0] += 0.015
        t = de.made[landing.pop(0)]
        t.state, t.settled, t.result = "Success", True, ok(t.request_id, pages=1)
        return True

    de.wait_for_end = land_next  # type: ignore[method-assign]
    for i in range(4):
        d.start(Work(recvs=[RecvSpec(f"x{i}", make(f"r{i}", ("10.0.0.5:7100",), 32, 32), (i + 1,))]))
    assert d.finished(set(), idle_wait_s=0.005) == (set(), set(), set()) and de.waits == [0.005]  # none landed
    de.waits.clear()
    landing[:] = ["r0@tp0.0", "r1@tp0.0", "r2@tp0.0"]  # r3's prefill is still computing
    assert d.finished(set(), idle_wait_s=0.005) == (set(), {"x0", "x1", "x2"}, set())
    assert de.waits == [0.005, GATHER_GAP_S, GATHER_GAP_S, GATHER_GAP_S]  # three ends, then a gap with none
    de.waits.clear()
    landing[:] = ["r3@tp0.0"]
    assert d.finished(set(), idle_wait_s=0.005) == (set(), {"x3"}, set())
    assert de.waits == [0.005]  # it ended and nothing else moves: no further wait

    # loads that keep landing hold the step GATHER_MAX_S at most; the rest go to the next step
    for i in range(20):
        d.start(Work(recvs=[RecvSpec(f"y{i}", make(f"s{i}", ("10.0.0.5:7100",), 32, 32), (i + 1,))]))
    de.waits.clear()
    landing[:] = [f"s{i}@tp0.0" for i in range(20)]
    _, recving, _ = d.finished(set(), idle_wait_s=0.005)
    gathered = 1 + int(GATHER_MAX_S / 0.015) + 1  # the first, those within the budget, one past its end
    assert len(recving) == len(de.waits) <= gathered < 20 and recving == {f"y{i}" for i in range(len(recving))}
    later = d.finished(set(), idle_wait_s=0.005)[1]  # the next step takes up the rest, a budget's worth
    assert later == {f"y{i}" for i in range(len(recving), len(recving) + len(later))} and later


def test_an_idle_prefill_step_does_not_wait_on_for_sends_after_one_ended() -> None:
    """A send's end only frees blocks: a prefill step reports it and steps again, so that a
    prompt arriving meanwhile waits IDLE_WAIT_S at most, not a gathering's time."""
    from kvservice.integrations.vllm.scheduler import Work

    p, pe = worker(1, 0)
    p.save(Work(sends=[SendSpec("a", (1,), 1), SendSpec("b", (2,), 1)]))

    def one_ends(timeout: float) -> bool:
        pe.waits.append(timeout)
        a = pe.made["a@tp0.0"]
        a.state, a.settled, a.result = "Success", True, ok(a.request_id, pages=1)
        return True

    pe.wait_for_end = one_ends  # type: ignore[method-assign]
    assert p.finished({"a", "b"}, idle_wait_s=0.005) == ({"a"}, set(), set())
    assert pe.waits == [0.005]  # "b" is still on its way: not waited for


def test_the_engines_wait_for_end_wakes_when_a_transfer_ends() -> None:
    import threading
    import time

    from kvservice.engine import KVTransferEngine
    from kvservice.engine._transfers import KVSender

    engine = KVTransferEngine()
    assert engine.wait_for_end(0.001) is False  # nothing ended
    sender = KVSender(engine, "r")
    timer = threading.Timer(0.05, sender.abort)
    timer.start()
    t0 = time.monotonic()
    try:
        assert engine.wait_for_end(10.0) is True and time.monotonic() - t0 < 5.0
    finally:
        timer.cancel()
        timer.join(10.0)
    engine.wait_for_end(0.0)  # what the abort's own shutdown path set after the first wake-up
    assert sender.result is not None and engine.wait_for_end(0.0) is False  # taken: the next call waits again
