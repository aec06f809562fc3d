"""The engines as people run them, each in its own environment (scripts/engine-env.sh): vLLM and
SGLang load kvservice through their own plugin points."""
