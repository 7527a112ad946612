"""Experiment families: one module per `config.experiment.kind`, loaded by the runner
(`experiments.framework.runner.family_factory`), each registering itself on import."""
