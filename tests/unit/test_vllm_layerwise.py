"""Decode-first, layer-wise push without vLLM: the router's ticket (signed and checked with
the hand-off's own MAC, told apart from a hand-off by a field the MAC covers), and the
prefill scheduler's plan of which blocks each step writes.  Real engines:
``tests/integrations/vllm/test_vllm_layerwise.py``."""

from __future__ import annotations

import pytest

from kvservice._trust.handoff import handoff_key
from kvservice.integrations.vllm.params import Handoff, HandoffError, handoff_from, ticket_from
from kvservice.integrations.vllm.scheduler import Cancel

from .test_vllm_side import KEY, NOW, PROMPT, Req, Status, side

SENDERS = ("127.0.0.1:7100",)


def ticket(rid: str = "t0", *, key: bytes | None = KEY, now: float = NOW, tokens: list[int] = PROMPT,
           senders: tuple[str, ...] = SENDERS, num_tokens: int = 70) -> Handoff:
    return Handoff.issue(rid, senders, tokens, num_tokens, 32, key=key, lifetime_s=30, now=now, ticket=True)


def test_a_ticket_round_trips_to_both_engines_and_verifies_as_a_handoff_does() -> None:
    t = ticket()
    assert t.ticket and t.mac and t.body()["ticket"] is True
    assert handoff_from(t.to_params()) == t  # the decode reads it as a hand-off
    assert ticket_from(t.to_prefill_params()) == t  # the prefill reads it from its request
    assert ticket_from({"do_remote_decode": True}) is None and ticket_from(t.to_params()) is None
    t.check(KEY, now=NOW + 29, skew_s=0, tokens=PROMPT)
    # the same fields as a hand-off: another MAC (the flag is covered), so neither passes for the other
    handoff = Handoff.issue("t0", SENDERS, PROMPT, 70, 32, key=KEY, lifetime_s=30, now=NOW)
    assert handoff.mac != t.mac and handoff.fields == t.fields[:-1]
    stripped = handoff_from({"do_remote_prefill": True, "kvservice": {k: v for k, v in t.body().items()
                                                                        if k != "ticket"}})
    added = handoff_from({"do_remote_prefill": True, "kvservice": {**handoff.body(), "ticket": True}})
    for record in (stripped, added):
        assert record is not None
        with pytest.raises(HandoffError) as caught:
            record.check(KEY, now=NOW, skew_s=0, tokens=PROMPT)
        assert caught.value.kind == "handoff_forged"


@pytest.mark.parametrize(("made", "kind"), [
    (lambda: ticket(key=None), "handoff_unsigned"),
    (lambda: ticket(key=handoff_key(b"o" * 32)), "handoff_forged"),
    (lambda: ticket(now=NOW - 120), "handoff_expired"),
    (lambda: ticket(tokens=[1] * 70), "handoff_unusable"),
])
def test_a_ticket_not_proved_is_refused_by_kind(made: object, kind: str) -> None:
    t = made()  # type: ignore[operator]
    with pytest.raises(HandoffError) as caught:
        t.check(KEY, now=NOW, skew_s=10, tokens=PROMPT)
    assert caught.value.kind == kind


@pytest.mark.parametrize("flag", ["yes", 1, False, None])
def test_a_ticket_flag_other_than_true_is_malformed(flag: object) -> None:
    with pytest.raises(HandoffError, match="ticket") as caught:
        ticket_from({"do_remote_decode": True, "kvservice": {**ticket().body(), "ticket": flag}})
    assert caught.value.kind == "handoff_invalid"


def blocks_of(rid: str) -> list[int]:
    return [4, 5, 6]


def test_the_prefill_sends_each_steps_completed_blocks_and_the_last_one_last() -> None:
    p = side(producer=True)
    req = Req("p0", ticket().to_prefill_params(), status=Status.FINISHED_LENGTH_CAPPED)
    p.on_new_request(req)
    chunks = []
    for n in (20, 12, 32, 6):  # chunked prefill: 20 tokens complete no block, 32 the first, ...
        chunks.append(p.build(scheduled={"p0": n}, blocks_of=blocks_of).layers)
        req.num_computed_tokens += n
    assert [[(c.blocks, c.first, c.last, c.transfer) for c in step] for step in chunks] == [
        [], [((4,), True, False, "t0")], [((5,), False, False, "t0")], [((6,), False, True, "t0")]]
    assert p.build(scheduled={"p0": 1}, blocks_of=blocks_of).layers == []  # nothing after the last
    assert p.request_finished(req, [4, 5, 6]) == (True, None)  # no hand-off: the decode has the ticket
    assert p.held == {"p0": 3} and p.has_pending_push_work()
    p.reported(["p0"], None)
    assert p.counts == {"layerwise": 1, "handoffs_freed": 1} and not p.has_pending_push_work()

    # the prefill's own prefix cache supplied the first blocks: they go with the first step
    q = Req("p1", ticket("t1").to_prefill_params(), num_computed_tokens=64)
    p.on_new_request(q)
    (chunk,) = p.build(scheduled={"p1": 6}, blocks_of=blocks_of).layers
    assert chunk.blocks == (4, 5, 6) and chunk.first and chunk.last


def test_a_ticket_the_prefill_cannot_prove_is_prefilled_and_handed_off_whole() -> None:
    p = side(producer=True)
    bad = [ticket("a", key=handoff_key(b"o" * 32)), ticket("b", senders=("127.0.0.1:7200",)),
           ticket("c", num_tokens=64, tokens=PROMPT)]
    plain = Handoff.issue("d", SENDERS, PROMPT, 70, 32, key=KEY, lifetime_s=30, now=NOW)
    for i, t in enumerate([*bad, plain]):
        req = Req(f"r{i}", {"do_remote_decode": True, "kvservice": t.body()}, num_computed_tokens=70)
        p.on_new_request(req)
        assert p.build(scheduled={f"r{i}": 70}, blocks_of=blocks_of).layers == []
        delay, params = p.request_finished(req, [4, 5, 6])
        assert delay and params is not None and "ticket" not in params["kvservice"]  # today's flow
    assert p.counts == {"handoff_forged": 1, "handoff_unusable": 3, "handoffs": 4}
    # a second request presenting a proved ticket
    t = ticket("e")
    p.on_new_request(Req("e1", t.to_prefill_params()))
    p.on_new_request(Req("e2", t.to_prefill_params()))
    assert p.counts["handoff_replayed"] == 1


def test_preempted_or_aborted_mid_prompt_the_send_is_aborted() -> None:
    p = side(producer=True)
    req = Req("p0", ticket().to_prefill_params())
    p.on_new_request(req)
    assert p.build(scheduled={"p0": 32}, blocks_of=blocks_of).layers
    req.num_computed_tokens = 32
    # preempted: vLLM has the blocks back; the worker aborts the send, nothing more is sent
    work = p.build(preempted=["p0"], scheduled={}, blocks_of=blocks_of)
    assert work.cancels == [Cancel("p0", finished=False)]
    req.num_computed_tokens = 0
    assert p.build(scheduled={"p0": 70}, blocks_of=blocks_of).layers == []
    assert p.request_finished(req, [4, 5, 6]) == (False, None)

    aborted = Req("p1", ticket("t1").to_prefill_params(), status=Status.FINISHED_ABORTED)
    p.on_new_request(aborted)
    assert p.build(scheduled={"p1": 32}, blocks_of=blocks_of).layers
    assert p.request_finished(aborted, [4, 5, 6]) == (True, None)  # held until the aborted send ends
    assert p.build().cancels == [Cancel("p1", finished=True)] and p.held == {"p1": 1}


def test_a_decode_with_the_first_blocks_cached_declines_a_ticket() -> None:
    d = side()
    t = ticket()
    req = Req("d0", t.to_params())
    assert d.get_num_new_matched_tokens(req, 32) == (0, False)
    assert d.build().declines == [t] and d.counts == {"tickets_declined": 1}
    assert req.kv_transfer_params is not None and req.kv_transfer_params["do_remote_prefill"] is False
    fresh = Req("d1", ticket("t1").to_params())
    assert d.get_num_new_matched_tokens(fresh, 0) == (70, True)


def test_a_ticket_with_a_bad_decode_tp_size_goes_the_handoff_way() -> None:
    p = side(producer=True)
    req = Req("p0", {**ticket().to_prefill_params(), "decode_tp_size": 0}, num_computed_tokens=70)
    p.on_new_request(req)  # never raises into vLLM's scheduler
    assert p.build(scheduled={"p0": 70}, blocks_of=blocks_of).layers == []
    assert p.request_finished(req, [4, 5, 6]) == (False, None) and p.counts == {"handoff_refused": 1}
