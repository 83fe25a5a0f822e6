# The two commands a fresh clone needs: `make run` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: install run test lint bench proto clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

proto: install
	$(PY) -m planner_service.proto_build

run: install
	$(VENV)/bin/planner plan --dataset wlbllm --context 131072 --cp 8 --strategy flashcp

test: install
	$(PY) -m pytest -q -n 2 -p no:cacheprovider

lint: install
	$(VENV)/bin/ruff check planner_service worker_runtime tests bench
	$(VENV)/bin/mypy planner_service worker_runtime

bench: install
	$(PY) -m bench.core_quality --batches 1000

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
