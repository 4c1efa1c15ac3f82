# `make demo` and `make test` set everything up on a fresh machine, then run.
# Where python3 already has torch, triton 3.6.0 and pytest (the GPU machine), nothing is
# installed; otherwise a virtual environment .venv is built with the CPU build of torch.
PYTHON ?= python3
VENV := .venv
HAVE_DEPS := $(shell $(PYTHON) -c "import torch, pytest, triton; assert triton.__version__ == '3.6.0'" >/dev/null 2>&1 && echo yes)

ifeq ($(HAVE_DEPS),yes)
PY := $(PYTHON)
SETUP :=
else
PY := $(VENV)/bin/python
SETUP := $(VENV)/.installed
endif

.PHONY: demo test test-gpu bench info clean

demo: $(SETUP)
	$(PY) -m moegemm demo

# Two pytest workers (pytest-xdist): the CPU suite is compile- and interpreter-bound, one core a worker.
test: $(SETUP)
	$(PY) -m pytest -q -n 2

test-gpu: $(SETUP)
	$(PY) -m pytest -q -m gpu

bench: $(SETUP)
	$(PY) -m moegemm bench

info: $(SETUP)
	$(PY) -m moegemm info

# torch first, pinned: an unpinned torch would pull a multi-GB CUDA build onto a CPU machine.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q torch==2.13.0
	$(VENV)/bin/pip install -q -e ".[test]"
	touch $@

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
