PY ?= .venv/bin/python

.PHONY: venv format lint typecheck test test-unit test-integration test-acceptance test-chaos testcov bench all
venv:
	python3 -m venv .venv && $(PY) -m pip install -e '.[dev]'
format:
	$(PY) -m ruff check --fix . && $(PY) -m ruff format .
lint:
	$(PY) -m ruff check . && $(PY) -m ruff format --check .
typecheck:
	$(PY) -m mypy
test:
	$(PY) -m pytest
test-unit test-integration test-acceptance test-chaos:  # one tier: make test-chaos
	$(PY) -m pytest tests/$(subst test-,,$@)
testcov:
	$(PY) -m pytest --cov=mtask --cov-report=term-missing
bench:
	$(PY) -m bench
all: lint typecheck test
