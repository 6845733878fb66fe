# The two README commands: `make demo` (set-up + the pipeline on the built-in model) and
# `make test` (set-up + the test suite). Both install what they need, idempotently.
SHELL := /bin/bash
VENV := $(CURDIR)/.venv/bin
export PATH := $(VENV):$(PATH)

.PHONY: setup demo test test-unit bench gpu-check calibration

setup:
	@scripts/setup.sh

# On any GPU machine at hand (torch with CUDA, llm-compressor; no vLLM, no network): quantize the default model
# there and check the builds, at most 8 minutes (scripts/gpu_check.sh). Fails in one line without a GPU.
gpu-check:
	@scripts/gpu_check.sh

# Record the calibration set (calibrate.recorded) anew: the 16-bit build answers calibrate.prompts through vLLM
# (about 13 min for 64 conversations on 2 CPU cores). Commit both recorded files: every build's lineage names them.
calibration: setup
	dvc repro -q prepare
	python -m pipeline.calibrate record models/fp16 evals

# -q: DVC's own per-stage lines (Running stage, Updating lock file) stay out; each stage prints its own
demo: setup
	dvc repro -q
	@quantgate report
	@quantgate status

# The unit tests in TEST_WORKERS processes (pytest-xdist; about 4.7 min instead of 7 on 2 cores), then the e2e
# tests one at a time (each uses the whole machine: vLLM servers, quantization); both always run, the first
# failure's status is make's
TEST_WORKERS ?= 2
test: setup
	ruff check .
	ruff format --check .
	rc=0; python -m pytest tests -m "not e2e" -n $(TEST_WORKERS) --durations=15 || rc=$$?; \
	python -m pytest tests -m e2e --durations=30 || { s=$$?; [ $$rc -ne 0 ] || rc=$$s; }; exit $$rc

test-unit: setup
	python -m pytest tests -m "not e2e" -n $(TEST_WORKERS)

# Every benchmark in turn (benchmarks/, README "Numbers"); incremental reuses pipeline_cost's project.
bench: setup
	rm -rf .bench
	python -m benchmarks.pipeline_cost --work .bench
	python -m benchmarks.incremental --project .bench/pipeline_cost
	python -m benchmarks.eval_engine --models .bench/pipeline_cost/models --work .bench/eval_engine
	python -m benchmarks.serving --models .bench/pipeline_cost/models
	python -m benchmarks.quality --models .bench/pipeline_cost/models --work .bench/quality
	python -m benchmarks.canary_sim
	python -m benchmarks.numbers --out benchmarks/results/numbers.md --readme benchmarks/README.md
