"""Peer benchmark scripts run by `experiments.bench_real` as subprocesses (see bench_real)."""
