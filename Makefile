# Two entry points for a fresh machine: `make serve` and `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
HOST ?= 127.0.0.1
PORT ?= 8000
MODEL ?= smollm2-135m

.PHONY: venv dev serve test clean

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

clean:
	rm -rf $(VENV) build *.egg-info
