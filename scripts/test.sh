#!/usr/bin/env bash
# Set up (if needed) and run every check: lint, types, Dockerfile lint, tests.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh || exit 1
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
# process), each test handed to the next free one (--dist loadgroup: tests that must not overlap
# would share an xdist_group; none need to today).  Most tests wait on real processes, links and
# deadlines, not on the CPU; their children are forked from a server that imported kvservice
# once (tests/conftest.py), and every timeout a slow peer must meet scales with the run's load
# (tests.helpers.scaled).  The slowest tests are in every run's log: what makes it long.
.venv/bin/python -m pytest -n "${KVSERVICE_TEST_WORKERS:-3}" --dist loadgroup --durations=25 "$@"
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
        PYTHONPATH="$PWD" "$vllm_env/bin/python" -m pytest tests/integrations/vllm -p no:cacheprovider || fail=1
    else
        echo "the vLLM environment could not be built (scripts/engine-env.sh vllm)" >&2
        fail=1
    fi
fi
# The chaos soak with real processes: kills, stops, restarts, aborts, deadlines; its five
# must-be-zero counters decide its exit code (docs/soak.md).
echo "== soak"
.venv/bin/kvservice soak --transfers 1000 --seed "${KVSERVICE_SOAK_SEED:-0}" || fail=1
# The SGLang transfer backend under SGLang's own classes and as served (tests/integrations/sglang:
# real sglang.launch_server pairs, one at a time, each test module's timeout marker bounding it):
# in SGLang's environment, built once and cached outside the checkout (scripts/engine-env.sh
# sglang); the run above skips those tests (no SGLang in .venv).
if [ "${KVSERVICE_SKIP_SGLANG:-0}" != 1 ]; then
    echo "== sglang"
    if sglang_env=$(bash scripts/engine-env.sh sglang); then
        KVSERVICE_REQUIRE_SGLANG=1 PYTHONPATH="$PWD" "$sglang_env/bin/python" -m pytest tests/integrations/sglang \
            -p no:cacheprovider || fail=1
    else
        echo "the SGLang environment could not be built (scripts/engine-env.sh sglang)" >&2
        fail=1
    fi
fi
exit "$fail"
