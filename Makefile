# The two commands of the README. Both create .venv when it is missing.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
export KEDRO_DISABLE_TELEMETRY := 1
export HF_HUB_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export KEDRO_LOGGING_CONFIG ?= conf/logging.yml

.PHONY: setup run test

$(BIN)/kedro: pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e ".[dev]"
	touch $(BIN)/kedro

setup: $(BIN)/kedro

## make run: build the embedded model when missing, then train it with QeRL (CPU, no network)
run: setup
	test -f data/06_models/embedded_model/config.json || $(BIN)/kedro run --pipelines=embedded_model
	$(BIN)/kedro run --pipelines=qerl_train

## make test: the test suite (what CI runs), on two workers; a test file stays on one worker
## (tests/test_cli.py's tests share one project copy, in order)
test: setup
	$(BIN)/python -m pytest -n 2 --dist loadfile
