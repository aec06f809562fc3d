"""Engines loading kvservice: one folder per engine (``vllm``, ``sglang``)."""
