# Two commands on a fresh machine: `make lab` runs the local lab, `make test` runs the tests.
# Each creates the environment it needs (a virtualenv in .venv, Azurite from npm for tests).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
VENV_STAMP := $(VENV)/.installed
NPM_STAMP := node_modules/.installed
# Which torch build the venv gets: `pypi` (the default: whatever PyPI serves for this machine,
# on Linux the CUDA build with its nvidia-* wheels, several GB) or `cpu` (PyTorch's CPU index:
# a 190 MB wheel, about 750 MB installed). The lab and the tests run on the CPU either way.
# It applies when the venv is made: `make clean` first to switch an existing one.
TORCH ?= pypi
ifeq ($(filter $(TORCH),pypi cpu),)
$(error TORCH=$(TORCH): allowed values are pypi (the default) and cpu)
endif
TORCH_CPU_INDEX := https://download.pytorch.org/whl/cpu
# The tests' workers (pytest-xdist): the slow tier mostly waits on processes it starts (paced
# steps, interpreter and torch start-up), so two workers on 2 cores overlap those waits.
# `--dist loadgroup` (worksteal and load ignore groups) keeps a module whose fixture is shared on
# one worker (one setup, not one per worker) and the tests that load the whole machine (`heavy`)
# on one worker in turn (tests/support/tiers.py); it hands out the groups with the most tests
# first, then single tests as workers free up. WORKERS=0 runs the tests in this process.
WORKERS ?= 2
XDIST := -n $(WORKERS) --dist loadgroup
# The chaos campaign's schedule count for `make bench-chaos` (200: about 3 h 20 min on 2 cores).
SCHEDULES ?= 200

.PHONY: venv lab test test-fast lint format bench bench-smoke bench-chaos clean

$(VENV_STAMP): requirements.txt requirements-dev.txt training/requirements.txt
	$(PYTHON) -m venv $(VENV)
	@if [ "$(TORCH)" = cpu ]; then \
	  echo "installing torch's CPU build from $(TORCH_CPU_INDEX)"; \
	  $(BIN)/python -m pip install --quiet --index-url $(TORCH_CPU_INDEX) \
	    "$$(grep -E '^torch==' requirements-dev.txt)"; \
	fi
	$(BIN)/python -m pip install --quiet -r requirements-dev.txt
	touch $@

$(NPM_STAMP): package.json package-lock.json
	npm ci --no-audit --no-fund --loglevel=error
	touch $@

venv: $(VENV_STAMP)

lab: $(VENV_STAMP)
	$(BIN)/python -m lab run $(ARGS)

# The whole suite: real etcd, torchrun agents, Azurite and processes (what CI runs).
test: $(VENV_STAMP) $(NPM_STAMP)
	$(BIN)/python -m pytest $(XDIST) $(ARGS)

# Unit tests, mocks and recorded APIs only: no etcd, torchrun, Azurite, child process or long
# training (tests/support/tiers.py marks the rest by the fixtures they use).
test-fast: $(VENV_STAMP)
	$(BIN)/python -m pytest -m "not slow" $(XDIST) $(ARGS)

lint: $(VENV_STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(VENV_STAMP)
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

# The recovery benchmarks against plain torchrun (recovery per fault kind, step time,
# checkpoint stall, an eviction's commit): about 20 minutes on 2 cores.
bench: $(VENV_STAMP)
	@echo "make bench: the recovery benchmarks, about 20 minutes on 2 cores" \
	  "(the chaos campaign is make bench-chaos)"
	$(BIN)/python -m bench --chaos-schedules 0 $(ARGS)

# One quick repetition of one fault and one short chaos schedule: proves the pipeline.
bench-smoke: $(VENV_STAMP)
	$(BIN)/python -m bench --smoke $(ARGS)

# The chaos campaign alone: SCHEDULES random schedules of overlapping faults.
bench-chaos: $(VENV_STAMP)
	@echo "make bench-chaos: $(SCHEDULES) schedules, about 1 minute each on 2 cores"
	$(BIN)/python -m bench chaos --schedules $(SCHEDULES) $(ARGS)

clean:
	rm -rf $(VENV) node_modules .pytest_cache .ruff_cache
