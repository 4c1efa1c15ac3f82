# `make demo` and `make test` set everything up on a fresh machine, then run.
# Where python3 already has torch, triton 3.6.0 and pytest (the GPU machine), nothing is
# installed; otherwise a virtual environment .venv is built with the CPU build of torch and
# every package at the version constraints.txt pins (the versions the suite passed with).
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

.PHONY: demo test test-gpu test-transformers bench info clean

demo: $(SETUP)
	$(PY) -m moegemm demo

# The versions it runs with first. Two pytest workers where pytest-xdist is installed (.venv has it,
# a GPU machine's python may not): the CPU suite is compile- and interpreter-bound, one core a worker.
test: $(SETUP)
	$(PY) -m moegemm info
	$(PY) -m pytest -q $$($(PY) -c 'import xdist; print("-n 2")' 2>/dev/null)

test-gpu: $(SETUP)
	$(PY) -m pytest -q -m gpu

bench: $(SETUP)
	$(PY) -m moegemm bench

info: $(SETUP)
	$(PY) -m moegemm info

# A venv $(1) with $(2) installed. torch first, pinned: an unpinned torch would pull a multi-GB CUDA
# build onto a CPU machine. Every install, and the build of moegemm itself (setuptools), at the
# versions of constraints.txt.
PINNED := -c constraints.txt
define venv_install
	$(PYTHON) -m venv $(1)
	$(1)/bin/pip install -q $(PINNED) --upgrade pip
	$(1)/bin/pip install -q $(PINNED) torch==2.13.0
	$(1)/bin/pip install -q $(PINNED) --build-constraint constraints.txt $(2)
endef

$(VENV)/.installed: pyproject.toml constraints.txt
	$(call venv_install,$(VENV),-e ".[test]")
	touch $@

# The tests that use transformers, against transformers==$(V) (e.g. a new release), in a throwaway
# venv in /tmp: the pinned packages without transformers, then transformers==$(V) with what that
# release requires (none of the packages only a newer transformers pulled in, which an older one
# may not import with).
HF_TESTS := tests/test_hf_backend.py tests/test_hf_families.py tests/test_hf_moe_helper.py tests/test_moe_parity.py
TF_VENV := $(or $(TMPDIR),/tmp)/moegemm-transformers-$(V)
test-transformers:
	@test -n "$(V)" || { echo "usage: make test-transformers V=<transformers version, e.g. 5.25.0>"; exit 2; }
	rm -rf $(TF_VENV)
	$(call venv_install,$(TF_VENV),-e ".[cpu]" pytest pytest-xdist)
	$(TF_VENV)/bin/pip install -q "transformers==$(V)"
	$(TF_VENV)/bin/python -m moegemm info
	$(TF_VENV)/bin/python -m pytest -q -n 2 -p no:cacheprovider $(HF_TESTS); status=$$?; rm -rf $(TF_VENV); exit $$status

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
