# Two commands do all the set-up on a fresh machine: `make run` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
CONFIG ?= etc/derivd.ini
PYTEST_WORKERS ?= 2

.PHONY: install run test lint typecheck unit chaos bench clean system-deps

# PostgreSQL server binaries are the one thing pip cannot bring; install them when absent
# and we may (root with apt-get), otherwise say what to install.
system-deps:
	@if ! command -v initdb >/dev/null 2>&1 && ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 \
	    && ! [ -x "$$(pg_config --bindir 2>/dev/null)/initdb" ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null; \
	  else \
	    echo "derivd needs PostgreSQL server binaries: apt-get install postgresql (or your OS's package)"; exit 1; \
	  fi; \
	fi

$(STAMP): setup.cfg pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip setuptools wheel
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

install: system-deps $(STAMP)

run: install
	$(BIN)/derivd -c $(CONFIG) demo

lint: install
	$(BIN)/ruff check .

typecheck: install
	$(BIN)/mypy supervisor handlers

unit: install
	$(BIN)/pytest -q -n $(PYTEST_WORKERS) tests

test: lint typecheck unit

chaos: install
	$(BIN)/python bench/chaos.py --full

bench: install
	$(BIN)/python bench/derive.py
	$(BIN)/python bench/queue.py
	$(BIN)/python bench/latency.py
	$(BIN)/python bench/claim_scale.py

clean:
	rm -rf $(VENV) var build *.egg-info
