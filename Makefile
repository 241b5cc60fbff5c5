# Two commands do all the set-up on a fresh machine: `make run` (what running needs) and
# `make test` (that plus the test toolchain and the programs the suite drives).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
CONFIG ?= etc/derivd.ini
PYTEST_WORKERS ?= 2

.PHONY: install install-run run docs test test-fast pytest test-unit test-integration test-acceptance lint typecheck chaos bench clean system-deps system-deps-run

# What pip cannot bring. Running needs PostgreSQL's server only; the test suite also uses
# pgbouncer, chromium, faketime and jpegtran (their tests skip, each with one line,
# without them).
# Installed when missing as root with apt-get, otherwise one line each says what to install.
system-deps-run:
	@sh etc/system-deps.sh run
system-deps:
	@sh etc/system-deps.sh test

# The folders supervisor/, handlers/ and sql/ install as derivd, derivd.handlers and
# derivd.sql (setup.cfg's package_dir). A strict editable install links every file into
# build/__editable__.*/derivd, a plain directory that mypy and pytest read like any other;
# adding or removing a file changes $(SOURCES) and so reinstalls.
SOURCES := $(VENV)/.sources
$(shell mkdir -p $(VENV) && find supervisor handlers sql \( -name '*.py' -o -name '*.sql' -o -name py.typed \) \
    | LC_ALL=C sort > $(SOURCES).new && (cmp -s $(SOURCES).new $(SOURCES) || mv $(SOURCES).new $(SOURCES)))

# `make run` installs what derivd needs to run; `make test` (and every target below that
# lints, checks types, tests or benchmarks) adds setup.cfg's `test` extra.
RUN_STAMP := $(VENV)/.installed-run
TEST_STAMP := $(VENV)/.installed-test

define editable_install
	[ -x $(BIN)/python ] || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip setuptools wheel
	rm -rf build/__editable__.derivd-*
	$(BIN)/pip install -q -e '.$(1)' --config-settings editable_mode=strict
	$(BIN)/python -m compileall -q build/__editable__.derivd-*
endef

$(RUN_STAMP): setup.cfg pyproject.toml $(SOURCES)
	$(call editable_install,)
	touch $@

# The test install holds everything running needs too.
$(TEST_STAMP): setup.cfg pyproject.toml $(SOURCES)
	$(call editable_install,[test])
	touch $@ $(RUN_STAMP)

install-run: system-deps-run $(RUN_STAMP)

# The Node upload service the suite runs (tests/node): its npm packages, exactly as
# package-lock.json pins them, in tests/node/node_modules (git-ignored).
NODE_STAMP := tests/node/node_modules/.package-lock.json
$(NODE_STAMP): tests/node/package.json tests/node/package-lock.json
	@if command -v npm >/dev/null 2>&1; then npm ci --prefix tests/node --no-audit --no-fund --loglevel=error && touch $@; \
	else echo "optional: npm not found: the Node client's test skips"; fi

install: system-deps $(TEST_STAMP) $(NODE_STAMP)

run: install-run
	$(BIN)/derivd -c $(CONFIG) demo

# The pages generated from declarations: every setting (supervisor/config.py) into
# docs/configuring.md and the example etc/derivd.ini. tests/unit/test_config_docs.py fails
# while either is out of date.
docs: install
	$(BIN)/python -m derivd.config_docs docs/configuring.md etc/derivd.ini

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check supervisor handlers sql tests bench harness

typecheck: install
	MYPYPATH="$$(echo build/__editable__.derivd-*)" $(BIN)/mypy -p derivd -p harness

# The suite, one folder per tier (tests/conftest.py): tests/unit (no services),
# tests/integration (PostgreSQL, moto's S3), tests/acceptance (the `derivd` process).
pytest: install
	$(BIN)/pytest -q -n $(PYTEST_WORKERS) tests

# Each tier alone; `make test` runs them all in one pytest session. With
# PYTEST_DERIVD_TIER=unit a service fixture fails the test: the unit tier needs none.
test-unit: install
	PYTEST_DERIVD_TIER=unit $(BIN)/pytest -q -n $(PYTEST_WORKERS) tests/unit
test-integration: install
	$(BIN)/pytest -q -n $(PYTEST_WORKERS) tests/integration
test-acceptance: install
	$(BIN)/pytest -q -n $(PYTEST_WORKERS) tests/acceptance

# Everything: lint, strict types, every test of every tier.
test: lint typecheck pytest

# While you work: lint and the unit tier (no database, no daemon, no mypy).
test-fast: lint test-unit

chaos: install
	$(BIN)/python bench/chaos.py --full
	$(BIN)/python bench/fleet_chaos.py --full
	$(BIN)/python bench/backfill_chaos.py

# Charts need matplotlib: setup.cfg's `bench` extra, installed here only (not a runtime
# dependency). bench/plots.py draws from bench/out/*.json, skipping what is absent.
bench: install
	$(BIN)/python -c 'import matplotlib' 2>/dev/null || $(BIN)/pip install -q 'matplotlib>=3.7'
	$(BIN)/python bench/derive.py
	$(BIN)/python bench/heic.py
	$(BIN)/python bench/throughput.py
	$(BIN)/python bench/latency.py
	$(BIN)/python bench/claim_scale.py
	$(BIN)/python bench/similar.py
	@if command -v valgrind >/dev/null; then $(BIN)/python bench/server_instructions.py; \
	else echo "bench/server_instructions.py: skipped (valgrind is not installed)"; fi
	$(BIN)/python bench/plots.py
	$(BIN)/python bench/results.py

# As root, the demo's cluster may live outside var/ (see supervisor/embedded/pghome.py):
# stop it and remove that directory too.
clean:
	@if [ -d var ] && [ -x $(BIN)/python ]; then $(BIN)/python -c \
	  'from pathlib import Path; from derivd.embedded.pgcluster import discard; discard(Path("var/pg"))'; fi
	rm -rf $(VENV) var build *.egg-info tests/node/node_modules
