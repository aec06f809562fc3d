"""A vLLM hand-off's proof: the prefill MACs exactly what the decode acts on (request,
senders, token and block counts, expiry, prompt), under a key derived from the cluster's
key; the decode refuses, naming why, a hand-off whose MAC is missing or wrong, whose fields
were altered, that expired (or claims to live too long), or that is for another prompt."""

from __future__ import annotations

import dataclasses
import hmac
from typing import Any

import pytest

from kvservice._trust import handshake
from kvservice._trust.handoff import encode, handoff_key, mac, mac_ok
from kvservice.integrations.vllm.params import (
    DEFAULT_SKEW_S,
    MAX_LIFETIME_S,
    Handoff,
    HandoffError,
    handoff_from,
    prompt_digest,
)

CLUSTER = b"c" * 32
KEY = handoff_key(CLUSTER)
NOW = 1_800_000_000.0
TOKENS = list(range(100, 170))


def issued(key: bytes | None = KEY, *, now: float = NOW, lifetime_s: float = 30.0) -> Handoff:
    return Handoff.issue("p0-1", ("10.0.0.5:7100", "10.0.0.5:7101"), TOKENS, 70, 32, key=key,
                         lifetime_s=lifetime_s, now=now)


def refused(handoff: Handoff | dict[str, Any], *, key: bytes | None = KEY, now: float = NOW,
            tokens: list[int] = TOKENS) -> str:
    """The kind a decode at ``now`` refuses ``handoff`` (a hand-off, or its wire form) as."""
    with pytest.raises(HandoffError) as caught:
        h = handoff if isinstance(handoff, Handoff) else handoff_from(handoff)
        assert h is not None
        h.check(key, now=now, skew_s=DEFAULT_SKEW_S, tokens=tokens)
    return caught.value.kind


def test_the_key_is_derived_and_separated_from_the_cluster_keys_other_uses() -> None:
    assert KEY is not None and len(KEY) == 32 and KEY != CLUSTER
    assert handoff_key(None) is None
    assert KEY != handoff_key(b"d" * 32)
    from kvservice.bench.control import bench_key
    from kvservice.integrations.sglang.registration import registry_key
    assert KEY not in (bench_key(CLUSTER), registry_key(CLUSTER))
    # a handshake proof is HMAC(cluster key, label ...): never the hand-off key's
    assert handshake.prove(CLUSTER, "dialer", b"") != KEY


def test_a_signed_handoff_verifies_over_the_wire() -> None:
    h = issued()
    assert h.expires == NOW + 30 and h.prompt == prompt_digest(TOKENS, 70) and len(h.mac) == 64
    back = handoff_from(h.to_params())
    assert back == h
    back.check(KEY, now=NOW + 30 + DEFAULT_SKEW_S, skew_s=DEFAULT_SKEW_S, tokens=TOKENS)  # the last second
    back.check(KEY, now=NOW - DEFAULT_SKEW_S, skew_s=DEFAULT_SKEW_S, tokens=[*TOKENS, 1, 2])  # a clock behind
    assert mac_ok(KEY, h.fields, h.mac) and h.signed(KEY) == h


@pytest.mark.parametrize(("field", "value"), [
    ("request", "p0-2"),
    ("senders", ("10.0.0.5:7100", "10.0.0.66:7101")),
    ("senders", ("10.0.0.5:7100",)),
    ("senders", ("10.0.0.5:7101", "10.0.0.5:7100")),
    ("num_tokens", 64),
    ("block_size", 16),
    ("expires", int(NOW) + 31),
    ("prompt", prompt_digest(list(range(70)), 70)),
])
def test_any_field_altered_is_refused_as_forged(field: str, value: Any) -> None:
    altered = dataclasses.replace(issued(), **{field: value})
    assert refused(altered) == "handoff_forged"
    wire = issued().to_params()
    wire["kvservice"][field] = list(value) if isinstance(value, tuple) else value
    assert refused(wire) == "handoff_forged"


def test_a_mac_under_another_key_or_none_is_refused() -> None:
    other = handoff_key(b"x" * 32)
    assert other is not None
    assert refused(issued(other)) == "handoff_forged"
    assert refused(issued(None)) == "handoff_unsigned"
    wire = issued().to_params()
    del wire["kvservice"]["mac"]
    assert refused(wire) == "handoff_unsigned"
    # the MAC of another hand-off, or one with a flipped digit
    wire = issued().to_params()
    wire["kvservice"]["mac"] = issued(now=NOW + 1).mac
    assert refused(wire) == "handoff_forged"
    good = issued().mac
    wire["kvservice"]["mac"] = good[:-1] + ("0" if good[-1] != "0" else "1")
    assert refused(wire) == "handoff_forged"
    # the cluster key itself, not the derived one, signs nothing a decode takes
    assert refused(issued(CLUSTER)) == "handoff_forged"


def test_an_unkeyed_decode_takes_a_handoff_as_given_but_still_checks_its_expiry_and_prompt() -> None:
    for h in (issued(None), issued(handoff_key(b"x" * 32))):
        h.check(None, now=NOW, skew_s=DEFAULT_SKEW_S, tokens=TOKENS)
    assert refused(issued(None), key=None, now=NOW + 60) == "handoff_expired"
    assert refused(issued(None), key=None, tokens=TOKENS[::-1]) == "handoff_unusable"


def test_an_expired_handoff_is_refused_and_a_replay_past_expiry_too() -> None:
    h = issued()
    assert refused(h, now=NOW + 30 + DEFAULT_SKEW_S + 1) == "handoff_expired"
    assert refused(h.to_params(), now=NOW + 3600) == "handoff_expired"
    # expired when issued (a prefill whose clock is far behind)
    assert refused(issued(now=NOW - 120)) == "handoff_expired"


def test_a_handoff_that_claims_to_live_past_the_bound_is_refused() -> None:
    long_lived = issued(lifetime_s=MAX_LIFETIME_S + DEFAULT_SKEW_S + 5)
    assert refused(long_lived) == "handoff_expired"
    issued(lifetime_s=MAX_LIFETIME_S).check(KEY, now=NOW, skew_s=DEFAULT_SKEW_S, tokens=TOKENS)


def test_a_genuine_handoff_for_another_prompt_is_refused() -> None:
    assert refused(issued(), tokens=[7, *TOKENS[1:]]) == "handoff_unusable"
    assert refused(issued(), tokens=TOKENS[:69]) == "handoff_unusable"
    # tokens past the handed-off ones are the decode's own: not covered
    issued().check(KEY, now=NOW, skew_s=DEFAULT_SKEW_S, tokens=[*TOKENS, 5])


@pytest.mark.parametrize(("field", "value"), [
    ("request", "r" * 100_000),
    ("senders", ["10.0.0.5:7100"] * 100_000),
    ("senders", ["h" * 100_000 + ":7100"]),
    ("num_tokens", 1 << 64),
    ("expires", 1 << 64),
    ("prompt", "0" * 100_000),
    ("mac", "0" * 100_000),
])
def test_an_oversized_field_is_refused_before_any_mac_is_computed(field: str, value: Any) -> None:
    wire = issued().to_params()
    wire["kvservice"][field] = value
    with pytest.raises(HandoffError) as caught:
        handoff_from(wire)
    assert caught.value.kind == "handoff_invalid" and len(str(caught.value)) < 400  # what the log quotes


def test_the_encoding_is_unambiguous() -> None:
    assert encode(["ab", "c"]) != encode(["a", "bc"])
    assert encode([("a", "b")]) != encode([("a",), ("b",)]) != encode(["a", "b"])
    assert encode([1]) != encode(["1"])
    with pytest.raises(TypeError):
        encode([True])
    assert mac(KEY, ["x"]) == hmac.digest(KEY, encode(["x"]), "sha256").hex()  # type: ignore[arg-type]
    assert not mac_ok(KEY, ["x"], None) and not mac_ok(KEY, ["x"], mac(KEY, ["x"]).upper())  # type: ignore[arg-type]
