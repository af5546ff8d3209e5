# Two commands from a fresh clone: `make demo` (train the example on tdx) and `make test`.
# Both run `make build` first: a .venv with torch, UCX and the extension built in place;
# re-running it after a source change recompiles only what changed (ninja).
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.14.1
UCX_SPEC ?= libucx-cu13>=1.22
NPROC ?= 4
export MAX_JOBS ?= 2

.PHONY: build demo test test-slow clean

$(VENV)/.deps: pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH_SPEC)" "$(UCX_SPEC)" ninja "setuptools>=64" wheel pytest numpy
	touch $@

$(VENV)/.installed: $(VENV)/.deps setup.py
	$(PY) -m pip install -q --no-build-isolation --no-deps -e .
	touch $@

build: $(VENV)/.installed
	$(PY) setup.py -q build_ext --inplace

demo: build
	OMP_NUM_THREADS=1 $(VENV)/bin/torchrun --standalone --nproc-per-node $(NPROC) examples/train.py

test: build
	$(PY) -m pytest

# The slow-marked tests (the kill sweep, the 10,000-op soak), left out of `make test`.
test-slow: build
	$(PY) -m pytest -m slow -s

clean:
	rm -rf build torchdist_ext/*.so *.egg-info
