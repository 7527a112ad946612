"""Training: `data` (byte tokenizer, default corpus, datasets), `trainer` (`Trainer`, `uptrain`;
imported on first use)."""

from kvattn.training import data

__all__ = ["data", "trainer"]


def __getattr__(name):
  if name == "trainer":  # orbax (~0.2 s) on first use
    import importlib  # pylint: disable=g-import-not-at-top
    return importlib.import_module("kvattn.training.trainer")
  raise AttributeError(f"module 'kvattn.training' has no attribute {name!r}")
