"""Models: `GroupedQueryAttention` (gqa.py), `MultiHeadLatentAttention` (mla.py), `Transformer`
(transformer.py; schema in config.py), `convert`, `int8`, `scan`."""

from kvattn.models.gqa import GroupedQueryAttention
from kvattn.models.mla import MultiHeadLatentAttention
from kvattn.models import config, transformer
from kvattn.models.transformer import Transformer, model_config, resolve_config
from kvattn.models import convert

__all__ = ["GroupedQueryAttention", "MultiHeadLatentAttention", "Transformer", "config", "convert",
           "model_config", "resolve_config", "transformer"]
