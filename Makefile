# Entry points for a fresh machine: `make serve`, `make test` (the full suite, CI's command) and
# `make test-quick` (the edit loop: no real models, no server or other processes).
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
HOST ?= 127.0.0.1
PORT ?= 8000
MODEL ?= smollm2-135m

.PHONY: venv dev serve test test-quick clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

venv: $(BIN)/python
	$(BIN)/pip install -q -e .

dev: $(BIN)/python
	$(BIN)/pip install -q -e '.[dev]'

serve: venv
	$(BIN)/pantheon pull $(MODEL)
	$(BIN)/pantheon serve --model $(MODEL) --host $(HOST) --port $(PORT)

test: dev
	$(BIN)/python -m pytest -q tests

test-quick: dev
	PANTHEON_TEST_TIER=quick $(BIN)/python -m pytest -q -m "not real and not slow" tests

clean:
	rm -rf $(VENV) build *.egg-info
