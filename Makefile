# Two commands on a fresh machine: `make run` serves the demo model, `make test` runs the whole suite.
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
TORCH_VERSION := 2.13.0
# CUDA=1 installs the CUDA build of torch (same version) from PyTorch's wheel index for CUDA_TAG instead of the
# default build, and NVML's bindings, through which the node reports the GPU's memory without a CUDA context:
# `make run CUDA=1` on a Linux box with an NVIDIA driver (the driver must support CUDA_TAG's toolkit; cu126 or cu128
# for an older driver). Without it a CPU-only machine keeps the small CPU build.
CUDA ?=
CUDA_TAG ?= cu130
TORCH_CUDA_INDEX ?= https://download.pytorch.org/whl/$(CUDA_TAG)
ifeq ($(CUDA),1)
STAMP := $(VENV)/.installed-stamp-$(CUDA_TAG)
TORCH_PIP := torch==$(TORCH_VERSION)+$(CUDA_TAG) --index-url $(TORCH_CUDA_INDEX)
EXTRA_PIP := nvidia-ml-py==13.615.71
else
STAMP := $(VENV)/.installed-stamp
TORCH_PIP := torch==$(TORCH_VERSION)
EXTRA_PIP :=
endif

.PHONY: run test test-fast lint bench dist clean chromium

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' || { echo "Skulk needs Python 3.11 or newer;" \
	  "$(PYTHON) is $$($(PYTHON) -V 2>&1). Install one (macOS: brew install python@3.12) and run e.g." \
	  "make run PYTHON=python3.12"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet $(TORCH_PIP)
	$(VENV)/bin/pip install --quiet -e '.[dev]' $(EXTRA_PIP)
	touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/skulk $(ARGS)

test: $(STAMP) chromium
	$(PY) -m pytest -q -p no:cacheprovider -n 2 --dist loadfile $(PYTEST_ARGS)

# The fast lane: pure and unit tests, no node processes and no `slow` model compute (under a minute on one core).
# `make test` runs everything.
test-fast: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider -n 0 -m "not integration and not slow" tests/unit $(PYTEST_ARGS)

# The dashboard tests drive Debian's chromium (Playwright with executable_path; never `playwright install`).
# Installed here when missing and apt-get may run (root); otherwise those tests skip and name the command.
chromium:
	@command -v chromium >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
	  echo "installing chromium for the dashboard tests (apt-get install -y chromium)" && \
	  apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; } || \
	  echo "chromium is not installed and could not be: the dashboard tests will skip (run: apt-get install -y chromium)"

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests bench
	$(VENV)/bin/pyright

bench: $(STAMP)
	$(PY) bench/serving.py

# The wheel (dashboard, model cards and kernel sources inside) and the sdist, built offline with the venv's
# setuptools (a dev dependency): `pipx install dist/skulk-*.whl` or `uv tool install dist/skulk-*.whl` then gives
# a working `skulk`. build/ goes first so a module deleted since the last build cannot ride along in the wheel.
dist: $(STAMP)
	rm -rf dist build
	$(PY) -m pip wheel --quiet --no-deps --no-build-isolation -w dist .
	$(PY) -c 'from setuptools.build_meta import build_sdist; build_sdist("dist")' >/dev/null
	@ls dist

clean:
	rm -rf $(VENV) .pytest_cache build dist
