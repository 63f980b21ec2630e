# kvguard developer entry points. `make run` and `make test` bootstrap .venv on a fresh machine.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# Torch requirement used only when no torch is importable in the venv. The default pin is a
# CPU build; GPU hosts override it, e.g. `make run TORCH_SPEC=torch` (CUDA wheel from PyPI).
TORCH_SPEC ?= torch==2.13.0
STAMP  := $(VENV)/.kvguard-installed

.PHONY: run test lint format bench clean venv

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[test]"
	touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/kvguard model fetch smollm2-135m
	$(VENV)/bin/kvguard serve

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(STAMP)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

test: lint
	$(PY) -m pytest -q

bench: $(STAMP)
	$(PY) bench/throughput.py
	$(PY) bench/kv_memory.py
	$(PY) bench/attention.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache .hypothesis
