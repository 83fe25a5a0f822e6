# The two commands a fresh clone needs: `make run` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# One stamp per install set and version of pyproject.toml + constraints.txt: `make run`
# installs the service extra alone (no torch); `make install` (and test, lint, bench)
# everything, the dev extra. Both at the exact versions of constraints.txt.
HASH := $(shell cat pyproject.toml constraints.txt | cksum | cut -d' ' -f1)
STAMP_SERVICE := $(VENV)/.installed-service-$(HASH)
STAMP := $(VENV)/.installed-dev-$(HASH)
HOST ?= 127.0.0.1
PORT ?= 8000
GRPC_PORT ?= 50051

.PHONY: install install-service run test lint bench proto clean

install: $(STAMP)

install-service: $(STAMP_SERVICE)

$(STAMP_SERVICE): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -c constraints.txt --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e '.[service]'
	rm -f $(VENV)/.installed-service-*
	touch $(STAMP_SERVICE)

# The dev extra holds the service's dependencies too: its stamp marks both installed.
$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -c constraints.txt --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e '.[dev]'
	rm -f $(VENV)/.installed-*
	touch $(STAMP) $(STAMP_SERVICE)

# After an edit of planner_service/proto/planner.proto: regenerate the committed stubs.
proto: install
	$(PY) -m planner_service.proto_build

run: install-service
	@echo "planner: web page and API on http://$(HOST):$(PORT)/ , gRPC on $(HOST):$(GRPC_PORT) (Ctrl-C stops)"
	$(VENV)/bin/planner serve --host $(HOST) --http-port $(PORT) --grpc-port $(GRPC_PORT)

# Two workers; --dist loadgroup hands out one test (or xdist_group) at a time, and
# tests/conftest.py puts the modules with a test marked slow first. Installs no system
# packages: the browser test skips without chromium + chromedriver.
# PLANNER_TEST_TIME_SCALE=3 triples every wall-clock allowance on a slow machine.
test: install
	$(PY) -m pytest -q -n 2 --dist loadgroup -p no:cacheprovider --durations=15

lint: install
	$(VENV)/bin/ruff check planner_service worker_runtime tests bench
	$(VENV)/bin/mypy planner_service worker_runtime

bench: install
	$(PY) -m bench.core_quality --batches 1000

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
