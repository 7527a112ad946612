"""HF transformers' `QuantizedCache` peer of the "lowbit" family (torch on CPU, f32, the same GGUF).

The family (experiments/families/lowbit.py, `peers.run`) writes a request with the GGUF path,
the token ids it streams (`ids`, n + 1 of them), `chunk`, `new_tokens`, `threads` and the
caches to run (`caches`: each `{"name", "nbits", "residual", "q_group_size"}`, `nbits`
None for transformers' `DynamicCache` in f32). Per cache, as the family does for its own:

  * streaming perplexity: the n tokens fed `chunk` per forward pass through one cache
    (`model(ids[s:e], past_key_values=cache)`), token i + 1 scored from tokens 0..i;
  * the cache's bytes per token after the n tokens, read from its tensors (quanto's packed
    codes, scales and shifts, the full-precision residual: every tensor the layers hold);
  * `new_tokens` tokens from that cache as the family's decode returns them: the fed token
    `ids[n]`, then `new_tokens - 1` greedy ones; decode tokens/s over the `new_tokens - 2`
    model steps after the first, timed directly.

`QuantizedCache(backend="quanto", nbits, residual_length, q_group_size)` is transformers'
KIVI-style cache (cache_utils.QuantizedLayer): the prompt is quantized at once, later tokens
go to a full-precision residual, and when the residual reaches `residual_length` the whole
cache is dequantized, concatenated with it and quantized again (quanto `MaxOptimizer`, per
group of `q_group_size` along the head dim for keys and values alike, transformers' default
axis 0). Protocol (`protocol.py`): one `ready` line, then per `run` line one JSON line
`{"results": [...]}`. Never imported by kvattn or its tests; needs the `[peers]` extra
(torch, transformers, optimum-quanto).
"""

from __future__ import annotations

import inspect
import math
import sys
import time

import torch
import transformers

from experiments.benchmarks.peers import protocol


def tensor_bytes(t) -> int:
  """Bytes of a tensor's storage; a quanto tensor's inner tensors (codes, scale, shift)."""
  if t is None or not isinstance(t, torch.Tensor):
    return 0
  flatten = getattr(t, "__tensor_flatten__", None)
  if flatten is not None and type(t) is not torch.Tensor:
    names, _ = flatten()
    return sum(tensor_bytes(getattr(t, name)) for name in names)
  return t.numel() * t.element_size()


def cache_bytes(cache) -> int:
  """Bytes of every tensor the cache's layers hold (quantized and full precision)."""
  total = 0
  for layer in cache.layers:
    for name in ("_quantized_keys", "_quantized_values", "keys", "values"):
      total += tensor_bytes(getattr(layer, name, None))
  return total


def make_cache(model, spec):
  """`DynamicCache` (spec `nbits` None) or `QuantizedCache(backend="quanto", ...)`."""
  if spec.get("nbits") is None:
    return transformers.DynamicCache(config=model.config)
  return transformers.QuantizedCache(backend="quanto", config=model.config,
                                     nbits=int(spec["nbits"]),
                                     residual_length=int(spec["residual"]),
                                     q_group_size=int(spec["q_group_size"]))


@torch.inference_mode()
def run_cache(model, ids, chunk: int, new_tokens: int, spec) -> dict:
  """Streaming perplexity, bytes per token and greedy decode speed of one cache (module doc)."""
  cache = make_cache(model, spec)
  # transformers 5.24 renamed `past_key_values` to `cache` (the old name warns until 5.40).
  cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else (
      "past_key_values")
  n = len(ids) - 1
  nll = []
  start, cpu = time.perf_counter(), time.process_time()
  for s in range(0, n, chunk):
    e = min(n, s + chunk)
    out = model(ids[None, s:e], **{cache_arg: cache}, use_cache=True)
    logp = torch.log_softmax(out.logits[0].double(), dim=-1)
    nll.append(-logp[torch.arange(e - s), ids[s + 1:e + 1]])
  ppl_s, ppl_cpu = time.perf_counter() - start, time.process_time() - cpu
  nll = torch.cat(nll)
  held = cache.get_seq_length()
  per_token = cache_bytes(cache) / held

  def step(token):
    out = model(token.view(1, 1), **{cache_arg: cache}, use_cache=True)
    return out.logits[0, -1].argmax(-1)

  # As `kvattn.generate`'s decode: the fed token first, then `new_tokens - 1` greedy ones
  # (so the lists line up for the agreement); the first step is not timed.
  tokens = [ids[n], step(ids[n])]
  start, cpu = time.perf_counter(), time.process_time()
  for _ in range(new_tokens - 2):
    tokens.append(step(tokens[-1]))
  decode_s, decode_cpu = time.perf_counter() - start, time.process_time() - cpu
  return {
      "name": spec["name"], "nbits": spec.get("nbits"), "residual": spec.get("residual"),
      "q_group_size": spec.get("q_group_size"), "num_tokens": n, "tokens_held": int(held),
      "cache_bytes_per_token": float(per_token), "ppl": float(math.exp(nll.mean().item())),
      "ppl_seconds": ppl_s, "ppl_cpu_s": ppl_cpu, "decode_steps_timed": new_tokens - 2,
      "decode_s": decode_s, "decode_cpu_s": decode_cpu,
      "decode_tokens_per_s": (new_tokens - 2) / decode_s if decode_s > 0 else float("nan"),
      "greedy_tokens": [int(t) for t in tokens],
  }


def main() -> None:
  """Reads the request (`protocol.read_request`), loads the GGUF in f32 with
  `AutoModelForCausalLM.from_pretrained(dir, gguf_file=name)` and serves `run` lines: each
  measures every requested cache in order (module doc) and prints `{"results": [...]}`."""
  request = protocol.read_request(sys.argv)
  model = protocol.load_hf_gguf(request)
  ids = torch.tensor(request["ids"], dtype=torch.long)
  chunk, new_tokens = int(request["chunk"]), int(request["new_tokens"])
  import optimum.quanto  # pylint: disable=g-import-not-at-top  (its version for the record)

  def run_once():
    return {"results": [run_cache(model, ids, chunk, new_tokens, spec)
                        for spec in request["caches"]]}

  protocol.serve({"system": "hf_quantized_cache", "version": transformers.__version__,
                  "torch": torch.__version__,
                  "optimum_quanto": getattr(optimum.quanto, "__version__", "?"),
                  "threads": torch.get_num_threads()}, run_once)


if __name__ == "__main__":
  main()
