# The two commands of the README: `make run` and `make test`. Both install everything first.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTHON ?= python3

.PHONY: install chromium promtool run test lint bench bench-receiver drill-hosts drill-chaos
.DEFAULT_GOAL := help

help:
	@echo "make run   - install, migrate, run receiver + worker + beat + Flower (Ctrl-C stops)"
	@echo "make test  - install, lint (ruff), type-check (mypy --strict), run the test suite"
	@echo "make drill-hosts - (root) the multi-host drill: hosts as network namespaces, faults between them"
	@echo "make drill-chaos - (root) the single-host chaos drill: kill -9, SIGSTOP, FLUSHDB, a Postgres crash"
	@echo "make bench-receiver [REV=rev] - the receiver against REV (default: the merge base with main)"

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q uv
	$(VENV)/bin/uv pip install -q --python $(PY) --compile-bytecode -e '.[dev]'
	@# The project's own modules too: where PYTHONDONTWRITEBYTECODE is set, every CLI run
	@# compiled them and the libraries again (1.9 s instead of 0.8 s for `events list`).
	$(PY) -m compileall -q core ingest models tasks webhooks
	@$(MAKE) --no-print-directory chromium promtool
	touch $@

# The console's browser tests (tests/test_console.py) drive Debian's chromium through
# Playwright's executable_path: never `playwright install`, no browser download.
CHROMIUM ?= /usr/bin/chromium
chromium:
	@if [ -x "$(CHROMIUM)" ]; then :; \
	elif [ "$$(id -u)" = 0 ]; then apt-get update -q && apt-get install -y -q chromium; \
	else echo "$(CHROMIUM) is missing: the console's browser tests need it." \
	  "Install it as root: apt-get install -y chromium (they are skipped until then)"; fi

# deploy/alerts.yml's unit tests (deploy/alerts_test.yml, run by tests/test_operators_alerts.py)
# use Prometheus' promtool, from Debian's prometheus package (its service is not started).
promtool:
	@if command -v promtool >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ]; then apt-get update -q && DEBIAN_FRONTEND=noninteractive \
	  apt-get install -y -q --no-install-recommends prometheus; \
	else echo "promtool is missing: the alert rules' unit tests need it." \
	  "Install it as root: apt-get install -y prometheus (they are skipped until then)"; fi

# Local secrets for a development machine, generated once (never committed).
# umask 077: the file is written readable by its owner only (mode 0600).
.env:
	@umask 077 && $(PYTHON) -c "import secrets; print('WEBHOOKS_SECRET_KEY=whk_' + secrets.token_urlsafe(32)); print('WEBHOOKS_ADMIN_TOKENS=ops:' + secrets.token_urlsafe(32)); print('WEBHOOKS_FLOWER_PASSWORD=' + secrets.token_urlsafe(16))" > .env
	@echo "wrote .env with a new secret key, admin token (named ops) and Flower password"

run: install .env
	$(VENV)/bin/webhooks run

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy core webhooks ingest tasks models

# Two pytest-xdist processes, a test file at a time (each process has a database and a
# redis-server of its own), then the tests marked serial alone: they restart Postgres, or
# read every process's logs, which both parts write to one WEBHOOKS_TEST_LOG_DIR. Exit
# status 5 (no test selected) is no failure. PYTEST_WORKERS=1 runs the first part in one
# process. Three processes were faster on 2 cores (14:34 against 17:59 for the first part)
# but two timing-bound tests failed under them in one of two runs: two stays the default.
PYTEST_WORKERS ?= 2
test: lint
	@logs=$$(mktemp -d -t webhooks-test-logs-XXXXXX); export WEBHOOKS_TEST_LOG_DIR=$$logs; rc=0; \
	$(VENV)/bin/pytest -n $(PYTEST_WORKERS) --dist loadfile -m "not serial" || rc=$$?; \
	[ $$rc -eq 5 ] && rc=0; \
	$(VENV)/bin/pytest -m serial -p no:xdist || { r=$$?; [ $$r -eq 5 ] || rc=$$r; }; \
	[ $$rc -eq 0 ] && rm -rf "$$logs" || echo "the test processes' logs: $$logs"; exit $$rc

# The receiver against another revision (default: where this branch left main), run
# alternately in one invocation with the naive peers and the bare ceiling. Needs wrk.
REV ?= $(shell git merge-base HEAD main)
bench-receiver: install
	$(PY) bench/bench_receiver.py --against $(REV) $(BENCH_ARGS)

# The multi-host drill (docs/reliability.md): hosts as network namespaces, faults between them,
# about 7 minutes; DRILL_ARGS=--short for a <= 3 minute run. Needs root (ip netns).
drill-hosts: install
	$(PY) bench/drill_hosts.py $(DRILL_ARGS)

# The single-host chaos drill (docs/reliability.md): every process on one host (a network
# namespace), kill -9, SIGSTOP, FLUSHDB, pg_terminate_backend and a Postgres crash while 2,200
# events flow, about 2.5 minutes; DRILL_ARGS=--short for a <= 3 minute run. Needs root.
drill-chaos: install
	$(PY) bench/drill_chaos.py $(DRILL_ARGS)
