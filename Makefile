# nnloom - the two commands:
#   make demo   run the built-in activation-patching experiment
#   make test   run every test (cmocka + pytest)
# Both set up what they need (scripts/env.sh: Debian packages and a virtual
# environment in $(NNLOOM_HOME), outside the clone), idempotently.

NNLOOM_HOME ?= $(HOME)/.cache/nnloom
export NNLOOM_HOME
VENV := $(NNLOOM_HOME)/venv
PY := $(VENV)/bin/python
CMAKE := $(VENV)/bin/cmake
CTEST := $(VENV)/bin/ctest
BUILD ?= build/dev
SAN_BUILD ?= build/sanitize
BUILD_LOG ?= /tmp/nnloom-pip-install.log
JOBS ?= $(shell nproc 2>/dev/null || echo 2)

.PHONY: all env env-bench build dev install test-pythons ctest pytest test demo bench sanitize print-python clean

all: build

env:
	@scripts/env.sh >/dev/null

env-bench:
	@scripts/env.sh bench >/dev/null

# C units + the extension, for the cmocka tests
build: env
	@$(CMAKE) -S . -B $(BUILD) -G Ninja -DPython3_EXECUTABLE=$(PY) -DNNLOOM_BUILD_TESTS=ON >/dev/null
	@$(CMAKE) --build $(BUILD) -j $(JOBS)

# the package, installed into the environment the way a user installs it
install: env
	@echo "[nnloom] pip install . (into $(VENV))"
	@$(PY) -m pip install -q --no-build-isolation --no-deps . > $(BUILD_LOG) 2>&1 || { cat $(BUILD_LOG); exit 1; }
	@$(PY) -c "import nnloom, sys; print('[nnloom] installed', nnloom.__file__)"

# in-tree development: the extension copied next to the sources, so
# `PYTHONPATH=python $(PY) ...` runs this checkout without installing it
dev: build
	@cp $(BUILD)/_C*.so python/nnloom/

ctest: build
	@cd $(BUILD) && $(CTEST) --output-on-failure

pytest: install
	@cd tests && $(PY) -m pytest -q -p no:cacheprovider py $(PYTEST_ARGS)

test: ctest pytest

# the interleaving tests on the other CPython 3.10-3.13 this machine has
test-pythons: env
	@scripts/test-pythons.sh

sanitize: env
	@$(CMAKE) -S . -B $(SAN_BUILD) -G Ninja -DPython3_EXECUTABLE=$(PY) -DNNLOOM_SANITIZE=ON -DCMAKE_BUILD_TYPE=Debug >/dev/null
	@$(CMAKE) --build $(SAN_BUILD) -j $(JOBS)
	@cd $(SAN_BUILD) && $(CTEST) --output-on-failure

demo: install
	@$(PY) -m nnloom.demo

bench: env-bench install
	@$(PY) bench/run.py $(if $(QUICK),--quick,)

print-python:
	@echo $(PY)

clean:
	rm -rf build
