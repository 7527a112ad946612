"""HF transformers peer of `experiments.benchmarks.speculative`: assisted generation with
prompt lookup (`generate(prompt_lookup_num_tokens=k, max_matching_ngram_size=n)`) next to
plain greedy `generate`, torch on CPU, f32, the same GGUF.

Request (`--request FILE`, JSON): `gguf`, `prompt` (token ids), `new_tokens`,
`num_draft_tokens`, `max_ngram_size`, `threads`. Prints `{"ready": true}`, then per `run`
line one JSON line: `prefill_s` (one forward over the prompt), `plain_s` and
`prompt_lookup_s` (wall seconds of each whole `generate` call, prefill included) and their
`*_tokens`. Never imported by kvattn or its tests; needs the `[peers]` extra.
"""

from __future__ import annotations

import os
import sys

import torch
import transformers

from experiments.benchmarks.peers import protocol


def main() -> None:
  """Serves the request of the module doc: loads the GGUF, then one JSON line per `run` line."""
  request = protocol.read_request(sys.argv)
  torch.set_num_threads(int(request["threads"]))
  path = request["gguf"]
  model = transformers.AutoModelForCausalLM.from_pretrained(
      os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32)
  model.eval()
  prompt = torch.tensor([request["prompt"]], dtype=torch.long)
  n = int(request["new_tokens"])
  common = dict(max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0,
                attention_mask=torch.ones_like(prompt))

  @torch.inference_mode()
  def run_once():
    prefill_s, _, _ = protocol.timed(lambda: model(prompt, use_cache=True))
    plain_s, _, plain = protocol.timed(lambda: model.generate(prompt, **common))
    lookup_s, _, lookup = protocol.timed(lambda: model.generate(
        prompt, prompt_lookup_num_tokens=int(request["num_draft_tokens"]),
        max_matching_ngram_size=int(request["max_ngram_size"]), **common))
    cut = prompt.shape[1]
    return dict(prefill_s=prefill_s, plain_s=plain_s, prompt_lookup_s=lookup_s,
                plain_tokens=plain[0, cut:].tolist(), prompt_lookup_tokens=lookup[0, cut:].tolist())

  protocol.serve({}, run_once)


if __name__ == "__main__":
  main()
