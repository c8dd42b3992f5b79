# splitserve: `make test` sets up a virtual environment (first run only) and runs the suite.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# torch is installed before the project so that the project's torch range takes it as is. Without CUDA this is
# the CPU build; on a machine whose pip would fetch the CUDA build, set TORCH_PIP_ARGS to
# "--index-url https://download.pytorch.org/whl/cpu". On a CUDA host set TORCH_SPEC=torch (the CUDA build).
TORCH_SPEC ?= torch==2.13.0
TORCH_PIP_ARGS ?=
PORT ?= 50051
# run, stack and serve: MODEL=<hub id or local Hugging Face folder> instead of the demo model (random weights).
MODEL ?=
MODEL_ARG := $(if $(MODEL),--model "$(MODEL)")

.PHONY: setup test lint format protos run stack serve clean

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install $(TORCH_PIP_ARGS) "$(TORCH_SPEC)"
	$(BIN)/pip install -e ".[core,dev]"
	touch $@

# The CPU attention kernel, compiled here (about 20 s) so that the first core start does not; again when its
# source changes. Without a C++ compiler setup goes on: cores then say why they use the slower reference backend.
KERNEL_SOURCES := $(wildcard kernels/attention/csrc/*.cpp kernels/attention/csrc/*.h) kernels/attention/cpu_ops.py
$(BIN)/.kernels: $(BIN)/.installed $(KERNEL_SOURCES)
	@if $(BIN)/splitserve build-kernels; then touch $@; else echo "setup goes on without the CPU attention kernel"; fi

setup: $(BIN)/.installed $(BIN)/.kernels

# Two pytest-xdist workers by default, each taking whole test files (their module fixtures start servers once);
# see tests/README.md. TEST_WORKERS=0 runs one pytest process.
TEST_WORKERS ?= 2
test: setup
	$(BIN)/python -m pytest -q $(if $(filter-out 0,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadfile)

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports
	$(BIN)/mypy

format: setup
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

protos: setup
	$(BIN)/python scripts/generate_protos.py

# The main job: core and frontend as two processes, demo prompts streamed through the public gRPC API, both
# stopped cleanly. The demo model is built on first use.
run: setup
	$(BIN)/splitserve demo $(MODEL_ARG)

# Keep the split stack running on localhost:$(PORT) until Ctrl-C.
stack: setup
	$(BIN)/splitserve stack --port $(PORT) $(MODEL_ARG)

# The same public API with the core in-process (one process).
serve: setup
	$(BIN)/splitserve serve --port $(PORT) $(MODEL_ARG)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .cache/mypy
