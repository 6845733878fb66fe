# The two README commands: `make demo` (set-up + the pipeline on the built-in model) and
# `make test` (set-up + the test suite). Both install what they need, idempotently.
SHELL := /bin/bash
VENV := $(CURDIR)/.venv/bin
export PATH := $(VENV):$(PATH)

.PHONY: setup demo test test-unit

setup:
	@scripts/setup.sh

demo: setup
	dvc repro
	@quantgate report
	@quantgate status

test: setup
	python -m pytest tests

test-unit: setup
	python -m pytest tests -m "not e2e"
