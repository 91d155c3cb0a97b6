# Two entry points (README): `make demo` runs the benchmark, `make test` runs the test suite.
# Both create .venv if it is missing and install the package into it.
#
# Existing environment (a cluster's, a container's): `make test PY=python3` (any target, any
# Python named on the command line) creates no venv and downloads nothing. It installs the
# package into that environment with `pip install --no-deps --no-build-isolation -e .`, so torch,
# triton, numpy, scipy, setuptools and pytest must already be there (it stops and says which are not).
PYTHON ?= python3
VENV ?= .venv
# CI pins the CPU build that lies on disk: make test TORCH=torch==2.13.0
TORCH ?= torch
ifeq ($(origin PY),command line)
EXISTING := 1
# The stamp lies outside .venv, one per environment (sys.prefix and version). The install is also
# redone when rfattn does not resolve to this checkout there (environment rebuilt, another
# checkout installed), seen without importing it or putting this folder on sys.path.
ENV_PROBE := $(shell $(PY) -c "import hashlib, importlib.util, os, sys; \
	sys.path[:] = [p for p in sys.path if p and os.path.realpath(p) != os.path.realpath('.')]; \
	s = importlib.util.find_spec('rfattn'); \
	here = s is not None and s.origin is not None and os.path.realpath(s.origin) == os.path.realpath(os.path.join('rfattn', '__init__.py')); \
	print(hashlib.sha1((sys.prefix + ' ' + sys.version).encode()).hexdigest()[:12], 'here' if here else 'elsewhere')" 2>/dev/null)
STAMP := build/.rfattn-installed-existing-$(firstword $(ENV_PROBE))
STAMP_FORCE := $(if $(filter here,$(ENV_PROBE)),,FORCE)
else
PY := $(VENV)/bin/python
STAMP := $(VENV)/.rfattn-installed
endif
# Kernels run under the Triton interpreter when no CUDA device is present.
HAS_CUDA = $(shell $(PY) -c "import torch; print(int(torch.cuda.is_available()))" 2>/dev/null)
INTERPRET = $(if $(filter 1,$(HAS_CUDA)),,TRITON_INTERPRET=1)

.PHONY: test test-slow check-compile check-install check-transformers-oldest demo bench-results bench-suite install lint clean

install: $(STAMP)

ifeq ($(EXISTING),1)
# What the editable install without dependencies needs, and what the targets import.
define ENV_CHECK
import importlib, sys, warnings
warnings.simplefilter("ignore")
missing = []
for name in ("torch", "triton", "numpy", "scipy", "pytest", "setuptools", "pip"):
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError:
        missing.append(name)
        continue
    except Exception as exc:
        missing.append(name + " (import fails: " + type(exc).__name__ + ")")
        continue
    if name == "setuptools" and int(module.__version__.split(".")[0]) < 64:
        missing.append("setuptools>=64 (has " + module.__version__ + ")")
if missing:
    sys.exit("make: " + sys.executable + " lacks " + ", ".join(missing) + ": install them into that environment (torch>=2.4, triton>=3.2), or leave PY= off to let make build .venv")
endef
export ENV_CHECK

$(STAMP): setup.cfg pyproject.toml $(STAMP_FORCE)
	@command -v $(PY) >/dev/null || { echo "make: PY=$(PY) is not a Python that can be run here" >&2; exit 1; }
	@$(PY) -c "$$ENV_CHECK"
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	@mkdir -p $(@D) && touch $@

FORCE:

# ruff comes from the index only when the environment lacks it.
RUFF_INSTALL = $(PY) -m ruff --version >/dev/null 2>&1 || $(PY) -m pip install -q ruff
else
$(STAMP): setup.cfg pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[test,bench,plots,hf]" $(PINS)
	touch $(STAMP)

RUFF_INSTALL = $(PY) -m pip install -q ruff
endif

# Tests run on every core through pytest-xdist where the environment has it (the `test` extra
# does), else in one process: make test PYTEST_WORKERS=0 for one process anyway.
PYTEST_WORKERS ?= auto
XDIST = $(if $(filter 0,$(PYTEST_WORKERS)),,$(shell $(PY) -c "import xdist" >/dev/null 2>&1 && echo "-n $(PYTEST_WORKERS)"))

test: $(STAMP)
	$(INTERPRET) $(PY) -m pytest $(XDIST) $(PYTEST_ARGS)

# The long interpreter tests (marker `slow`: the larger shapes, gradchecks with state, the runbook's
# stage timeouts), outside `make test` to keep it under five minutes on 2 cores; CI runs both.
test-slow: $(STAMP)
	$(INTERPRET) $(PY) -m pytest -m slow $(XDIST) $(PYTEST_ARGS)

# Every fused kernel launch compiles for a Hopper GPU (sm_90) and fits its shared memory, checked
# without a GPU (bench/compile.py; ~30 minutes on 2 cores, so not part of `make test`; CI runs it);
# with it, torch.compile(dynamic=True) of rf_attention: one graph for every sequence length.
check-compile: $(STAMP)
	$(INTERPRET) $(PY) -m pytest -m compile tests/test_compile.py $(PYTEST_ARGS)

# The Hugging Face suites against the oldest transformers setup.cfg declares, in a venv of their
# own (.venv-oldest; PINS pins it after the extras): CI runs it.
OLDEST_TRANSFORMERS = $(shell sed -n 's/^ *transformers>=\([0-9.]*\)$$/\1/p' setup.cfg | head -n 1)
check-transformers-oldest:
	$(MAKE) test VENV=.venv-oldest PINS="transformers==$(OLDEST_TRANSFORMERS).*" TORCH='$(TORCH)' \
		PYTEST_ARGS="$(PYTEST_ARGS) tests/test_hf.py tests/test_generate.py"

# A fresh venv in a temporary folder with only `pip install .` (no extras, not editable) imports
# rfattn and builds all nine weight matrices (issue 14; .ci/fresh_install.sh). Needs no .venv;
# CI pins the CPU torch build: make check-install TORCH=torch==2.13.0
check-install:
	TORCH='$(TORCH)' PYTHON='$(PYTHON)' bash .ci/fresh_install.sh

# The plots are drawn even when a correctness check failed; the exit status still says so.
demo: $(STAMP)
	$(PY) -m bench --out plots/out $(BENCH_ARGS); status=$$?; \
	$(PY) -m plots plots/out/bench.json --out plots/out && exit $$status

# Regenerate the committed results of this machine type (bench/results/<device>/), on a quiet
# machine: make bench-results BENCH_ARGS='--notes "..."'
bench-results: $(STAMP)
	dir=$$($(PY) -c "from bench.env import pick_device, results_slug; \
	print('bench/results/' + results_slug(pick_device()))"); \
	$(PY) -m bench --out $$dir $(BENCH_ARGS); status=$$?; \
	$(PY) -m plots $$dir/bench.json --out $$dir && exit $$status

# The same providers as pytest-benchmark cases (not part of `make test`).
bench-suite: $(STAMP)
	$(PY) -m pytest bench/ $(PYTEST_ARGS)

lint: $(STAMP)
	$(RUFF_INSTALL)
	$(PY) -m ruff check rfattn kernels tests bench plots

clean:
	rm -rf $(VENV) .venv-oldest build *.egg-info .pytest_cache plots/out
