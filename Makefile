# Two commands on a fresh machine: `make run` (the demo) and `make test` (the suite).
# Everything is installed into .venv by this file; nothing needs to be installed by hand.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
RF     := $(VENV)/bin/rackflow
STAMP  := $(VENV)/.installed

.PHONY: run test test-fast chaos test-cluster lint bench services-up services-down clean

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "rackflow needs Python >= 3.11, found " + sys.version' 
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	# torch first, pinned: the CPU wheel lies on this machine kind's disk; resolving it later through transformers
	# would fetch a multi-GB CUDA build
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet -e '.[dev,torch]'
	touch $(STAMP)

run: $(STAMP)
	$(RF) demo

test: $(STAMP)
	$(PY) -m pytest -q tests

test-fast: $(STAMP)
	$(PY) -m pytest -q tests/unit

# kill -9 / restart tests only (they are part of `make test` too)
chaos: $(STAMP)
	$(PY) -m pytest -q -m chaos tests/chaos

test-cluster: $(STAMP)
	$(PY) -m pytest -q -m cluster tests/cluster

lint: $(STAMP)
	$(VENV)/bin/ruff check pipeline streams workers tests
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

bench: $(STAMP)
	$(RF) bench pipeline

services-up: $(STAMP)
	$(RF) services up

services-down: $(STAMP)
	$(RF) services down

clean:
	-$(RF) services down 2>/dev/null
	rm -rf $(VENV) .rackflow *.egg-info .pytest_cache .mypy_cache .ruff_cache .hypothesis
