# Every target creates .venv when it is missing, installs torch==2.13.0 first (the CPU build on
# this machine's disk; an unpinned torch would pull a multi-GB CUDA build), then the project with
# the extras it needs, then does its job. Stamps make repeated runs cheap.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
PIP    := $(BIN)/python -m pip

# Ray binds to and talks on 127.0.0.1 only.
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER := 0
export RAY_USAGE_STATS_ENABLED := 0
export PYTHONDONTWRITEBYTECODE := 1

DEMO_ARGS ?=
BENCH_ARGS ?=

.PHONY: demo test bench clean-venv

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

$(VENV)/.torch: | $(BIN)/python
	$(PIP) install torch==2.13.0
	touch $@

$(VENV)/.installed-%: pyproject.toml setup.py $(VENV)/.torch
	$(PIP) install -e '.[$*]'
	$(BIN)/python -c 'from pdserve.workers.model.cpu_kernels import main; main()'
	touch $@

demo: $(VENV)/.installed-test
	$(BIN)/pdserve demo $(DEMO_ARGS)

test: $(VENV)/.installed-test
	$(BIN)/python -m pytest -q tests

bench: $(VENV)/.installed-bench $(VENV)/.installed-test
	mkdir -p bench/out
	$(BIN)/python bench/scheduler.py --json bench/out/scheduler.json $(BENCH_ARGS)
	$(BIN)/python benchmarks/engine.py --json bench/out/engine.json
	$(BIN)/python benchmarks/transfer.py --json bench/out/transfer.json

clean-venv:
	rm -rf $(VENV)
