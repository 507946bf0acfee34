# deepseek-one-gpu — build, serve, test.
#   make serve   install (first time) and serve the embedded default model on 127.0.0.1:8090
#   make test    install (first time) and run the whole test suite
#   make check   ruff format --check, ruff check, mypy
#   make bench   this server vs llama-server and llama-batched-bench (bench/compare.py)
#   make fuzz    schemathesis against a live server, from its OpenAPI document (bench/fuzz_api.py)
#   make bench-kv  KV pressure: ours vs llama-server on the same pool (bench/kv_pressure.py)
#   make bench-multiturn  prefix cache: multi-turn chat and shared-prefix bursts vs llama-server
#   make soak    30 minutes of mixed traffic, then memory, leak and error checks (bench/soak.py)
# GPU=cuda forces a CUDA build of llama.cpp; otherwise CUDA is used when `nvidia-smi -L` finds a GPU.

SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
HOST ?= 127.0.0.1
PORT ?= 8090
SERVE_ARGS ?=
LLAMA_CPP_VERSION := 0.3.36

GPU ?= $(shell nvidia-smi -L >/dev/null 2>&1 && echo cuda || echo cpu)
ifeq ($(GPU),cuda)
  LLAMA_CMAKE_ARGS := -DGGML_CUDA=on
else
  LLAMA_CMAKE_ARGS :=
endif
STAMP := $(VENV)/.installed-$(GPU)
LLAMA_BUILD := .build
LLAMA_SDIST := $(LLAMA_BUILD)/llama_cpp_python-$(LLAMA_CPP_VERSION).tar.gz
LLAMA_SRC := $(LLAMA_BUILD)/llama_cpp_python-$(LLAMA_CPP_VERSION)
PATCHES := $(sort $(wildcard engine/llama_patches/*.patch))
# The build's stamp names the version and the set of patches: a patch removed or a version
# changed is a stamp not there, so a rebuild (a patch edited is a newer prerequisite).
# ggml's AMX kernels are left out: on VMs whose CPUs advertise AMX they die of SIGILL at
# their first tile instruction (seen on the 2-core build machine); AVX-512 serves instead.
LLAMA_CFLAGS := -mno-amx-tile -mno-amx-int8 -mno-amx-bf16
PATCH_SET := $(shell printf '%s\n' $(notdir $(PATCHES)) '$(LLAMA_CFLAGS)' | cksum | cut -d' ' -f1)
LLAMA_STAMP := $(VENV)/.llama-$(GPU)-$(LLAMA_CPP_VERSION)-$(PATCH_SET)
# Native parts, no link dependency: the expert-telemetry callback (engine/expert_tap.py says
# why it is C) and the step's decode-and-sample call (engine/native/decode_sample.c). Built on
# the machine that runs them, for its CPU.
TAP := engine/native/libexpert_tap.so
STEP := engine/native/libdecode_sample.so
NATIVE := $(TAP) $(STEP)
# The CPU the native step is built for; an image for other machines names one
# (deploy/Dockerfile: x86-64-v3).
MARCH ?= native

.PHONY: install native peers prometheus serve test check bench bench-stall bench-repro bench-kv bench-multiturn fuzz soak model clean

install: $(STAMP) $(NATIVE)

native: $(NATIVE)

$(TAP): engine/native/expert_tap.c
	$(CC) -O2 -Wall -Wextra -shared -fPIC -o $@ $<

$(STEP): engine/native/decode_sample.c
	$(CC) -O3 -march=$(MARCH) -fno-trapping-math -Wall -Wextra -shared -fPIC -pthread -o $@ $< -lm

# llama-cpp-python from its PyPI source with our patches to the llama.cpp it vendors
# (engine/llama_patches/, applied in name order), built for this machine: rebuilt when a
# patch or the version changes.
$(LLAMA_STAMP): $(PATCHES)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	test -f $(LLAMA_SDIST) || $(PY) -m pip download -q --no-deps --no-binary :all: \
	  llama-cpp-python==$(LLAMA_CPP_VERSION) -d $(LLAMA_BUILD)
	rm -rf $(LLAMA_SRC) && tar xzf $(LLAMA_SDIST) -C $(LLAMA_BUILD)
	for p in $(PATCHES); do patch -p1 -s -d $(LLAMA_SRC)/vendor/llama.cpp < $$p || exit 1; done
	@echo "building llama-cpp-python $(LLAMA_CPP_VERSION) ($(GPU)); the first build takes ~9 minutes on 2 cores"
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" CFLAGS="$(LLAMA_CFLAGS)" CXXFLAGS="$(LLAMA_CFLAGS)" \
	  $(PY) -m pip install -q --no-cache-dir --force-reinstall \
	  --no-deps ./$(LLAMA_SRC)
	rm -f $(VENV)/.llama-*
	touch $@

$(STAMP): pyproject.toml $(LLAMA_STAMP)
	$(PY) -m pip install -q -e '.[dev]'
	rm -f $(VENV)/.installed-*
	touch $@

model: $(STAMP)
	$(PY) -c "from engine.default_model import default_model_path; print(default_model_path())"

serve: $(STAMP) $(NATIVE) model
	$(VENV)/bin/one-gpu serve --host $(HOST) --port $(PORT) $(SERVE_ARGS)

test: $(STAMP) $(NATIVE) prometheus peers
	$(PY) -m pytest $(PYTEST_ARGS)

# llama.cpp's own llama-server, llama-batched-bench and llama-perplexity, built once into
# .bench/ from the same sources (bench/peers.py): the tests that run the benchmarks against
# them find them there, so the suite's time is the tests', not a compiler's.
peers: $(STAMP)
	$(PY) -m bench.peers

# Debian's prometheus (and promtool) for the monitoring tests (tests/test_monitoring.py);
# where it cannot be installed (not root, no apt) those tests are skipped and say why.
prometheus:
	@command -v prometheus >/dev/null && command -v promtool >/dev/null || { \
	  echo "installing Debian's prometheus for the monitoring tests"; \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	    --no-install-recommends prometheus) >/dev/null 2>&1 \
	  || echo "WARNING: prometheus could not be installed: the monitoring tests are skipped"; }

check: $(STAMP)
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

bench: $(STAMP) $(NATIVE) model
	$(PY) -m bench.compare $(BENCH_ARGS)

bench-stall: $(STAMP) $(NATIVE) model
	$(PY) -m bench.stall $(BENCH_ARGS)

bench-repro: $(STAMP) $(NATIVE) model
	$(PY) -m bench.repro $(BENCH_ARGS)

fuzz: $(STAMP) $(NATIVE) model
	$(PY) -m bench.fuzz_api $(BENCH_ARGS)

bench-kv: $(STAMP) $(NATIVE) model
	$(PY) -m bench.kv_pressure $(BENCH_ARGS)

bench-multiturn: $(STAMP) $(NATIVE) model
	$(PY) -m bench.multiturn $(BENCH_ARGS)

soak: $(STAMP) $(NATIVE) model
	$(PY) -m bench.soak $(BENCH_ARGS)

clean:
	rm -rf $(VENV) $(NATIVE) $(LLAMA_BUILD) .mypy_cache .ruff_cache .pytest_cache
