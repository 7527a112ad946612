"""Inference: generation in one compiled loop, continuous batching, resuming from a cache.

  `generate`, `prefill`, `decode`, `Sampling`   generation.py.
  `ContinuousBatcher`                           batching/: slots over pools or rows of any kind.
  `resume`                                      reuse.py: reuse a restored cache's prefix.
  `PromptLookup`, `DraftModel`                  speculative.py: drafters for
                                                `generate(speculative=)`.
  `disaggregated`                               disaggregated.py: a prefill worker's pages
                                                pulled by a decode worker (transfer server).
"""

from kvattn.inference.generation import Sampling, decode, generate, prefill
from kvattn.inference.batching import ContinuousBatcher, Finished, NoFreeSlotError
from kvattn.inference.reuse import resume, reusable_length, truncate
from kvattn.inference import disaggregated, speculative
from kvattn.inference.speculative import DraftModel, PromptLookup

__all__ = ["ContinuousBatcher", "DraftModel", "Finished", "NoFreeSlotError", "PromptLookup",
           "Sampling", "decode", "disaggregated", "generate", "prefill", "resume",
           "reusable_length", "speculative", "truncate"]
