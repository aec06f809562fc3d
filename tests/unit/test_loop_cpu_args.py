"""``benchmarks.loop_cpu`` refuses, before starting anything, a run its sender would refuse in
part: the receiver's Expects all reach the sender before the clock starts, and past the
sender's ``max_unknown_expects`` the rest are refused, so those sends would wait for ever."""

from __future__ import annotations

import pytest

from benchmarks import loop_cpu


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
