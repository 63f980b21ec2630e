# kvguard developer entry points. `make run` and `make test` bootstrap .venv on a fresh machine
# (Python >= 3.11 and make needed); `make help` lists the targets and variables.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# Torch, installed only when none is importable in the venv. The default is the CPU build from
# PyTorch's CPU index: PyPI's `torch==2.13.0` is the CUDA build, several GB with its NVIDIA
# wheels. A GPU host takes PyPI's instead: `make run TORCH_SPEC=torch TORCH_INDEX=`.
# --retries 1: pip asks that index for torch and for each of its dependencies; where it cannot
# be reached, pip's default 5 retries (with back-off) took over a minute, one retry nothing.
TORCH_SPEC  ?= torch==2.13.0+cpu
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
# more `kvguard serve` flags for `make run`, e.g. SERVE_ARGS="--model tiny --port 9000"
SERVE_ARGS  ?=
# `make run` installs kvguard and what it needs to serve; test, lint, format and bench add the
# test extra (pytest, ruff, transformers, triton, ...), each once: a stamp file records it.
STAMP      := $(VENV)/.kvguard-installed
TEST_STAMP := $(VENV)/.kvguard-test-installed

.PHONY: help run test lint format bench clean venv

help:
	@echo "make run      bootstrap .venv (kvguard and torch) and serve the default model on"
	@echo "              127.0.0.1:8000 (fetched and converted on the first start)"
	@echo "make test     lint, then the test suite (installs the test extra first)"
	@echo "make lint     ruff check and ruff format --check"
	@echo "make format   ruff format and ruff check --fix"
	@echo "make bench    bench/throughput.py, bench/kv_memory.py, bench/attention.py"
	@echo "make venv     only bootstrap .venv, as make run does"
	@echo "make clean    remove .venv and build and tool caches"
	@echo ""
	@echo "variables (make VAR=value target):"
	@echo "  PYTHON=$(PYTHON)   the interpreter that creates .venv (Python >= 3.11)"
	@echo "  TORCH_SPEC=$(TORCH_SPEC)   torch to install where none is importable in .venv"
	@echo "  TORCH_INDEX=$(TORCH_INDEX)   extra index for it;"
	@echo "              a GPU host: TORCH_SPEC=torch TORCH_INDEX= (PyPI's CUDA build)"
	@echo "  SERVE_ARGS=$(SERVE_ARGS)   more flags for \`kvguard serve\` in make run, e.g. \"--model tiny\""

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c 'import sys; sys.exit(sys.version_info < (3, 11) and "kvguard needs Python >= 3.11: make clean, then make PYTHON=python3.11 ...")'
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet \
	  $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX) --retries 1) "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e .
	touch $(STAMP)

$(TEST_STAMP): $(STAMP)
	$(PY) -m pip install --quiet -e ".[test]"
	touch $(TEST_STAMP)

run: $(STAMP)
	$(VENV)/bin/kvguard serve $(SERVE_ARGS)

lint: $(TEST_STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(TEST_STAMP)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

test: lint
	$(PY) -m pytest -q

bench: $(TEST_STAMP)
	$(PY) bench/throughput.py
	$(PY) bench/kv_memory.py
	$(PY) bench/attention.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache .hypothesis
