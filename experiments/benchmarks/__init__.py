"""Benchmarks: `python -m experiments.benchmarks.<name>`, each timing one thing against
its peers and ceilings in one run (`peers/`: HF transformers, llama.cpp subprocesses)."""
