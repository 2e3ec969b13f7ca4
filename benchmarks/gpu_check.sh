#!/usr/bin/env bash
# GPU check (at most ~8 min on one H100/H200; no test needs a GPU): CUDA capture and the default build of
# SmolLM2-135M- and Qwen2.5-0.5B-shaped models in float32 and bfloat16 against CPU rows, FAISS GPU search latency, capture
# throughput and peak memory against a bare forward+backward. Writes benchmarks/results/gpu.json.
#
#   bash benchmarks/gpu_check.sh              # on a machine with a CUDA GPU (scripts/setup.sh installs faiss-gpu)
#   bash benchmarks/gpu_check.sh --dry-run    # a tiny config on the CPU: checks the script runs (a test does this)
#   bash benchmarks/gpu_check.sh --out FILE   # write the JSON elsewhere
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
PY=${PYTHON:-python}
if [ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ]; then PY=.venv/bin/python; fi
dry=0
for a in "$@"; do [ "$a" = "--dry-run" ] && dry=1; done
if [ "$dry" = 0 ]; then
  if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
    echo "gpu_check: no NVIDIA GPU visible (nvidia-smi); run with --dry-run for the CPU smoke mode" >&2
    exit 2
  fi
  nvidia-smi -L
fi
echo "gpu_check: $("$PY" -c 'import torch, faiss; print("torch", torch.__version__, "| cuda", torch.cuda.is_available(), "| faiss", faiss.__version__)')"
exec timeout "${GPU_CHECK_TIMEOUT:-480}" "$PY" -m benchmarks.gpu_check "$@"
