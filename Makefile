# Two entry points for a fresh machine; each creates .venv and installs what it needs.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test lint bench bytecode redis-server faketime chromium node-deps

# The Redis tests start a private redis-server from the binary (or use $REDIS_URL).
redis-server:
	@if [ -z "$$REDIS_URL" ] && ! command -v redis-server >/dev/null; then \
	  echo "installing redis-server (Debian package) for the Redis ledger tests"; \
	  (apt-get update -qq && apt-get install -y -qq redis-server >/dev/null) \
	    || { echo "could not install redis-server: install it, or set REDIS_URL to a disposable database"; exit 1; }; \
	fi

# The clock-skew tests run a wrapper on a host clock 30 h ahead under libfaketime (tests/integration/test_redis_clock_skew.py).
faketime:
	@if ! command -v faketime >/dev/null; then \
	  echo "installing faketime (Debian package) for the clock-skew tests"; \
	  (apt-get update -qq && apt-get install -y -qq faketime >/dev/null) \
	    || { echo "could not install faketime: install it (Debian: apt-get install faketime)"; exit 1; }; \
	fi

# The dashboard tests load the page in headless Chromium, the system's, driven by Playwright (tests/integration/test_dashboard.py).
chromium:
	@if ! command -v chromium >/dev/null; then \
	  echo "installing chromium (Debian package) for the dashboard tests"; \
	  (apt-get update -qq && apt-get install -y -qq chromium >/dev/null) \
	    || { echo "could not install chromium: install it (Debian: apt-get install chromium)"; exit 1; }; \
	fi

$(BIN)/quotawrap: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test,redis,volc,serve]'
	$(MAKE) --no-print-directory bytecode
	touch $@

# An editable install is not byte-compiled (pip compiles only what it copies), and with
# PYTHONDONTWRITEBYTECODE=1 Python never writes the cache either: every `quotawrap` run and every
# hooked child would compile quotawrap's modules again (~30 ms of a wrapper's start-up). Compiled
# here as pip does for a regular install; a source changed since is still read correctly (Python
# checks each .pyc against its source's mtime and compiles a stale one in memory), only slower, so
# the entry points below recompile what changed (compileall skips what is up to date).
bytecode:
	$(BIN)/python -m compileall -q quotawrap sitecustomize_hook

demo: $(BIN)/quotawrap bytecode  ## the main job: a parallel agent guarded by quotawrap (simulator unless ARK_API_KEY)
	$(BIN)/quotawrap demo

# The gateway tests run a real Node agent on the locked `openai` npm package (tests/node).
node-deps:
	@if ! command -v npm >/dev/null; then \
	  echo "WARNING: npm not found: the Node gateway tests will be SKIPPED (install nodejs and npm to run them)"; \
	elif [ ! -f tests/node/node_modules/.package-lock.json ] \
	  || [ tests/node/package-lock.json -nt tests/node/node_modules/.package-lock.json ]; then \
	  cd tests/node && npm ci --no-audit --no-fund; \
	fi

lint: $(BIN)/quotawrap  ## the static checks: ruff, ruff format, mypy --strict, import rules
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy --strict quotawrap
	$(BIN)/python tests/check_imports.py

test: lint bytecode redis-server faketime chromium node-deps  ## the whole test suite, lint included
	$(BIN)/pytest -q

bench: $(BIN)/quotawrap bytecode redis-server  ## every figure of docs/benchmarks.md and docs/day-simulation.md
	for script in bench/bench_*.py bench/day_simulation.py bench/day_simulation_stress.py; do $(BIN)/python $$script || exit 1; done
