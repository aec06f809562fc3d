"""``Proofs``: what a sender may prove to a receiver that asks, and what its bounds cost.

Forgetting must only ever take proofs away: an unproven request that had to be
forgotten must not come back as provable (it could still be written into)."""

from __future__ import annotations

from kvservice._transfer.proofs import Proofs


def test_an_unproven_request_is_not_proven_to_its_receiver_only() -> None:
    proofs = Proofs()
    proofs.unproven("decode-a", "r1", "test")
    proofs.unproven(None, "r2", "test")  # a request bound to nobody posted nothing: nothing to record
    assert not proofs.may_prove("decode-a", "r1")
    assert proofs.may_prove("decode-a", "r2")  # never let go of unfinished: provable
    assert proofs.may_prove("decode-b", "r1")  # its WRITEs went to decode-a's pages, not decode-b's
    assert len(proofs) == 1


def test_an_agent_past_its_bound_proves_nothing_any_more() -> None:
    proofs = Proofs(per_agent=3, agents=8)
    for i in range(4):
        proofs.unproven("decode-a", f"r{i}", "test")
    assert len(proofs) == 3  # the oldest was forgotten ...
    assert not proofs.may_prove("decode-a", "r0")  # ... and is not provable for that
    assert not proofs.may_prove("decode-a", "never-seen")  # nor is anything else of that agent
    assert proofs.may_prove("decode-b", "never-seen")  # other agents keep their answers


def test_past_the_agent_bound_agents_without_an_entry_prove_nothing_unknown() -> None:
    proofs = Proofs(per_agent=8, agents=2)
    proofs.unproven("decode-a", "r1", "test")
    assert proofs.may_prove("decode-z", "r9")
    proofs.unproven("decode-b", "r1", "test")
    proofs.unproven("decode-c", "r1", "test")  # decode-a's entry is forgotten
    assert len(proofs) == 2
    assert not proofs.may_prove("decode-a", "r1")  # it came back as nothing: not provable
    assert not proofs.may_prove("decode-z", "r9")  # an agent without an entry may be a forgotten one
    assert proofs.may_prove("decode-c", "r2")  # one with an entry still answers


def test_a_recent_agent_is_kept_over_an_older_one() -> None:
    proofs = Proofs(per_agent=8, agents=2)
    proofs.unproven("decode-a", "r1", "test")
    proofs.unproven("decode-b", "r1", "test")
    proofs.unproven("decode-a", "r2", "test")  # decode-a is the most recent now
    proofs.unproven("decode-c", "r1", "test")  # so decode-b goes
    assert not proofs.may_prove("decode-a", "r1") and not proofs.may_prove("decode-a", "r2")
    assert proofs.may_prove("decode-a", "r3")
    assert not proofs.may_prove("decode-b", "r2")


def test_an_agent_gone_for_good_is_forgotten_and_only_it() -> None:
    proofs = Proofs(per_agent=2, agents=8)
    for i in range(3):  # decode-a overflows: incomplete
        proofs.unproven("decode-a", f"r{i}", "test")
    proofs.unproven("decode-b", "r1", "test")
    proofs.forget("decode-a")
    assert len(proofs) == 1 and "decode-a" not in proofs._incomplete
    assert not proofs.may_prove("decode-b", "r1")  # the live one keeps its entries
    proofs.forget("decode-b")
    proofs.forget("never-seen")  # nothing to forget: nothing happens
    assert len(proofs) == 0
