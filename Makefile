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
	$(PY) -m mtask.bench
all: lint typecheck test
