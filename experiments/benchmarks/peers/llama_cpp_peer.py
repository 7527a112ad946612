"""llama.cpp peer of `experiments.benchmarks.real` (`llama-cpp-python`, the same GGUF as shipped).

Batch 1 only (the high-level API evaluates one sequence); `threads` threads
for prefill and decode, llama.cpp's default f16 KV cache. Per `run`: the
context is reset, the prompt evaluated in one `eval` call (prefill), then
`new_tokens - 1` greedy steps of `eval([token])` (decode). The weight bytes are
the GGUF's tensor bytes as stored (read with `gguf`). Protocol: `protocol.py`.
Never imported by kvattn or its tests; needs the `[peers]` extra.
"""

from __future__ import annotations

import sys

import gguf
import llama_cpp
import numpy as np

from experiments.benchmarks.peers import protocol


def main() -> None:
  """Runs the llama.cpp peer (`llama-cpp-python`, the GGUF as shipped), batch 1 only
  (SystemExit naming the batch otherwise): reads the request (`protocol.read_request`) and
  serves the rounds `bench_real` asks for (`protocol.serve`), each timing prefill and greedy
  decode and returning seconds, process CPU seconds and tokens."""
  request = protocol.read_request(sys.argv)
  prompts = request["prompts"]
  if len(prompts) != 1:
    raise SystemExit(f"llama_cpp_peer runs batch 1 only; got batch {len(prompts)}")
  ids = [int(t) for t in prompts[0]]
  new_tokens = int(request["new_tokens"])
  threads = int(request["threads"])
  path = request["gguf"]
  reader = gguf.GGUFReader(path)
  weight_bytes = int(sum(int(t.n_bytes) for t in reader.tensors))

  def field(key):
    f = reader.fields[key]
    return int(f.parts[f.data[0]][0])

  arch = str(bytes(reader.fields["general.architecture"].parts[-1]), "utf-8")
  layers, kv_heads = field(f"{arch}.block_count"), field(f"{arch}.attention.head_count_kv")
  head_dim = field(f"{arch}.embedding_length") // field(f"{arch}.attention.head_count")
  cache_bytes_per_token = 2 * layers * kv_heads * head_dim * 2  # f16 K and V
  llm = llama_cpp.Llama(model_path=path, n_ctx=len(ids) + new_tokens + 8, n_batch=512,
                        n_threads=threads, n_threads_batch=threads, logits_all=False,
                        verbose=False)

  def last_token() -> int:
    return int(np.argmax(llm.scores[llm.n_tokens - 1]))

  def run_once():
    llm.reset()

    def prefill():
      llm.eval(ids)
      return last_token()

    prefill_s, prefill_cpu, token = protocol.timed(prefill)

    def decode():
      tokens = [token]
      for _ in range(new_tokens - 1):
        llm.eval([tokens[-1]])
        tokens.append(last_token())
      return tokens

    decode_s, decode_cpu, tokens = protocol.timed(decode)
    return {"prefill_s": prefill_s, "decode_s": decode_s, "prefill_cpu_s": prefill_cpu,
            "decode_cpu_s": decode_cpu, "tokens": [tokens],
            "weight_bytes": weight_bytes, "cache_bytes_per_token": cache_bytes_per_token}

  protocol.serve({"system": "llama_cpp", "version": llama_cpp.__version__}, run_once)


if __name__ == "__main__":
  main()
