# The two README commands: `make demo` (set-up + the pipeline on the built-in model) and
# `make test` (set-up + the test suite). Both install what they need, idempotently.
SHELL := /bin/bash
VENV := $(CURDIR)/.venv/bin
export PATH := $(VENV):$(PATH)

.PHONY: setup demo test test-unit check-workers bench gpu-check calibration

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

# The unit tests in TEST_WORKERS processes (pytest-xdist, one test file per process at a time: a file's tests share
# its module fixtures, such as the registry servers; 3-4 min instead of 7 on 2 cores), then the e2e tests one at
# a time (each uses the whole machine: vLLM servers, quantization). The e2e tests run even when a unit test failed,
# so one run shows every failure; make then fails. Ctrl-C stops both.
TEST_WORKERS ?= 2
XDIST = -n $(TEST_WORKERS) --dist loadfile
test: check-workers setup
	ruff check .
	ruff format --check .
	trap 'exit 130' INT; rc=0; python -m pytest tests -m "not e2e" $(XDIST) --durations=15 || rc=$$?; \
	python -m pytest tests -m e2e --durations=30 || { s=$$?; [ $$rc -ne 0 ] || rc=$$s; }; exit $$rc

test-unit: check-workers setup
	python -m pytest tests -m "not e2e" $(XDIST)

check-workers:
	@[[ "$(TEST_WORKERS)" =~ ^([0-9]+|auto|logical)$$ ]] || { echo "make: TEST_WORKERS='$(TEST_WORKERS)': give a number of test processes (2, the default; 0 runs them in this one), auto or logical" >&2; exit 2; }

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
