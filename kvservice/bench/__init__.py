"""``kvservice bench``: kvservice against raw NIXL and the memory-copy limit, on one
host or between two (``kvservice.bench.main``).  The modules named ``*_side``,
``raw_nixl`` and ``lagprobe`` run as the bench's child processes."""
