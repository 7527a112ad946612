"""HF transformers peer of `experiments.benchmarks.real` (torch on CPU, f32 or bf16, the same GGUF).

Loads the GGUF with `AutoModelForCausalLM.from_pretrained(dir, gguf_file=name)`
(transformers dequantizes it to the request's `dtype`, f32 by default), then per `run`: one prefill call over
the prompts with `use_cache=True`, and the cached decode loop -- one call per
token on the last greedy token with `past_key_values` -- timed directly (not
as the difference of two `generate` calls). Protocol: `protocol.py`.
Never imported by kvattn or its tests; needs the `[peers]` extra.
"""

from __future__ import annotations

import sys

import torch
import transformers

from experiments.benchmarks.peers import protocol


def main() -> None:
  """Runs the HF transformers peer: reads the request `experiments.benchmarks.real` wrote
  (`protocol.read_request`: GGUF path, prompts, new tokens, threads), loads the GGUF with
  `AutoModelForCausalLM.from_pretrained(..., gguf_file=...)` in f32, and serves the rounds
  `bench_real` asks for (`protocol.serve`): each times prefill and the cached greedy decode
  loop directly and returns seconds, process CPU seconds, tokens and the bytes per step."""
  request = protocol.read_request(sys.argv)
  model = protocol.load_hf_gguf(request, request.get("dtype", "float32"))
  prompts = torch.tensor(request["prompts"], dtype=torch.long)
  new_tokens = int(request["new_tokens"])
  cfg = model.config
  head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
  weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
  cache_bytes_per_token = (2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim
                           * torch.tensor([], dtype=dtype).element_size())

  @torch.inference_mode()
  def run_once():
    def prefill():
      out = model(prompts, use_cache=True)
      return out.past_key_values, out.logits[:, -1].argmax(-1)

    prefill_s, prefill_cpu, (past, token) = protocol.timed(prefill)

    def decode():
      nonlocal past
      tokens = [token]
      for _ in range(new_tokens - 1):
        out = model(tokens[-1][:, None], past_key_values=past, use_cache=True)
        past = out.past_key_values
        tokens.append(out.logits[:, -1].argmax(-1))
      return torch.stack(tokens, 1)

    decode_s, decode_cpu, tokens = protocol.timed(decode)
    return {"prefill_s": prefill_s, "decode_s": decode_s, "prefill_cpu_s": prefill_cpu,
            "decode_cpu_s": decode_cpu, "tokens": tokens.tolist(),
            "weight_bytes": weight_bytes, "cache_bytes_per_token": cache_bytes_per_token}

  protocol.serve({"system": "hf_transformers", "version": transformers.__version__,
                  "torch": torch.__version__, "dtype": str(dtype)}, run_once)


if __name__ == "__main__":
  main()
