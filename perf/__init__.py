"""Benchmarks: load generators, baselines and experiment drivers (run as `python -m perf.NAME`)."""
