# Developer entry points. `make test` is the command CI runs (.ci/run) from a clean clone.
VENV ?= .venv
PY := $(VENV)/bin/python
# llama-cpp-python (the test oracle) builds from source: a portable x86-64-v3 build that runs on
# any AVX2 machine, whatever the CPU that built it.
LLAMA_CMAKE_ARGS ?= -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
  -DGGML_AVX512=OFF -DGGML_AVX_VNNI=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF \
  -DGGML_AMX_BF16=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF

.PHONY: dev test test-unit test-all lint format clean

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(PY) -m pip install -q -e '.[test]'
	touch $@

dev: $(VENV)/.installed

test: dev  ## everything but the slow real-model checks (what CI runs)
	./scripts/ensure-chromium
	./scripts/ensure-cross
	$(PY) -c "import pocketlm.runtime.kernels.native as n; assert n.available(), n.unavailable_reason()"
	$(PY) -m pytest -m "not slow"
	POCKET_KERNELS=numpy $(PY) -m pytest -q tests/test_runtime.py tests/test_gguf_import.py tests/test_api.py
	./scripts/check-min-versions

# The fast tier (under a minute here): layouts, the deploy file, kernels against their numpy
# twins, tokenizers, the registry, layering and API misuse; no real model, no server, no torch.
UNIT_TESTS := tests/test_quant.py tests/test_pocketfile.py tests/test_layers.py \
  tests/test_api_misuse.py tests/test_tokenizer.py tests/test_kernels_native.py tests/test_registry.py

test-unit: dev  ## the fast tier, for the edit-test loop
	$(PY) -m pytest -q -m "not slow" $(UNIT_TESTS)

test-all: dev  ## also gemma3-270m and qwen2.5-0.5b against llama.cpp
	$(PY) -m pytest

lint: dev
	$(PY) -m ruff check pocketlm tests benchmarks

format: dev
	$(PY) -m ruff format pocketlm tests benchmarks

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
