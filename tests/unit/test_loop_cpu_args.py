"""``benchmarks.loop_cpu`` refuses, before starting anything, a run its sender would refuse in
part: the receiver's Expects all reach the sender before the clock starts, and past the
sender's ``max_unknown_expects`` the rest are refused, so those sends would wait for ever."""

from __future__ import annotations

import importlib

import pytest

from benchmarks import loop_cpu
from kvservice._control.protocol import ChunkNotif
from kvservice._transfer import posts


@pytest.mark.parametrize(("argv", "says"), [
    (["--case", "w3/c1", "--rounds", "40"], "at most 39 rounds of w3/c1"),
    (["--case", "w9/c1"], "one of w2/c1"),
    (["--rounds", "0"], "at least 1"),
    (["--concurrency", "0"], "at least 1"),
])
def test_a_run_that_cannot_finish_is_refused_saying_why(argv: list[str], says: str,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        loop_cpu.main(argv)
    assert exc.value.code == 2 and says in capsys.readouterr().err


def test_parts_wraps_each_named_call_where_it_is_looked_up_and_puts_it_back() -> None:
    """Every part ``--parts`` names still exists (a rename fails here, not in the tool), is
    timed while the context is open, and is the original again after it."""
    owners = []
    for _, module_name, owner_name, fn_name in loop_cpu.PARTS:
        module = importlib.import_module(module_name)
        owner = getattr(module, owner_name) if owner_name else module
        owners.append((owner, fn_name, getattr(owner, fn_name)))
    with loop_cpu.timed_parts() as spent:
        assert all(getattr(owner, fn) is not original for owner, fn, original in owners)
        posts.encode_notif(ChunkNotif("r", 0, 1, None), b"")  # a part called: its time is counted
    assert spent.get("encode_notif", 0) > 0
    assert all(getattr(owner, fn) is original for owner, fn, original in owners)
