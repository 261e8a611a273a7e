#!/usr/bin/env bash
# Quick start, main job: set up, then train the tiny model with TSP on 2 CPU processes on real text.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m lightning_tsp.demo --tsp-size 2 "$@"
