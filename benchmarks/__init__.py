"""The benchmarks of lightning_tsp, one package: run every script from the repository root as
``python -m benchmarks.<name>`` (harness, inference, multi_gpu, schedules, plot, ...). ``runner`` holds what the
sweeps share (one subprocess per configuration, OOM detection, JSON lines, tables); ``baselines`` the rival
strategies. See benchmarks/README.md."""
