#!/usr/bin/env bash
# Quick start, main job: set up, then train the tiny model with TSP on 2 CPU processes (Trainer(strategy="tsp"),
# LightningCLI) on real text that exists offline everywhere: Python's own standard-library source.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/lightning-tsp fit --config recipes/tiny-cpu.yaml "$@"
