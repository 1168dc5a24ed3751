# Two commands on a fresh machine: `make lab` runs the local lab, `make test` runs the tests.
# Each creates the environment it needs (a virtualenv in .venv, Azurite from npm for tests).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
VENV_STAMP := $(VENV)/.installed
NPM_STAMP := node_modules/.installed

.PHONY: venv lab test lint format bench bench-smoke clean

$(VENV_STAMP): requirements.txt requirements-dev.txt training/requirements.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet -r requirements-dev.txt
	touch $@

$(NPM_STAMP): package.json package-lock.json
	npm ci --no-audit --no-fund --loglevel=error
	touch $@

venv: $(VENV_STAMP)

lab: $(VENV_STAMP)
	$(BIN)/python -m lab run $(ARGS)

test: $(VENV_STAMP) $(NPM_STAMP)
	$(BIN)/python -m pytest $(ARGS)

lint: $(VENV_STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(VENV_STAMP)
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

bench: $(VENV_STAMP)
	$(BIN)/python -m bench $(ARGS)

clean:
	rm -rf $(VENV) node_modules .pytest_cache .ruff_cache
