# The two commands: `make run` and `make test`. Everything they need is
# installed by these rules into .venv (created if missing).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# `make run SHAPE=pools`: a gateway in front of replica pools instead of a sidecar in front of twin engines.
SHAPE ?= twin
STAMP := $(VENV)/.specgate-installed

.PHONY: install browser run test test-fast lint typecheck bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# Reinstall only when the project's dependencies change.
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[test,bench]'
	touch $@

install: $(STAMP)

# ruff, then the import contracts of pyproject.toml (the layers of docs/architecture.md).
lint: install
	$(BIN)/ruff check .
	$(BIN)/lint-imports --no-logo

typecheck: install
	$(BIN)/mypy

test-fast: lint typecheck
	$(BIN)/python -m pytest -q -x -m "not engines"

# The dashboard's browser test drives Debian's Chromium, never a browser that a
# test tool downloads.
browser:
	@test -x /usr/bin/chromium || { \
	  echo "installing Debian's chromium for the dashboard's browser test"; \
	  SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
	  $$SUDO apt-get update -qq && $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; }

test: lint typecheck browser
	$(BIN)/python -m pytest -q

# The whole product on one machine: the control plane on SQLite (.specgate/)
# with the example policies, real vLLM CPU engines with the testbed's tiny
# models (built once, then cached), a sidecar, looping traffic and the
# dashboard; prints every URL and a fresh admin key. Ctrl-C stops it all.
# `.venv/bin/specgate up --no-engines` brings up only the control plane and dashboard.
run: install
	$(BIN)/specgate up --shape $(SHAPE)

bench: install
	$(BIN)/python -m bench.decisions

clean:
	rm -rf $(VENV) .mypy_cache .pytest_cache .ruff_cache .hypothesis build *.egg-info
