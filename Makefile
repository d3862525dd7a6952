# Two commands for a fresh machine (see README.md):
#   make run    installs everything into .venv, then serves the demo model and queries it
#   make test   installs everything into .venv, then runs lint, type checks and the test suite
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup run test lint

setup: $(STAMP)

# torch first, pinned: the CPU wheel 2.13.0. A looser requirement would download a CUDA build.
$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

run: setup
	$(PY) scripts/demo.py

lint: setup
	$(VENV)/bin/ruff check moeserve tests scripts
	$(VENV)/bin/mypy moeserve

test: lint
	bash scripts/run_tests.sh $(PY)
