"""``_trust.strikes``: a source whose metadata cost a vetting child twice backs off, doubling."""

from __future__ import annotations

from kvservice._trust.strikes import Strikes


def test_a_source_backs_off_from_its_second_strike_doubling_up_to_the_most_and_others_are_untouched() -> None:
    strikes = Strikes(base_s=2.0, max_s=5.0)
    assert strikes.refused("10.0.0.2", 0.0) is None and not strikes.struck("10.0.0.2", 0.0)
    assert strikes.charge("10.0.0.2", 0.0) == (1, 0.0)  # vetted apart from now on, not refused
    assert strikes.refused("10.0.0.2", 0.0) is None and strikes.struck("10.0.0.2", 0.0)
    assert strikes.charge("10.0.0.2", 1.0) == (2, 2.0)
    assert strikes.refused("10.0.0.2", 2.5) == (2, 0.5)
    assert strikes.refused("10.0.0.3", 2.5) is None  # another source is not charged
    assert strikes.refused("10.0.0.2", 3.0) is None and strikes.struck("10.0.0.2", 3.0)
    assert strikes.charge("10.0.0.2", 3.0) == (3, 4.0)
    assert strikes.charge("10.0.0.2", 7.0) == (4, 5.0)  # 8 s, held to the most
    assert strikes.refused("10.0.0.2", 11.9) is not None


def test_a_quiet_source_is_forgotten_and_the_table_is_bounded() -> None:
    strikes = Strikes(base_s=1.0, max_s=4.0, remembered=2)
    strikes.charge("a", 0.0)
    assert strikes.struck("a", 7.9) and not strikes.struck("a", 8.0)  # quiet for 2 * max_s
    assert strikes.charge("a", 9.0) == (1, 0.0)  # starts over
    strikes.charge("b", 9.0)
    strikes.charge("c", 9.0)
    assert len(strikes) == 2 and not strikes.struck("a", 9.0)  # the oldest charged went first


def test_a_cost_the_network_may_have_caused_escalates_only_close_behind_the_last_charge() -> None:
    """``escalate=False`` (NIXL refused the load, or it hung): a source is vetted apart from the
    first, and refused only for such costs that follow its last charge within ``window_s``;
    a cost of the bytes (a crash) escalates whenever it comes."""
    strikes = Strikes(base_s=2.0, max_s=50.0, window_s=10.0)
    assert strikes.charge("10.0.0.2", 0.0, escalate=False) == (1, 0.0)
    for t in (10.0, 20.0, 35.0):  # each a window or more after the last: no more strikes
        assert strikes.charge("10.0.0.2", t, escalate=False) == (1, 0.0)
        assert strikes.refused("10.0.0.2", t) is None and strikes.struck("10.0.0.2", t)
    assert strikes.charge("10.0.0.2", 40.0, escalate=False) == (2, 2.0)  # 5 s behind the last
    assert strikes.refused("10.0.0.2", 41.0) == (2, 1.0)
    assert strikes.charge("10.0.0.2", 60.0, escalate=False) == (2, 0.0)  # spaced again: as it was
    assert strikes.charge("10.0.0.2", 100.0) == (3, 4.0)  # a crash escalates, spaced or not
    assert strikes.count("10.0.0.2", 100.0) == 3 and strikes.count("10.0.0.3", 100.0) == 0
    assert strikes.struck("10.0.0.2", 199.9) and not strikes.struck("10.0.0.2", 200.0)  # 2 * max_s after the last
