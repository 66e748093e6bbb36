# Two entry points for a fresh machine; each creates .venv and installs what it needs.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test lint bench

$(BIN)/quotawrap: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test,redis,volc]'
	touch $@

demo: $(BIN)/quotawrap  ## the main job: a parallel agent guarded by quotawrap (simulator unless ARK_API_KEY)
	$(BIN)/quotawrap demo

test: $(BIN)/quotawrap  ## the whole test suite, lint included
	$(BIN)/ruff check .
	$(BIN)/pytest -q

bench: $(BIN)/quotawrap
	for script in bench/bench_*.py; do $(BIN)/python $$script || exit 1; done
