#!/usr/bin/env bash
# Create .venv and install gradindex with its test tools. Idempotent and quick when nothing changed:
# it re-installs only when pyproject.toml, the Python or the FAISS variant differ from the last
# install (a stamp in .venv/.gradindex-setup). FAISS: faiss-gpu (with ~1.2 GB of CUDA runtime wheels)
# when this machine has an NVIDIA GPU, else faiss-cpu; force one with GRADINDEX_FAISS=gpu|cpu.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ -n "${GRADINDEX_FAISS:-}" ]; then
  FAISS=$GRADINDEX_FAISS
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  FAISS=gpu
else
  FAISS=cpu
fi
case "$FAISS" in gpu|cpu) ;; *) echo "GRADINDEX_FAISS must be gpu or cpu, got '$FAISS'" >&2; exit 2 ;; esac
STAMP=.venv/.gradindex-setup
want="$(cat pyproject.toml | sha256sum | cut -c1-16) $("$PY" -c 'import sys; print(sys.version.split()[0])') faiss-$FAISS"
if [ -x .venv/bin/python ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
  exit 0
fi
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
# pip's notices, and setuptools' multi-line note on every editable install, are noise to a user
quiet() {
  sed -e '/BuildBackendWarning: Editable installation/,/with strategy, WheelFile/d' \
    | grep -v -e "^WARNING: Location" -e "^DEPRECATION" || true
}
echo "gradindex set-up: installing torch, transformers, faiss-$FAISS and gradindex into .venv (a few minutes the first time; about $([ "$FAISS" = gpu ] && echo 2.9 || echo 1.6) GB)" >&2
python -m pip install -q --upgrade pip 2>&1 | quiet
# The CPU build of torch when this machine has it on local disk (small); otherwise the package's range.
if ! python -c "import torch" 2>/dev/null; then
  python -m pip install -q "torch==2.13.0" 2>&1 | quiet || python -m pip install -q "torch>=2.2"
fi
# Both FAISS packages install the module `faiss`: remove the other one before switching.
other=$([ "$FAISS" = gpu ] && echo faiss-cpu || echo faiss-gpu)
if python -m pip show -q "$other" >/dev/null 2>&1; then
  python -m pip uninstall -q -y "$other" 2>&1 | quiet
  python -m pip uninstall -q -y "faiss-$FAISS" 2>&1 | quiet  # its files were overwritten: reinstall clean
fi
python -m pip install -q -e ".[dev,$FAISS]" 2>&1 | quiet
python -c "import gradindex, torch, faiss, transformers; print('gradindex', gradindex.__version__, '| torch', torch.__version__, '| faiss', faiss.__version__, '($FAISS)')"
echo "$want" > "$STAMP"
