"""Peer benchmark scripts run by `experiments.benchmarks.real` as subprocesses (see bench_real)."""
