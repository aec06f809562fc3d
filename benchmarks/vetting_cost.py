"""What the vetting child costs each service (each SGLang or vLLM rank): its start time,
CPU and resident memory.

Starts ``MetadataVetter``'s child as a service does, waits until it serves, and reads its
CPU time and resident memory from ``/proc/<pid>/``: ``kvservice.bench.vetting``, which
``kvservice bench``'s memory part runs too (medians of 3 children there, in a child of the
bench).  This prints every child, in this process, with the UCX settings the figures in
docs/perf were measured with.  Run it with the interpreter the ranks use (for SGLang:
``$(bash scripts/engine-env.sh sglang)/bin/python``), kvservice on ``PYTHONPATH``::

    PYTHONPATH=$PWD python -m benchmarks.vetting_cost 5
"""

from __future__ import annotations

import sys

import anyio

from kvservice.bench.vetting import measure_children

UCX_ENV = {"UCX_TLS": "tcp,self", "UCX_NET_DEVICES": "lo"}


async def main(runs: int) -> None:
    got = await measure_children(runs, UCX_ENV)  # NIXL is loaded first, as in a service: not counted
    print(f"{'start s':>8} {'cpu s':>6} {'rss MiB':>8} {'pss MiB':>8}")
    for child in got["per_child"]:
        pss = "-" if child["pss_mib"] is None else f"{child['pss_mib']:.0f}"
        print(f"{child['ready_s']:8.2f} {child['cpu_s']:6.2f} {child['rss_mib']:8.0f} {pss:>8}")
    pss = "" if got["pss_mib"] is None else f", pss {got['pss_mib']:.0f} MiB"
    print(f"median: start {got['ready_s']:.2f} s, cpu {got['cpu_s']:.2f} s, rss {got['rss_mib']:.0f} MiB{pss}; "
          f"load average {got['load_avg']:.1f}; {sys.executable}")


if __name__ == "__main__":
    anyio.run(main, int(sys.argv[1]) if len(sys.argv) > 1 else 5)
