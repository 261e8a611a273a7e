#!/usr/bin/env bash
# Quick start, tests: set up, then run the whole suite (CPU; GPU-only tests skip without CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q --durations=15 "$@"
