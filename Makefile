# Two commands on a fresh machine: `make demo` and `make test`. Both set up .venv themselves.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup demo test test-fast lint gpu-check clean

setup: $(STAMP)

# torch is pinned to 2.13.0: a CPU wheel here, the CUDA build on GPU machines.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV) || python3 -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e '.[dev,ray,lm-eval]'
	touch $(STAMP)

# SmolLM2-135M answers a question about a long prompt under several policies, then prints KV statistics.
demo: $(STAMP)
	$(BIN)/python -m infinikv.demo

# The import layering (pyproject's [tool.importlinter]) is checked first: it takes a second.
test: $(STAMP)
	$(BIN)/lint-imports --no-cache
	$(BIN)/python -m pytest -q

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not real_model"

lint: $(STAMP)
	$(BIN)/lint-imports --no-cache
	$(BIN)/ruff check src tests
	$(BIN)/ruff format --check src tests

# The GPU check (docs/gpu.md): make gpu-check OUT=dir [TINY=1]. No venv: it runs infinikv from src/ with
# the machine's own Python (GPU_PYTHON, default: the script's choice) and installs nothing from a network.
gpu-check:
	$(if $(GPU_PYTHON),PYTHON=$(GPU_PYTHON)) scripts/gpu_check.sh $(or $(OUT),runs/gpu-check) $(if $(TINY),--tiny)

clean:
	rm -rf $(VENV) .pytest_cache
