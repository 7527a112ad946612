"""HF transformers peer of `experiments.benchmarks.speculative`: assisted generation with
prompt lookup (`generate(prompt_lookup_num_tokens=k, max_matching_ngram_size=n)`) next to
plain greedy `generate`, torch on CPU, f32, the same GGUF.

Request (`--request FILE`, JSON): `gguf`, `prompt` (token ids), `new_tokens`,
`num_draft_tokens`, `max_ngram_size`, `threads`. Prints `{"ready": true}`, then per `run`
line one JSON line: `plain_s` and `prompt_lookup_s` (wall seconds of each whole `generate`
call of `new_tokens`, prefill included), `plain_first_s` and `prompt_lookup_first_s` (the
same call with `max_new_tokens=1`: prefill, first token and `generate`'s fixed costs, timed
right before; a caller subtracts it to get the decode seconds of the other `new_tokens - 1`
tokens, as kvattn's decode loop is timed) and their `*_tokens`. Never imported by kvattn or its tests; needs the `[peers]` extra.
"""

from __future__ import annotations

import sys

import torch

from experiments.benchmarks.peers import protocol


def main() -> None:
  """Serves the request of the module doc: loads the GGUF, then one JSON line per `run` line."""
  request = protocol.read_request(sys.argv)
  model = protocol.load_hf_gguf(request)
  prompt = torch.tensor([request["prompt"]], dtype=torch.long)
  n = int(request["new_tokens"])
  common = dict(do_sample=False, pad_token_id=0, attention_mask=torch.ones_like(prompt))
  lookup_args = dict(prompt_lookup_num_tokens=int(request["num_draft_tokens"]),
                     max_matching_ngram_size=int(request["max_ngram_size"]))

  def generate(tokens, **kwargs):
    return model.generate(prompt, max_new_tokens=tokens, min_new_tokens=tokens, **common,
                          **kwargs)

  @torch.inference_mode()
  def run_once():
    plain_first_s, _, _ = protocol.timed(lambda: generate(1))
    plain_s, _, plain = protocol.timed(lambda: generate(n))
    lookup_first_s, _, _ = protocol.timed(lambda: generate(1, **lookup_args))
    lookup_s, _, lookup = protocol.timed(lambda: generate(n, **lookup_args))
    cut = prompt.shape[1]
    return dict(plain_first_s=plain_first_s, plain_s=plain_s,
                prompt_lookup_first_s=lookup_first_s, prompt_lookup_s=lookup_s,
                plain_tokens=plain[0, cut:].tolist(), prompt_lookup_tokens=lookup[0, cut:].tolist())

  protocol.serve({}, run_once)


if __name__ == "__main__":
  main()
