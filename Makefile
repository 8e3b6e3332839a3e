# Quick start: `make demo` runs the main job, `make test` runs the tests.
# Both create .venv and install lmcollect into it on first use.
PY ?= python3
VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: demo test bench

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/lmcollect demo

test: $(STAMP)
	$(VENV)/bin/python -m pytest -q

bench: $(STAMP)
	$(VENV)/bin/python benchmarks/collect.py
