"""``python -m lightning_tsp.planning ...`` runs the planner CLI."""

import sys

from .cli import main

sys.exit(main())
