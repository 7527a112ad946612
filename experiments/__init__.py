"""Experiment entry points, sweep runner and benchmarks."""
