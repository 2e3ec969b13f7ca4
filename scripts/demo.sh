#!/usr/bin/env bash
# Set up (if needed) and run the demo end to end. Extra arguments go to scripts/demo.py.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# OpenMP threads that spin while waiting cost 10-50x on a shared CPU (tests/conftest.py); sleep instead
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}
python scripts/demo.py "$@"
