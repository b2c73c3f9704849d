# Two commands matter: `make demo` (set up and run the main job) and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: venv demo test test-all bench bench-quick fuzz check format clean

venv: $(STAMP)

$(STAMP): pyproject.toml requirements/test.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[cli]' -r requirements/test.txt
	touch $(STAMP)

## Save, inspect, validate and load a model-shaped file.
demo: venv
	$(PY) examples/demo.py

## The default test suite (a few minutes).
test: venv
	$(PY) -m pytest -q

## Everything, including slow tests.
test-all: venv
	$(PY) -m pytest -q -m "slow or not slow"

## The side-by-side benchmark against the reference; writes benchmarks/RESULTS.md.
bench: venv
	$(PY) benchmarks/run.py

bench-quick: venv
	$(PY) benchmarks/run.py --quick

## The long coverage-guided fuzzing campaign (see fuzz/RESULTS.md).
fuzz: venv
	bash fuzz/run_long.sh

check: venv
	$(VENV)/bin/ruff check src tests benchmarks examples
	$(VENV)/bin/ruff format --check src tests benchmarks examples
	$(VENV)/bin/mypy

format: venv
	$(VENV)/bin/ruff format src tests benchmarks examples
	$(VENV)/bin/ruff check --fix src tests benchmarks examples

clean:
	rm -rf $(VENV) build dist .pytest_cache .mypy_cache .ruff_cache
