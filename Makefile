# Two commands do all the set-up on a fresh machine: `make run` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
CONFIG ?= etc/derivd.ini
PYTEST_WORKERS ?= 2

.PHONY: install run test pytest test-unit test-integration test-acceptance lint typecheck chaos bench clean system-deps

# What pip cannot bring: PostgreSQL's server (required), pgbouncer, chromium and faketime
# (optional; their tests skip). Installed when missing as root with apt-get, otherwise
# one line each says what to install.
system-deps:
	@sh etc/system-deps.sh

# The folders supervisor/, handlers/ and sql/ install as derivd, derivd.handlers and
# derivd.sql (setup.cfg's package_dir). A strict editable install links every file into
# build/__editable__.*/derivd, a plain directory that mypy and pytest read like any other;
# adding or removing a file changes $(SOURCES) and so reinstalls.
SOURCES := $(VENV)/.sources
$(shell mkdir -p $(VENV) && find supervisor handlers sql \( -name '*.py' -o -name '*.sql' -o -name py.typed \) \
    | LC_ALL=C sort > $(SOURCES).new && (cmp -s $(SOURCES).new $(SOURCES) || mv $(SOURCES).new $(SOURCES)))

$(STAMP): setup.cfg pyproject.toml $(SOURCES)
	[ -x $(BIN)/python ] || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip setuptools wheel
	rm -rf build/__editable__.derivd-*
	$(BIN)/pip install -q -e '.[test]' --config-settings editable_mode=strict
	touch $(STAMP)

install: system-deps $(STAMP)

run: install
	$(BIN)/derivd -c $(CONFIG) demo

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check supervisor handlers sql tests bench

typecheck: install
	MYPYPATH="$$(echo build/__editable__.derivd-*)" $(BIN)/mypy -p derivd

pytest: install
	$(BIN)/pytest -q -n $(PYTEST_WORKERS) tests

# Each tier alone; `make test` runs them all in one pytest session.
test-unit: install
	DERIVD_TEST_TIER=unit $(BIN)/pytest -q -n $(PYTEST_WORKERS) -m unit tests
test-integration: install
	$(BIN)/pytest -q -n $(PYTEST_WORKERS) -m integration tests
test-acceptance: install
	$(BIN)/pytest -q -n $(PYTEST_WORKERS) -m acceptance tests

test: lint typecheck pytest

chaos: install
	$(BIN)/python bench/chaos.py --full
	$(BIN)/python bench/fleet_chaos.py --full

# Charts need matplotlib: setup.cfg's `bench` extra, installed here only (not a runtime
# dependency). bench/plots.py draws from bench/out/*.json, skipping what is absent.
bench: install
	$(BIN)/python -c 'import matplotlib' 2>/dev/null || $(BIN)/pip install -q 'matplotlib>=3.7'
	$(BIN)/python bench/derive.py
	$(BIN)/python bench/queue_peers.py
	$(BIN)/python bench/latency.py
	$(BIN)/python bench/claim_scale.py
	$(BIN)/python bench/similar.py
	$(BIN)/python bench/plots.py

# As root, the demo's cluster may live outside var/ (see supervisor/embedded/pghome.py):
# stop it and remove that directory too.
clean:
	@if [ -d var ] && [ -x $(BIN)/python ]; then $(BIN)/python -c \
	  'from pathlib import Path; from derivd.embedded.pgcluster import discard; discard(Path("var/pg"))'; fi
	rm -rf $(VENV) var build *.egg-info
