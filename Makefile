# Two entry points (README): `make demo` runs the benchmark, `make test` runs the test suite.
# Both create .venv if it is missing and install the package into it.
PYTHON ?= python3
VENV ?= .venv
# CI pins the CPU build that lies on disk: make test TORCH=torch==2.13.0
TORCH ?= torch
PY := $(VENV)/bin/python
STAMP := $(VENV)/.rfattn-installed
# Kernels run under the Triton interpreter when no CUDA device is present.
HAS_CUDA = $(shell $(PY) -c "import torch; print(int(torch.cuda.is_available()))" 2>/dev/null)
INTERPRET = $(if $(filter 1,$(HAS_CUDA)),,TRITON_INTERPRET=1)

.PHONY: test demo bench-results bench-suite install lint clean

install: $(STAMP)

$(STAMP): setup.cfg pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[test,bench,plots,hf]"
	touch $(STAMP)

test: $(STAMP)
	$(INTERPRET) $(PY) -m pytest $(PYTEST_ARGS)

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
	$(PY) -m pip install -q ruff
	$(PY) -m ruff check rfattn kernels tests bench plots

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache plots/out
