"""The vetting child's figures in ``kvservice bench``: what ``procfs`` picks out of ``/proc``'s
files."""

from __future__ import annotations

import os

import pytest

from kvservice.bench import procfs

#: a process whose name holds a space and a ')': fields count from the last one
STAT = ("4242 (a b) c) S 1 4242 4242 0 -1 4194560 10 0 0 0 "
        "731 45 0 0 20 0 3 0 100 1000000 2000 18446744073709551615")
STATUS = "Name:\tpython\nVmPeak:\t  70000 kB\nVmHWM:\t   60000 kB\nVmRSS:\t   56936 kB\nRssAnon:\t  20000 kB\n"
ROLLUP = ("55c5-7fff ---p 00000000 00:00 0    [rollup]\nRss:   56936 kB\nPss_Anon:  100 kB\n"
          "Pss:   30512 kB\nPss_Dirty:  144 kB\n")


def test_cpu_is_utime_plus_stime_counted_after_the_name() -> None:
    assert procfs.stat_ticks(STAT) == 731 + 45


def test_a_kib_field_is_its_own_line_not_one_it_prefixes() -> None:
    assert procfs.kib_field(STATUS, "VmRSS") == 56936
    assert procfs.kib_field(ROLLUP, "Pss") == 30512  # not Pss_Anon's, which comes first
    assert procfs.kib_field(ROLLUP, "Swap") is None


def test_this_process_reads_positive() -> None:
    used = procfs.usage(os.getpid())
    assert used.rss_mib > 0 and used.cpu_s > 0
    assert used.pss_mib is None or 0 < used.pss_mib <= used.rss_mib


def test_a_process_that_is_gone_is_an_error_not_a_zero() -> None:
    with pytest.raises(OSError):
        procfs.usage(2**22 + 1)  # above pid_max's largest value: never a process

