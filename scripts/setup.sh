#!/usr/bin/env bash
# Create .venv and install gradindex with its test tools. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip 2>&1 | grep -v "^WARNING: Location" || true
# The CPU build of torch when this machine has it on local disk (small); otherwise the package's range.
if ! python -c "import torch" 2>/dev/null; then
  python -m pip install -q "torch==2.13.0" 2>&1 | grep -v "^WARNING: Location" || python -m pip install -q "torch>=2.2"
fi
python -m pip install -q -e ".[dev]" 2>&1 | grep -v "^WARNING: Location" || true
python -c "import gradindex, torch, faiss, transformers; print('gradindex', gradindex.__version__, '| torch', torch.__version__, '| faiss', faiss.__version__)"
