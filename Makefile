# splitserve: `make test` sets up a virtual environment (first run only) and runs the suite.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# torch is installed before the project so that the project's torch range takes it as is. Without CUDA this is
# the CPU build; on a machine whose pip would fetch the CUDA build, set TORCH_PIP_ARGS to
# "--index-url https://download.pytorch.org/whl/cpu". On a CUDA host set TORCH_SPEC=torch (the CUDA build).
TORCH_SPEC ?= torch==2.13.0
TORCH_PIP_ARGS ?=
PROMPTS ?= --prompt "The future of AI is" --prompt "def fibonacci(n):" --prompt "Once upon a time"

.PHONY: setup test lint format protos run clean

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install $(TORCH_PIP_ARGS) "$(TORCH_SPEC)"
	$(BIN)/pip install -e ".[dev]"
	touch $@

setup: $(BIN)/.installed

test: setup
	$(BIN)/python -m pytest -q

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: setup
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

protos: setup
	$(BIN)/python scripts/generate_protos.py

# The main job today: prompts through the engine core on the demo model (built on first use).
run: setup
	$(BIN)/splitserve generate $(PROMPTS) --max-tokens 32 --seed 0

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
