# Both targets set everything up from nothing: a .venv with pagefold (editable) and its test extras.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup demo test lint bench

$(STAMP): pyproject.toml requirements-cpu.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip
	$(BIN)/pip install -r requirements-cpu.txt
	$(BIN)/pip install -e '.[test]'
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/pagefold generate

test: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q tests

lint: $(STAMP)
	$(BIN)/ruff check pagefold tests benchmarks

bench: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/python -m benchmarks.throughput
