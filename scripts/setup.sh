#!/usr/bin/env bash
# Create .venv and install kvservice with its test tools.  Idempotent.
# torch==2.13.0 goes first: a CPU build of it is available locally; letting
# pip resolve torch through nixl or kvservice would download a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet "torch==2.13.0"
.venv/bin/python -m pip install --quiet -e ".[test,etcd]"
# The network-cut fault tests build network namespaces with iproute2 (ip, tc); as root on a
# Debian machine without it, install it.
if ! command -v ip >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    apt-get update -qq && apt-get install -y -qq iproute2 >/dev/null
fi
# The discovery tests (tests/discovery) start their own etcd server: Debian's etcd-server.
if ! command -v etcd >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    apt-get update -qq && apt-get install -y -qq etcd-server >/dev/null
fi
# The Mooncake baseline of `kvservice bench` (tests/system/test_bench_mooncake.py): its
# package, and the libibverbs it loads even over TCP.
if ! /sbin/ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1' && [ "$(id -u)" = 0 ] \
        && command -v apt-get >/dev/null 2>&1; then
    apt-get update -qq && apt-get install -y -qq libibverbs1 >/dev/null
fi
.venv/bin/python -m pip install --quiet -e ".[mooncake]"
