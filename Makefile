# Two commands for a fresh machine: `make demo` and `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PIPQ := $(BIN)/pip install -q --disable-pip-version-check
# llama.cpp is built from the pinned llama-cpp-python sdist plus our patch (native/), once per source change
# and cached in $SPECULANT_HOME/wheels: a portable wheel whose CPU kernels are picked by CPUID at run time.
NATIVE := native/build-llama.sh $(wildcard native/*.patch native/src/*)
MODELS := qwen2.5-coder-1.5b-instruct qwen2.5-coder-0.5b-instruct qwen2.5-coder-0.5b-instruct-q4_0-out-q4_0 \
	smollm2-135m-instruct

.PHONY: setup models demo test test-all clean

$(BIN)/.llama: $(NATIVE)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIPQ) --upgrade pip
	wheel="$$(PIP=$(BIN)/pip bash native/build-llama.sh)" && $(PIPQ) "$$wheel"
	touch $@

$(BIN)/.installed: pyproject.toml $(BIN)/.llama
	$(PIPQ) -e .
	touch $@

$(BIN)/.installed-test: pyproject.toml $(BIN)/.llama
	$(PIPQ) -e '.[test,torch]'
	touch $@

setup: $(BIN)/.installed

models: $(BIN)/.installed
	$(BIN)/speculant pull $(MODELS)

demo: $(BIN)/.installed
	$(BIN)/speculant pull  # the default target and draft
	$(BIN)/speculant demo

# the CI suite: every path at least once; the tests marked slow (tests/conftest.py SLOW) repeat a path with a
# bigger model or another setting, or run a whole benchmark, and are left to test-all
test: $(BIN)/.installed-test models
	$(BIN)/python -m pytest -q -ra --durations=25 -m "not slow"

test-all: $(BIN)/.installed-test models
	$(BIN)/python -m pytest -q -ra --durations=25

clean:
	rm -rf $(VENV) build *.egg-info
