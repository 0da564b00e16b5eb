# Two commands do all the set-up on a fresh machine:
#   make demo   installs the package alone into .venv on first use (no extras: NumPy, gRPC, the
#               planner's solvers; no PyTorch), then runs `tidalpool demo`
#   make test   installs the package with its dev extras (PyTorch, the linters, pytest, ...) into
#               .venv on first use, then lint (with the import contracts of pyproject.toml), type
#               check and tests
# The dev install includes everything the demo needs, so `make demo` after `make test` installs
# nothing more. `make traces` records the sample traces of traces/ again (needs the dev extras).
# `make prometheus` installs Debian's prometheus package (prometheus and promtool, for the
# alert-rule and dashboard tests) when they are missing, and stops and disables the system
# service the package starts; `make test` runs it first.
# `make gpu-check` runs bench/gpu_check.py: on a machine with an NVIDIA GPU, every GPU test and
# benchmark within 8 minutes, one JSON under bench/results/; without a GPU, a dry run that lists
# them (docs/benchmarks.md, "GPU check"). GPU_CHECK_ARGS adds options (--only, --copy-to, ...).
# `make gpu-wheels` downloads into .gpu-wheels/ (not committed) the wheels bench/gpu-wheels.txt
# lists, for CPython 3.12 on x86-64: what the lent GPU machines, which have no network, lack.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
BASE   := $(VENV)/.installed
STAMP  := $(VENV)/.installed-dev
SOURCES := pyproject.toml planner/tidalplan/_exact.c client/tidalclient/_native/hotpath.c \
           client/tidalclient/_native/hotpath.h client/tidalclient/_native/bench.c
PIP    := $(PY) -m pip install --quiet --disable-pip-version-check
TEST_WORKERS ?= auto

.PHONY: demo test lint typecheck unit stubs bench traces prometheus dashboards clean gpu-check \
        gpu-wheels

define make_venv
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "tidalpool needs Python >= 3.11, $(PYTHON) is " + sys.version.split()[0])'
	$(PYTHON) -m venv $(VENV)
endef

# The package and its own dependencies: what `tidalpool demo` and a daemon need.
$(BASE): $(SOURCES)
	$(make_venv)
	$(PIP) -e .
	@touch $@

# The package with the dev extras; it holds the base install too.
$(STAMP): $(SOURCES)
	$(make_venv)
	$(PIP) -e ".[dev]"
	@touch $@ $(BASE)

demo: $(BASE)
	$(VENV)/bin/tidalpool demo

test: prometheus lint typecheck unit

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(VENV)/bin/lint-imports

typecheck: $(STAMP)
	$(PY) -m mypy

# The suite in TEST_WORKERS processes (pytest-xdist; "auto": one a CPU, 0: in this one).
unit: $(STAMP)
	$(PY) -m pytest -n $(TEST_WORKERS)

stubs: $(STAMP)
	$(PY) proto/generate.py

dashboards: $(STAMP)
	$(PY) -m tools.dashboards

traces: $(STAMP)
	$(PY) traces/record.py

# Installing the package enables and starts a system Prometheus service on :9090: tools.prometheus
# stops and disables it at once (the tests start their own on free ports).
prometheus:
	@$(PYTHON) -m tools.prometheus

bench: $(STAMP)
	$(PY) bench/session.py
	$(PY) bench/executor.py
	$(PY) bench/placement.py
	$(PY) bench/swap.py
	$(PY) bench/native.py
	$(PY) bench/torch_saved.py

# Standard library only: it installs the package itself on the GPU machine.
gpu-check:
	$(PYTHON) bench/gpu_check.py $(GPU_CHECK_ARGS)

gpu-wheels:
	$(PYTHON) -m pip download --disable-pip-version-check --no-deps --only-binary=:all: \
	    --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 \
	    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
	    -d .gpu-wheels -r bench/gpu-wheels.txt

clean:
	rm -rf $(VENV) build *.egg-info client/*.egg-info .pytest_cache .mypy_cache .ruff_cache
