#!/usr/bin/env bash
# Create .venv with a CPU build of PyTorch (when none is installed) and lightning-tsp with its test extras.
# Idempotent: a second run only checks what is there.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  # An unpinned `torch` would pull a multi-GB CUDA build: install the pinned CPU wheel first
  # (TORCH_SPEC overrides, e.g. TORCH_SPEC="torch==2.11.0").
  .venv/bin/pip install -q "${TORCH_SPEC:-torch==2.13.0}"
fi
.venv/bin/pip install -q -e ".[dev]"
