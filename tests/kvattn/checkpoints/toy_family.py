"""A test-only model family: Llama's config mapping and block, its norms under other names.

Importing this module registers it (one line in the test that uses it), as a family
under kvattn/checkpoints/families/ is registered by one import line there.
"""

from __future__ import annotations

from kvattn.checkpoints import families
from kvattn.checkpoints.families import readers

MODEL_TYPE = "kvattn_toy"
# kvattn norm module -> this family's HF module under "model.layers.{i}." (Llama's:
# input_layernorm, post_attention_layernorm).
NORMS = (("attn_norm", "ln_attn"), ("mlp_norm", "ln_mlp"))

FAMILY = families.register(families.Family(
    model_type=MODEL_TYPE, model_config=readers.gqa_model, hf_layer_norms=NORMS))
