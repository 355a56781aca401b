# Two commands for a fresh machine: `make demo` and `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# llama.cpp for this CPU: AVX-512 kernels, no AMX (its matmul path segfaults on quantized models here),
# no llamafile sgemm (so a batched pass computes each logit like a single-token pass does).
LLAMA_CMAKE_ARGS := -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
	-DGGML_BMI2=ON -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON \
	-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF -DGGML_LLAMAFILE=OFF -DGGML_RPC=ON
MODELS := qwen2.5-coder-1.5b-instruct qwen2.5-coder-0.5b-instruct smollm2-135m-instruct

.PHONY: setup models demo test clean

$(BIN)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check --upgrade pip
	@echo "installing (the first build of llama-cpp-python compiles llama.cpp: ~10 min on 2 cores)"
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(BIN)/pip install --disable-pip-version-check -q -e '.[test,torch]'
	touch $@

setup: $(BIN)/.installed

models: setup
	$(BIN)/speculant pull $(MODELS)

demo: setup
	$(BIN)/speculant pull qwen2.5-coder-1.5b-instruct qwen2.5-coder-0.5b-instruct
	$(BIN)/speculant demo

test: models
	$(BIN)/python -m pytest -q -ra

clean:
	rm -rf $(VENV) build *.egg-info
