PY ?= .venv/bin/python

.PHONY: venv lint typecheck test bench all
venv:
	python3 -m venv .venv && $(PY) -m pip install -e '.[dev]'
lint:
	$(PY) -m ruff check . && $(PY) -m ruff format --check .
typecheck:
	$(PY) -m mypy
test:
	$(PY) -m pytest
bench:
	@echo "the benchmark suite (python -m mtask.bench) is not written yet; see issue 5" && exit 1
all: lint typecheck test
