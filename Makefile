# One command sets up and runs each job; setup is idempotent (re-runs only when its inputs change).
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
HOST ?= 127.0.0.1
PORT ?= 8000
ARGS ?=
# Extra serving flags for the main job; the defaults serve the bundled model well (8 graphs; the README says
# how long the first and later starts take per CPU class).
SERVE_ARGS ?=
# setup: which torch build (auto: CUDA where nvidia-smi lists a GPU, else the CPU build), and KEEP_TRITON=1 to keep
# triton on a machine without an NVIDIA GPU (scripts/setup_venv.py).
TORCH_BUILD ?= auto
KEEP_TRITON ?=
# Setup re-runs when its inputs or its settings change.
STAMP := $(VENV)/.installed-$(shell (cat pyproject.toml constraints.txt scripts/setup_venv.py; echo "$(TORCH_BUILD) $(KEEP_TRITON)") | sha1sum | cut -c1-12)

.PHONY: setup run test test-fast bench compile gpu-check clean

$(STAMP):
	TORCH_BUILD=$(TORCH_BUILD) KEEP_TRITON=$(KEEP_TRITON) $(PY) scripts/setup_venv.py --venv $(VENV)
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

setup: $(STAMP)

run: setup  ## serve the bundled model (OpenAI API on http://$(HOST):$(PORT)/v1; PORT=, HOST= change them)
	$(BIN)/vllm-neuron serve $(if $(filter --host --host=%,$(ARGS)),,--host $(HOST)) $(if $(filter --port --port=%,$(ARGS)),,--port $(PORT)) $(SERVE_ARGS) $(ARGS)

test: setup  ## the whole test suite (CPU), two workers (each file whole on one): server tests spend much of their time waiting
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=30 $(ARGS)

test-fast: setup  ## the fast tier: every test that builds no engine (pure units, the kernels, the HTTP layer on a fake engine)
	$(BIN)/python -m pytest -q -m "not engine and not slow and not network and not soak and not gpu" $(ARGS)

compile: setup  ## fill the compile cache for the default serving configuration
	$(BIN)/vllm-neuron compile $(ARGS)

bench: setup  ## offline throughput vs transformers on the bundled model
	$(BIN)/python benchmarks/offline_throughput.py $(ARGS)

gpu-check:  ## on a CUDA machine: parity, kernels, graph replay, the speed table (benchmarks/gpu/run.sh)
	PY=$${PY-$(if $(wildcard $(BIN)/python),$(BIN)/python,python3)} bash benchmarks/gpu/run.sh

clean:
	rm -rf $(VENV) .pytest_cache

.PHONY: bench-bounds
bench-bounds: setup  ## the machine's matmul peak (engine dtype) and read bandwidth, and each step kind of ours against its bound
	$(BIN)/python benchmarks/step_bounds.py $(ARGS)

.PHONY: bench-peers
bench-peers: setup  ## our server vs vLLM CPU and llama.cpp's llama-server (peers install once into ~/.cache/vllm_neuron_peers)
	$(BIN)/python benchmarks/compare_peers.py $(ARGS)

.PHONY: soak
soak: setup  ## the soak test for SOAK_MINUTES (default 30): mixed valid, invalid and disconnecting traffic; RSS samples in soak_rss.csv
	VLLM_NEURON_SOAK_MINUTES=$(or $(SOAK_MINUTES),30) VLLM_NEURON_SOAK_CSV=$(or $(SOAK_CSV),soak_rss.csv) $(BIN)/python -m pytest -q -s -m soak tests/soak $(ARGS)
