"""Models: attention modules, the decoder-only Transformer and checkpoint conversions.

  `GroupedQueryAttention`      gqa.py: MHA / GQA / MQA through `num_kv_heads`.
  `MultiHeadLatentAttention`   mla.py: DeepSeek-V2 MLA, latent cache, absorbed decode.
  `Transformer`                transformer.py: the LM; its config schema is config.py
                               (`model_config`, `resolve_config`).
  `convert`                    KV-head regrouping and conversion to MLA.
"""

from kvattn.models.gqa import GroupedQueryAttention
from kvattn.models.mla import MultiHeadLatentAttention
from kvattn.models import config, transformer
from kvattn.models.transformer import Transformer, model_config, resolve_config
from kvattn.models import convert

__all__ = ["GroupedQueryAttention", "MultiHeadLatentAttention", "Transformer", "config", "convert",
           "model_config", "resolve_config", "transformer"]
