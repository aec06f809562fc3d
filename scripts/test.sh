#!/usr/bin/env bash
# Set up (if needed) and run every check: lint, types, Dockerfile lint, tests.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh || exit 1
# What the run and the servers it starts leave in the temporary directory (pytest's folders,
# vLLM's and SGLang's IPC sockets and init files, engines' scratch files) goes to one folder of
# the run's own, removed at the end: a machine that runs the tests day after day keeps nothing.
run_tmp=$(mktemp -d "${TMPDIR:-/tmp}/kvs-test.XXXXXX") || exit 1
chmod 1777 "$run_tmp"  # as /tmp is: the tests that run a peer as another user reach their folders
export TMPDIR="$run_tmp"
trap 'rm -rf "$run_tmp"' EXIT
trap 'exit 130' INT TERM  # a stopped run removes it too
fail=0
lint_paths=()
for d in kvservice tests benchmarks examples; do [ -d "$d" ] && lint_paths+=("$d"); done
echo "== ruff";  .venv/bin/ruff check "${lint_paths[@]}" || fail=1
echo "== mypy";  .venv/bin/mypy || fail=1
if [ -f Dockerfile ]; then
    echo "== hadolint"; .venv/bin/hadolint Dockerfile || fail=1
fi
echo "== pytest"
# On 3 pytest-xdist workers by default (KVSERVICE_TEST_WORKERS=N for another number, 0 for one
# process), each test handed to the next free one (--dist load).  Not loadgroup: pytest-xdist
# 3.8's loadgroup scheduler hangs for good once a crashed worker is replaced (its issue 1323),
# where load reports the crashed test failed, naming it, and goes on.  Most tests wait on real
# processes, links and deadlines, not on the CPU; their children are forked from a server that
# imported kvservice once (tests/conftest.py), and every timeout a slow peer must meet scales with
# the run's load (tests.helpers.scaled).  The slowest tests are in every run's log: what makes it
# long.  Each suite also has a wall-clock bound (phase below; about three times what it takes on
# an idle machine): a suite that hangs is interrupted (SIGINT: pytest still prints what failed)
# and fails, and the suites after it still run.
phase() {  # phase MINUTES COMMAND...: run COMMAND, interrupted after MINUTES
    local minutes=$1
    shift
    timeout --signal=INT --kill-after=120 "${minutes}m" "$@"
    local rc=$?
    [ "$rc" -eq 124 ] && echo "interrupted after ${minutes} minutes: $*" >&2
    return "$rc"
}
phase 35 .venv/bin/python -m pytest -n "${KVSERVICE_TEST_WORKERS:-3}" --dist load --durations=25 "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
    echo "pytest collected no tests: failing" >&2
    rc=1
fi
[ "$rc" -ne 0 ] && fail=1
# vLLM's own engines load the connector (tests/integrations/vllm: two engines, vLLM's real
# scheduler): in the environment of vLLM's CPU build, built once and cached outside the
# checkout (scripts/engine-env.sh vllm); the run above skips those tests (no vLLM in .venv).
if [ "${KVSERVICE_SKIP_VLLM:-0}" != 1 ]; then
    echo "== vllm"
    if vllm_env=$(bash scripts/engine-env.sh vllm); then
        PYTHONPATH="$PWD" phase 30 "$vllm_env/bin/python" -m pytest tests/integrations/vllm -p no:cacheprovider \
            --durations=10 || fail=1
    else
        echo "the vLLM environment could not be built (scripts/engine-env.sh vllm)" >&2
        fail=1
    fi
fi
# The chaos soak with real processes: kills, stops, restarts, aborts, deadlines; its five
# must-be-zero counters decide its exit code (docs/soak.md).
echo "== soak"
phase 15 .venv/bin/kvservice soak --transfers 1000 --seed "${KVSERVICE_SOAK_SEED:-0}" || fail=1
# The SGLang transfer backend under SGLang's own classes and as served (tests/integrations/sglang:
# real sglang.launch_server pairs, one at a time, each test module's timeout marker bounding it):
# in SGLang's environment, built once and cached outside the checkout (scripts/engine-env.sh
# sglang); the run above skips those tests (no SGLang in .venv).
if [ "${KVSERVICE_SKIP_SGLANG:-0}" != 1 ]; then
    echo "== sglang"
    if sglang_env=$(bash scripts/engine-env.sh sglang); then
        KVSERVICE_REQUIRE_SGLANG=1 PYTHONPATH="$PWD" phase 30 "$sglang_env/bin/python" -m pytest \
            tests/integrations/sglang -p no:cacheprovider --durations=10 || fail=1
    else
        echo "the SGLang environment could not be built (scripts/engine-env.sh sglang)" >&2
        fail=1
    fi
fi
left=$(find "$run_tmp" -mindepth 1 -maxdepth 1 | wc -l)
echo "== the run left $left entries in its temporary folder (removed now)"
exit "$fail"
